"""The embedded development stack: a Kafka-protocol broker, a GCS emulator and a local store folder.

``rlpipe up`` starts ``python -m pipeline.devstack.stack serve`` as a detached background
process that owns the servers (Tansu, the local S3 server under Tansu's log, and
fake-gcs-server), writes where they
listen to ``$RLPIPE_HOME/stack.json`` (default ``~/.rlpipe``) and stops them
cleanly on SIGTERM.  ``rlpipe down`` sends that SIGTERM.  The serving process holds a lock on
``$RLPIPE_HOME/stack.lock`` for its life, so two ``rlpipe up`` at once start one stack and the
other reports it as already running; a ``stack.json`` whose lock no process holds (left by a reboot or a
``kill -9``) is stale and counts as no stack.  Every other command finds
the broker through ``resolve_bootstrap_servers``: the configured address if there
is one, else the running stack's, else a one-line error naming ``rlpipe up``.

Why a separate process rather than threads in the CLI: the stack must outlive the
command that started it, and one owner process makes ``down`` a single signal.
The broker keeps its log in S3 on a journaled local S3 server
(``pipeline.devstack.s3_server``, journal under ``$RLPIPE_HOME/s3``), so events keep their
offsets across ``down`` / ``up`` and checkpoints' offsets stay valid; the store
folder and the emulator's objects are kept on disk under ``$RLPIPE_HOME`` too.  So are the
ports (``$RLPIPE_HOME/ports.json``, which ``down`` keeps): the next ``up`` listens on them
again where they are free, so a run's processes that outlived ``down``, retrying the address
they know, reconnect and go on.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.devstack.broker import TansuBroker
from pipeline.devstack.process import descendants_in_group, process_table, still_living
from pipeline.devstack.reconnect import choose_ports, remember_ports, write_model
from pipeline.devstack.s3_server import LocalS3Server
from schemas.config import BusConfig

HOME_ENV = "RLPIPE_HOME"
STATE_FILE = "stack.json"
LOCK_FILE = "stack.lock"  # held (flock) by the one serving process of a home, for its whole life
EXIT_ALREADY_RUNNING = 3  # `serve` found another stack serving this home
DEFAULT_BUCKET = "rlpipe"

log = logging.getLogger(__name__)


class StackError(RuntimeError):
    """The embedded stack could not be started, found or stopped."""


class StackAlreadyRunningError(StackError):
    """A stack already runs for this RLPIPE_HOME; ``state`` says where."""

    def __init__(self, state: StackState) -> None:
        super().__init__(f"the rlpipe stack is already running (pid {state.pid}, Kafka at {state.bootstrap_servers})")
        self.state = state


class NoBrokerConfiguredError(ValueError):
    """No broker address is configured and no embedded stack is running."""


class StackState(BaseModel):
    """Where a running embedded stack listens (the content of ``stack.json``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pid: int = Field(ge=1, description="process id of the serving process (`rlpipe up`'s background one, or `up --foreground`)")
    bootstrap_servers: str = Field(description="Kafka address of the embedded broker")
    gcs_endpoint: str | None = Field(None, description="fake-gcs-server endpoint; None when started without it")
    gcs_bucket: str | None = Field(None, description="bucket created on the emulator")
    log_storage: str = Field("memory://tansu/", description="the broker's storage engine")
    s3_endpoint: str | None = Field(None, description="local S3 server holding the broker's log; None = in memory")
    store_root: str = Field(description="default object store root (file:// folder)")
    home: str = Field(description="the RLPIPE_HOME this stack belongs to")
    log_dir: str = Field(description="folder of the servers' logs")
    started_at: datetime = Field(description="when the stack became ready")


def rlpipe_home() -> Path:
    """``$RLPIPE_HOME``, else ``~/.rlpipe``: where the stack state, logs and local store live."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".rlpipe").expanduser()


def make_home(home: Path) -> None:
    """Create the rlpipe home folder; ``StackError`` naming the fix if a file holds its name."""
    if home.exists() and not home.is_dir():
        raise StackError(f"RLPIPE_HOME {home} is a file, not a folder; point RLPIPE_HOME at a folder "
                         "(default ~/.rlpipe)")
    home.mkdir(parents=True, exist_ok=True)


def state_path(home: Path | None = None) -> Path:
    """The state file of the stack of ``home``."""
    return (home or rlpipe_home()) / STATE_FILE


def default_store_root(home: Path | None = None) -> str:
    """``file://<home>/store``: the local object store used when nothing else is configured."""
    return ((home or rlpipe_home()) / "store").resolve().as_uri()


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _home_is_served(home: Path) -> bool:
    """True while a process holds the home's lock: ``serve`` holds it for its whole life, and the kernel drops it
    when that process dies (a reboot or ``kill -9`` included), so a state file left behind is told apart from a
    stack however it was started (``rlpipe up``, ``rlpipe up --foreground``) and whatever now has its pid."""
    try:
        descriptor = os.open(home / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)  # only refused while someone holds it exclusively
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)  # also releases the shared lock, if taken
    return False


