"""Gathering a run's report: the store and the event log -> ``RunReport``.

Reads the run's ``run.json``, trajectories, adapter manifests, evaluations, the
newest complete learner checkpoint (through ``schemas.checkpoint``) with its step
log (a value learner's too: return, TD error, Q values, replay memory size), and the run's events on ``<ns>.control`` (a bounded read); hands the rows,
steps and events to ``pipeline.analysis.report.metrics`` for the series; then builds the
summary table and notes, per section, what is missing and why.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import polars as pl

from pipeline.analysis.report.metrics import (
    collapse_thresholds,
    duty_cycle,
    episodes_of,
    eval_series,
    lanes_of,
    learner_traces,
    reward_by_version,
    reward_over_time,
    run_window_hints,
    staleness_totals,
    throughput_series,
    value_traces,
)
from pipeline.analysis.report.model import ControlEvents, RunReport, dig, finite, first_known
from pipeline.analysis.runs import read_evals, run_kind, runs_there, summarize, with_recorded_membership
from pipeline.devstack.stack import resolve_bootstrap_servers
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.bus import BusError, tail
from pipeline.io.registry import AdapterRegistry
from pipeline.io.steplog import StepLog, StepLogGapError
from pipeline.io.store import ObjectStore
from pipeline.runtime import effective_run_config
from pipeline.timefmt import utc_text
from schemas.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointManifest,
    LearnerState,
    checkpoint_prefix,
    complete_folders,
)
from schemas.config import IMPORTANCE_LOSSES, BusConfig, LearnerConfig
from schemas.evaluation import EvalResult
from schemas.events import LearnerCheckpointed, ProducerHeartbeat, RunStarted
from schemas.names import validate_name
from schemas.registry import AdapterManifest

MAX_CONTROL_EVENTS = 1_000_000  # newest events read per partition of <ns>.control
DEFAULT_BUS_TIMEOUT_S = 5.0


class UnknownRunError(ValueError):
    """The run has no folder in the store."""


def open_run(store: ObjectStore, run_id: str) -> str:
    """``run_id`` if the store has it, else ``UnknownRunError`` naming the runs it does have."""
    validate_name(run_id, "run_id")
    if not store.exists(f"runs/{run_id}"):
        raise UnknownRunError(f"run {run_id!r} not found under {store.root}; {runs_there(store)}")
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
    manifests = load_manifests(AdapterRegistry(store, run_id), report)
    evals = load_evals(store, run_id, report)
    state, checkpoint_key = read_learner_state(store, run_id, report)
    events = read_events(bus_config, run_id, bus_timeout_s, report)
    status = summarize(store, run_id, events.activity, events.log_read).status  # as `rlpipe runs show` gives it
    add_recorded_membership(store, run_id, events, report)
    step_log = read_step_log(store, run_id, state, report)

    report.series["reward_by_version"] = reward_by_version(episodes)
    report.series["reward_over_time"] = reward_over_time(episodes)
    report.series["eval"] = eval_series(evals)
    report.series["staleness_histogram"] = staleness_totals(step_log)
    report.series["max_staleness"] = dig(run_config, "learner", "max_staleness")
    report.series["learner_steps"] = learner_traces(step_log)
    report.series["collapse_thresholds"] = collapse_thresholds(run_config)
    report.series["throughput"] = throughput_series(events.heartbeats)
    report.series["checkpoints"] = [
        {"time": t, "step": p.step, "version": p.version, "path": p.path} for t, p in events.checkpoints
    ]
    report.series["duty_cycle"] = duty_cycle(lanes_of(step_log, events.heartbeats), run_window_hints(events))
    report.series["value"] = value_traces(step_log)
    report.summary = build_summary(report, run_config, rows, episodes, manifests, evals, state, checkpoint_key, events)
    report.summary["status"] = status
    add_value_summary(report, run_config)
    add_missing_notes(report, run_id, rows, evals, state, step_log, events, bus_config is None, run_config)
    return report


def add_value_summary(report: RunReport, run_config: dict[str, Any]) -> None:
    """A value run: its newest replay memory size and return, or a note when its learner logged no step yet."""
    traces = report.series["value"]
    if traces:
        report.summary["value_replay_size"] = traces[-1]["replay_size"]
        returns = [t["episode_return_mean"] for t in traces if finite(t["episode_return_mean"])]
        report.summary["value_return_last"] = returns[-1] if returns else None
    elif run_config.get("value"):
        report.note("value", "the value learner has logged no step up to its newest checkpoint yet")
    else:
        report.note("value", "not a value run (its configuration has no value section)")


def read_run_config(store: ObjectStore, run_id: str, report: RunReport) -> dict[str, Any]:
    """The run's configuration (``run.json`` with its newest recorded change) as plain JSON (only a few fields
    are shown; no validation needed), or {}."""
    try:
        data = effective_run_config(store, run_id)
    except FileNotFoundError:
        report.note("summary", f"no runs/{run_id}/run.json in the store: env and base model come from elsewhere")
        return {}
    except ValueError as exc:
        report.note("summary", f"{exc}; ignored")  # names the file
        return {}
    return data


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


def load_manifests(registry: AdapterRegistry, report: RunReport) -> list[AdapterManifest]:
    """Every readable adapter manifest, oldest first; one that cannot be read (damaged, or written by a newer
    rlpipe) is noted and skipped."""
    manifests = []
    for version in registry.versions():
        try:
            manifests.append(registry.show(version))
        except ValueError as exc:  # ManifestError, SchemaVersionError: the message names the file
            report.note("summary", f"skipped adapter v{version}: {exc}")
    return manifests


def load_evals(store: ObjectStore, run_id: str, report: RunReport) -> list[EvalResult]:
    """Every readable ``runs/<run>/eval/*.json``; unreadable ones are noted and skipped."""
    results, unreadable = read_evals(store, run_id)
    for why in unreadable:
        report.note("eval", f"skipped: {why}")
    return sorted(results, key=lambda r: (r.policy, r.version, r.created_at))


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
    """The run's control events, each once (by ``event_id``), or none (with a note) when the bus is skipped or
    cannot be read in time."""
    events = ControlEvents()
    if bus_config is None:
        return events
    try:
        servers = resolve_bootstrap_servers(bus_config)
        bounded = bus_config.model_copy(
            update={"bootstrap_servers": servers, "connect_timeout_s": min(bus_config.connect_timeout_s, timeout_s)}
        )
        seen: set[uuid.UUID] = set()  # event ids: a publisher resends an event in doubt, leaving two copies on the topic
        for record in tail(bounded, "control", n=MAX_CONTROL_EVENTS, run_id=run_id, read_timeout_s=timeout_s):
            if record.event is not None and record.event.event_id not in seen:
                seen.add(record.event.event_id)
                _collect(events, record.event.time.timestamp(), record.event.payload)
        events.log_read = True
    except (BusError, ValueError, OSError) as exc:  # unreachable, no topic, no broker configured
        report.note("bus", f"event log not read ({type(exc).__name__}: {_first_line(exc)})")
        return ControlEvents()
    return events


def add_recorded_membership(store: ObjectStore, run_id: str, events: ControlEvents, report: RunReport) -> None:
    """The run's newest start or stop as the store keeps it (``runs/<run>/membership.json``, which retention does
    not trim), added to ``events.activity`` as ``rlpipe runs list|show`` add it; an unreadable record is a stop
    and a note."""
    recorded, unreadable = with_recorded_membership(store, run_id, events.activity)
    events.activity = recorded or events.activity
    if unreadable:
        report.note("summary", unreadable)


def _collect(events: ControlEvents, time_s: float, payload: Any) -> None:
    events.activity.add(time_s, payload)
    if isinstance(payload, ProducerHeartbeat):
        events.heartbeats.append((time_s, payload))
    elif isinstance(payload, RunStarted):  # events come oldest first: the run's window opens at its first start
        events.started = events.started or (time_s, payload)
    elif isinstance(payload, LearnerCheckpointed):
        events.checkpoints.append((time_s, payload))


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
        "env": first_known(dig(run_config, "env", "name"), started and started.env, _only_value(rows, "env"),
                            evals[0].env if evals else None),
        "base_model": first_known(manifests[-1].base_model if manifests else None, started and started.base_model,
                                   dig(run_config, "model", "base_model")),
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
        "eval": [{k: point[k] for k in ("policy", "env", "version", "episodes", "mean_return", "ci95", "success_rate",
                                        "success_low", "success_high")}
                 for point in report.series["eval"]],
        "busy_fraction": {lane["name"]: lane["busy_fraction"] for lane in duty["lanes"]},
        "time_span": _time_span(duty, episodes),
        "run_stopped": events.stopped[1] if events.stopped else None,
        "run_stopped_at": utc_text(events.stopped[0]) if events.stopped and events.stopped[0] is not None else None,
        "kind": run_kind(run_config),
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
    return {"start": utc_text(start), "end": utc_text(end), "seconds": end - start}


def add_missing_notes(
    report: RunReport,
    run_id: str,
    rows: pl.DataFrame,
    evals: list[EvalResult],
    state: LearnerState | None,
    step_log: list[dict[str, Any]],
    events: ControlEvents,
    bus_skipped: bool,
    run_config: dict[str, Any] | None = None,
) -> None:
    """Say, per section, what is missing and why (the section shows this instead of a figure).

    A run whose ``learner.loss`` divides by no behaviour probability (``cross_entropy``, ``awr``, ``filtered_bc``:
    the objectives ``rlpipe replay --train`` trains offline rows with) has no importance ratios by design, and its
    note says so rather than that no step has trained yet."""
    bus_why = "event log skipped (--no-bus)" if bus_skipped else "; ".join(report.notes.get("bus", []))
    learner_why = f"no complete learner checkpoint under runs/{run_id}/checkpoints yet"
    if not evals:
        report.note("eval", f"no evaluation results under runs/{run_id}/eval (write them with `rlpipe eval`)")
    if report.summary.get("kind") != "value-network":  # a value run has no trajectories, staleness or ratios
        if rows.height == 0:
            report.note("reward", f"no trajectory batches under runs/{run_id}/trajectories yet")
        if state is None:
            report.note("staleness", learner_why)
            report.note("importance", learner_why)
        elif not report.series["staleness_histogram"]:
            report.note("staleness", "the learner's steps recorded no staleness histogram")
        loss = dig(run_config or {}, "learner", "loss") or LearnerConfig.model_fields["loss"].default
        if state is not None and loss not in IMPORTANCE_LOSSES:
            report.note("importance", f"no importance ratios by design: learner.loss {loss} trains the rows as offline "
                                      "data (weighted cross-entropy), which needs no behaviour logprobs")
        elif state is not None and not any(finite(e.get("ratio_mean")) for e in step_log):
            report.note("importance", "no learner step trained on rows yet (no importance ratios)")
    if not events.heartbeats:
        report.note("throughput", bus_why or f"no ProducerHeartbeat events for run {run_id} on the control topic")
        report.note("duty_cycle", f"producer lanes missing: {bus_why or 'no ProducerHeartbeat events'}")
    if state is None:
        report.note("duty_cycle", f"learner lane missing: {learner_why}")


def _only_value(rows: pl.DataFrame, column: str) -> str | None:
    if not rows.height:
        return None
    values = sorted(rows[column].unique().to_list())
    return values[0] if len(values) == 1 else ", ".join(values)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
