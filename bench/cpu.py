"""The machine's busy CPU, for the bound it puts on running several jobs at once, and its load around a timing.

A benchmark that runs 1, 2 and 3 jobs side by side can measure how many core-seconds
one job costs alone; N jobs cost N times that, so on C cores their combined throughput
over one job's is at most ``min(N, C x wall / busy core-seconds)`` of the job alone
(``cpu_bound``).  Busy time counts every process on the machine, and torch's worker
threads while they spin between parallel regions.

Every timing bench also names the machine's load average before and after its measurement
(``LoadAverage``): on a shared machine other jobs move a figure by a third, and the load is how
a reader tells an idle machine's figure from a busy one's.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np


def busy_core_seconds() -> float:
    """Core-seconds the machine has spent busy since boot (every process; idle and I/O wait excluded).

    Guest time is already inside user and nice time, so it is not added again.
    """
    import psutil

    times = psutil.cpu_times()
    return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


def cpu_bound(jobs: int, cores: int, alone_wall_s: float, alone_busy_s: float) -> float:
    """The most ``jobs`` at once can reach over one job's throughput, each costing what it costs alone.

    One job alone took ``alone_wall_s`` and kept the machine busy ``alone_busy_s`` core-seconds;
    the cores give at most ``cores`` core-seconds a second, and no job runs faster than alone.
    """
    if alone_busy_s <= 0:
        return float(jobs)
    return min(float(jobs), cores * alone_wall_s / alone_busy_s)


class CpuMeter:
    """Samples ``busy_core_seconds`` every ``period_s`` in a thread; ``busy_between`` reads any window later."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.times: list[float] = []
        self.busy: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="cpu-meter", daemon=True)

    def __enter__(self) -> CpuMeter:
        self._record()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._record()

    def _record(self) -> None:
        self.times.append(time.time())
        self.busy.append(busy_core_seconds())

    def _sample(self) -> None:
        while not self._stop.wait(self.period_s):
            self._record()

    def busy_between(self, start: float, end: float) -> float:
        """Busy core-seconds between unix times ``start`` and ``end`` (linear between samples)."""
        return self._at(end) - self._at(start)

    def _at(self, when: float) -> float:
        times, busy = list(self.times), list(self.busy)  # the thread may append meanwhile
        return float(np.interp(when, times[: len(busy)], busy[: len(times)])) if times else 0.0


def load_text(before: float, after: float) -> str:
    """``load average 1.20 before, 2.35 after``: the 1-minute load averages around a measurement."""
    return f"load average {before:.2f} before, {after:.2f} after"


class LoadAverage:
    """The machine's 1-minute load average when it is made (or its block starts) and at ``stop`` (or its
    block's end); ``str()`` names both (the load now, if not stopped yet)."""

    def __init__(self) -> None:
        self.before = os.getloadavg()[0]
        self.after: float | None = None

    def __enter__(self) -> LoadAverage:
        self.before = os.getloadavg()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.after = os.getloadavg()[0]

    def __str__(self) -> str:
        return load_text(self.before, os.getloadavg()[0] if self.after is None else self.after)