def read_stack_state(home: Path | None = None) -> StackState | None:
    """The running stack's state, or None if none runs (a state file that no serving process holds is stale)."""
    path = state_path(home)
    try:
        state = StackState.model_validate_json(path.read_text())
    except (OSError, ValidationError, ValueError):
        return None
    return state if _is_alive(state.pid) and _home_is_served(path.parent) else None


def resolve_bootstrap_servers(bus_config: BusConfig) -> str:
    """The configured ``bus.bootstrap_servers``, else the running stack's, else a one-line error."""
    if bus_config.bootstrap_servers.strip():
        return bus_config.bootstrap_servers.strip()
    state = read_stack_state()
    if state is not None:
        return state.bootstrap_servers
    raise NoBrokerConfiguredError(
        "no Kafka broker configured and no local stack running; start one with `rlpipe up` "
        "or set bus.bootstrap_servers (RLPIPE_BUS__BOOTSTRAP_SERVERS)"
    )


def resolve_store_root(root: str | None = None) -> str:
    """``root`` if given, else the running stack's store root, else ``file://$RLPIPE_HOME/store``."""
    if root:
        return root
    state = read_stack_state()
    return state.store_root if state is not None else default_store_root()


class DevStack:
    """The broker, the GCS emulator (with a bucket) and the store folder, started and stopped together."""

    def __init__(
        self,
        home: Path | None = None,
        kafka_port: int | None = None,
        gcs_port: int | None = None,
        with_gcs: bool = True,
        bucket: str = DEFAULT_BUCKET,
        durable_log: bool = True,
    ) -> None:
        self.home = (home or rlpipe_home()).expanduser().resolve()
        self.log_dir = self.home / "logs"
        self.with_gcs = with_gcs
        self.bucket = bucket
        self.s3 = LocalS3Server(data_dir=self.home / "s3", log_path=self.log_dir / "s3.log") if durable_log else None
        storage = self.s3.storage_url() if self.s3 is not None else "memory://tansu/"
        self.broker = TansuBroker(port=kafka_port, log_path=self.log_dir / "tansu.log", storage_engine=storage)
        self.gcs = None
        if with_gcs:
            from pipeline.devstack.gcs_emulator import FakeGCSServer

            self.gcs = FakeGCSServer(port=gcs_port, data_dir=self.home / "gcs", log_path=self.log_dir / "gcs.log")
        self.started_at: datetime | None = None

    def start(self) -> DevStack:
        """Start every part (stopping what started if one fails)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        Path(self.store_root.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
        try:
            if self.s3 is not None:
                self.broker.environment = self.s3.start().broker_environment()
            self.broker.start()
            if self.gcs is not None:
                from pipeline.devstack.gcs_emulator import ensure_bucket

                self.gcs.start()
                ensure_bucket(self.gcs.endpoint_url, self.bucket)
        except BaseException:
            self.stop()
            raise
        self.started_at = datetime.now(UTC)
        return self

    @property
    def store_root(self) -> str:
        """The local store folder as a ``file://`` URL."""
        return default_store_root(self.home)

    @property
    def healthy(self) -> bool:
        """True while every started part is still running."""
        return (self.broker.running and (self.gcs is None or self.gcs.running)
                and (self.s3 is None or self.s3.running))

    def state(self, pid: int | None = None) -> StackState:
        """The state to record for this stack, owned by process ``pid`` (default: this one)."""
        return StackState(
            pid=pid or os.getpid(),
            bootstrap_servers=self.broker.bootstrap_servers,
            gcs_endpoint=self.gcs.endpoint_url if self.gcs is not None else None,
            gcs_bucket=self.bucket if self.gcs is not None else None,
            log_storage=self.broker.storage_engine,
            s3_endpoint=self.s3.endpoint_url if self.s3 is not None else None,
            store_root=self.store_root,
            home=str(self.home),
            log_dir=str(self.log_dir),
            started_at=self.started_at or datetime.now(UTC),
        )

    def stop(self) -> None:
        """Stop every part; safe to call twice."""
        if self.gcs is not None:
            self.gcs.stop()
        self.broker.stop()
        if self.s3 is not None:
            self.s3.stop()  # after the broker: nothing it writes is lost

    def __enter__(self) -> DevStack:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------------------------------
