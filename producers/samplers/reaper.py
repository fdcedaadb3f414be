"""The engine reaper: a tiny watcher process that ends an engine's processes when their owner dies.

vLLM starts its engine core (and on the CPU its worker) with multiprocessing "spawn" and has no
parent-death handling of its own, and no code of ours runs inside those children before they start.
So when the process owning the engine dies without shutting it down (SIGKILL, the OOM killer), they run
on for good, parented to init, holding ~3 GB.  Once the engine is up its owner lists the processes
the engine start added (``engine_processes``: its multiprocessing children and theirs) and hands them to
``EngineReaper``,
which starts this file as a separate Python process:

- owner -> watcher, on the watcher's stdin (a pipe): one JSON line ``[[pid, create_time], ...]``, then
  nothing.  The owner keeps the write end open for as long as it lives; no other process holds it
  (the pipe is made after the engine's processes start, and is not inherited by later children).
- EOF on that pipe means the owner exited, however it died, or closed the engine.  The watcher then
  ends the listed processes still running: SIGTERM, SIGKILL after ``GRACE_S``; and exits.  After a
  clean close that is nothing, or what vLLM's shutdown left behind (vLLM 0.32 on the CPU can return
  with its worker still running).  A process counts as listed only with its pid AND its start time,
  so a pid reused by another process is never touched.

EOF needs no PR_SET_PDEATHSIG, so this works on macOS as well.  The watcher runs in a session of its
own (a terminal's Ctrl-C reaches the owner, not it), reads only the pipe, writes to no stdout, and
keeps stderr for its one line when it ends something.  It is run as a file (``python -P``: its folder
is not put on ``sys.path``) and imports only the standard library and psutil, so it stays small.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterable

import psutil

GRACE_S = 5.0  # SIGTERM -> SIGKILL
# Start times are read as boot time + ticks since boot; a clock step can move the boot time Linux reports,
# so two readings of one process's start time may differ by up to about a second.  A pid wraps around far
# more slowly than that, so a process started within the tolerance of the listed one under its pid is it.
START_TOLERANCE_S = 1.0

Identity = tuple[int, float]  # (pid, create_time in s since the epoch)


def started_children() -> set[int]:
    """The pids of the processes this process started with multiprocessing that still run (a vLLM engine's core)."""
    return {child.pid for child in multiprocessing.active_children() if child.pid is not None}


def engine_processes(before: set[int]) -> list[psutil.Process]:
    """What an engine's start added: the multiprocessing children started since ``before`` (``started_children``
    then; vLLM starts its engine core as one) with all their descendants (its workers).

    A process another thread starts meanwhile with ``subprocess`` is no multiprocessing child, and multiprocessing's
    resource tracker (which vLLM's first spawn starts: it serves this process, outlives the engine and cleans up
    after this process by itself) is started without one, so neither is listed.
    """
    found: list[psutil.Process] = []
    for pid in sorted(started_children() - before):
        with contextlib.suppress(psutil.NoSuchProcess):  # ended meanwhile: nothing to reap
            child = psutil.Process(pid)
            found += [child, *child.children(recursive=True)]
    return found


class EngineReaper:
    """The owner's end: starts the watcher over ``processes`` and holds the pipe whose EOF tells it to reap."""

    def __init__(self, processes: Iterable[psutil.Process]) -> None:
        identities = self.identities(processes)
        # both ends non-inheritable: a process the owner starts later never holds the pipe (a fork child
        # that never execs would, and would hold back the EOF until it exits)
        read_fd, write_fd = os.pipe()
        try:
            self._watcher = subprocess.Popen(
                [sys.executable, "-P", os.path.abspath(__file__), str(os.getpid())],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(read_fd)
        self._pipe = os.fdopen(write_fd, "w")
        self._pipe.write(json.dumps(identities) + "\n")
        self._pipe.flush()

    @staticmethod
    def identities(processes: Iterable[psutil.Process]) -> list[Identity]:
        """(pid, start time) of each of ``processes`` still running, by pid."""
        listed = []
        for process in processes:
            try:
                listed.append((process.pid, process.create_time()))
            except psutil.NoSuchProcess:
                continue
        return sorted(listed)

    @property
    def watcher_pid(self) -> int:
        return self._watcher.pid

    def close(self) -> None:
        """Call once the engine is shut down: the watcher reaps any straggler and exits; wait for it."""
        if self._pipe.closed:
            return
        self._pipe.close()
        with contextlib.suppress(subprocess.TimeoutExpired):  # still ending a straggler: it exits on its own
            self._watcher.wait(timeout=GRACE_S + 5.0)


def reap(identities: Iterable[Identity], grace_s: float = GRACE_S) -> list[int]:
    """End those of ``identities`` still running as the same process (SIGTERM, SIGKILL after ``grace_s``);
    return their pids."""
    running = [p for p in (_same_process(pid, started) for pid, started in identities) if p is not None]
    for process in running:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, stubborn = psutil.wait_procs(running, timeout=grace_s)
    for process in stubborn:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    return [process.pid for process in running]


def _same_process(pid: int, started: float) -> psutil.Process | None:
    """The process ``pid`` if it still runs and started at ``started``; None if it ended or the pid was reused."""
    try:
        process = psutil.Process(pid)
        if abs(process.create_time() - started) > START_TOLERANCE_S or process.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.NoSuchProcess:
        return None
    return process


def main() -> None:
    """The watcher (argument: the owner's pid): read the list, wait for EOF (the owner is gone or closed the
    engine), reap, exit."""
    owner = int(sys.argv[1])
    identities = [(int(pid), float(started)) for pid, started in json.loads(sys.stdin.readline() or "[]")]
    sys.stdin.read()  # blocks until every write end is closed
    ended = reap(identities)
    if ended:
        print(f"rlpipe engine reaper: ended the engine processes {ended} that process {owner} left running",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
