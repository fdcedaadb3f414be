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
the runs' shares are stacked in the order the runs were given (``stacked_bars``); where
they add up to more than the lane's height (one engine busy for several runs at once)
they are scaled down together to fill it, and the title says so, so that no run vanishes
above the lane while its label gives its share.
"""

from __future__ import annotations

import bisect
import itertools
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


def stacked_bars(intervals: Sequence[Sequence[Any]], runs: Sequence[str]
                 ) -> tuple[dict[str, list[tuple[float, float, float, float]]], bool]:
    """Per run, its bars (start, end, bottom, height) in lane heights (1 = the whole lane), and whether any span
    was scaled.

    The lane is cut at every interval's start and end; in each span a run's share is the highest of its intervals
    covering it (two producers of one run may overlap), and the runs stack in ``runs``' order.  A span whose
    shares add up to ``total`` > 1 has each divided by ``total``: heights keep their proportions and fill the lane.
    Neighbouring spans of one run with the same bottom and height make one bar.
    """
    edges_T = sorted({float(t) for s, e, *_ in intervals for t in (s, e)})
    share_RT = {run: [0.0] * max(len(edges_T) - 1, 0) for run in runs}
    for s, e, share, run in intervals:
        for k in range(bisect.bisect_left(edges_T, s), bisect.bisect_left(edges_T, e)):
            share_RT[run][k] = max(share_RT[run][k], share)
    bars: dict[str, list[tuple[float, float, float, float]]] = {run: [] for run in runs}
    scaled = False
    for k, (start, end) in enumerate(itertools.pairwise(edges_T)):
        total = math.fsum(share_RT[run][k] for run in runs)
        scale = 1.0 / total if total > 1.0 else 1.0
        scaled = scaled or total > 1.0
        bottom = 0.0
        for run in runs:
            height = share_RT[run][k] * scale
            if height > 0:
                _extend(bars[run], (start, end, bottom, height))
            bottom += height
    return {run: rows for run, rows in bars.items() if rows}, scaled


def _extend(rows: list[tuple[float, float, float, float]], bar: tuple[float, float, float, float]) -> None:
    """Append ``bar``, or lengthen the last one if ``bar`` continues it at the same bottom and height."""
    if rows and rows[-1][1] == bar[0] and rows[-1][2:] == bar[2:]:
        rows[-1] = (rows[-1][0], *bar[1:])
    else:
        rows.append(bar)


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
    labels, scaled_lanes = [], []
    for row, lane in enumerate(reversed(duty["lanes"])):  # the trainer (first) ends up on top
        bars, scaled = stacked_bars(lane["intervals"], runs)
        if scaled:
            scaled_lanes.append(lane["name"])
        for run, rows in bars.items():  # one collection per run: thousands of intervals draw in a second
            boxes = [[(x, y), (x + w, y), (x + w, y + h), (x, y + h)] for x, w, y, h in (
                ((s - origin) / divisor, (e - s) / divisor, row - _BAR / 2 + _BAR * bottom, _BAR * height)
                for s, e, bottom, height in rows)]
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
    if scaled_lanes:
        title += (f"\n{' and '.join(scaled_lanes)}: where the runs' shares add up past 1 they are scaled down "
                  "together to fill the lane")
    _style(ax, title, _time_label(origin, unit), "")
    ax.grid(axis="y", visible=False)
    return png_bytes(fig)


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
