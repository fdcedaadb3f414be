"""The runs of a store: what each one is, how far it got, and removing one completely.

Where each field of a ``RunSummary`` comes from (read through the helpers that
own each layout, never by parsing their files here):

- environment, base model, ``max_steps``: the run's ``run.json`` with its newest recorded change
  (``runs/<run>/config-changes/``: a resume with another ``--max-steps`` is one);
- versions, last reward: the adapter registry (``AdapterRegistry``; the newest
  manifest whose metrics hold ``reward_mean``); a manifest that cannot be read is a note, and the
  versions are then counted by their folders;
- steps: the newest complete learner checkpoint (its folder name, read through
  ``schemas.checkpoint``, the checkpoint's contract), or the newest
  version's ``learner_step`` when that is further;
- status and last activity: the run's events on ``<ns>.control`` (``RunStarted``,
  ``RunStopped``, ``LearnerCheckpointed``, heartbeats), read with a bounded wait, and
  its newest start or stop as the store keeps it (``runs/<run>/membership.json``, what
  packed processes starting obey; ``RunActivity.add_recorded``).  Without the log a run
  is ``finished`` when its steps reached ``max_steps``, ``stopped`` when its record is a
  stop, else ``unknown``.  A Tinker API training client (``<session>.train.<n>``: weights, no
  ``run.json``, no control events) takes its session's state instead (``pipeline.api.lifecycle``):
  ``ended`` once the session ended (the end is its stop reason), ``running`` while it beats,
  ``idle`` while it has lapsed.

Deleting a run removes every object under ``runs/<run>/`` of the store (its
trajectories, adapters, checkpoints, evaluations, step records) and, on this
machine, its launcher folder (``$RLPIPE_HOME/runs/<run>``) and every cached copy of
its adapters (``$RLPIPE_HOME/adapter-cache/<consumer>/<run>``,
``$RLPIPE_HOME/cache/adapters/<run>``).  Names are matched whole, folder by
folder, so run ``cart`` never touches ``cartpole``.  Its events stay on the
topics: the log is shared by every run and is trimmed by retention only.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline.devstack.stack import resolve_bootstrap_servers
from pipeline.io.bus import BusError, tail
from pipeline.io.registry import AdapterRegistry, run_ids
from pipeline.io.store import ObjectStore, read_json_records
from schemas.checkpoint import checkpoint_prefix, complete_folders
from schemas.config import BusConfig
from schemas.evaluation import EvalResult, eval_from_bytes, eval_prefix
from schemas.events import (
    LearnerCheckpointed,
    LearnerLeft,
    LearnerProgress,
    ProducerHeartbeat,
    RunStarted,
    RunStopped,
)
from schemas.names import validate_name
from schemas.registry import AdapterManifest

ACTIVE_WITHIN_S = 120.0  # a run with an event this recent (heartbeats come every few seconds) is running
# a packed run is stopped while its producers serve it: their last heartbeats, as they let it go, follow its RunStopped
LEAVING_WITHIN_S = 60.0
# a learner's reports this long after a stop are no wind-down (the rows it had waiting trained, its last checkpoint
# written): a learner that never sends LearnerLeft (under torchrun, say) and still reports is training the run
LEARNER_WIND_DOWN_S = 600.0
MAX_CONTROL_EVENTS = 1_000_000  # newest events read per partition of <ns>.control
# what a learner reports of its run: after the run's stop, its wind-down (the rows waiting trained, checkpointed, left)
LEARNER_REPORTS = (LearnerCheckpointed, LearnerProgress, LearnerLeft)
STATUSES = ("running", "finished", "stopped", "ended", "idle", "unknown")  # ended: a Tinker session's client


@dataclass
class RunActivity:
    """What the control topic says about one run.

    The newest event of each kind that can show the run going is kept rather than a verdict, and whether the run
    went on after its stop is read from them when asked (``stopped_last``): a stop added late (the store's record
    of one the topic no longer holds, ``add_recorded``) then reads the events after it as the topic's own stop
    would have.
    """

    last_event_s: float | None = None
    stopped_s: float | None = None
    stop_reason: str | None = None
    last_step: int | None = None
    last_reward: float | None = None
    membership_s: float | None = None  # the newest RunStarted or RunStopped
    heartbeat_s: float | None = None  # the newest ProducerHeartbeat
    left_s: float | None = None  # the newest LearnerLeft
    reported_s: float | None = None  # the newest learner's report but a LearnerLeft
    other_s: float | None = None  # the newest event of any kind but a heartbeat or a learner's report

    def add(self, time_s: float, payload: Any) -> None:
        self.last_event_s = _newest(self.last_event_s, time_s)
        if isinstance(payload, ProducerHeartbeat):
            self.heartbeat_s = _newest(self.heartbeat_s, time_s)
        elif isinstance(payload, LearnerLeft):
            self.left_s = _newest(self.left_s, time_s)
        elif isinstance(payload, LEARNER_REPORTS):
            self.reported_s = _newest(self.reported_s, time_s)
        else:
            self.other_s = _newest(self.other_s, time_s)
        if isinstance(payload, RunStarted | RunStopped):
            self.membership_s = _newest(self.membership_s, time_s)
        if isinstance(payload, RunStopped):
            self.stopped_s, self.stop_reason = time_s, payload.reason
        elif isinstance(payload, RunStarted):
            self.stopped_s = self.stop_reason = None  # started (again) after any earlier stop
        elif isinstance(payload, LearnerCheckpointed):
            self.last_step = payload.step
            if (reward := episode_reward(payload.metrics)) is not None:
                self.last_reward = reward

    def stopped_last(self) -> bool:
        """Whether the run's newest start or stop is a stop and nothing after it shows the run going.

        After a stop, its producers' heartbeats within ``LEAVING_WITHIN_S`` are them letting it go, and whatever its
        learner reports (``LEARNER_REPORTS``: the steps it trains from the rows waiting, its checkpoints, its
        ``LearnerLeft``) is its wind-down until a newer ``RunStarted`` (which clears the stop); a later heartbeat, a
        learner's report after its ``LearnerLeft`` (a learner started on the run again) or more than
        ``LEARNER_WIND_DOWN_S`` after the stop (a learner that sends none still training it), or any other event
        after the stop (a ``RunConfigChanged`` of a resume), shows the run going again.
        """
        if self.stopped_s is None:
            return False
        stop = self.stopped_s
        beating = self.heartbeat_s is not None and self.heartbeat_s - stop > LEAVING_WITHIN_S
        acting = self.other_s is not None and self.other_s > stop
        left = self.left_s is not None and self.left_s >= stop
        returned = self.reported_s is not None and (
            (left and self.reported_s > self.left_s) or self.reported_s - stop > LEARNER_WIND_DOWN_S)
        return not (beating or acting or returned)

    def add_recorded(self, time_s: float | None, payload: RunStarted | RunStopped) -> None:
        """The run's newest start or stop as the store keeps it, added after the topic's events: it holds unless the
        topic has a newer start or stop (the commands that record one publish it next, but the publish may fail, and
        retention trims the topic, not the record).  Events after it still show the run going.  ``time_s`` None is a
        damaged record, which packed processes take as a stop: one older than anything on the topic."""
        if self.membership_s is not None and (time_s is None or time_s <= self.membership_s):
            return
        if time_s is not None:
            self.add(time_s, payload)
        elif isinstance(payload, RunStopped):
            self.stopped_s, self.stop_reason = 0.0, payload.reason


def _newest(known: float | None, time_s: float) -> float:
    return time_s if known is None else max(known, time_s)


def run_kind(config: Mapping[str, Any]) -> str:
    """What a run's versions are, from its stored configuration: a value run's ``value-network``, else ``lora``."""
    return "value-network" if config.get("value") else "lora"


def version_zero(kind: str) -> str:
    """What version 0 of a run of ``kind`` (``run_kind``) plays, as ``rlpipe eval`` names it: a value run's
    ``uniform random`` policy (no network trained yet), a LoRA run's base model."""
    return "uniform random" if kind == "value-network" else "the base model"


