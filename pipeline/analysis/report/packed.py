"""The duty cycle of a packed process: one sampler lane and one trainer lane, each run in its own colour.

``rlpipe report --run A --run B ...`` gathers each run's report as usual (each run
keeps its own step log and heartbeats) and merges their duty-cycle lanes: every
learner step of every run goes into the trainer lane, every producer heartbeat
interval of every run into the sampler lane, each tagged with the run it served.
The figure is the OpenRL picture for 1, 2 and 3 jobs: the more runs share the
engines, the more of both lanes is filled.

Fractions use one window for all runs (the earliest start to the latest end of
their windows).  Per run: its busy seconds in a lane divided by the window; per
lane: the sum over runs.  Trainer steps of a packed learner never overlap, so the
trainer's sum is at most 1; sampler shares come from each run's own heartbeats and
may overlap (continuous batching serves several runs at once), so the sampler's sum
says how much sampling the runs asked for together and may exceed 1.  In the figure
a sampler interval's height is its busy share, each run stacked on the highest share
of each run given before it that overlaps the interval, clipped at the lane's height.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pipeline.analysis.report.metrics import busy_seconds
from pipeline.analysis.report.model import Lane, RunReport, _finite_json, percent
from pipeline.analysis.report.plots import _style, _time_label, _time_unit, png_bytes

PACKED_FIGURE = "packed_duty_cycle.png"
PACKED_JSON = "packed.json"
_LANE_KINDS = (("trainer", "learner"), ("sampler", "producer"))  # packed lane <- the runs' lane kind
_BAR = 0.76  # lane height in axis units


def run_color(index: int) -> str:
    """The colour of the ``index``-th run (matplotlib's default cycle)."""
    return f"C{index % 10}"


def lanes_from_report(report: RunReport) -> tuple[list[Lane], tuple[float | None, float | None]]:
    """A gathered run's duty-cycle lanes (and its window) back as ``Lane`` objects."""
    duty = report.series["duty_cycle"]
    lanes = [Lane(lane["name"], lane["kind"], [tuple(i) for i in lane["intervals"]]) for lane in duty["lanes"]]
    return lanes, (duty["start"], duty["end"])  # type: ignore[misc]


def packed_duty_cycle(per_run: dict[str, tuple[Sequence[Lane], tuple[float | None, float | None]]]) -> dict[str, Any]:
    """The merged trainer and sampler lanes, intervals as (start, end, share, run), with per-run busy fractions."""
    runs = list(per_run)
    merged: dict[str, list[tuple[float, float, float, str]]] = {name: [] for name, _ in _LANE_KINDS}
    for run, (lanes, _) in per_run.items():
        for name, kind in _LANE_KINDS:
            merged[name] += [
                (s, e, share, run) for lane in lanes if lane.kind == kind for s, e, share in lane.intervals
            ]
    bounds = [t for _, (_, hints) in per_run.items() for t in hints if t is not None]
    bounds += [t for intervals in merged.values() for s, e, _, _ in intervals for t in (s, e)]
    start, end = (min(bounds), max(bounds)) if bounds else (None, None)
    span = end - start if start is not None and end is not None else 0.0
    result = []
    for name, _ in _LANE_KINDS:
        intervals = sorted(merged[name], key=lambda i: (i[0], runs.index(i[3]), i[1]))
        by_run = {
            run: busy_seconds([(s, e, share) for s, e, share, r in intervals if r == run], start, end) / span
            if span > 0 else math.nan
            for run in runs
        }  # fmt: skip
        result.append({
            "name": name, "busy_fraction": math.fsum(by_run.values()) if span > 0 else math.nan,
            "busy_fraction_by_run": by_run, "intervals": [list(i) for i in intervals],
        })  # fmt: skip
    return {"runs": runs, "start": start, "end": end, "lanes": result}


def plot_packed_duty_cycle(duty: dict[str, Any], title: str | None = None, legend_title: str = "run",
                           labels: dict[str, str] | None = None) -> bytes:
    """PNG: the lanes top to bottom in ``duty``'s order (the trainer first), each run's intervals in its own colour.

    ``title``, ``legend_title`` and ``labels`` (run -> legend entry) let other duty cycles of the same shape
    (``pipeline.analysis.report.server``) use the drawing.
    """
    runs, names = duty["runs"], labels or {}
    colors = {run: run_color(index) for index, run in enumerate(runs)}
    fig = Figure(figsize=(13, 3.2), layout="constrained")
    ax = fig.subplots()
    origin = duty["start"] if duty["start"] is not None else 0.0
    divisor, unit = _time_unit((duty["end"] or origin) - origin)
    labels = []
    for row, lane in enumerate(reversed(duty["lanes"])):  # the trainer (first) ends up on top
        stacked: dict[str, _Drawn] = {}  # per earlier run: the intervals drawn
        bars: dict[str, list[tuple[float, float, float, float]]] = {}  # per run: (x, width, bottom, height)
        for s, e, share, run in sorted(lane["intervals"], key=lambda i: (runs.index(i[3]), i[0])):
            below = math.fsum(drawn.highest(s, e) for other, drawn in stacked.items() if other != run)
            height = max(0.0, min(share, 1.0 - below))
            stacked.setdefault(run, _Drawn()).add(s, e, height)
            bars.setdefault(run, []).append(((s - origin) / divisor, (e - s) / divisor,
                                             row - _BAR / 2 + _BAR * below, _BAR * height))
        for run, rows in bars.items():  # one collection per run: thousands of intervals draw in a second
            boxes = [[(x, y), (x + w, y), (x + w, y + h), (x, y + h)] for x, w, y, h in rows]
            ax.add_collection(PolyCollection(boxes, facecolors=colors[run], linewidths=0))
        entries = [f"{run} {percent(f)}" for run, f in lane["busy_fraction_by_run"].items()]
        shares = ",\n".join(", ".join(entries[i:i + 2]) for i in range(0, len(entries), 2))  # two runs a line
        labels.append(f"{lane['name']} {percent(lane['busy_fraction'])} busy\n({shares})")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(-0.6, len(labels) - 0.4)
    if duty["end"] is not None:
        ax.set_xlim(0, (duty["end"] - origin) / divisor)
    ax.legend(handles=[Patch(color=colors[run], label=names.get(run, run)) for run in runs],
              title=legend_title, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)  # fmt: skip
    title = title or f"packed duty cycle of {len(runs)} runs (trainer: training steps; sampler: busy share per heartbeat)"
    _style(ax, title, _time_label(origin, unit), "")
    ax.grid(axis="y", visible=False)
    return png_bytes(fig)


class _Drawn:
    """One run's drawn intervals, added in order of start: the highest one overlapping a span without a full scan."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.heights: list[float] = []
        self.reach: list[float] = []  # reach[j]: the latest end among intervals 0..j

    def add(self, start: float, end: float, height: float) -> None:
        self.starts.append(start)
        self.ends.append(end)
        self.heights.append(height)
        self.reach.append(max(end, self.reach[-1]) if self.reach else end)

    def highest(self, start: float, end: float) -> float:
        """The tallest drawn interval that overlaps ``(start, end)`` (0 when none does)."""
        best, j = 0.0, bisect.bisect_left(self.starts, end) - 1  # the intervals that start before ``end``
        while j >= 0 and self.reach[j] > start:
            if self.ends[j] > start:
                best = max(best, self.heights[j])
            j -= 1
        return best


def packed_summary(duty: dict[str, Any]) -> dict[str, Any]:
    """Busy fractions per lane and per run, for the JSON and the printed summary."""
    return {
        "runs": duty["runs"],
        "busy_fraction": {lane["name"]: lane["busy_fraction"] for lane in duty["lanes"]},
        "busy_fraction_by_run": {lane["name"]: lane["busy_fraction_by_run"] for lane in duty["lanes"]},
        "seconds": duty["end"] - duty["start"] if duty["start"] is not None else None,
    }


def write_packed_report(reports: Sequence[RunReport], out_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """Write ``packed_duty_cycle.png`` and ``packed.json`` into ``out_dir``; return the JSON path and its body."""
    duty = packed_duty_cycle({report.run_id: lanes_from_report(report) for report in reports})
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PACKED_FIGURE).write_bytes(plot_packed_duty_cycle(duty))
    body = _finite_json({"runs": duty["runs"], "summary": packed_summary(duty), "duty_cycle": duty})
    path = folder / PACKED_JSON
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path, body
