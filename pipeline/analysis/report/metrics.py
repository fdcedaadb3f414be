"""The report's numbers: pure functions of trajectory rows, learner steps and control events.

Nothing here reads the store or the log or draws anything, so each function can be
checked on a hand-made table: episodes from per-turn rows, reward per version with
Wilson intervals, evaluation points, staleness totals, learner traces (and a value
learner's), producer throughput and the duty-cycle lanes with their busy fractions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import polars as pl

from pipeline.analysis.report.model import ControlEvents, Lane, dig, first_known
from schemas.config import LearnerConfig
from schemas.evaluation import Z_975, EvalResult, mean_ci95
from schemas.events import ProducerHeartbeat

MAX_SERIES_POINTS = 2000  # reward-over-time points kept in JSON and plots (evenly thinned)


def episodes_of(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per episode: ``policy_version``, ``reward``, ``success``, ``time`` (unix s).

    Per-turn rows (some ``turn`` > 0) are grouped by ``episode_id``: the version the
    episode started with, the return and success of its last row, and the time of its
    last row (when its return was known).  Otherwise each row is one episode.
    """
    columns = ["episode_id", "policy_version", "reward", "success", "created_at"]
    if rows.height and int(rows["turn"].max()) > 0:  # type: ignore[arg-type]
        rows = (
            rows.sort("turn")
            .group_by("episode_id", maintain_order=True)
            .agg(
                pl.col("policy_version").first(), pl.col("reward").last(), pl.col("success").last(),
                pl.col("created_at").max(),
            )
        )  # fmt: skip
    return rows.select(columns).with_columns(
        pl.col("reward").cast(pl.Float64), (pl.col("created_at").dt.epoch("us") / 1e6).alias("time")
    )


