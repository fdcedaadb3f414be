"""``rlpipe report``: one run's story in numbers and pictures, from the store and the event log alone.

Store + ``<ns>.control`` -> ``gather_report`` -> ``RunReport`` (summary, series,
notes) -> ``write_report`` -> ``report.html`` (PNGs inlined as data URIs, so the
file can be mailed), the same PNGs next to it, and ``report.json``.  The page is
rendered from the Jinja2 template ``pipeline/templates/report.html.jinja`` with
autoescaping on; Python only prepares plain values for it.

Where each number comes from (nothing else is read; no hidden state):

- trajectories: every Parquet batch of the run (``TrajectoryArchive.scan``).
  Rewards are episode-level: long-horizon environments write one row per turn
  (``turn`` > 0 exists), and there each episode counts once with its ``reward``
  (the episode return), its first turn's ``policy_version`` and its last row's time.
- adapters: the registry's manifests (versions, base model).
- learner: ``state.json`` of the newest complete checkpoint, its digest checked
  against the checkpoint's manifest (the contract of ``schemas.checkpoint``),
  and the step log up to its step (``pipeline.steplog``; a checkpoint of the old
  layout carries it inline): staleness, importance ratios, ESS, step times and the
  signs of collapse (entropy, identical groups, zero advantages, reward spread).
- evaluations: ``runs/<run>/eval/*.json`` (``schemas.evaluation.EvalResult``).
- producers: ``ProducerHeartbeat`` events on ``<ns>.control`` (rates, busy fraction),
  plus ``RunStarted``/``RunStopped``/``LearnerCheckpointed``; the read is bounded.

The duty-cycle timeline puts every producer and the learner on one time axis.
A lane's busy fraction is its busy seconds inside the run window divided by the
window's length; the window runs from the earliest known moment (``RunStarted``
or the first lane activity) to the latest (``RunStopped`` or the last activity).
A producer interval counts ``busy_fraction * interval_s`` busy seconds (the
heartbeat only knows the share, not where inside the interval it fell).

Anything missing (no checkpoint yet, no evaluations, an unreachable broker)
leaves its section empty with a note saying why; it never fails the report.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import polars as pl
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pipeline.archive import TrajectoryArchive
from pipeline.bus import BusError, tail
from pipeline.registry import AdapterRegistry, run_ids
from pipeline.stack import resolve_bootstrap_servers
from pipeline.steplog import StepLog, StepLogGapError
from pipeline.store import ObjectStore
from schemas.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointManifest,
    LearnerState,
    checkpoint_prefix,
    complete_folders,
)
from schemas.config import BusConfig, LearnerConfig
from schemas.evaluation import EvalResult, eval_from_bytes, eval_prefix, mean_ci95
from schemas.events import LearnerCheckpointed, ProducerHeartbeat, RunStarted, RunStopped
from schemas.names import validate_name
from schemas.registry import AdapterManifest

SECTIONS: dict[str, str] = {
    "reward": "Reward and success per adapter version",
    "eval": "Evaluation on held-out seeds",
    "staleness": "Staleness of trained rows",
    "importance": "Importance ratios and effective sample size",
    "collapse": "Signs of collapse: entropy, identical groups, zero advantages, reward spread",
    "throughput": "Producer throughput",
    "duty_cycle": "Duty cycle: producers and learner on one time axis",
}
FIGURE_FILES: dict[str, str] = {section: f"{section}.png" for section in SECTIONS}
MAX_SERIES_POINTS = 2000  # reward-over-time points kept in JSON and plots (evenly thinned)
MAX_CONTROL_EVENTS = 1_000_000  # newest events read per partition of <ns>.control
DEFAULT_BUS_TIMEOUT_S = 5.0
_WILSON_Z = 1.959964  # two-sided 95% normal quantile
_ESS_WARNING = 0.3  # below this normalised ESS the off-policy correction is doing heavy lifting
_LEARNER_COLOR = "#1f4e9c"
_MAX_MARKED_POINTS = 80  # longer series are drawn faint with a rolling mean on top
_MAX_EDGED_INTERVALS = 60  # heartbeat intervals per lane up to which each bar gets a separating edge


class UnknownRunError(ValueError):
    """The run has no folder in the store."""


@dataclass
class RunReport:
    """Everything ``rlpipe report`` shows: a summary, the plotted series, and notes on what is missing."""

    run_id: str
    store: str
    generated_at: str
    summary: dict[str, Any]
    series: dict[str, Any]
    notes: dict[str, list[str]] = field(default_factory=dict)  # section -> why it is empty or partial

    def note(self, section: str, text: str) -> None:
        self.notes.setdefault(section, []).append(text)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (NaN and infinities become null)."""
        return _finite_json(
            {"run_id": self.run_id, "store": self.store, "generated_at": self.generated_at,
             "summary": self.summary, "series": self.series, "notes": self.notes}
        )  # fmt: skip


@dataclass
class ControlEvents:
    """What ``<ns>.control`` says about one run; times are unix seconds."""

    heartbeats: list[tuple[float, ProducerHeartbeat]] = field(default_factory=list)
    started: tuple[float, RunStarted] | None = None
    stopped: tuple[float, RunStopped] | None = None
    checkpoints: list[tuple[float, LearnerCheckpointed]] = field(default_factory=list)