def shown_policy(policy: str, version: int, kind: str) -> str:
    """The name ``rlpipe eval`` and the report give an evaluated policy: a value run's ``value-network`` v0 is
    ``uniform random`` (it plays no network); any other keeps its own."""
    return version_zero(kind) if kind == "value-network" and policy == "value-network" and version == 0 else policy


def episode_reward(metrics: Mapping[str, float]) -> float | None:
    """The mean episode return a version or checkpoint reports: ``reward_mean`` (a LoRA learner's sampled
    trajectories) or ``episode_return_mean`` (a value learner's actors)."""
    for name in ("reward_mean", "episode_return_mean"):
        if name in metrics:
            return float(metrics[name])
    return None


@dataclass
class RunSummary:
    """One run at a glance (``rlpipe runs list|show``)."""

    run_id: str
    status: str
    env: str | None = None
    base_model: str | None = None
    steps: int = 0
    max_steps: int | None = None
    versions: int = 0
    last_reward: float | None = None
    last_activity: datetime | None = None
    stop_reason: str | None = None
    notes: list[str] = field(default_factory=list)
    kind: str = "lora"  # what its versions are: "lora" adapters, or a value run's "value-network"
    # its run.json (or newest recorded change), an adapter manifest or its membership record could not be read:
    # the first note says why
    unreadable: bool = False


