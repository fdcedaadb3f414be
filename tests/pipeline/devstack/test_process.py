"""``ManagedProcess``: the start, readiness wait, log file and stop shared by the dev stack's servers."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from pipeline.devstack.process import ManagedProcess, free_port, port_is_free


class ProcessError(RuntimeError):
    pass


class Script(ManagedProcess):
    """A Python one-liner as the server; it "answers" once it has written its port to the log."""

    what = "the script"
    error = ProcessError
    log_prefix = "rlpipe-test-process-"

    def __init__(
        self, code: str, port: int | None = None, log_path: Path | None = None, start_timeout_s: float = 15.0
    ) -> None:
        super().__init__(port=port, log_path=log_path, start_timeout_s=start_timeout_s)
        self.code = code

    def _command(self) -> list[str]:
        return [sys.executable, "-c", self.code, str(self.port)]

    def _answers(self) -> bool:
        return self.log_path is not None and f"port {self.port}" in self.log_path.read_text()


SERVE = "import sys, time; print('port', sys.argv[1], flush=True); time.sleep(60)"


def test_start_waits_for_the_answer_and_stop_removes_the_temporary_log() -> None:
    with Script(SERVE) as script:
        assert script.running and script.pid is not None and script.port is not None
        log_path = script.log_path
        assert log_path is not None and log_path.exists()
    assert not script.running and script.pid is None
    assert not log_path.exists()
    script.stop()  # a second stop is harmless


def test_a_given_log_is_kept(tmp_path: Path) -> None:
    log_path = tmp_path / "logs" / "script.log"
    with Script(SERVE, log_path=log_path):
        pass
    assert "port" in log_path.read_text()


def test_exit_at_start_names_the_log_and_its_last_lines(tmp_path: Path) -> None:
    script = Script("import sys; print('no config here', flush=True); sys.exit(3)", log_path=tmp_path / "s.log")
    with pytest.raises(ProcessError, match=r"the script exited at start; see .*s\.log: no config here"):
        script.start()
    assert not script.running


def test_no_answer_within_the_timeout_is_an_error() -> None:
    script = Script("import time; time.sleep(60)", port=free_port(), start_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(ProcessError, match=r"did not answer on port \d+ within 0 s"):
        script.start()
    assert time.monotonic() - started < 10 and not script.running
    log_path = script.log_path  # kept after a failed start, for its error to point at
    script.stop()
    assert log_path is None or not log_path.exists()


def test_port_is_free_sees_a_listener() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not port_is_free(sock.getsockname()[1])
    assert port_is_free(free_port())


def test_invalid_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="out of range"):
        Script(SERVE, port=70_000)
    with pytest.raises(ValueError, match="positive"):
        Script(SERVE, start_timeout_s=0)