@dataclass
class Lane:
    """One row of the duty-cycle timeline: (start, end, busy share) intervals in unix seconds."""

    name: str
    kind: str  # "learner" or "producer"
    intervals: list[tuple[float, float, float]]


# ---------------------------------------------------------------------------------------------------------------------
# Gathering


def open_run(store: ObjectStore, run_id: str) -> str:
    """``run_id`` if the store has it, else ``UnknownRunError`` naming the runs it does have."""
    validate_name(run_id, "run_id")
    if not store.exists(f"runs/{run_id}"):
        known = run_ids(store)
        hint = f"runs there: {', '.join(known[:10])}" if known else "there are no runs there"
        raise UnknownRunError(f"run {run_id!r} not found under {store.root}; {hint}")
    return run_id


def gather_report(
    store: ObjectStore,
    run_id: str,
    bus_config: BusConfig | None = None,
    bus_timeout_s: float = DEFAULT_BUS_TIMEOUT_S,
) -> RunReport:
    """Read everything about ``run_id`` (``bus_config=None`` skips the event log) into a ``RunReport``."""
    open_run(store, run_id)
    report = RunReport(run_id, store.root, datetime.now(UTC).isoformat(), summary={}, series={})
    run_config = read_run_config(store, run_id, report)
    rows, episodes = load_trajectories(TrajectoryArchive(store), run_id)
    manifests = AdapterRegistry(store, run_id).list()
    evals = load_evals(store, run_id, report)
    state, checkpoint_key = read_learner_state(store, run_id, report)
    events = read_events(bus_config, run_id, bus_timeout_s, report)
    step_log = read_step_log(store, run_id, state, report)

    report.series["reward_by_version"] = reward_by_version(episodes)
    report.series["reward_over_time"] = reward_over_time(episodes)
    report.series["eval"] = eval_series(evals)
    report.series["staleness_histogram"] = staleness_totals(step_log)
    report.series["max_staleness"] = _dig(run_config, "learner", "max_staleness")
    report.series["learner_steps"] = learner_traces(step_log)
    report.series["collapse_thresholds"] = collapse_thresholds(run_config)
    report.series["throughput"] = throughput_series(events.heartbeats)
    report.series["checkpoints"] = [
        {"time": t, "step": p.step, "version": p.version, "path": p.path} for t, p in events.checkpoints
    ]
    report.series["duty_cycle"] = duty_cycle(lanes_of(step_log, events.heartbeats), run_window_hints(events))
    report.summary = build_summary(report, run_config, rows, episodes, manifests, evals, state, checkpoint_key, events)
    add_missing_notes(report, run_id, rows, evals, state, step_log, events, bus_config is None)
    return report


def read_run_config(store: ObjectStore, run_id: str, report: RunReport) -> dict[str, Any]:
    """``run.json`` as plain JSON (only a few fields are shown; no validation needed), or {}."""
    try:
        data = json.loads(store.get(f"runs/{run_id}/run.json"))
    except FileNotFoundError:
        report.note("summary", f"no runs/{run_id}/run.json in the store: env and base model come from elsewhere")
        return {}
    except ValueError as exc:
        report.note("summary", f"runs/{run_id}/run.json is not JSON ({exc}); ignored")
        return {}
    return data if isinstance(data, dict) else {}


