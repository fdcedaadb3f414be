"""Run a sweep's unfinished experiments, ``parallel`` at a time, each its own process.

Every experiment is a client of the same server, so the server's shared
engines pack them: one training engine and one sampling engine serve every
experiment's session.  The processes are started and watched from this thread
(no threads: a child started from a thread would be killed with that thread),
their output appended to their ``log.txt`` (stdout: the script's progress
lines) and ``stderr.txt`` (logging, warnings, a traceback).  On Linux each child
is asked to die with the sweep (``PR_SET_PDEATHSIG``, devstack's
``die_with_parent``), so a killed sweep leaves no experiment running behind it,
and a sweep started again on its folder runs the unfinished ones from their start.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.devstack.process import die_with_parent, stop_processes
from pipeline.sweeps.plan import LOG_FILE, STDERR_FILE, Experiment, SweepDir, SweepSpec, experiments

SWEEP_EXPERIMENT_ENV = "RLPIPE_SWEEP_EXPERIMENT"  # the experiment's name, for the script's own logs


@dataclass
class Attempt:
    experiment: Experiment
    process: subprocess.Popen[bytes]
    log: Path
    started: float = field(default_factory=time.monotonic)

    def last_line(self, path: Path | None = None) -> str:
        """The last non-empty line the script printed to stdout (its progress), or to ``path``."""
        return _last_line(path or self.log)


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, path.stat().st_size - 4096))
            lines = [line for line in handle.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


@dataclass
class Event:
    """What the runner reports: ``started``, ``finished``, ``failed`` or ``progress`` (every running attempt)."""

    kind: str
    experiment: Experiment | None = None
    seconds: float = 0.0
    result: dict[str, Any] | None = None
    reason: str = ""
    running: list[tuple[Experiment, float, str]] = field(default_factory=list)


def pending(sweep: SweepDir, spec: SweepSpec) -> list[Experiment]:
    """The experiments without a result, in plan order (failed ones included: they run again)."""
    return [e for e in experiments(spec) if sweep.result(e) is None]


def run_sweep(sweep: SweepDir, spec: SweepSpec, parallel: int, report: Callable[[Event], None],
              progress_every_s: float = 30.0, poll_s: float = 0.2) -> dict[str, int]:
    """Run every pending experiment; returns how many finished and failed in this call."""
    queue = pending(sweep, spec)
    running: list[Attempt] = []
    counts = {"finished": 0, "failed": 0}
    last_progress = time.monotonic()
    try:
        while queue or running:
            while queue and len(running) < parallel:
                attempt = _start(sweep, spec, queue.pop(0))
                running.append(attempt)
                report(Event("started", attempt.experiment))
            time.sleep(poll_s)
            for attempt in [a for a in running if a.process.poll() is not None]:
                running.remove(attempt)
                event = _settle(sweep, attempt)
                counts[event.kind] += 1
                report(event)
            if running and time.monotonic() - last_progress >= progress_every_s:
                last_progress = time.monotonic()
                report(Event("progress", running=[(a.experiment, time.monotonic() - a.started, a.last_line())
                                                  for a in running]))
    finally:  # attempts still running when the sweep stops (Ctrl-C, an error) run again on resume
        stop_processes([attempt.process for attempt in running], timeout_s=10.0)
    return counts


def _start(sweep: SweepDir, spec: SweepSpec, experiment: Experiment) -> Attempt:
    result_path = sweep.prepare(experiment)
    log = sweep.folder(experiment) / LOG_FILE
    header = f"== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(experiment.argv(spec, result_path))}\n".encode()
    with open(log, "ab") as out, open(sweep.folder(experiment) / STDERR_FILE, "ab") as err:
        out.write(header)
        err.write(header)
        out.flush()
        err.flush()
        process = subprocess.Popen(
            experiment.argv(spec, result_path), stdout=out, stderr=err, stdin=subprocess.DEVNULL,
            env={**os.environ, SWEEP_EXPERIMENT_ENV: experiment.name, "PYTHONUNBUFFERED": "1"},
            preexec_fn=die_with_parent)
    return Attempt(experiment, process, log)


def _settle(sweep: SweepDir, attempt: Attempt) -> Event:
    seconds = time.monotonic() - attempt.started
    code = attempt.process.returncode
    if code == 0:
        try:
            return Event("finished", attempt.experiment, seconds, result=sweep.accept(attempt.experiment))
        except ValueError as exc:
            reason = str(exc)
    else:
        errors = attempt.log.with_name(STDERR_FILE)
        reason = f"exited with {code}: {attempt.last_line(errors) or attempt.last_line() or 'no output'} (see {errors})"
    sweep.record_failure(attempt.experiment, reason, code)
    return Event("failed", attempt.experiment, seconds, reason=reason)


