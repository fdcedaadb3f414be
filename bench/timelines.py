"""Timelines of a benchmark run (when its samplers and learner were busy) and the numbers taken from them:
idle fractions, throughput, the sync loop's phases and overlap bound.  Pure: the async-versus-sync and packing
benches and their tests share them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Interval = tuple[float, float, float]  # (start, end, busy share), unix seconds


@dataclass(frozen=True)
class Timeline:
    """When one run's samplers and learner were busy, in unix seconds."""

    start: float  # the first sample: sampling started here
    learner: list[Interval]  # one per learner step, share 1
    samplers: list[list[Interval]]  # one lane per sampler (producer)
    rows: int  # rows trained, summed over steps

    @property
    def steps(self) -> int:
        return len(self.learner)

    @property
    def end(self) -> float:
        """The end of the last learner step (the work is done)."""
        return max((e for _, e, _ in self.learner), default=self.start)


def idle_fraction(lane: Sequence[Interval], start: float, end: float) -> float:
    """1 - busy seconds / window length, for one lane over [start, end] (NaN for an empty window)."""
    from pipeline.analysis.report import busy_seconds

    span = end - start
    return 1.0 - busy_seconds(lane, start, end) / span if span > 0 else math.nan


def side_numbers(timeline: Timeline) -> dict[str, Any]:
    """Work window, throughput and idle fractions of one run over its own work window."""
    start, end = timeline.start, timeline.end
    window_s = end - start
    sampler_idle = [idle_fraction(lane, start, end) for lane in timeline.samplers]
    step_s = [e - s for s, e, _ in timeline.learner]
    return {
        "window_s": window_s, "steps": timeline.steps, "rows": timeline.rows,
        "step_s": statistics.fmean(step_s) if step_s else math.nan,
        "rows_per_s": timeline.rows / window_s if window_s > 0 else math.nan,
        "sampler_idle": statistics.fmean(sampler_idle) if sampler_idle else math.nan,
        "learner_idle": idle_fraction(timeline.learner, start, end),
    }  # fmt: skip


def combined_numbers(timelines: Sequence[Timeline]) -> dict[str, Any]:
    """Several runs sharing the machine: totals over the union of their work windows, mean idle fractions."""
    if not timelines:
        return {"window_s": math.nan, "steps": 0, "rows": 0, "rows_per_s": math.nan, "steps_per_s": math.nan,
                "sampler_idle": math.nan, "learner_idle": math.nan}  # fmt: skip
    start, end = min(t.start for t in timelines), max(t.end for t in timelines)
    window_s = end - start
    each = [side_numbers(t) for t in timelines]
    rows, steps = sum(t.rows for t in timelines), sum(t.steps for t in timelines)
    return {
        "window_s": window_s, "steps": steps, "rows": rows,
        "rows_per_s": rows / window_s if window_s > 0 else math.nan,
        "steps_per_s": steps / window_s if window_s > 0 else math.nan,
        "sampler_idle": _mean_finite(n["sampler_idle"] for n in each),
        "learner_idle": _mean_finite(n["learner_idle"] for n in each),
    }  # fmt: skip


def sync_timeline(summary: dict[str, Any]) -> Timeline:
    """The sync loop's summary (``bench/sync_loop.run``) as a timeline."""
    return Timeline(
        start=float(summary["started_at"]),
        learner=[(float(s), float(e), 1.0) for s, e in summary["learner_intervals"]],
        samplers=[[(float(s), float(e), 1.0) for s, e in summary["sampler_intervals"]]],
        rows=int(summary["rows"]),
    )


def sync_phase_shares(summary: dict[str, Any]) -> dict[str, float]:
    """The sync loop's phase split: the sampler waits while it trains, the learner while it samples."""
    wall = float(summary["wall_s"])
    if wall <= 0:
        return {"sampler_waits_on_training": math.nan, "learner_waits_on_sampling": math.nan}
    return {"sampler_waits_on_training": summary["train_s"] / wall,
            "learner_waits_on_sampling": summary["sample_s"] / wall}  # fmt: skip


def overlap_bound(summary: dict[str, Any]) -> float:
    """The most overlapping sampling and training can speed the sync loop up: its wall over its longer phase
    (sample or train), as if the shorter one ran entirely beside it."""
    longer = max(float(summary["sample_s"]), float(summary["train_s"]))
    return float(summary["wall_s"]) / longer if longer > 0 else math.nan


def report_timeline(learner_steps: Sequence[dict[str, Any]], lanes: Sequence[dict[str, Any]]) -> Timeline | None:
    """A pipeline run's timeline from ``gather_report``'s series (``learner_steps``, ``duty_cycle.lanes``).

    Sampling starts where the first producer heartbeat interval starts (the
    producer's heartbeat meter starts with its rollout loop); None when the run
    trained no step or no heartbeat was read.
    """
    steps = [s for s in learner_steps if _finite(s.get("started_at")) and _finite(s.get("finished_at"))]
    samplers = [[(float(a), float(b), float(c)) for a, b, c in lane["intervals"]]
                for lane in lanes if lane["kind"] == "producer" and lane["intervals"]]  # fmt: skip
    if not steps or not samplers:
        return None
    return Timeline(
        start=min(lane[0][0] for lane in samplers),
        learner=[(float(s["started_at"]), float(s["finished_at"]), 1.0) for s in steps],
        samplers=samplers,
        rows=sum(int(s.get("rows") or 0) for s in steps),
    )


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _mean_finite(values: Any) -> float:
    kept = [v for v in values if _finite(v)]
    return statistics.fmean(kept) if kept else math.nan


def to_json(value: Any) -> Any:
    """Plain JSON: timelines become dicts, NaN becomes null."""
    if isinstance(value, Timeline):
        return to_json({"start": value.start, "end": value.end, "rows": value.rows, "learner": value.learner,
                        "samplers": value.samplers})
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