def load_trajectories(archive: TrajectoryArchive, run_id: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(one row per trajectory row without the token lists, one row per episode)."""
    rows = (
        archive.scan(run_id)
        .select(
            "batch_id", "episode_id", "env", "producer_id", "policy_version", "reward", "success", "turn",
            "created_at",
            pl.col("tokens").list.len().cast(pl.Int64).alias("num_tokens"),
            pl.col("loss_mask").cast(pl.List(pl.Int64)).list.sum().alias("num_generated"),
        )
        .collect()
    )  # fmt: skip
    return rows, episodes_of(rows)


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
    p, z2 = successes / n, _WILSON_Z**2
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = _WILSON_Z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


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


def load_evals(store: ObjectStore, run_id: str, report: RunReport) -> list[EvalResult]:
    """Every readable ``runs/<run>/eval/*.json``; unreadable ones are noted and skipped."""
    results = []
    for key in store.list(eval_prefix(run_id), recursive=True):
        if not key.endswith(".json"):
            continue
        try:
            results.append(eval_from_bytes(store.get(key), where=key))
        except (ValueError, FileNotFoundError) as exc:
            report.note("eval", f"skipped: {exc}")
    return sorted(results, key=lambda r: (r.policy, r.version, r.created_at))


def eval_series(evals: Sequence[EvalResult]) -> list[dict[str, Any]]:
    """One point per (policy, version): the newest evaluation of it."""
    newest: dict[tuple[str, int], EvalResult] = {}
    for result in evals:
        current = newest.get((result.policy, result.version))
        if current is None or result.created_at >= current.created_at:
            newest[(result.policy, result.version)] = result
    return [
        {"policy": r.policy, "version": r.version, "env": r.env, "episodes": r.episodes, "seed_start": r.seed_start,
         "mean_return": r.mean_return, "ci95": r.ci95, "success_rate": r.success_rate, "breakdown": r.breakdown,
         "created_at": r.created_at.isoformat()}
        for r in sorted(newest.values(), key=lambda r: (r.policy, r.version))
    ]  # fmt: skip


def checkpoint_folders(store: ObjectStore, run_id: str) -> list[tuple[int, str]]:
    """(step, folder key) of every checkpoint with a manifest, newest step first."""
    keys = store.list(checkpoint_prefix(run_id), recursive=True)
    return [(folder.step, folder.key) for folder in complete_folders(keys)]


def read_learner_state(store: ObjectStore, run_id: str, report: RunReport) -> tuple[LearnerState | None, str | None]:
    """The ``state`` of the newest complete checkpoint whose ``state.json`` matches its manifest digest.

    A damaged checkpoint is noted and the next older one is tried, as the learner itself does.
    """
    for _, folder in checkpoint_folders(store, run_id):
        try:
            manifest = CheckpointManifest.from_json(json.loads(store.get(f"{folder}/{MANIFEST_FILE}")))
            blob = store.get(f"{folder}/{STATE_FILE}", sha256=manifest.files[STATE_FILE])
            state = json.loads(blob)["state"]
            if not isinstance(state, dict):
                raise ValueError("its 'state' is not an object")
            return LearnerState.from_json(state), folder
        except (KeyError, TypeError, ValueError, FileNotFoundError) as exc:  # ChecksumError is a ValueError
            report.note("learner", f"skipped checkpoint {folder}: {type(exc).__name__}: {exc}")
    return None, None


def read_step_log(
    store: ObjectStore, run_id: str, state: LearnerState | None, report: RunReport
) -> list[dict[str, Any]]:
    """The learner's per-step entries up to the checkpoint's step (inline in an old-layout checkpoint)."""
    if state is None:
        return []
    if state.legacy_layout:
        return list(state.legacy_step_log)
    try:
        return StepLog(store, run_id).read(upto=state.step)
    except (StepLogGapError, ValueError, OSError) as exc:
        report.note("learner", f"step log not read: {type(exc).__name__}: {exc}")
        return []


def read_events(bus_config: BusConfig | None, run_id: str, timeout_s: float, report: RunReport) -> ControlEvents:
    """The run's control events, or none (with a note) when the bus is skipped or cannot be read in time."""
    events = ControlEvents()
    if bus_config is None:
        return events
    try:
        servers = resolve_bootstrap_servers(bus_config)
        bounded = bus_config.model_copy(
            update={"bootstrap_servers": servers, "connect_timeout_s": min(bus_config.connect_timeout_s, timeout_s)}
        )
        for record in tail(bounded, "control", n=MAX_CONTROL_EVENTS, run_id=run_id, read_timeout_s=timeout_s):
            if record.event is not None:
                _collect(events, record.event.time.timestamp(), record.event.payload)
    except (BusError, ValueError, OSError) as exc:  # unreachable, no topic, no broker configured
        report.note("bus", f"event log not read ({type(exc).__name__}: {_first_line(exc)})")
        return ControlEvents()
    return events


def _collect(events: ControlEvents, time_s: float, payload: Any) -> None:
    if isinstance(payload, ProducerHeartbeat):
        events.heartbeats.append((time_s, payload))
    elif isinstance(payload, RunStarted):
        events.started = events.started or (time_s, payload)
    elif isinstance(payload, RunStopped):
        events.stopped = (time_s, payload)
    elif isinstance(payload, LearnerCheckpointed):
        events.checkpoints.append((time_s, payload))


def staleness_totals(step_log: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Rows per staleness (versions behind the learner), summed over steps; keys sorted numerically."""
    totals: dict[int, int] = {}
    for entry in step_log:
        for staleness, count in (entry.get("staleness_histogram") or {}).items():
            totals[int(staleness)] = totals.get(int(staleness), 0) + int(count)
    return {str(k): totals[k] for k in sorted(totals)}


_STEP_FIELDS = ("rows", "tokens", "loss", "reward_mean", "ratio_mean", "effective_sample_size", "clip_fraction",
                "tokens_per_s", "version", "dropped_stale_rows")  # fmt: skip
_COLLAPSE_FIELDS = ("entropy_mean", "identical_group_share", "zero_advantage_share", "reward_spread", "kl_mean")


def learner_traces(step_log: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per learner step: times and the metrics the report plots (None where a step lacks one)."""
    return [
        {"step": entry.get("step"), "started_at": entry.get("started_at"), "finished_at": entry.get("finished_at"),
         **{name: entry.get(name) for name in (*_STEP_FIELDS, *_COLLAPSE_FIELDS)}}
        for entry in step_log
    ]  # fmt: skip


def collapse_thresholds(run_config: dict[str, Any]) -> dict[str, float]:
    """The learner's warning thresholds of the signs of collapse (its defaults where the run config is missing)."""
    learner = LearnerConfig.model_fields
    names = ("warn_identical_group_share", "warn_zero_advantage_share", "warn_entropy_fraction",
             "warn_reward_spread_fraction", "collapse_baseline_steps")  # fmt: skip
    return {name: _first_known(_dig(run_config, "learner", name), learner[name].default) for name in names}


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


# ---------------------------------------------------------------------------------------------------------------------
# Summary and notes


def build_summary(
    report: RunReport,
    run_config: dict[str, Any],
    rows: pl.DataFrame,
    episodes: pl.DataFrame,
    manifests: list[AdapterManifest],
    evals: list[EvalResult],
    state: LearnerState | None,
    checkpoint_key: str | None,
    events: ControlEvents,
) -> dict[str, Any]:
    """The table at the top of the report."""
    by_version = report.series["reward_by_version"]
    started = events.started[1] if events.started else None
    duty = report.series["duty_cycle"]
    return {
        "run_id": report.run_id,
        "env": _first_known(_dig(run_config, "env", "name"), started and started.env, _only_value(rows, "env"),
                            evals[0].env if evals else None),
        "base_model": _first_known(manifests[-1].base_model if manifests else None, started and started.base_model,
                                   _dig(run_config, "model", "base_model")),
        "learner_steps": _learner_steps(state, events, manifests),
        "checkpoint": checkpoint_key,
        "adapter_versions": len(manifests),
        "latest_version": manifests[-1].version if manifests else 0,
        "trajectories": {
            "batches": rows["batch_id"].n_unique() if rows.height else 0,
            "rows": rows.height,
            "episodes": episodes.height,
            "tokens": int(rows["num_tokens"].sum()) if rows.height else 0,
            "generated_tokens": int(rows["num_generated"].sum()) if rows.height else 0,
            "producers": sorted(rows["producer_id"].unique().to_list()) if rows.height else [],
        },
        "dropped_stale_rows": state.dropped_stale_rows if state else None,
        "reward_first_version": _version_summary(by_version[0]) if by_version else None,
        "reward_last_version": _version_summary(by_version[-1]) if by_version else None,
        "eval": [{k: point[k] for k in ("policy", "version", "episodes", "mean_return", "ci95", "success_rate")}
                 for point in report.series["eval"]],
        "busy_fraction": {lane["name"]: lane["busy_fraction"] for lane in duty["lanes"]},
        "time_span": _time_span(duty, episodes),
        "run_stopped": events.stopped[1].reason if events.stopped else None,
    }  # fmt: skip


def _learner_steps(state: LearnerState | None, events: ControlEvents, manifests: list[AdapterManifest]) -> int | None:
    if state is not None:
        return state.step
    if events.checkpoints:
        return max(p.step for _, p in events.checkpoints)
    return max(m.learner_step for m in manifests) if manifests else None


def _version_summary(point: dict[str, Any]) -> dict[str, Any]:
    return {k: point[k] for k in ("version", "episodes", "reward_mean", "reward_ci95", "success_rate")}


def _time_span(duty: dict[str, Any], episodes: pl.DataFrame) -> dict[str, Any] | None:
    starts = [t for t in (duty["start"], episodes["time"].min() if episodes.height else None) if t is not None]
    ends = [t for t in (duty["end"], episodes["time"].max() if episodes.height else None) if t is not None]
    if not starts:
        return None
    start, end = min(starts), max(ends)  # type: ignore[type-var]
    return {"start": _iso(start), "end": _iso(end), "seconds": end - start}


def add_missing_notes(
    report: RunReport,
    run_id: str,
    rows: pl.DataFrame,
    evals: list[EvalResult],
    state: LearnerState | None,
    step_log: list[dict[str, Any]],
    events: ControlEvents,
    bus_skipped: bool,
) -> None:
    """Say, per section, what is missing and why (the section shows this instead of a figure)."""
    bus_why = "event log skipped (--no-bus)" if bus_skipped else "; ".join(report.notes.get("bus", []))
    learner_why = f"no complete learner checkpoint under runs/{run_id}/checkpoints yet"
    if rows.height == 0:
        report.note("reward", f"no trajectory batches under runs/{run_id}/trajectories yet")
    if not evals:
        report.note("eval", f"no evaluation results under runs/{run_id}/eval (write them with `rlpipe eval`)")
    if state is None:
        report.note("staleness", learner_why)
        report.note("importance", learner_why)
    elif not report.series["staleness_histogram"]:
        report.note("staleness", "the learner's steps recorded no staleness histogram")
    if state is not None and not any(_finite(e.get("ratio_mean")) for e in step_log):
        report.note("importance", "no learner step trained on rows yet (no importance ratios)")
    if not events.heartbeats:
        report.note("throughput", bus_why or f"no ProducerHeartbeat events for run {run_id} on the control topic")
        report.note("duty_cycle", f"producer lanes missing: {bus_why or 'no ProducerHeartbeat events'}")
    if state is None:
        report.note("duty_cycle", f"learner lane missing: {learner_why}")


# ---------------------------------------------------------------------------------------------------------------------
# Figures (matplotlib's object API on the Agg canvas: no pyplot, no global backend switch)


def render_figures(report: RunReport) -> dict[str, bytes]:
    """PNG bytes per section that has something to plot."""
    series = report.series
    t0 = _time_origin(report)
    figures = {
        "reward": plot_reward(series["reward_by_version"], series["reward_over_time"], t0),
        "eval": plot_eval(series["eval"]),
        "staleness": plot_staleness(series["staleness_histogram"], series["max_staleness"]),
        "importance": plot_importance(series["learner_steps"]),
        "collapse": plot_collapse(series["learner_steps"], series.get("collapse_thresholds") or {}),
        "throughput": plot_throughput(series["throughput"], t0),
        "duty_cycle": plot_duty_cycle(series["duty_cycle"], t0),
    }
    return {section: png_bytes(fig) for section, fig in figures.items() if fig is not None}


def png_bytes(fig: Figure) -> bytes:
    """Render ``fig`` to PNG with the Agg canvas."""
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight", facecolor="white")
    return buffer.getvalue()


def plot_reward(by_version: list[dict[str, Any]], over_time: dict[str, Any], t0: float | None) -> Figure | None:
    """Mean reward and success rate per version (95% CIs), and reward over time with its rolling mean."""
    if not by_version:
        return None
    fig = Figure(figsize=(15, 4.4), layout="constrained")
    ax_reward, ax_success, ax_time = fig.subplots(1, 3)
    versions = [p["version"] for p in by_version]
    ax_reward.errorbar(versions, [p["reward_mean"] for p in by_version], yerr=[p["reward_ci95"] for p in by_version],
                       marker="o", capsize=4, color="tab:blue")  # fmt: skip
    for p in by_version:
        ax_reward.annotate(f"n={p['episodes']}", (p["version"], p["reward_mean"]), textcoords="offset points",
                           xytext=(6, -12), fontsize=8, color="dimgray")  # fmt: skip
    _style(ax_reward, "mean episode reward per version (95% CI)", "adapter version (0 = base)", "reward")
    rates = np.array([p["success_rate"] for p in by_version])
    lows, highs = np.array([p["success_low"] for p in by_version]), np.array([p["success_high"] for p in by_version])
    ax_success.errorbar(
        versions, rates, yerr=np.vstack([rates - lows, highs - rates]), marker="s", capsize=4, color="tab:green"
    )
    ax_success.set_ylim(-0.03, 1.03)
    _style(ax_success, "success rate per version (95% Wilson CI)", "adapter version (0 = base)", "success rate")
    for ax in (ax_reward, ax_success):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.margins(x=0.1)
    points = over_time["points"]
    origin = t0 if t0 is not None else points[0]["time"]
    divisor, unit = _time_unit(points[-1]["time"] - origin)
    times = [(p["time"] - origin) / divisor for p in points]
    few = len(points) < 300  # a few dots can be big and opaque; thousands must be faint
    ax_time.scatter(times, [p["reward"] for p in points], s=14 if few else 5, alpha=0.6 if few else 0.2,
                    color="tab:blue", linewidths=0, label="episode")  # fmt: skip
    ax_time.plot(times, [p["rolling_mean"] for p in points], color="tab:red", linewidth=2,
                 label=f"rolling mean ({over_time['window']} episodes)")  # fmt: skip
    ax_time.legend(loc="best", fontsize=8)
    _style(ax_time, "reward over time", _time_label(origin, unit), "reward")
    return fig


def plot_eval(points: list[dict[str, Any]]) -> Figure | None:
    """Mean return (95% CI) and success rate per evaluated version; a one-version baseline is a band."""
    if not points:
        return None
    fig = Figure(figsize=(12, 4.4), layout="constrained")
    ax_return, ax_success = fig.subplots(1, 2)
    policies = sorted({p["policy"] for p in points}, key=lambda name: (name != "adapter", name))
    versions = [p["version"] for p in points]
    x_low, x_high = min(versions) - 0.4, max(versions) + 0.4
    for index, policy in enumerate(policies):
        mine = [p for p in points if p["policy"] == policy]
        color = f"C{index}"
        if policy != "adapter" and len(mine) == 1:  # a baseline: a horizontal reference across all versions
            p = mine[0]
            ax_return.axhline(p["mean_return"], color=color, linestyle="--", label=f"{policy} ({p['episodes']} ep)")
            ax_return.axhspan(p["mean_return"] - p["ci95"], p["mean_return"] + p["ci95"], color=color, alpha=0.12)
            ax_success.axhline(p["success_rate"], color=color, linestyle="--", label=policy)
            continue
        xs = [p["version"] for p in mine]
        ax_return.errorbar(xs, [p["mean_return"] for p in mine], yerr=[p["ci95"] for p in mine], marker="o",
                           capsize=4, color=color, label=policy)  # fmt: skip
        ax_success.plot(xs, [p["success_rate"] for p in mine], marker="s", color=color, label=policy)
    for ax in (ax_return, ax_success):
        ax.set_xlim(x_low, x_high)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(loc="best", fontsize=8)
    ax_success.set_ylim(-0.03, 1.03)
    _style(ax_return, "held-out mean return (95% CI)", "adapter version (0 = base)", "mean return")
    _style(ax_success, "held-out success rate", "adapter version (0 = base)", "success rate")
    return fig


def plot_staleness(histogram: dict[str, int], max_staleness: int | None) -> Figure | None:
    """Rows per staleness, summed over learner steps; rows beyond ``max_staleness`` (dropped) in red."""
    if not histogram:
        return None
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    staleness = [int(k) for k in histogram]
    colors = ["tab:red" if max_staleness is not None and s > max_staleness else "tab:blue" for s in staleness]
    bars = ax.bar(staleness, list(histogram.values()), color=colors, width=0.7)
    ax.bar_label(bars, fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    limit = f" (red: beyond max_staleness {max_staleness}, dropped)" if max_staleness is not None else ""
    _style(ax, f"staleness of rows reaching the learner{limit}", "versions behind the learner", "rows")
    return fig


def plot_importance(steps: list[dict[str, Any]]) -> Figure | None:
    """Importance-ratio mean and normalised effective sample size per learner step."""
    trained = [s for s in steps if _finite(s.get("ratio_mean")) or _finite(s.get("effective_sample_size"))]
    if not trained:
        return None
    fig = Figure(figsize=(10, 5.5), layout="constrained")
    ax_ratio, ax_ess = fig.subplots(2, 1, sharex=True)
    xs = [s["step"] for s in trained]
    _trace(ax_ratio, xs, [_nan(s.get("ratio_mean")) for s in trained], "tab:purple", None)
    ax_ratio.axhline(1.0, color="gray", linestyle=":", linewidth=1, label="on-policy (1.0)")
    ax_ratio.legend(loc="best", fontsize=8)
    _style(ax_ratio, "importance ratio mean (learner / sampler probability)", "", "ratio mean")
    _trace(ax_ess, xs, [_nan(s.get("effective_sample_size")) for s in trained], "tab:orange", None)
    ax_ess.axhline(_ESS_WARNING, color="tab:red", linestyle=":", linewidth=1, label=f"drift warning ({_ESS_WARNING})")
    ax_ess.set_ylim(0, 1.05)
    ax_ess.legend(loc="best", fontsize=8)
    ax_ess.xaxis.set_major_locator(MaxNLocator(integer=True))
    _style(ax_ess, "effective sample size (normalised; 1 = on-policy)", "learner step", "ESS")
    return fig


def plot_collapse(steps: list[dict[str, Any]], thresholds: dict[str, float]) -> Figure | None:
    """Per learner step: policy entropy, the shares of identical groups and zero advantages, and the
    within-group reward spread beside the mean reward (the spread falls first: the early warning).
    Dotted lines are the learner's warning thresholds; the relative ones scale its first steps' mean."""
    trained = [s for s in steps if any(_finite(s.get(name)) for name in _COLLAPSE_FIELDS)]
    if not trained:
        return None
    fig = Figure(figsize=(10, 8), layout="constrained")
    ax_entropy, ax_share, ax_spread = fig.subplots(3, 1, sharex=True)
    xs = [s["step"] for s in trained]
    baseline_steps = int(thresholds.get("collapse_baseline_steps", 3))

    def relative_line(ax: Any, name: str, fraction: float | None) -> None:
        first = [s[name] for s in trained if _finite(s.get(name))][:baseline_steps]
        if fraction is not None and len(first) == baseline_steps:
            ax.axhline(fraction * float(np.mean(first)), color="tab:red", linestyle=":", linewidth=1,
                       label=f"warning ({fraction:g} x first {baseline_steps} steps)")  # fmt: skip
            ax.legend(loc="best", fontsize=8)

    _trace(ax_entropy, xs, [_nan(s.get("entropy_mean")) for s in trained], "tab:green", None)
    relative_line(ax_entropy, "entropy_mean", thresholds.get("warn_entropy_fraction"))
    _style(ax_entropy, "policy entropy of the sampled tokens", "", "nats / token")
    for name, color, label in (("identical_group_share", "tab:purple", "groups with identical samples"),
                               ("zero_advantage_share", "tab:orange", "rows with advantage 0")):
        _trace(ax_share, xs, [_nan(s.get(name)) for s in trained], color, label)
        if thresholds.get(f"warn_{name}") is not None:
            ax_share.axhline(thresholds[f"warn_{name}"], color=color, linestyle=":", linewidth=1)
    ax_share.set_ylim(-0.02, 1.05)
    ax_share.legend(loc="best", fontsize=8)
    _style(ax_share, "share of the step (dotted: warning thresholds)", "", "share")
    _trace(ax_spread, xs, [_nan(s.get("reward_spread")) for s in trained], "tab:blue", "within-group reward std")
    relative_line(ax_spread, "reward_spread", thresholds.get("warn_reward_spread_fraction"))
    ax_mean = ax_spread.twinx()
    ax_mean.plot(xs, [_nan(s.get("reward_mean")) for s in trained], color="gray", linewidth=1, label="reward mean")
    ax_mean.set_ylabel("reward mean", color="gray")
    ax_mean.legend(loc="lower left", fontsize=8)
    ax_spread.xaxis.set_major_locator(MaxNLocator(integer=True))
    _style(ax_spread, "reward spread within groups (falls before the mean: the Echo Trap warning)", "learner step",
           "reward std")  # fmt: skip
    return fig


def plot_throughput(series: dict[str, list[dict[str, Any]]], t0: float | None) -> Figure | None:
    """Samples/s and tokens/s per producer over time."""
    if not series:
        return None
    fig = Figure(figsize=(12, 5.5), layout="constrained")
    ax_samples, ax_tokens = fig.subplots(2, 1, sharex=True)
    origin = t0 if t0 is not None else min(points[0]["time"] for points in series.values())
    divisor, unit = _time_unit(max(points[-1]["time"] for points in series.values()) - origin)
    for index, (producer, points) in enumerate(series.items()):
        times = [(p["time"] - origin) / divisor for p in points]
        _trace(ax_samples, times, [p["samples_per_s"] for p in points], f"C{index}", producer)
        _trace(ax_tokens, times, [p["tokens_per_s"] for p in points], f"C{index}", producer)
    ax_samples.legend(loc="best", fontsize=8, ncols=min(4, len(series)))
    _style(ax_samples, "producer throughput (from heartbeats)", "", "samples / s")
    _style(ax_tokens, "", _time_label(origin, unit), "tokens / s")
    return fig


def plot_duty_cycle(duty: dict[str, Any], t0: float | None) -> Figure | None:
    """One lane per producer (heartbeat intervals shaded by busy share) and one for the learner (solid steps)."""
    lanes = duty["lanes"]
    if not lanes:
        return None
    origin = duty["start"] if t0 is None else t0
    start, end = duty["start"] - origin, duty["end"] - origin
    divisor, unit = _time_unit(end)
    fig = Figure(figsize=(13, 1.6 + 0.75 * len(lanes)), layout="constrained")
    ax = fig.subplots()
    cmap = colormaps["Greens"]
    labels = []
    for row, lane in enumerate(reversed(lanes)):  # the learner (first) ends up on top
        bars = [((s - origin) / divisor, (e - s) / divisor) for s, e, _ in lane["intervals"]]
        if lane["kind"] == "learner":
            ax.broken_barh(bars, (row - 0.38, 0.76), facecolors=_LEARNER_COLOR, linewidth=0)
        else:  # thin white edges keep a few wide intervals apart; with many they would hide the colours
            colors = [cmap(0.12 + 0.88 * share) for _, _, share in lane["intervals"]]
            edge = 0.6 if len(bars) <= _MAX_EDGED_INTERVALS else 0.0
            ax.broken_barh(bars, (row - 0.38, 0.76), facecolors=colors, edgecolors="white", linewidth=edge)
        labels.append(f"{lane['name']}\n{_percent(lane['busy_fraction'])} busy")
    ax.set_yticks(range(len(lanes)), labels)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlim(start / divisor, end / divisor)
    if any(lane["kind"] == "producer" for lane in lanes):
        mappable = ScalarMappable(norm=Normalize(0, 1), cmap=cmap)
        fig.colorbar(mappable, ax=ax, label="producer busy share", fraction=0.04, pad=0.01)
    _style(ax, "duty cycle (learner: training steps; producers: busy share per heartbeat interval)",
           _time_label(origin, unit), "")  # fmt: skip
    ax.grid(axis="y", visible=False)
    return fig


def _trace(ax: Any, xs: Sequence[float], ys: Sequence[float], color: str, label: str | None) -> None:
    """A short series as dots on a line; a long one as a faint line under its rolling mean (noise would hide it)."""
    if len(xs) <= _MAX_MARKED_POINTS:
        ax.plot(xs, ys, marker=".", color=color, label=label)
        return
    window = max(3, len(xs) // 40)
    smooth = pl.Series(ys, dtype=pl.Float64).rolling_mean(window_size=window, min_samples=1, center=True)
    ax.plot(xs, ys, color=color, alpha=0.2, linewidth=0.6)
    ax.plot(xs, smooth.to_list(), color=color, linewidth=1.8,
            label=f"{label} (rolling mean of {window})" if label else f"rolling mean of {window}")  # fmt: skip


def _style(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)


def _time_unit(span_s: float) -> tuple[float, str]:
    """Seconds, minutes or hours, whichever keeps the axis numbers readable."""
    if span_s > 2 * 3600:
        return 3600.0, "h"
    if span_s > 2 * 60:
        return 60.0, "min"
    return 1.0, "s"


def _time_label(origin: float, unit: str) -> str:
    return f"time since {_iso(origin)} ({unit})"


def _time_origin(report: RunReport) -> float | None:
    """The common start of every time axis: the duty-cycle window's start, else the first episode."""
    duty_start = report.series["duty_cycle"]["start"]
    points = report.series["reward_over_time"]["points"]
    first_episode = points[0]["time"] if points else None
    known = [t for t in (duty_start, first_episode) if t is not None]
    return min(known) if known else None


# ---------------------------------------------------------------------------------------------------------------------
# Output


def write_report(report: RunReport, out_dir: str | Path) -> Path:
    """Write ``report.html`` (images inline), each figure as a PNG, and ``report.json``; return the HTML path."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    images = render_figures(report)
    for section, data in images.items():
        (folder / FIGURE_FILES[section]).write_bytes(data)
    (folder / "report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    path = folder / "report.html"
    path.write_text(render_html(report, images), encoding="utf-8")
    return path


TEMPLATE = "report.html.jinja"  # in pipeline/templates, shipped with the package


@functools.cache
def report_templates() -> jinja2.Environment:
    """The packaged page templates, autoescaped (every value is text) and strict about missing names."""
    return jinja2.Environment(
        loader=jinja2.PackageLoader("pipeline", "templates"), autoescape=True, undefined=jinja2.StrictUndefined,
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
    )  # fmt: skip


def render_html(report: RunReport, images: dict[str, bytes]) -> str:
    """A self-contained page: summary table first, then one section per figure."""
    sections = [
        {"id": section, "title": title, "notes": report.notes.get(section, []),
         "image": base64.b64encode(images[section]).decode("ascii") if section in images else None,
         "table": section_table(section, report)}
        for section, title in SECTIONS.items()
    ]  # fmt: skip
    summary_notes = [text for key in ("summary", "learner") for text in report.notes.get(key, [])]
    return report_templates().get_template(TEMPLATE).render(
        report=report, summary=summary_lines(report.summary), summary_notes=summary_notes, sections=sections
    )


_SUMMARY_LABELS = (
    ("run_id", "run id"), ("env", "environment"), ("base_model", "base model"), ("learner_steps", "learner steps"),
    ("adapter_versions", "adapter versions"), ("trajectories", "trajectories"),
    ("dropped_stale_rows", "dropped stale rows"), ("reward_first_version", "mean reward, first version"),
    ("reward_last_version", "mean reward, last version"), ("eval", "evaluations"),
    ("busy_fraction", "busy fraction over the run"), ("time_span", "time span"), ("checkpoint", "newest checkpoint"),
)  # fmt: skip


def summary_lines(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) pairs of the summary, for the terminal and the HTML alike."""
    return [(label, _format_summary_value(summary, key)) for key, label in _SUMMARY_LABELS]


def _format_summary_value(summary: dict[str, Any], key: str) -> str:
    value = summary.get(key)
    if value is None or value == [] or value == {}:
        return "-"
    if key == "trajectories":
        return (f"{value['rows']} rows, {value['episodes']} episodes, {value['tokens']} tokens "
                f"({value['generated_tokens']} generated), {value['batches']} batches")  # fmt: skip
    if key == "adapter_versions":
        return f"{value} (latest v{summary.get('latest_version', 0)})"
    if key.startswith("reward_"):
        return (f"v{value['version']}: {value['reward_mean']:.4g} ± {value['reward_ci95']:.2g} "
                f"({value['episodes']} episodes, success {_percent(value['success_rate'])})")  # fmt: skip
    if key == "eval":
        return "; ".join(f"{e['policy']} v{e['version']}: {e['mean_return']:.4g} ± {e['ci95']:.2g} "
                         f"(success {_percent(e['success_rate'])}, {e['episodes']} ep)" for e in value)  # fmt: skip
    if key == "busy_fraction":
        return ", ".join(f"{name} {_percent(fraction)}" for name, fraction in value.items())
    if key == "time_span":
        return f"{value['start']} to {value['end']} ({value['seconds']:.0f} s)"
    return str(value)


def section_table(section: str, report: RunReport) -> dict[str, list[Any]] | None:
    """The numbers under a figure (``head`` and ``rows``), where a table helps (eval details, busy fractions)."""
    if section == "eval" and report.series["eval"]:
        keys = sorted({k for p in report.series["eval"] for k in p["breakdown"]})
        head = ["policy", "version", "episodes", "seed start", "mean return", "95% CI", "success", *keys]
        rows = [
            [p["policy"], p["version"], p["episodes"], p["seed_start"], f"{p['mean_return']:.4g}",
             f"± {p['ci95']:.3g}", _percent(p["success_rate"]),
             *(f"{p['breakdown'][k]:.4g}" if k in p["breakdown"] else "-" for k in keys)]
            for p in report.series["eval"]
        ]  # fmt: skip
        return {"head": head, "rows": rows}
    if section == "duty_cycle" and report.series["duty_cycle"]["lanes"]:
        rows = [[lane["name"], lane["kind"], f"{lane['busy_s']:.1f}", _percent(lane["busy_fraction"]),
                 _percent(lane["busy_fraction_active"])] for lane in report.series["duty_cycle"]["lanes"]]  # fmt: skip
        return {"head": ["lane", "kind", "busy seconds", "busy over the run", "busy while active"], "rows": rows}
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Small helpers


def _dig(data: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _first_known(*values: Any) -> Any:
    return next((v for v in values if v not in (None, "")), None)


def _only_value(rows: pl.DataFrame, column: str) -> str | None:
    if not rows.height:
        return None
    values = sorted(rows[column].unique().to_list())
    return values[0] if len(values) == 1 else ", ".join(values)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _nan(value: Any) -> float:
    return float(value) if _finite(value) else math.nan


def _percent(value: Any) -> str:
    return f"{100 * value:.1f}%" if _finite(value) else "-"


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _finite_json(obj: Any) -> Any:
    """Replace NaN and infinities by None (JSON has neither), recursively; numpy scalars become Python ones."""
    if isinstance(obj, dict):
        return {str(k): _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite_json(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
