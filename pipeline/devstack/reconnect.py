"""What lets a run's processes outlive ``rlpipe down``: the home's remembered ports, and the runs still using the stack.

A run's learner and producers keep retrying the broker address they know when the stack
stops; its log is durable, so a stack started again on the same ports
(``$RLPIPE_HOME/ports.json``, kept by ``down``, taken again by ``up`` where free) lets them go
on where they stopped.  ``rlpipe down`` names the runs whose processes still go
(``runs_still_going``), so stopping the stack under them is a choice made knowingly.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.devstack.process import command_lines, port_is_free

PORTS_FILE = "ports.json"  # the ports the home's last stack listened on: kept by `down`, taken again by `up`
HOME_ENV = "RLPIPE_HOME"  # as pipeline.devstack.stack reads it
RECENT_LOG_S = 120.0  # a run's process that wrote its log this recently is taken to be running still
ROLES = ("learner", "producer")  # the commands `rlpipe run` starts, each with `--config <home>/runs/<run>/config.yaml`


def write_model(path: Path, model: BaseModel) -> None:
    """Write ``model`` as JSON atomically, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(model.model_dump_json(indent=2))
    os.replace(tmp, path)


class StackPorts(BaseModel):
    """The ports the home's last stack listened on (the content of ``ports.json``).

    Processes that outlive ``rlpipe down`` (a run's learner and producers) keep retrying the address they know;
    the broker's log is durable, so a stack started again on the same ports lets them go on where they stopped.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kafka_port: int = Field(ge=1, le=65535, description="port of the embedded broker")
    gcs_port: int | None = Field(None, ge=1, le=65535, description="port of the GCS emulator; None if never started")

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        if self.kafka_port == self.gcs_port:
            raise ValueError(f"the broker and the GCS emulator cannot share port {self.kafka_port}")
        return self


@dataclass(frozen=True)
class PortChoice:
    """The ports to start a stack on (None: a free one), and a line for each remembered port found taken."""

    kafka_port: int | None
    gcs_port: int | None
    notes: list[str] = field(default_factory=list)



def read_remembered_ports(home: Path) -> StackPorts | None:
    """The ports the home's last stack listened on; None if none is recorded or the file does not validate."""
    try:
        return StackPorts.model_validate_json((home / PORTS_FILE).read_text())
    except (OSError, ValidationError, ValueError):
        return None


def remember_ports(home: Path, kafka_port: int, gcs_port: int | None) -> None:
    """Record the ports a stack of ``home`` listens on; a stack without the emulator keeps the emulator's last one."""
    previous = read_remembered_ports(home)
    if gcs_port is None and previous is not None and previous.gcs_port != kafka_port:
        gcs_port = previous.gcs_port
    write_model(home / PORTS_FILE, StackPorts(kafka_port=kafka_port, gcs_port=gcs_port))


def choose_ports(home: Path, kafka_port: int | None, gcs_port: int | None, with_gcs: bool) -> PortChoice:
    """The ports a new stack of ``home`` starts on: the ones asked for, else the remembered ones where free.

    A remembered port found in use is left to a free one, with a note saying that processes still on the old
    address will not find the stack there.
    """
    remembered = read_remembered_ports(home)
    if remembered is None:
        return PortChoice(kafka_port, gcs_port)
    notes = []
    wanted = {"Kafka": (kafka_port, remembered.kafka_port),
              "GCS emulator": (gcs_port, remembered.gcs_port if with_gcs else None)}
    chosen: dict[str, int | None] = {}
    for part, (asked, previous) in wanted.items():
        chosen[part] = asked
        if asked is not None or previous is None:
            continue
        if previous not in (kafka_port, gcs_port) and port_is_free(previous):
            chosen[part] = previous
        else:
            notes.append(f"the {part} port this home used before, {previous}, is in use; starting on a free port "
                         f"(processes still on port {previous} will not reach this stack)")
    return PortChoice(chosen["Kafka"], chosen["GCS emulator"], notes)



def runs_still_going(home: Path, within_s: float = RECENT_LOG_S) -> dict[str, list[str]]:
    """Run -> its processes that likely still use the home's stack: a learner or producer started on one of the
    home's run configurations (``runs/<run>/config.yaml``, as ``rlpipe run`` starts them), or started by hand
    naming its runs (``--run``) with ``RLPIPE_HOME`` (or its default) this home; a packed process names each run.

    Where ``/proc`` cannot be read (macOS), those whose log (``runs/<run>/logs/<name>.log``) changed within the
    last ``within_s`` seconds instead: a process that exited a moment ago is named too, and processes started by
    hand are not seen.
    """
    commands = command_lines()
    found: dict[str, list[str]] = {}
    pairs = _recent_run_logs(home, within_s) if commands is None else _processes_of_home_runs(home, commands)
    for run, name in pairs:
        if name not in found.setdefault(run, []):
            found[run].append(name)
    return found


def _processes_of_home_runs(home: Path, commands: dict[int, list[str]]) -> list[tuple[str, str]]:
    """(run, "<role> (pid N)") of each learner or producer of ``commands`` (pid -> argv) whose arguments name a run
    configuration under ``home``, or name runs (``--run``) while its environment's home is ``home``."""
    runs_folder = (home / "runs").resolve()
    found = []
    for pid, argv in sorted(commands.items()):
        role = next((arg for arg in argv if arg in ROLES), None)
        if role is None or pid == os.getpid():
            continue
        name = f"{role} (pid {pid})"
        for arg in argv:
            path = Path(arg)
            if path.name == "config.yaml" and path.parent.parent == runs_folder:
                found.append((path.parent.name, name))
        named = _named_runs(argv)
        if named and _home_of(pid) == home.resolve():
            found += [(run, name) for run in named]
    return found


def _named_runs(argv: list[str]) -> list[str]:
    """The runs ``argv`` names with ``--run X``, ``--run=X``, ``-r X`` or ``-rX``."""
    runs = [value for flag, value in itertools.pairwise(argv) if flag in ("--run", "-r")]
    return runs + [arg.removeprefix("--run=") if arg.startswith("--run=") else arg[2:] for arg in argv
                   if arg.startswith("--run=") or (arg.startswith("-r") and len(arg) > 2 and arg[2] != "-")]


def _home_of(pid: int) -> Path | None:
    """The rlpipe home of process ``pid`` (its ``RLPIPE_HOME``, a relative one from that process's own folder, else
    ``~/.rlpipe`` of its ``HOME``); None when its environment cannot be read (another user's process)."""
    import psutil

    try:
        process = psutil.Process(pid)
        environ = process.environ()
        if not environ.get(HOME_ENV):
            return (Path(environ["HOME"]) / ".rlpipe").resolve() if environ.get("HOME") else None
        home = Path(environ[HOME_ENV]).expanduser()
        return (home if home.is_absolute() else Path(process.cwd()) / home).resolve()
    except psutil.Error:  # ended meanwhile, or not ours to read
        return None


def _recent_run_logs(home: Path, within_s: float) -> list[tuple[str, str]]:
    """(run, process name) of each log ``rlpipe run`` keeps (packed runs': in the first run's folder) that changed
    within the last ``within_s`` seconds."""
    now = time.time()
    found = []
    for log_file in sorted((home / "runs").glob("*/logs/*.log")):
        with contextlib.suppress(OSError):  # removed meanwhile (rlpipe runs delete)
            if now - log_file.stat().st_mtime <= within_s:
                found.append((log_file.parent.parent.name, log_file.stem))
    return found