def wilson_interval(successes: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a success rate (sensible at 0% and 100%, unlike the normal one)."""
    if n == 0:
        return math.nan, math.nan
    p, z2 = successes / n, Z_975**2
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z_975 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))  # it holds p; rounding must not move it


def reward_by_version(episodes: pl.DataFrame) -> list[dict[str, Any]]:
    """Per policy version: episodes, mean reward with its 95% CI (Student t), success rate with Wilson CI."""
    result = []
    for (version,), group in sorted(episodes.group_by("policy_version"), key=lambda item: item[0][0]):
        rewards = group["reward"].to_list()
        mean, ci95 = mean_ci95(rewards)
        wins = int(group["success"].sum())
        low, high = wilson_interval(wins, group.height)
        result.append({
            "version": int(version), "episodes": group.height, "reward_mean": mean, "reward_ci95": ci95,
            "success_rate": wins / group.height, "success_low": low, "success_high": high,
        })  # fmt: skip
    return result


def rolling_window(n: int) -> int:
    """Episodes per rolling mean: about 5% of them, between 5 and 200 (never more than there are)."""
    return max(1, min(n, max(5, min(200, n // 20))))


def reward_over_time(episodes: pl.DataFrame, max_points: int = MAX_SERIES_POINTS) -> dict[str, Any]:
    """Episode rewards by time with their rolling mean, thinned evenly to at most ``max_points``."""
    if episodes.height == 0:
        return {"window": 0, "points": []}
    ordered = episodes.sort("time")
    window = rolling_window(ordered.height)
    ordered = ordered.with_columns(pl.col("reward").rolling_mean(window_size=window, min_samples=1).alias("rolling"))
    keep = np.unique(np.linspace(0, ordered.height - 1, min(max_points, ordered.height)).astype(np.int64))
    picked = ordered[keep.tolist()]
    points = picked.select(
        "time", "reward", pl.col("rolling").alias("rolling_mean"), pl.col("policy_version").alias("version")
    ).to_dicts()
    return {"window": window, "points": points}


def eval_series(evals: Sequence[EvalResult]) -> list[dict[str, Any]]:
    """One point per (policy, environment, version, seed range): the newest evaluation of it.

    A newer result replaces an older one only where it played the same episodes (same policy, version,
    environment, first seed and count); ``rlpipe eval --env OTHER`` or another seed range of a version is a point
    of its own.  Points are sorted by policy, environment, version and seeds, so each (policy, env) series is in
    version order.  A point's success rate comes with its 95% Wilson interval (``success_low``, ``success_high``).
    """
    newest: dict[tuple[str, str, int, int, int], EvalResult] = {}
    for result in evals:
        key = (result.policy, result.env, result.version, result.seed_start, result.episodes)
        current = newest.get(key)
        if current is None or result.created_at >= current.created_at:
            newest[key] = result
    return [_eval_point(r) for _, r in sorted(newest.items())]


def _eval_point(result: EvalResult) -> dict[str, Any]:
    """One evaluation as the report shows it: its summary, with the 95% Wilson interval of its success rate."""
    low, high = wilson_interval(sum(result.successes), result.episodes)
    return {
        "policy": result.policy, "version": result.version, "env": result.env, "episodes": result.episodes,
        "seed_start": result.seed_start, "mean_return": result.mean_return, "ci95": result.ci95,
        "success_rate": result.success_rate, "success_low": low, "success_high": high,
        "breakdown": result.breakdown, "created_at": result.created_at.isoformat(),
    }  # fmt: skip


def staleness_totals(step_log: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Rows per staleness (versions behind the learner), summed over steps; keys sorted numerically."""
    totals: dict[int, int] = {}
    for entry in step_log:
        for staleness, count in (entry.get("staleness_histogram") or {}).items():
            totals[int(staleness)] = totals.get(int(staleness), 0) + int(count)
    return {str(k): totals[k] for k in sorted(totals)}


_STEP_FIELDS = ("rows", "tokens", "loss", "reward_mean", "ratio_mean", "effective_sample_size", "clip_fraction",
                "tokens_per_s", "version", "dropped_stale_rows")  # fmt: skip
COLLAPSE_FIELDS = ("entropy_mean", "identical_group_share", "zero_advantage_share", "reward_spread", "kl_mean")


def learner_traces(step_log: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per learner step: times and the metrics the report plots (None where a step lacks one)."""
    return [
        {"step": entry.get("step"), "started_at": entry.get("started_at"), "finished_at": entry.get("finished_at"),
         **{name: entry.get(name) for name in (*_STEP_FIELDS, *COLLAPSE_FIELDS)}}
        for entry in step_log
    ]  # fmt: skip


VALUE_FIELDS = ("episode_return_mean", "episodes", "td_abs_mean", "q_mean", "loss", "replay_size", "updates",
                "transitions", "version")  # fmt: skip


def value_traces(step_log: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per step of a value learner (``consumers.value.learner``; its entries carry ``replay_size``):
    the return of the episodes its batch finished, mean |TD error|, mean Q of the actions taken,
    loss, replay memory size, updates, transitions and version (None where a step lacks one)."""
    return [
        {"step": entry.get("step"), **{name: entry.get(name) for name in VALUE_FIELDS}}
        for entry in step_log if "replay_size" in entry
    ]  # fmt: skip


def collapse_thresholds(run_config: dict[str, Any]) -> dict[str, float]:
    """The learner's warning thresholds of the signs of collapse (its defaults where the run config is missing)."""
    learner = LearnerConfig.model_fields
    names = ("warn_identical_group_share", "warn_zero_advantage_share", "warn_entropy_fraction",
             "warn_reward_spread_fraction", "collapse_baseline_steps")  # fmt: skip
    return {name: first_known(dig(run_config, "learner", name), learner[name].default) for name in names}


def throughput_series(heartbeats: Sequence[tuple[float, ProducerHeartbeat]]) -> dict[str, list[dict[str, Any]]]:
    """Per producer, in time order: samples/s, tokens/s, env steps/s, busy share and the adapter it served."""
    series: dict[str, list[dict[str, Any]]] = {}
    for time_s, beat in sorted(heartbeats, key=lambda item: item[0]):
        series.setdefault(beat.producer_id, []).append({
            "time": time_s, "samples_per_s": beat.samples_per_s, "tokens_per_s": beat.tokens_per_s,
            "env_steps_per_s": beat.env_steps_per_s, "busy_fraction": beat.busy_fraction,
            "interval_s": beat.interval_s, "adapter_version": beat.adapter_version,
            "samples_total": beat.samples_total, "tokens_total": beat.tokens_total,
        })  # fmt: skip
    return dict(sorted(series.items()))


def lanes_of(step_log: Iterable[dict[str, Any]], heartbeats: Sequence[tuple[float, ProducerHeartbeat]]) -> list[Lane]:
    """The learner lane (each step busy from start to finish), then one lane per producer."""
    steps = [
        (float(e["started_at"]), float(e["finished_at"]), 1.0)
        for e in step_log
        if isinstance(e.get("started_at"), int | float) and isinstance(e.get("finished_at"), int | float)
        and e["finished_at"] >= e["started_at"]
    ]  # fmt: skip
    lanes = [Lane("learner", "learner", sorted(steps))] if steps else []
    by_producer: dict[str, list[tuple[float, float, float]]] = {}
    for time_s, beat in heartbeats:
        if beat.interval_s > 0:  # a producer's first beat has no interval yet
            by_producer.setdefault(beat.producer_id, []).append((time_s - beat.interval_s, time_s, beat.busy_fraction))
    lanes += [Lane(name, "producer", sorted(intervals)) for name, intervals in sorted(by_producer.items())]
    return lanes


def run_window_hints(events: ControlEvents) -> tuple[float | None, float | None]:
    """Run start and stop times from the event log, where known."""
    return (events.started[0] if events.started else None, events.stopped[0] if events.stopped else None)


def busy_seconds(intervals: Iterable[tuple[float, float, float]], start: float, end: float) -> float:
    """Sum of busy_share * (overlap of [s, e] with [start, end])."""
    return math.fsum(share * max(0.0, min(e, end) - max(s, start)) for s, e, share in intervals)


def duty_cycle(lanes: Sequence[Lane], hints: tuple[float | None, float | None] = (None, None)) -> dict[str, Any]:
    """The run window and, per lane, its intervals and busy fractions (over the window and over its own span)."""
    if not lanes:
        return {"start": None, "end": None, "lanes": []}
    start = min(lane.intervals[0][0] for lane in lanes)
    end = max(max(e for _, e, _ in lane.intervals) for lane in lanes)
    started, stopped = hints
    start = min(start, started) if started is not None else start
    end = max(end, stopped) if stopped is not None else end
    span = end - start
    result = []
    for lane in lanes:
        own_start, own_end = lane.intervals[0][0], max(e for _, e, _ in lane.intervals)
        busy = busy_seconds(lane.intervals, start, end)
        result.append({
            "name": lane.name, "kind": lane.kind, "busy_s": busy,
            "busy_fraction": busy / span if span > 0 else math.nan,
            "busy_fraction_active": busy / (own_end - own_start) if own_end > own_start else math.nan,
            "intervals": [list(interval) for interval in lane.intervals],
        })  # fmt: skip
    return {"start": start, "end": end, "lanes": result}
