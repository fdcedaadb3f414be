"""A server subprocess on a loopback port, with the lifecycle the embedded dev stack needs.

The local broker (``pipeline.devstack.broker``), the GCS emulator (``pipeline.devstack.gcs_emulator``)
and the local S3 server (``pipeline.devstack.s3_server``) each run one server on
``127.0.0.1:PORT`` and need the same things around it: a free port (and another
one if it is taken between the pick and the bind), the server's output in a log
file named in every error (a temporary one is removed on stop), a ``start()`` that
returns only once the server answers, and a ``stop()`` that terminates the process
and kills it if it does not exit.  ``ManagedProcess`` is that lifecycle; a subclass
says which command to run (``_command``), how to tell that the server answers
(``_answers``) and which error to raise (``error``).

The process is stopped by ``stop()``, by leaving a ``with`` block, at interpreter
exit, and (on Linux) by the kernel when the thread that started it dies, so a
crashed test run leaves no server behind.

``process_table``, ``descendants_in_group`` and ``still_living`` read the process
tree from ``/proc``, for ``rlpipe down`` to kill a stack's servers and nothing else;
``command_lines`` reads the processes' arguments, for it to name the runs still going.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, ClassVar, Self

LOOPBACK = "127.0.0.1"
log = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the caller retries if it is taken meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    """True if nothing listens on ``127.0.0.1:port`` (a port in TIME_WAIT counts as free, as servers bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def die_with_parent() -> None:
    """Runs in the child before exec: ask Linux to SIGTERM it when the starting thread dies."""
    with contextlib.suppress(OSError, AttributeError):  # no libc.so.6 (musl) or no prctl: start without it
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def stop_processes(processes: list[subprocess.Popen[bytes]], timeout_s: float = 60.0) -> None:
    """Ask each process to stop (SIGTERM); kill those still running ``timeout_s`` after the request."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("process %d did not stop within %.0f s; killing it", process.pid, timeout_s)
            process.kill()
            process.wait()


def process_table() -> dict[int, tuple[str, int, int]] | None:
    """Every process as pid -> (state, parent pid, process group), from /proc; None without /proc."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    processes = {}
    for stat in proc.glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rpartition(")")[2].split()  # after "pid (comm)": state, ppid, pgrp, ...
            processes[int(stat.parent.name)] = (fields[0], int(fields[1]), int(fields[2]))
    return processes


def command_lines() -> dict[int, list[str]] | None:
    """Every readable process's arguments as pid -> argv, from /proc; None without /proc."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    commands = {}
    for cmdline in proc.glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError, ValueError):
            commands[int(cmdline.parent.name)] = cmdline.read_bytes().decode(errors="replace").split("\0")[:-1]
    return commands


def descendants_in_group(pid: int, processes: dict[int, tuple[str, int, int]], group: int | None = None) -> list[int]:
    """``pid`` and its descendants that are in process group ``group`` (default: the one ``pid`` leads), ``pid``
    first."""
    group = pid if group is None else group
    children: dict[int, list[int]] = {}
    for child, (_, parent, child_group) in processes.items():
        if child_group == group:
            children.setdefault(parent, []).append(child)
    found = [pid]
    for parent in found:  # grows as it goes: breadth first
        found += sorted(children.get(parent, []))
    return found


def still_living(pgid: int, targets: list[int] | None) -> list[int]:
    """Which of ``targets`` are not zombies; with None (no /proc), ``[pgid]`` while any of its group runs."""
    if targets is None:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    processes = process_table() or {}
    return [pid for pid in targets if pid in processes and processes[pid][0] not in ("Z", "X")]


class ManagedProcess:
    """One server subprocess on ``127.0.0.1:PORT``: started, waited for, logged and stopped.

    ``port=None`` picks a free port (three tries, in case it is taken meanwhile).
    ``log_path=None`` writes the output to a temporary file named after ``log_prefix``
    and removes it on ``stop()``; where ``log_prefix`` is None the output is
    discarded instead.  ``start()`` waits at most ``start_timeout_s`` for
    ``_answers()``; ``stop()`` is safe to call twice.
    """

    what: ClassVar[str] = "the server"  # names the server in errors
    error: ClassVar[type[RuntimeError]] = RuntimeError  # raised when it will not start
    log_prefix: ClassVar[str | None] = "rlpipe-"  # temporary log file name; None: no log without a log_path
    refuse_taken_port: ClassVar[bool] = False  # check a port before the start (else the probe may find another server)

    def __init__(
        self, *, port: int | None, log_path: str | Path | None, start_timeout_s: float, die_with_parent: bool = True
    ) -> None:
        # By keyword and without defaults: each server orders its own arguments and chooses its own defaults.
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port {port} is out of range; use 1-65535 or None for a free one")
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be positive, got {start_timeout_s}")
        self._requested_port = port
        self.port: int | None = None
        self.start_timeout_s = start_timeout_s
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self._log_path = Path(log_path) if log_path is not None else None
        self._log_is_temporary = log_path is None
        self._log_file: IO[bytes] | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        """True while the subprocess is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id of the server, while it runs."""
        return self._process.pid if self.running and self._process is not None else None

    @property
    def log_path(self) -> Path | None:
        """Where the server's own output goes (named in start errors)."""
        return self._log_path

    def start(self) -> Self:
        """Start the server and wait until it answers (at most ``start_timeout_s``); retry on a port taken meanwhile."""
        if self.running:
            return self
        attempts = 1 if self._requested_port else 3
        for attempt in range(attempts):
            self.port = self._requested_port or free_port()
            try:
                if self.refuse_taken_port and not port_is_free(self.port):
                    raise self.error(f"port {self.port} is already in use; choose another or leave it unset")
                self._spawn()
                self._wait_until_ready()
                break
            except self.error:
                self._terminate()
                if attempt == attempts - 1:
                    raise
        atexit.register(self.stop)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the server (kill it after ``timeout_s``); safe to call twice."""
        self._terminate(timeout_s)
        if self._log_is_temporary and self._log_path is not None:
            with contextlib.suppress(OSError):
                self._log_path.unlink()
            self._log_path = None
        atexit.unregister(self.stop)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- what a subclass says ----------------------------------------------------------------------------------------

    def _command(self) -> list[str]:
        """The command line that runs the server on ``self.port``."""
        raise NotImplementedError

    def _answers(self) -> bool:
        """True once the server serves requests (a bound port alone is not enough)."""
        raise NotImplementedError

    def _environment(self) -> dict[str, str] | None:
        """The server's environment; None inherits this process's."""
        return None

    def _working_directory(self) -> str | None:
        """Where the server runs; None: here."""
        return None

    # -- phases of start and stop --------------------------------------------------------------------------------------

    def _open_log(self) -> IO[bytes] | int:
        if self._log_path is None and self.log_prefix is None:
            return subprocess.DEVNULL
        if self._log_path is None:
            handle, name = tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")
            self._log_path = Path(name)
            self._log_file = open(handle, "ab")  # noqa: SIM115 - kept open for the process lifetime
        else:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self._log_path, "ab")  # noqa: SIM115
        return self._log_file

    def _spawn(self) -> None:
        command = self._command()
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._open_log(),
            stderr=subprocess.STDOUT,
            env=self._environment(),
            cwd=self._working_directory(),
            preexec_fn=die_with_parent if self.die_with_parent else None,
        )

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise self.error(f"{self.what} exited at start{self._see_log()}")
            if self._answers():
                return
            time.sleep(0.05)
        raise self.error(
            f"{self.what} did not answer on port {self.port} within {self.start_timeout_s:.0f} s{self._see_log()}"
        )

    def _terminate(self, timeout_s: float = 5.0) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout_s)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _see_log(self) -> str:
        """``; see LOG: <its last lines>`` for an error (a temporary log is gone once the server is stopped)."""
        if self._log_path is None:
            return ""
        try:
            tail = self._log_path.read_text(errors="replace")[-500:].strip()
        except OSError:
            tail = ""
        return f"; see {self._log_path}: {tail}" if tail else f"; see {self._log_path}"