# The background server and its control (rlpipe up / down)


def _hold_home_lock(home: Path, wait_for_state_s: float = 30.0) -> int:
    """Take the home's lock for this process's life (the descriptor, kept open); one stack serves a home.

    Two ``rlpipe up`` at once would otherwise each start a stack on the same folders (two S3 servers rewriting
    one journal).  Where another process holds the lock, ``StackAlreadyRunningError`` names its stack once it
    has recorded its state (``StackError`` if it records none within ``wait_for_state_s``).  The kernel drops
    the lock when the holder dies, so a crashed stack never blocks the next one.
    """
    make_home(home)
    descriptor = os.open(home / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_for_state_s
    while True:  # tried again: a reader's probe (``_home_is_served``) holds it shared for a moment
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return descriptor
        except BlockingIOError:
            pass
        running = read_stack_state(home)
        if running is not None or time.monotonic() > deadline:
            os.close(descriptor)
            if running is not None:
                raise StackAlreadyRunningError(running)
            raise StackError(f"another rlpipe stack is starting or stopping for {home}; try again in a moment")
        time.sleep(0.1)


def serve(home: Path, kafka_port: int | None = None, gcs_port: int | None = None, with_gcs: bool = True) -> int:
    """Run the stack in this process until SIGTERM/SIGINT; the state file exists exactly while it serves.

    ``StackAlreadyRunningError`` when another process serves ``home`` (``_hold_home_lock``).
    """
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    path = state_path(home)
    lock = _hold_home_lock(home)
    try:
        return _serve_locked(home, path, stop, kafka_port, gcs_port, with_gcs)
    finally:
        os.close(lock)


def _serve_locked(home: Path, path: Path, stop: threading.Event, kafka_port: int | None, gcs_port: int | None,
                  with_gcs: bool) -> int:
    stack = DevStack(home=home, kafka_port=kafka_port, gcs_port=gcs_port, with_gcs=with_gcs)
    with stack:
        write_model(path, stack.state())
        if stack.broker.port is not None:  # set by a start
            remember_ports(home, stack.broker.port, stack.gcs.port if stack.gcs is not None else None)
        print(f"rlpipe stack ready: {stack.state().model_dump_json()}", flush=True)
        try:
            while not stop.wait(0.5):
                if not stack.healthy:
                    print("a stack server exited unexpectedly; stopping the stack (see the logs)", flush=True)
                    return 1
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    print("rlpipe stack stopped", flush=True)
    return 0


def start_background(
    home: Path | None = None,
    kafka_port: int | None = None,
    gcs_port: int | None = None,
    with_gcs: bool = True,
    timeout_s: float = 30.0,
    on_note: Callable[[str], None] = log.warning,
) -> StackState:
    """Start ``python -m pipeline.devstack.stack serve`` detached and wait until it records its state.

    A port not given is the one the home's last stack used, where free (``choose_ports``; ``on_note`` gets a line
    for each that is not), else a free one.  Raises ``StackAlreadyRunningError`` if a stack already runs for
    ``home``, and ``StackError`` if the server exits or does not become ready in time.
    """
    home = (home or rlpipe_home()).expanduser().resolve()
    running = read_stack_state(home)
    if running is not None:
        raise StackAlreadyRunningError(running)
    make_home(home)
    ports = choose_ports(home, kafka_port, gcs_port, with_gcs)
    for note in ports.notes:
        on_note(note)
    log_path = home / "stack.log"
    try:
        return _start_and_wait(home, ports.kafka_port, ports.gcs_port, with_gcs, log_path, timeout_s)
    except StackTakenPortError:
        if (ports.kafka_port, ports.gcs_port) == (kafka_port, gcs_port):
            raise
        # a remembered port, free when looked at, was taken before the stack bound it: free ones, as with none
        on_note("a port this home used before was taken as the stack started; starting on free ports (processes "
                "still on the old ports will not reach this stack)")
        return _start_and_wait(home, kafka_port, gcs_port, with_gcs, log_path, timeout_s)


class StackTakenPortError(StackError):
    """The stack exited at start because a port it was given was in use."""


def _start_and_wait(home: Path, kafka_port: int | None, gcs_port: int | None, with_gcs: bool, log_path: Path,
                    timeout_s: float) -> StackState:
    process = _spawn_server(home, kafka_port, gcs_port, with_gcs, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = read_stack_state(home)
        if state is not None and state.pid == process.pid:
            return state
        if process.poll() is not None:
            code = process.returncode
            if code == EXIT_ALREADY_RUNNING and (running := read_stack_state(home)) is not None:
                raise StackAlreadyRunningError(running)  # another `up` started it meanwhile
            line = _last_line(log_path)
            error = StackTakenPortError if "already in use" in line else StackError
            raise error(f"the stack exited at start (code {code}): {line} (see {log_path})")
        time.sleep(0.1)
    _terminate(process.pid, timeout_s=5.0)
    raise StackError(f"the stack did not become ready within {timeout_s:g}s; see {log_path}")


def _spawn_server(
    home: Path, kafka_port: int | None, gcs_port: int | None, with_gcs: bool, log_path: Path
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "pipeline.devstack.stack", "serve", "--home", str(home)]
    if kafka_port:
        command += ["--kafka-port", str(kafka_port)]
    if gcs_port:
        command += ["--gcs-port", str(gcs_port)]
    if not with_gcs:
        command.append("--no-gcs")
    project_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [project_root, os.environ.get("PYTHONPATH")]))}
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # detached: Ctrl-C in the terminal that ran `rlpipe up` does not reach it
            env=env,
            cwd=str(home),
        )