def stored_run_config(store: ObjectStore, run_id: str) -> dict[str, Any] | None:
    """The run's configuration now (``run.json`` with its newest recorded change, e.g. a resume's ``max_steps``)
    as a dict; None when it has no ``run.json`` (e.g. demonstrations recorded under a name); ``ValueError``
    naming the file when it is not a JSON object."""
    from pipeline.runtime import effective_run_config

    if not store.exists(f"runs/{validate_name(run_id, 'run_id')}/run.json"):
        return None
    return effective_run_config(store, run_id)


class NoRunConfigError(ValueError):
    """A run named for its configuration has none; ``listed``: whether the store has the run at all."""

    def __init__(self, message: str, listed: bool) -> None:
        super().__init__(message)
        self.listed = listed


def required_run_config(store: ObjectStore, run_id: str) -> dict[str, Any]:
    """``stored_run_config``, or ``NoRunConfigError`` saying why there is none: a run the store lists without a
    ``run.json`` (a command that starts no run, such as envs record, wrote it), or no such run (naming the runs
    there).  The caller adds what to do instead."""
    data = stored_run_config(store, run_id)
    if data is not None:
        return data
    listed = list_runs(store)
    if run_id in listed:
        raise NoRunConfigError(f"run {run_id!r} in {store.root} has no run.json (a command that starts no run, "
                               "such as envs record, wrote it)", listed=True)
    raise NoRunConfigError(f"no run {run_id!r} in {store.root} ({_runs_listed(listed)})", listed=False)


def refuse_training_run(store: ObjectStore, run_id: str, fix: str) -> None:
    """``ValueError`` when ``run_id`` is a training run (it has a ``run.json``), for a command writing batches of
    its own: its producers would announce them to its learner, and its data would mix with theirs.  ``fix``:
    what to do instead."""
    if store.exists(f"runs/{validate_name(run_id, 'run_id')}/run.json"):
        raise ValueError(f"run {run_id} is a training run (it has a run.json); {fix}")


def run_exists(store: ObjectStore, run_id: str) -> bool:
    """True when anything of the run is in the store."""
    return AdapterRegistry(store, run_id).run_exists()


def read_evals(store: ObjectStore, run_id: str) -> tuple[list[EvalResult], list[ValueError | FileNotFoundError]]:
    """Every readable ``runs/<run>/eval/*.json`` (``rlpipe eval``'s stored results), and why each other one could
    not be read (``read_json_records``: each error names its key)."""
    return read_json_records(store, eval_prefix(run_id), lambda data, key: eval_from_bytes(data, where=key))


