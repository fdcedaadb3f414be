"""The processes a benchmark starts: each in its own session with its log, waited for with progress lines,
and stopped as Ctrl-C would, then killed with what it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


class Clock:
    """Progress lines with the elapsed time since the bench started."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)


@dataclass
class Child:
    """One process the bench started (in its own session, so it can be stopped with its engines)."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    started: float
    finished: float | None = None

    @property
    def wall_s(self) -> float:
        return (self.finished or time.monotonic()) - self.started


def start_child(name: str, argv: list[str], log_path: Path) -> Child:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=PROJECT_ROOT, start_new_session=True)
    return Child(name, process, log_path, time.monotonic())


def wait_children(children: list[Child], timeout_s: float, clock: Clock, status: Callable[[], str]) -> bool:
    """Wait for every child (a status line every 30 s); on timeout stop them all and return False."""
    deadline = time.monotonic() + timeout_s
    next_status = time.monotonic() + 30.0
    while any(c.finished is None for c in children):
        for child in children:
            if child.finished is None and child.process.poll() is not None:
                child.finished = time.monotonic()
        if time.monotonic() >= deadline:
            clock(f"timeout after {timeout_s:.0f}s: stopping {', '.join(c.name for c in children if not c.finished)}")
            stop_children(children)
            return False
        if time.monotonic() >= next_status:
            clock(status())
            next_status += 30.0
        time.sleep(0.5)
    return True


def stop_children(children: list[Child], grace_s: float = 60.0) -> None:
    """Ctrl-C each running child (``rlpipe run`` then stops its learner and producers), then kill its group."""
    running = [c for c in children if c.process.poll() is None]
    for child in running:
        child.process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace_s
    for child in running:
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(child.process.pid, signal.SIGKILL)  # its own session: the child and what it started
            child.process.wait()
        child.finished = child.finished or time.monotonic()


def rlpipe_argv(*args: str) -> list[str]:
    return [sys.executable, "-c", "from pipeline.cli.main import main; main()", *args]


def tail_text(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def built_tiny_model() -> str | None:
    """The tiny model already built under the caller's RLPIPE_HOME (reused as ``model.tiny_dir``), else None."""
    from pipeline.models import ModelNotBuiltError, resolve_base_model
    from schemas.config import ModelConfig

    try:
        return resolve_base_model(ModelConfig())
    except ModelNotBuiltError:
        return None