def stop_background(home: Path | None = None, timeout_s: float = 10.0) -> StackState | None:
    """Stop the stack of ``home`` (SIGTERM, then SIGKILL after ``timeout_s``); returns its state, None if none ran.

    ``StackError`` names the stack's processes that a SIGKILL left running (``_kill_stack``)."""
    home = (home or rlpipe_home()).expanduser().resolve()
    state = read_stack_state(home)
    if state is not None:
        _terminate(state.pid, timeout_s)
    with contextlib.suppress(FileNotFoundError):
        state_path(home).unlink()
    return state


def _terminate(pid: int, timeout_s: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.1)
    _kill_stack(pid)


def _kill_stack(pid: int, wait_s: float = 5.0) -> None:
    """SIGKILL the serving process ``pid`` and the servers it started (broker, local S3 server, GCS emulator).

    Killing it alone would drop the home's lock while they still run, and the next ``rlpipe up`` would start a
    second S3 server on the same journal.  The servers are its descendants in its process group (``ManagedProcess``
    gives them no group of their own), which it leads when ``rlpipe up`` started it, or a shell with job control
    ran ``rlpipe up --foreground | tee log``; a script's shell keeps such a pipeline in its own group.  Only the
    serving process and its descendants are killed, never the rest of the group (``tee``, the shell).  Without
    ``/proc`` (macOS) the whole group is killed where the serving process leads it, else the serving process alone
    (its servers get SIGTERM from the kernel, ``die_with_parent``).  ``StackError`` names what still runs
    ``wait_s`` after the SIGKILL.
    """
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return
    processes = process_table()
    if processes is None and group != pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return
    if processes is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        targets = None
    else:
        targets = descendants_in_group(pid, processes, group)
        for target in targets:  # the serving process first: it starts no server after
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while left := still_living(pid, targets):
        if time.monotonic() > deadline:
            raise StackError(f"the stack's processes {', '.join(map(str, left))} still run {wait_s:g}s after "
                             "SIGKILL; wait for them to exit (ps -o pid,stat,cmd -p PID) before rlpipe up")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        reaped, _ = os.waitpid(pid, os.WNOHANG)  # our own child: reap it so it is not a zombie
        if reaped == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _last_line(path: Path) -> str:
    """The log's last line, an exception's message without its module path (``BrokerStartError: port ...``)."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace")[-2000:].splitlines() if line.strip()]
    except OSError:
        lines = []
    return re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", lines[-1]) if lines else "nothing logged"


def _tail(path: Path, chars: int = 400) -> str:
    try:
        return " | ".join(path.read_text(errors="replace")[-chars:].strip().splitlines())
    except OSError:
        return ""


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.devstack.stack", description="Run the embedded rlpipe stack.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="run the stack in the foreground until SIGTERM")
    serve_parser.add_argument("--home", type=Path, default=None, help="RLPIPE_HOME (default ~/.rlpipe)")
    serve_parser.add_argument("--kafka-port", type=int, default=None)
    serve_parser.add_argument("--gcs-port", type=int, default=None)
    serve_parser.add_argument("--no-gcs", action="store_true", help="do not start the GCS emulator")
    args = parser.parse_args(argv)
    home = (args.home or rlpipe_home()).expanduser().resolve()
    try:
        return serve(home, kafka_port=args.kafka_port, gcs_port=args.gcs_port, with_gcs=not args.no_gcs)
    except StackAlreadyRunningError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ALREADY_RUNNING


if __name__ == "__main__":
    sys.exit(_main())