def learner_step(store: ObjectStore, run_id: str) -> int:
    """The step of the run's newest complete learner checkpoint (0 before the first one)."""
    folders = complete_folders(store.list(checkpoint_prefix(validate_name(run_id, "run_id")), recursive=True))
    return folders[0].step if folders else 0


def read_activity(bus_config: BusConfig, timeout_s: float, run_id: str | None = None) -> dict[str, RunActivity]:
    """Per run, what ``<ns>.control`` says (every run, or only ``run_id``); ``BusError`` if it cannot be read."""
    servers = resolve_bootstrap_servers(bus_config)
    bounded = bus_config.model_copy(
        update={"bootstrap_servers": servers, "connect_timeout_s": min(bus_config.connect_timeout_s, timeout_s)}
    )
    activity: dict[str, RunActivity] = {}
    for record in tail(bounded, "control", n=MAX_CONTROL_EVENTS, run_id=run_id, read_timeout_s=timeout_s):
        if record.event is not None:
            activity.setdefault(record.event.run_id, RunActivity()).add(
                record.event.time.timestamp(), record.event.payload
            )
    return activity


def activity_or_note(
    bus_config: BusConfig | None, timeout_s: float, run_id: str | None = None
) -> tuple[dict[str, RunActivity] | None, str | None]:
    """``read_activity``, or (None, why) when the log is skipped or cannot be read in time."""
    if bus_config is None:
        return None, "event log not read (--no-bus): status from the store alone"
    try:
        return read_activity(bus_config, timeout_s, run_id), None
    except (BusError, ValueError, OSError) as exc:  # unreachable, no topic yet, no broker configured
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None, f"event log not read ({text}): status from the store alone"


def summarize(
    store: ObjectStore, run_id: str, activity: RunActivity | None, log_read: bool, now_s: float | None = None
) -> RunSummary:
    """Everything ``runs show`` prints about one run; an unreadable ``run.json`` is a note (the rest still shows)."""
    try:
        config, unreadable = stored_run_config(store, run_id) or {}, None
    except ValueError as exc:
        config, unreadable = {}, str(exc)  # names the file
    value = config.get("value")  # a value run: its budget and network are value.learner's, it has no base model
    learner = (value.get("learner") or {}) if value else config.get("learner") or {}
    manifests, unreadable_versions = read_manifests(store, run_id)
    steps = max([learner_step(store, run_id), *(m.learner_step for m in manifests[-1:])])
    rewards = [reward for m in manifests if (reward := episode_reward(m.metrics)) is not None]
    summary = RunSummary(
        run_id=run_id, status="unknown", env=(config.get("env") or {}).get("name"),
        base_model=f"{learner.get('agent')} value network" if value else (config.get("model") or {}).get("base_model"),
        steps=steps, max_steps=learner.get("max_steps"),
        versions=len(manifests) if unreadable_versions is None else len(AdapterRegistry(store, run_id).versions()),
        last_reward=rewards[-1] if rewards else None, kind=run_kind(config),
    )
    moments = [m.created_at.timestamp() for m in manifests[-1:]]
    activity, unreadable_record = with_recorded_membership(store, run_id, activity if log_read else None)
    if activity is not None:
        newest_version_step = manifests[-1].learner_step if manifests else -1
        if activity.last_reward is not None and (activity.last_step or 0) >= newest_version_step:
            summary.last_reward = activity.last_reward  # steps after the newest version (publish_every > 1)
        summary.steps = max(summary.steps, activity.last_step or 0)
        summary.stop_reason = activity.stop_reason
        moments += [activity.last_event_s] if activity.last_event_s is not None else []
    if moments:
        summary.last_activity = datetime.fromtimestamp(max(moments), tz=UTC)
    for why in (unreadable, unreadable_versions, unreadable_record):
        if why:
            summary.notes.append(why)
            summary.unreadable = True
    if not config and not unreadable:
        summary.env, note = origin_without_run_json(store, run_id)
        summary.notes.append(note)
    summary.status = run_status(summary, activity, log_read, now_s)
    session = training_client_session(run_id) if not config and not unreadable else None
    if session is not None:
        session_state = api_session_state(store, session, now_s)
        if session_state is not None:
            summary.status, reason = session_state
            summary.stop_reason = reason or summary.stop_reason
    return summary


