"""The embedded stack: state file, address resolution, and `rlpipe up`/`down` with real background processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pipeline.cli.main import app
from pipeline.devstack.broker import answers_kafka_metadata
from pipeline.devstack.reconnect import (
    PORTS_FILE,
    PortChoice,
    StackPorts,
    choose_ports,
    read_remembered_ports,
    remember_ports,
)
from pipeline.devstack.stack import (
    DevStack,
    NoBrokerConfiguredError,
    StackState,
    read_stack_state,
    resolve_bootstrap_servers,
    resolve_store_root,
    state_path,
)
from pipeline.io import bus
from schemas.config import BusConfig
from schemas.events import RunStopped, make_event

runner = CliRunner()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private RLPIPE_HOME, and no broker address from the environment."""
    path = tmp_path / "rlpipe-home"
    monkeypatch.setenv("RLPIPE_HOME", str(path))
    monkeypatch.delenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", raising=False)
    return path


def _host_port(bootstrap: str) -> tuple[str, int]:
    host, _, port = bootstrap.rpartition(":")
    return host, int(port)


def _gcs_answers(endpoint: str, bucket: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{bucket}", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _state(home: Path, pid: int) -> StackState:
    return StackState(
        pid=pid,
        bootstrap_servers="127.0.0.1:1",
        store_root=(home / "store").as_uri(),
        home=str(home),
        log_dir=str(home / "logs"),
        started_at=datetime.now(UTC),
    )


def test_without_a_stack_the_error_names_rlpipe_up(home: Path) -> None:
    assert read_stack_state() is None
    with pytest.raises(NoBrokerConfiguredError, match="rlpipe up"):
        resolve_bootstrap_servers(BusConfig())
    assert resolve_bootstrap_servers(BusConfig(bootstrap_servers=" kafka:9092 ")) == "kafka:9092"


def test_store_root_defaults_to_a_folder_under_rlpipe_home(home: Path) -> None:
    assert resolve_store_root("memory://elsewhere") == "memory://elsewhere"
    assert resolve_store_root() == "file://" + str((home / "store").resolve())


def test_a_stale_state_file_counts_as_no_stack(home: Path) -> None:
    path = state_path()
    path.parent.mkdir(parents=True)
    path.write_text(_state(home, _dead_pid()).model_dump_json())
    assert read_stack_state() is None
    # A live process that is not a stack server (a recycled pid) does not count either.
    path.write_text(_state(home, os.getpid()).model_dump_json())
    assert read_stack_state() is None
    path.write_text("{not json")
    assert read_stack_state() is None


def test_dev_stack_starts_and_stops_every_part(tmp_path: Path) -> None:
    with DevStack(home=tmp_path / "home") as stack:
        state = stack.state()
        assert stack.healthy
        assert answers_kafka_metadata(*_host_port(state.bootstrap_servers))
        assert state.gcs_endpoint is not None and state.gcs_bucket == "rlpipe"
        assert _gcs_answers(state.gcs_endpoint, state.gcs_bucket)
        assert Path(state.store_root.removeprefix("file://")).is_dir()
    assert not stack.healthy
    assert not answers_kafka_metadata(*_host_port(state.bootstrap_servers), timeout_s=0.5)
    assert not _gcs_answers(state.gcs_endpoint, "rlpipe")


def test_up_and_down_run_the_stack_in_the_background(home: Path) -> None:
    started = runner.invoke(app, ["up", "--json"])
    assert started.exit_code == 0, started.output
    info = json.loads(started.stdout)
    try:
        assert info["status"] == "started"
        state = read_stack_state()
        assert state is not None and state.pid == info["pid"] != os.getpid()
        assert _alive(state.pid)
        assert answers_kafka_metadata(*_host_port(state.bootstrap_servers))
        assert state.gcs_endpoint and _gcs_answers(state.gcs_endpoint, "rlpipe")
        # Other code finds the broker and the store through the state file alone.
        assert resolve_bootstrap_servers(BusConfig()) == state.bootstrap_servers
        assert resolve_store_root() == state.store_root
        config = BusConfig(namespace=f"t{uuid.uuid4().hex[:10]}")
        with bus.EventPublisher(config) as publisher:
            publisher.publish("control", make_event("run-up", RunStopped(reason="through the stack")))
        assert [r.event.payload.reason for r in bus.tail(config, "control") if r.event] == ["through the stack"]

        again = runner.invoke(app, ["up"])
        assert again.exit_code == 0
        assert "already running" in again.stdout
        assert read_stack_state() == state
        running_port = int(state.bootstrap_servers.rsplit(":", 1)[1])
        same = runner.invoke(app, ["up", "--kafka-port", str(running_port)])
        assert same.exit_code == 0 and "already running" in same.stdout
        other = runner.invoke(app, ["up", "--kafka-port", str(running_port % 60000 + 1)])  # not what it listens on
        assert other.exit_code == 1 and state.bootstrap_servers in other.output and "rlpipe down" in other.output
        assert read_stack_state() == state

        status = runner.invoke(app, ["status", "--json"])
        assert json.loads(status.stdout)["running"] is True
        assert json.loads(status.stdout)["kafka_answers"] is True
    finally:
        stopped = runner.invoke(app, ["down"])
    assert stopped.exit_code == 0
    assert f"stopped (pid {state.pid})" in stopped.stdout
    assert not _alive(state.pid)
    assert not state_path().exists()
    assert not answers_kafka_metadata(*_host_port(state.bootstrap_servers), timeout_s=0.5)
    deadline = time.monotonic() + 5
    while _gcs_answers(state.gcs_endpoint, "rlpipe") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _gcs_answers(state.gcs_endpoint, "rlpipe")
    assert "no rlpipe stack is running" in runner.invoke(app, ["down"]).stdout
    assert json.loads(runner.invoke(app, ["status", "--json"]).stdout)["running"] is False


def test_the_embedded_log_survives_a_restart_of_the_stack(tmp_path: Path) -> None:
    """`rlpipe down` / `up` (a restart of every part) keeps every event at its offset, and the topic's identity."""
    home = tmp_path / "home"
    config = BusConfig(namespace=f"t{uuid.uuid4().hex[:10]}", connect_timeout_s=5.0)
    with DevStack(home=home, with_gcs=False) as stack:
        config = config.model_copy(update={"bootstrap_servers": stack.state().bootstrap_servers})
        with bus.EventPublisher(config) as publisher:
            for index in range(5):
                publisher.publish("control", make_event("run-up", RunStopped(reason=f"event {index}")))
        before = bus.describe_topic(config, "control")
    with DevStack(home=home, with_gcs=False) as stack:
        config = config.model_copy(update={"bootstrap_servers": stack.state().bootstrap_servers})
        records = list(bus.tail(config, "control", n=10))
        assert [(r.offset, r.event.payload.reason) for r in records if r.event] == [
            (index, f"event {index}") for index in range(5)]
        assert bus.describe_topic(config, "control") == before and before.topic_id is not None


def test_down_lists_what_it_stops(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.cli import main as cli_main

    state = _state(home, 4242).model_copy(update={"gcs_endpoint": "http://127.0.0.1:4443", "gcs_bucket": "rlpipe",
                                                  "s3_endpoint": "http://127.0.0.1:4566"})
    monkeypatch.setattr(cli_main, "stop_background", lambda timeout_s: state)
    stopped = runner.invoke(app, ["down"], env={"COLUMNS": "200"})
    assert stopped.exit_code == 0, stopped.output
    for part in ("pid 4242", "Kafka broker", "127.0.0.1:1", "GCS emulator", "http://127.0.0.1:4443", "store",
                 "local S3 server", "http://127.0.0.1:4566"):
        assert part in stopped.stdout, part
    as_json = json.loads(runner.invoke(app, ["down", "--json"]).stdout)
    assert as_json["status"] == "stopped" and as_json["pid"] == 4242
    monkeypatch.setattr(cli_main, "stop_background", lambda timeout_s: None)
    assert json.loads(runner.invoke(app, ["down", "--json"]).stdout) == {"status": "not running"}


def test_status_exit_code_tells_a_script_whether_a_stack_runs_and_answers(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0: running and the broker answers; 1: running, broker silent; 3: no stack (as LSB `status` commands)."""
    from pipeline.cli import main as cli_main

    for args in (["status"], ["status", "--json"]):
        none = runner.invoke(app, args)
        assert none.exit_code == 3, none.output
    assert "rlpipe up" in runner.invoke(app, ["status"]).stdout
    assert json.loads(runner.invoke(app, ["status", "--json"]).stdout)["running"] is False

    monkeypatch.setattr(cli_main, "read_stack_state", lambda: _state(home, 4242))
    for answers, code in ((True, 0), (False, 1)):
        monkeypatch.setattr(cli_main, "answers_kafka_metadata", lambda host, port, timeout_s, a=answers: a)
        for args in (["status"], ["status", "--json"]):
            result = runner.invoke(app, args)
            assert result.exit_code == code, (args, result.output)
        assert json.loads(runner.invoke(app, ["status", "--json"]).stdout)["kafka_answers"] is answers


def test_an_rlpipe_home_that_is_a_file_is_named_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.write_text("kept")
    monkeypatch.setenv("RLPIPE_HOME", str(home))
    monkeypatch.delenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", raising=False)
    result = runner.invoke(app, ["up", "--no-gcs"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"RLPIPE_HOME {home} is a file, not a folder" in result.output
    assert home.read_text() == "kept"


def test_up_on_a_port_in_use_says_why_in_one_line(home: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["up", "--no-gcs", "--kafka-port", str(port)])
    assert result.exit_code == 1 and read_stack_state() is None
    assert f"port {port} is already in use" in result.output and "Traceback" not in result.output
    assert "|" not in result.output and "stack.log" in result.output


def test_two_ups_at_once_start_one_stack_and_the_other_says_it_runs(home: Path) -> None:
    """Two `rlpipe up` at the same moment each started a stack on one RLPIPE_HOME (two S3 servers rewriting one
    journal); the slower waited 30 s and failed, and the first to stop removed the other's stack.json, so `rlpipe
    down` no longer found the stack still running."""
    command = [sys.executable, "-m", "pipeline.cli.main", "up", "--json", "--no-gcs", "--timeout", "20"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    ups = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
           for _ in range(2)]
    try:
        answers = [up.communicate(timeout=60) for up in ups]
        assert [up.returncode for up in ups] == [0, 0], answers
        infos = [json.loads(out) for out, _ in answers]
        assert sorted(info["status"] for info in infos) == ["already running", "started"]
        assert infos[0]["pid"] == infos[1]["pid"]
        servers = subprocess.run(["pgrep", "-f", f"pipeline.devstack.stack serve --home {home.resolve()}"],
                                 capture_output=True, text=True).stdout.split()
        assert servers == [str(infos[0]["pid"])]
    finally:
        stopped = runner.invoke(app, ["down"])
    assert f"stopped (pid {infos[0]['pid']})" in stopped.stdout
    assert not _alive(infos[0]["pid"])


def test_status_shows_a_long_store_path_whole_on_an_80_column_terminal(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `where` column folds a path too long for the terminal onto more lines instead of cutting it."""
    from pipeline.cli import main as cli_main

    deep = home / ("a-folder-with-a-long-name/" * 5).strip("/")
    state = _state(deep, 4242)
    monkeypatch.setattr(cli_main, "read_stack_state", lambda: state)
    monkeypatch.setattr(cli_main, "answers_kafka_metadata", lambda host, port, timeout_s: True)
    result = runner.invoke(app, ["status"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "…" not in result.stdout and max(len(line) for line in lines) <= 80
    where = "".join(line.split("│")[2].strip() for line in lines if line.count("│") == 3)  # the second cells, joined
    assert state.store_root in where and state.log_dir in where


STUCK_SERVER = """
import fcntl, os, signal, subprocess, sys, time
home = sys.argv[1]
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stack stuck on its way down: only SIGKILL ends it
lock = os.open(os.path.join(home, "stack.lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(lock, fcntl.LOCK_EX)
server = subprocess.Popen([sys.executable, "-c",  # one of its servers, as stuck, and not told when its parent dies
                           "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
with open(os.path.join(home, "stack.pid"), "w") as file:
    file.write(str(os.getpid()))
with open(os.path.join(home, "server.pid.partial"), "w") as file:  # renamed once written: never read empty
    file.write(str(server.pid))
os.replace(os.path.join(home, "server.pid.partial"), os.path.join(home, "server.pid"))
time.sleep(120)
"""


@pytest.mark.parametrize("in_a_pipeline", [False, True], ids=["detached", "shell-pipeline"])
def test_down_that_has_to_kill_the_stack_kills_the_servers_it_started_and_nothing_else(
        home: Path, in_a_pipeline: bool) -> None:
    """SIGKILL of the serving process alone released the home's lock while its servers still ran (the next `rlpipe
    up` would start a second S3 server on the same journal); the servers share its process group and die with it.
    ``rlpipe up --foreground | tee log`` in an interactive shell makes the pipeline one process group led by the
    serving process: the fallback killed ``tee`` too, and now spares it."""
    import fcntl

    home.mkdir(parents=True)
    script = home / "stuck_stack.py"
    script.write_text(STUCK_SERVER)
    command = [sys.executable, str(script), str(home), "pipeline.devstack.stack"]
    if in_a_pipeline:  # as a shell with job control starts one: its first process leads a new group, the next joins
        stack = subprocess.Popen(command, process_group=0)
        tee = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], process_group=stack.pid)
    else:  # as `rlpipe up` starts the serving process
        stack, tee = subprocess.Popen(command, start_new_session=True), None
    server_pid = None
    try:
        deadline = time.monotonic() + 20
        while not (home / "server.pid").exists():
            assert time.monotonic() < deadline and stack.poll() is None, "the stuck stack never named its server"
            time.sleep(0.05)
        server_pid = int((home / "server.pid").read_text())
        assert os.getpgid(server_pid) == stack.pid and (tee is None or os.getpgid(tee.pid) == stack.pid)
        state_path(home).write_text(_state(home, stack.pid).model_dump_json())
        assert read_stack_state() is not None

        from pipeline.devstack.stack import stop_background

        assert stop_background(timeout_s=0.5) is not None
        stack.wait(timeout=5)
        deadline = time.monotonic() + 5
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server_pid), "a server of the killed stack still runs"
        assert tee is None or tee.poll() is None, "the pipeline's other process was killed with the stack"
        with open(home / "stack.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: nothing of the old stack holds or needs it
    finally:
        for pid in (stack.pid, server_pid, tee and tee.pid):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        stack.wait(timeout=5)
        if tee is not None:
            tee.wait(timeout=5)


@pytest.mark.parametrize("shell", [["sh", "-c"], ["bash", "-c", "set -m;"]], ids=["script", "job-control"])
def test_down_that_has_to_kill_a_stack_piped_into_tee_by_a_shell_spares_the_shell_and_tee(
        home: Path, shell: list[str]) -> None:
    """``rlpipe up --foreground | tee log`` run by a real shell.  A script's shell (no job control) keeps the
    pipeline in its own process group, so the serving process leads none; a shell with job control makes it lead
    the pipeline's group, tee in it.  Either way the SIGKILL ends the serving process and its servers (one ignores
    SIGTERM and is not told when its parent dies), and neither the shell nor tee: tee reads to the end and exits 0."""
    import shutil

    if shutil.which(shell[0]) is None or shutil.which("tee") is None:
        pytest.skip(f"needs {shell[0]} and tee")
    home.mkdir(parents=True)
    script = home / "stuck_stack.py"
    script.write_text(STUCK_SERVER)
    pipeline = f"{' '.join(shell[2:])} {sys.executable} {script} {home} | tee {home / 'up.log'}"
    shell_process = subprocess.Popen([*shell[:2], pipeline], start_new_session=True, stdin=subprocess.DEVNULL)
    stack_pid = server_pid = None
    try:
        deadline = time.monotonic() + 20
        while not (home / "server.pid").exists():
            assert time.monotonic() < deadline and shell_process.poll() is None, "the stuck stack never named its server"
            time.sleep(0.05)
        stack_pid, server_pid = (int((home / f"{name}.pid").read_text()) for name in ("stack", "server"))
        leads = os.getpgid(stack_pid) == stack_pid
        assert leads == (len(shell) > 2), "the shell did not group the pipeline as this test expects"
        state_path(home).write_text(_state(home, stack_pid).model_dump_json())

        from pipeline.devstack.stack import stop_background

        assert stop_background(timeout_s=0.5) is not None
        deadline = time.monotonic() + 5
        while (_alive(server_pid) or _alive(stack_pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(stack_pid), "the serving process still runs"
        assert not _alive(server_pid), "a server of the killed stack still runs"
        assert shell_process.wait(timeout=5) == 0, "the shell or tee was killed with the stack"
    finally:
        for pid in (stack_pid, server_pid):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if shell_process.poll() is None:
            os.kill(shell_process.pid, signal.SIGKILL)
        shell_process.wait(timeout=5)


def test_a_stack_run_in_the_foreground_is_found_by_the_other_commands(home: Path) -> None:
    """`rlpipe up --foreground` serves from the `rlpipe` process itself, whose command line is not the background
    server's: its state must still count as a running stack (status, down, run), found through the home's lock."""
    command = [sys.executable, "-m", "pipeline.cli.main", "up", "--foreground", "--no-gcs"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    foreground = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while not state_path().exists() and foreground.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert state_path().exists(), "the foreground stack did not record its state"
        state = read_stack_state()
        assert state is not None and state.pid == foreground.pid
        stopped = runner.invoke(app, ["down"])
        assert f"stopped (pid {foreground.pid})" in stopped.stdout, stopped.output
        assert foreground.wait(timeout=20) == 0
    finally:
        if foreground.poll() is None:
            foreground.kill()
            foreground.wait()


def test_up_with_the_gcs_emulator_on_a_port_in_use_says_why_in_one_line(home: Path) -> None:
    """Another GCS emulator already on the port (a container on 4443, say) answered the readiness probe: the stack
    recorded it as its own, and stopped a moment later when its own emulator exited on the taken port."""
    import http.server
    import threading

    class Answers(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def do_POST(self) -> None:
            self.do_GET()

        def log_message(self, *args: object) -> None:
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    try:
        result = runner.invoke(app, ["up", "--gcs-port", str(port)])
        assert result.exit_code == 1, result.output
        assert read_stack_state() is None
    finally:
        stopped = runner.invoke(app, ["down"])
        other.shutdown()
        other.server_close()
    assert "no rlpipe stack is running" in stopped.stdout
    assert f"port {port} is already in use" in result.output and "Traceback" not in result.output
    assert "|" not in result.output and "stack.log" in result.output


def test_up_in_the_foreground_whose_local_s3_server_will_not_start_says_why_in_one_line(home: Path) -> None:
    """The local S3 server's failure at start is the user's to fix (its log says why), as the broker's is: one
    line naming the log, nothing left running, no traceback."""
    (home / "s3" / "journal.jsonl").mkdir(parents=True)  # a journal it cannot read
    result = runner.invoke(app, ["up", "--foreground", "--no-gcs"])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.exception
    assert "error: the local S3 server exited at start" in result.output and "s3.log" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert read_stack_state() is None


def test_up_after_down_listens_on_the_same_ports_again(home: Path) -> None:
    """`rlpipe down` then `rlpipe up` moved the broker and the emulator to new free ports, so a run's learner and
    producers, still on the old address, never reached the stack again (its log is durable: they could go on)."""
    first = runner.invoke(app, ["up", "--json"])
    assert first.exit_code == 0, first.output
    before = json.loads(first.stdout)
    assert runner.invoke(app, ["down"]).exit_code == 0
    assert (home / PORTS_FILE).is_file() and not state_path().exists()
    again = runner.invoke(app, ["up", "--json"])
    try:
        assert again.exit_code == 0, again.output
        after = json.loads(again.stdout)
        assert after["pid"] != before["pid"]
        assert after["bootstrap_servers"] == before["bootstrap_servers"]
        assert after["gcs_endpoint"] == before["gcs_endpoint"]
        assert answers_kafka_metadata(*_host_port(after["bootstrap_servers"]))
        assert "in use" not in again.output
    finally:
        runner.invoke(app, ["down"])


@contextlib.contextmanager
def _up_with_remembered_port_taken(home: Path) -> Iterator[tuple[int, Any, StackState | None]]:
    """`rlpipe up --no-gcs --json` while the broker port the home remembers is held by another listener: (that port,
    the command's result, the stack's state); the stack is stopped after the block."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        home.mkdir(parents=True)
        (home / PORTS_FILE).write_text(json.dumps({"kafka_port": port, "gcs_port": None}))
        result = runner.invoke(app, ["up", "--no-gcs", "--json"])
        try:
            yield port, result, read_stack_state()
        finally:
            runner.invoke(app, ["down"])


def test_up_whose_previous_port_is_taken_starts_on_a_free_one_saying_so(home: Path) -> None:
    with _up_with_remembered_port_taken(home) as (port, result, state):
        assert result.exit_code == 0, result.output
        assert state is not None and _host_port(state.bootstrap_servers)[1] != port
        notes = [line for line in result.stderr.splitlines() if str(port) in line]
        assert len(notes) == 1 and "in use" in notes[0] and "free port" in notes[0], result.stderr
        assert json.loads(result.stdout)["bootstrap_servers"] == state.bootstrap_servers  # stdout stays JSON
    # the port it took instead is the one remembered now
    assert read_remembered_ports(home) == StackPorts(kafka_port=_host_port(state.bootstrap_servers)[1])


def test_a_remembered_port_taken_after_it_was_looked_at_falls_back_to_a_free_one(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The remembered broker port was free when `up` looked and taken before the stack bound it (another home's
    stack, say): the start goes on on free ports, saying so, as when the port was seen taken."""
    from pipeline.devstack import reconnect

    monkeypatch.setattr(reconnect, "port_is_free", lambda port: True)  # the look said free; the bind says taken
    with _up_with_remembered_port_taken(home) as (port, result, state):
        assert result.exit_code == 0, result.output
        assert state is not None and _host_port(state.bootstrap_servers)[1] != port
        assert "was taken as the stack started" in result.stderr, result.stderr


def test_an_explicit_port_wins_over_the_remembered_one(home: Path) -> None:
    from pipeline.devstack.process import free_port

    wanted = free_port()
    home.mkdir(parents=True)
    (home / PORTS_FILE).write_text(json.dumps({"kafka_port": free_port(), "gcs_port": None}))
    result = runner.invoke(app, ["up", "--no-gcs", "--json", "--kafka-port", str(wanted)])
    try:
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["bootstrap_servers"] == f"127.0.0.1:{wanted}"
    finally:
        runner.invoke(app, ["down"])


@pytest.mark.parametrize("text", ["{not json", '{"kafka_port": 0}', '{"kafka_port": 70000}', '{"kafka_port": "x"}',
                                  '{"kafka_port": 5000, "gcs_port": 5000}', '{"kafka_port": 5000, "pid": 1}', "[]"])
def test_a_ports_file_that_does_not_validate_is_ignored(home: Path, text: str) -> None:
    home.mkdir(parents=True)
    (home / PORTS_FILE).write_text(text)
    assert read_remembered_ports(home) is None
    assert choose_ports(home, None, None, with_gcs=True) == PortChoice(kafka_port=None, gcs_port=None, notes=[])


def test_a_stack_without_the_emulator_keeps_the_remembered_emulator_port(home: Path) -> None:
    from pipeline.devstack.process import free_port

    first_kafka, gcs, kafka = free_port(), free_port(), free_port()
    home.mkdir(parents=True)
    remember_ports(home, kafka_port=first_kafka, gcs_port=gcs)
    remember_ports(home, kafka_port=kafka, gcs_port=None)  # `rlpipe run` starts one with --no-gcs
    assert read_remembered_ports(home) == StackPorts(kafka_port=kafka, gcs_port=gcs)
    assert choose_ports(home, None, None, with_gcs=True) == PortChoice(kafka, gcs)
    assert choose_ports(home, None, None, with_gcs=False) == PortChoice(kafka, None)
    assert choose_ports(home, first_kafka, None, with_gcs=True) == PortChoice(first_kafka, gcs)  # asked for wins


def test_down_while_a_run_still_writes_its_logs_warns_that_it_will_wait_for_the_same_ports(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without /proc (macOS) the runs still going are those whose logs changed lately."""
    from pipeline.cli import main as cli_main
    from pipeline.devstack import reconnect

    monkeypatch.setattr(reconnect, "command_lines", lambda: None)
    state = _state(home, 4242)
    monkeypatch.setattr(cli_main, "stop_background", lambda timeout_s: state)
    logs = home / "runs" / "pk-1" / "logs"
    logs.mkdir(parents=True)
    for name in ("learner", "producer-0"):
        (logs / f"{name}.log").write_text("step 3\n")
    old = home / "runs" / "done" / "logs"
    old.mkdir(parents=True)
    (old / "learner.log").write_text("finished\n")
    an_hour_ago = time.time() - 3600
    os.utime(old / "learner.log", (an_hour_ago, an_hour_ago))

    result = runner.invoke(app, ["down"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "pk-1" in line]
    assert len(warnings) == 1, result.stderr
    assert "learner" in warnings[0] and "producer-0" in warnings[0] and "rlpipe up" in warnings[0]
    assert "same ports" in warnings[0] and "done" not in warnings[0]
    as_json = json.loads(runner.invoke(app, ["down", "--json"]).stdout)
    assert as_json["recent_runs"] == {"pk-1": ["learner", "producer-0"]}

    os.utime(logs / "learner.log", (an_hour_ago, an_hour_ago))
    os.utime(logs / "producer-0.log", (an_hour_ago, an_hour_ago))
    quiet = runner.invoke(app, ["down"])
    assert "pk-1" not in quiet.stderr and "rlpipe stack stopped" in quiet.stdout


def test_down_names_the_processes_started_on_a_run_config_of_the_home_even_with_quiet_logs(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A learner busy on its first step writes no log for minutes; its command line names its runs' config files."""
    from pipeline.cli import main as cli_main

    monkeypatch.setattr(cli_main, "stop_background", lambda timeout_s: _state(home, 4242))
    configs = [home / "runs" / run / "config.yaml" for run in ("pk-1", "pk-2")]
    learner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "learner", "start",
                                "--config", str(configs[0]), "--config", str(configs[1])])
    elsewhere = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "producer", "start",
                                  "--config", "/elsewhere/runs/other/config.yaml"])
    try:
        deadline = time.monotonic() + 5
        while "learner" not in Path(f"/proc/{learner.pid}/cmdline").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)  # until it has exec'd
        result = runner.invoke(app, ["down", "--json"])
    finally:
        for process in (learner, elsewhere):
            process.kill()
            process.wait()
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["recent_runs"] == {run: [f"learner (pid {learner.pid})"] for run in ("pk-1", "pk-2")}
    assert "pk-1" in result.stderr and "other" not in result.stderr
    # with /proc, a log written a moment ago by a process that has exited names nothing
    (home / "runs" / "pk-1" / "logs").mkdir(parents=True)
    (home / "runs" / "pk-1" / "logs" / "learner.log").write_text("stopped\n")
    assert json.loads(runner.invoke(app, ["down", "--json"]).stdout)["recent_runs"] == {}


def test_down_names_a_process_started_by_hand_on_a_run_of_this_home_only(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rlpipe learner start --preset cartpole --run mine` names its run, not a config file: it is named when its
    environment points at this home (RLPIPE_HOME), and a process of another home is not."""
    from pipeline.cli import main as cli_main

    monkeypatch.setattr(cli_main, "stop_background", lambda timeout_s: _state(home, 4242))
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    mine = subprocess.Popen([*sleeper, "learner", "start", "--preset", "cartpole", "--run", "mine"],
                            env={**os.environ, "RLPIPE_HOME": str(home)})
    packed = subprocess.Popen([*sleeper, "producer", "start", "--preset", "cartpole", "--run=a", "--run", "b"],
                              env={**os.environ, "RLPIPE_HOME": str(home / ".." / home.name)})
    other = subprocess.Popen([*sleeper, "learner", "start", "--preset", "cartpole", "--run", "theirs"],
                             env={**os.environ, "RLPIPE_HOME": str(home.parent / "another-home")})
    short = subprocess.Popen([*sleeper, "learner", "start", "--preset", "cartpole", "-r", "c", "-rd"],  # relative home
                             env={**os.environ, "RLPIPE_HOME": home.name}, cwd=home.parent)
    started = (mine, packed, other, short)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(
                "start" in Path(f"/proc/{p.pid}/cmdline").read_text() for p in started):
            time.sleep(0.05)  # until they have exec'd
        result = runner.invoke(app, ["down", "--json"])
    finally:
        for process in started:
            process.kill()
            process.wait()
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["recent_runs"] == {
        "mine": [f"learner (pid {mine.pid})"], "a": [f"producer (pid {packed.pid})"],
        "b": [f"producer (pid {packed.pid})"], "c": [f"learner (pid {short.pid})"],
        "d": [f"learner (pid {short.pid})"]}