def training_client_session(run_id: str) -> str | None:
    """The Tinker API session whose training client a run name is (``<session>.train.<n>``), else None."""
    session, _, number = run_id.partition(".train.")
    return session if session and number.isdigit() else None


def api_session_state(store: ObjectStore, session_id: str, now_s: float | None = None
                      ) -> tuple[str, str | None] | None:
    """A training client's status from its session's state (``stored_session_state``, the one ``rlpipe sessions``
    shows): (``ended``, why) once the session ended (finished, ended by an operator, or a day without a heartbeat),
    (``idle``, None) while it has lapsed, (``running``, None) while it lives; None when the store holds no such
    session."""
    found = stored_session_state(store, session_id, now_s)
    if found is None:
        return None
    state, end = found
    return {"ended": "ended", "lapsed": "idle", "live": "running"}[state], end


def stored_session_state(store: ObjectStore, session_id: str, now_s: float | None = None
                         ) -> tuple[str, str | None] | None:
    """The session's state as ``pipeline.api.lifecycle.session_state`` says it (``live``, ``lapsed`` or ``ended``,
    and why it ended); None when the store holds no such session."""
    from pipeline.api.lifecycle import session_state
    from schemas.api import session_path

    try:
        if not store.exists(f"{session_path(session_id)}/session.json"):
            return None
    except ValueError:  # not a name a session can have: no session's client
        return None
    return session_state(store, session_id, now_s)


def with_recorded_membership(store: ObjectStore, run_id: str,
                             activity: RunActivity | None) -> tuple[RunActivity | None, str | None]:
    """``activity`` (a copy) with the run's recorded start or stop added (``RunActivity.add_recorded``), and a note
    when the record cannot be read; ``activity`` itself when the run has no record."""
    from pipeline.membership import recorded_membership

    try:
        event = recorded_membership(store, run_id)
    except ValueError as exc:  # names the file
        merged = replace(activity) if activity is not None else RunActivity()
        merged.add_recorded(None, RunStopped(reason="membership record unreadable"))
        return merged, (f"{exc}; packed processes starting take the run as stopped: write it again with "
                        f"`rlpipe runs resume --run {run_id}` or `rlpipe runs stop --run {run_id}`")
    if event is None:
        return activity, None
    merged = replace(activity) if activity is not None else RunActivity()
    merged.add_recorded(event.time.timestamp(), event.payload)
    return merged, None


def read_manifests(store: ObjectStore, run_id: str) -> tuple[list[AdapterManifest], str | None]:
    """The run's adapter manifests, oldest first; ([], why) when one cannot be read (damaged, or written by a
    newer rlpipe): the message names its file, and the run is still listed from the rest of the store."""
    try:
        return AdapterRegistry(store, run_id).list(), None
    except ValueError as exc:  # ManifestError, SchemaVersionError
        return [], f"adapter versions unreadable, last reward not shown: {exc}"


def origin_without_run_json(store: ObjectStore, run_id: str) -> tuple[str | None, str]:
    """What wrote a run folder that has no ``run.json`` (as its listing's environment, in brackets) and a note."""
    session = training_client_session(run_id)
    if session is not None:
        return ("(Tinker API)", f"no run.json: the weights of a training client of Tinker API session {session}; "
                                f"see rlpipe sessions show {session}")
    datasets = sorted(key.rsplit("/", 1)[-1].removesuffix(".json") for key in store.list(f"runs/{run_id}/offline")
                      if key.endswith(".json"))
    if datasets:
        return ("(dataset)", f"no run.json: dataset {', '.join(datasets)} converted by rlpipe datasets "
                             f"to-trajectories; train a run from it with rlpipe replay --run {run_id} --train --preset "
                             f"building-hvac --set run_id={run_id}-awr (docs/offline.md)")
    return None, "no run.json: written by a command that does not start a run (e.g. envs record)"


def run_status(summary: RunSummary, activity: RunActivity | None, log_read: bool, now_s: float | None = None) -> str:
    """running (recent events, no stop after them) > finished (max_steps reached) > stopped > idle > unknown.

    Producer heartbeats within ``LEAVING_WITHIN_S`` after a stop are its producers letting the run go, not a
    restart, and what its learner reports after a stop is its wind-down until a newer ``RunStarted``
    (``RunActivity.stopped_last``).  Without the log (``activity`` then holds only the run's recorded start or
    stop) nothing is recent.
    """
    now_s = time.time() if now_s is None else now_s
    recent = (log_read and activity is not None and activity.last_event_s is not None
              and now_s - activity.last_event_s < ACTIVE_WITHIN_S)
    stopped_last = activity is not None and activity.stopped_last()
    if recent and not stopped_last:
        return "running"
    if summary.max_steps is not None and summary.steps >= summary.max_steps:
        return "finished"
    if stopped_last:
        return "stopped"
    return "idle" if log_read else "unknown"


def list_runs(store: ObjectStore) -> list[str]:
    """Every run with a folder in the store, sorted; entries whose names no run can have (``.DS_Store``, a
    folder with a space) are not runs and are left out."""
    return sorted(name for name in run_ids(store) if _is_run_id(name))


def _is_run_id(name: str) -> bool:
    try:
        validate_name(name, "run_id")
    except ValueError:
        return False
    return True


def runs_there(store: ObjectStore) -> str:
    """For an error about a run the store lacks: the runs it does have (the first ten)."""
    return _runs_listed(list_runs(store))


def _runs_listed(known: list[str]) -> str:
    return f"runs there: {', '.join(known[:10])}" if known else "there are no runs there"


# ---- delete ---------------------------------------------------------------------------------


@dataclass
class DeletePlan:
    """What deleting one run removes: store objects and local folders."""

    run_id: str
    store_prefix: str
    store_keys: list[str]
    local_paths: list[Path]


def plan_delete(store: ObjectStore, run_id: str, home: Path) -> DeletePlan:
    """Every object and local folder that belongs to ``run_id`` and to no other run."""
    run_id = validate_name(run_id, "run_id")
    prefix = f"runs/{run_id}"
    keys = store.list(prefix, recursive=True)
    strays = [key for key in keys if not key.startswith(f"{prefix}/")]
    if strays:  # a store listing that matched by prefix: never delete another run's objects
        raise RuntimeError(f"listing {prefix}/ returned {strays[0]!r}, outside the run; nothing was deleted")
    return DeletePlan(run_id, prefix, keys, local_run_paths(home, run_id))


def local_run_paths(home: Path, run_id: str) -> list[Path]:
    """The run's folders under ``home``: the launcher's, and each consumer's cached adapters of it."""
    candidates = [home / "runs" / run_id, home / "cache" / "adapters" / run_id]
    cache = home / "adapter-cache"
    if cache.is_dir():
        candidates += [consumer / run_id for consumer in sorted(cache.iterdir()) if consumer.is_dir()]
    return [path for path in candidates if path.is_dir() and not path.is_symlink()]


def delete_run(store: ObjectStore, plan: DeletePlan) -> None:
    """Remove what ``plan`` lists: each object by its key, then the emptied folders."""
    for key in plan.store_keys:
        store.delete(key, missing_ok=True)
    if store.is_local:
        store.delete(plan.store_prefix, recursive=True, missing_ok=True)  # only empty folders are left
    for path in plan.local_paths:
        shutil.rmtree(path)
        if path.parent.parent.name == "adapter-cache":  # a consumer's cache folder left empty goes too
            with contextlib.suppress(OSError):  # not empty: other runs' adapters
                path.parent.rmdir()
