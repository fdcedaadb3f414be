"""What every long-running rlpipe process sets up the same way.

Resolving where the broker and the store are (configuration first, then the
embedded stack from ``rlpipe up``), routing each event type to its topic,
creating a run (``run.json`` create-only, then ``RunStarted``; a restart may
change only the fields that keep stored data meaningful, each change recorded
and announced as ``RunConfigChanged``), and turning
SIGTERM/SIGINT into a stop flag that the loops check between phases.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.config import config_to_json
from pipeline.devstack.stack import read_stack_state, resolve_bootstrap_servers, resolve_store_root
from pipeline.io.bus import EventPublisher
from pipeline.io.registry import run_ids
from pipeline.io.store import ObjectStore, sha256_hex
from schemas.config import BusConfig, RunConfig, StoreConfig
from schemas.events import (
    AdapterPublished,
    ConfigFieldChange,
    DeadLetter,
    Envelope,
    Payload,
    RunConfigChanged,
    RunStarted,
    TrajectoryBatchCommitted,
    make_event,
)
from schemas.names import case_twin_of

log = logging.getLogger("rlpipe")

_TOPIC_OF: dict[type[Payload], str] = {
    TrajectoryBatchCommitted: "trajectories",
    AdapterPublished: "adapters",
    DeadLetter: "dlq",
}


def topic_kind_of(payload: Payload) -> str:
    """The topic kind an event type travels on (control for the rest)."""
    return _TOPIC_OF.get(type(payload), "control")


def resolved_bus(bus: BusConfig) -> BusConfig:
    """``bus`` with ``bootstrap_servers`` filled in from the embedded stack when empty."""
    return bus.model_copy(update={"bootstrap_servers": resolve_bootstrap_servers(bus)})


def resolved_store_config(store: StoreConfig) -> StoreConfig:
    """``store`` with ``root`` filled in from the embedded stack (or the local default) when empty."""
    if store.root:
        return store
    update: dict[str, Any] = {"root": resolve_store_root(None)}
    state = read_stack_state()
    if state is not None and store.gcs_endpoint is None and update["root"].startswith("gs://"):
        update["gcs_endpoint"] = state.gcs_endpoint
    return store.model_copy(update=update)


def open_store(store: StoreConfig) -> ObjectStore:
    """The object store the configuration (or the embedded stack) names."""
    return ObjectStore.from_config(resolved_store_config(store))


class Announcer:
    """Publishes payloads of one run, each to its topic; thread-safe (the publisher is)."""

    def __init__(self, publisher: EventPublisher, run_id: str) -> None:
        self.publisher, self.run_id = publisher, run_id

    def __call__(self, payload: Payload) -> tuple[int, int]:
        return self.publish(self.envelope(payload))

    def envelope(self, payload: Payload) -> Envelope:
        """``payload`` as one event of this run (``make_event``: a fresh ``event_id``, or the one a version, a
        checkpoint or a record's dead letter always has), to ``publish`` as often as it is tried."""
        return make_event(self.run_id, payload)

    def publish(self, envelope: Envelope) -> tuple[int, int]:
        """Publish an event made by ``envelope``, as it is: a try again sends the same ``event_id``."""
        return self.publisher.publish(topic_kind_of(envelope.payload), envelope)


def announcing_once(announce: Callable[[Payload], Any], payload: Payload) -> Callable[[], Any]:
    """A call that announces ``payload`` as one event however often it is made (each try of a write the broker
    refuses): with an ``Announcer`` its envelope is made once, here, so a try the broker wrote without acknowledging
    it and the try after it carry one ``event_id``, and readers that dedupe by it (reports) count it once.  Any
    other callable (a test's list) is called with the payload."""
    if isinstance(announce, Announcer):
        envelope = announce.envelope(payload)
        return lambda: announce.publish(envelope)
    return lambda: announce(payload)


# Fields that define what a run's stored data means: trajectories were sampled from this base model in this
# environment, checkpoints hold LoRA tensors of this shape trained with this loss.  Changing one on a restart
# would mix incompatible data under one run id, so it is refused.
RUN_DEFINING_FIELDS = (
    "model.base_model", "env.name", "env.overrides", "learner.loss",
    "learner.lora_rank", "learner.lora_alpha", "learner.target_modules",
    # a value run's checkpoints hold its network's tensors, its replay memory is rebuilt from the step log at its
    # capacity and n-step, and an offline run's network learnt one dataset's scaled observations
    "value.observation_size", "value.num_actions", "value.slate", "value.learner.agent", "value.learner.hidden_sizes",
    "value.learner.num_atoms", "value.learner.n_step", "value.learner.replay_capacity", "value.offline.dataset",
)
# Where the run's parts connect, not what the run is: never compared.
_PLACEMENT_PREFIXES = ("bus.", "store.", "model.tiny_dir")
_PLACEMENT_SUFFIXES = ("health_port",)


class RunConfigConflictError(ValueError):
    """A restart asked to change a field that defines the run's stored data."""


class RunIdCaseError(ValueError):
    """A run id differs only in case from a run in the store, and is not itself there."""


def case_twin(store: ObjectStore, run_id: str) -> str | None:
    """The run in the store whose id differs from ``run_id`` only in case, when ``run_id`` itself is not listed
    there; else None.  On a case-insensitive filesystem (macOS, Windows) ``runs/<run_id>`` is the twin's folder,
    so every lookup of ``run_id`` finds the twin's files: only the listed ids tell the two apart."""
    return case_twin_of(run_id, run_ids(store))


def refuse_case_twin(store: ObjectStore, run_id: str, flag: str = "--run ") -> None:
    """Raise ``RunIdCaseError`` when ``run_id`` is not in the store but a run differing from it only in case is.

    Every command that names an existing run, to read it or to write into it, asks this before it touches the
    store: on a case-insensitive filesystem it would read the twin's files as this run's, or write into the twin's
    folder.  ``flag``: how the command names the run (``--run ``, ``--resume ``), for the fix the error names.
    A command creating a run asks ``refuse_new_run_case_twin`` instead.
    """
    twin = case_twin(store, run_id)
    if twin is not None:
        raise RunIdCaseError(f"run {run_id!r} is not in {store.root}, but run {twin!r} is: run ids are "
                             f"case-sensitive; name it {flag}{twin}")


def new_run_note(store: ObjectStore, run_id: str) -> str | None:
    """For a process started on a run (``learner start``, ``producer start``): one line saying that ``run_id`` is
    not in the store and starts as a new run, naming a stored run whose id is close to it (a typo starts a new
    run as readily as a new name does); None when the run is stored."""
    stored = sorted(run_ids(store))
    if run_id in stored:
        return None
    close = difflib.get_close_matches(run_id, stored, n=1, cutoff=0.8)
    hint = f"; did you mean {close[0]}?" if close else " (rlpipe runs list shows the stored runs)"
    return f"run {run_id} is not in {store.root}; it starts as a new run{hint}"


def refuse_new_run_case_twin(store: ObjectStore, run_id: str) -> None:
    """Raise ``RunIdCaseError`` when ``run_id``, a run being created (or filled by a command of its own), is not
    in the store but a run differing from it only in case is.

    The fix is another name, not the twin's: the twin is an unrelated run, which a new run of its name would
    be refused as existing, or write into.
    """
    twin = case_twin(store, run_id)
    if twin is not None:
        raise RunIdCaseError(f"run {run_id!r} differs only in case from the run {twin!r} in {store.root}; "
                             "on a case-insensitive filesystem (macOS, Windows) the two would share their files: "
                             "name the run otherwise")


def create_run(store: ObjectStore, config: RunConfig, base_model: str) -> tuple[str, str, Payload | None]:
    """Write ``runs/<run_id>/run.json`` create-only; return (key, sha256, the event to announce or None).

    A new run gives ``RunStarted``.  An existing run is compared with its
    effective configuration (``run.json`` plus the recorded changes): a change of
    a ``RUN_DEFINING_FIELDS`` field raises ``RunConfigConflictError``; other
    changes (learning rate, ``max_steps``, producer count, ...) are recorded
    create-only under ``runs/<run_id>/config-changes/`` and give
    ``RunConfigChanged``; no change gives None.  Secrets are never written: the
    stored config shows them as ``***``.  A new run whose id differs only in case from a run in the store raises
    ``RunIdCaseError``: on a case-insensitive filesystem the two would share one folder.
    """
    key = f"runs/{config.run_id}/run.json"
    # before the run's own run.json is looked for: on a case-insensitive filesystem it exists for a twin's
    refuse_new_run_case_twin(store, config.run_id)
    if store.exists(key):
        return record_config_change(store, config)
    data = config_to_json(config).encode()
    try:
        # once: absent a moment ago, so the same bytes there are this create's (a gs:// retry whose first
        # attempt landed reports a conflict), or an identical create's at the same moment: the same run
        digest = store.put_create_once(key, data)
    except FileExistsError:
        return record_config_change(store, config)
    return key, digest, RunStarted(config_path=key, config_sha256=digest, env=config.env.name, base_model=base_model)


def started_again(store: ObjectStore, run_id: str) -> RunStarted:
    """``RunStarted`` of an existing run (``rlpipe runs resume``), naming its effective configuration's file;
    ``FileNotFoundError`` without ``run.json``, ``ValueError`` naming the file when it cannot be read."""
    key = _latest_key(store, run_id, _change_keys(store, run_id))
    config = effective_run_config(store, run_id)
    env, model = config.get("env"), config.get("model")
    if not (isinstance(env, dict) and isinstance(env.get("name"), str)
            and isinstance(model, dict) and isinstance(model.get("base_model"), str)):
        raise ValueError(f"{key} unreadable: no env.name or model.base_model")
    return RunStarted(config_path=key, config_sha256=sha256_hex(store.get(key)), env=env["name"],
                      base_model=model["base_model"])


def effective_run_config(store: ObjectStore, run_id: str) -> dict[str, Any]:
    """The run's configuration now: the newest recorded change, else ``run.json``.

    ``FileNotFoundError`` without ``run.json``; ``ValueError`` naming the file when it is not a JSON object.
    """
    return numbered_run_config(store, run_id)[1]


def numbered_run_config(store: ObjectStore, run_id: str) -> tuple[int, dict[str, Any]]:
    """(number, configuration): the run's configuration now (``effective_run_config``) and the number of the change
    it was read from (``change_number``), 0 for ``run.json``: one listing gives both, so the number is the read one's."""
    changes = _change_keys(store, run_id)
    if changes:
        return change_number(run_id, changes[-1]), recorded_change_config(store, changes[-1])
    return 0, _json_object(store, f"runs/{run_id}/run.json")


def newest_change_number(store: ObjectStore, run_id: str) -> int:
    """The number of the run's newest recorded change (``change_number``; 0 when none is, ``run.json`` then holds
    its configuration), from the listing of its changes alone: it names a change whose record cannot be read as
    well.  ``ValueError`` for a file there that is no change."""
    changes = _change_keys(store, run_id)
    return change_number(run_id, changes[-1]) if changes else 0


def change_number(run_id: str, key: str) -> int:
    """n, for run ``run_id``'s change recorded at ``key`` (``runs/<run_id>/config-changes/<n>.json``,
    ``record_config_change``): a later change has a higher one.  ``ValueError`` for a key that is no change of the
    run (another run's, or a file outside its changes)."""
    name = key.removeprefix(f"runs/{run_id}/config-changes/")
    if name == key or not re.fullmatch(r"[0-9]+\.json", name):
        raise ValueError(f"{key} is no configuration change of run {run_id} (those are "
                         f"runs/{run_id}/config-changes/<n>.json)")
    return int(name.removesuffix(".json"))


def recorded_change_config(store: ObjectStore, key: str, sha256: str | None = None) -> dict[str, Any]:
    """The configuration a change recorded at ``key`` (``record_config_change``; its ``RunConfigChanged`` names the
    key); with ``sha256`` (the announced one), only if the record still has it.  ``FileNotFoundError`` without
    the record, ``ChecksumError`` (a ``ValueError``) when it holds other bytes, ``ValueError`` naming the key
    when it is no change record."""
    record = _json_object(store, key, sha256)
    if not isinstance(record.get("config"), dict):
        raise ValueError(f"{key} unreadable: no configuration object under 'config'")
    return dict(record["config"])


def _json_object(store: ObjectStore, key: str, sha256: str | None = None) -> dict[str, Any]:
    """The JSON object stored at ``key``; ``ValueError`` naming the key for anything else."""
    try:
        data = json.loads(store.get(key, sha256))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{key} unreadable: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{key} unreadable: a JSON {type(data).__name__}, not an object")
    return data


def record_config_change(store: ObjectStore, config: RunConfig) -> tuple[str, str, RunConfigChanged | None]:
    """Compare ``config`` with the run's effective one; refuse, record or ignore the difference (see ``create_run``)."""
    wanted = json.loads(config_to_json(config))
    for _ in range(5):  # another process may record a change at the same moment: compare again with it
        changes = _change_keys(store, config.run_id)
        current = effective_run_config(store, config.run_id)
        differences = config_differences(current, wanted)
        check_run_definition(config.run_id, differences)
        if not differences:
            return _latest_key(store, config.run_id, changes), sha256_hex(json.dumps(current).encode()), None
        key = f"runs/{config.run_id}/config-changes/{len(changes) + 1:06d}.json"
        record = {"config": wanted, "changes": [change.model_dump(mode="json") for change in differences]}
        try:
            # once: as for run.json (absent from the listing a moment ago)
            digest = store.put_create_once(key, json.dumps(record, indent=2, sort_keys=True).encode())
        except FileExistsError:
            continue
        log.info("run %s: configuration changed (%s); recorded at %s", config.run_id,
                 ", ".join(change.field for change in differences), key)
        return key, digest, RunConfigChanged(config_path=key, config_sha256=digest, changes=differences)
    raise RuntimeError(f"run {config.run_id}: configuration changes kept racing with another process; try again")


def check_run_definition(run_id: str, differences: list[ConfigFieldChange]) -> None:
    """``RunConfigConflictError`` naming the first of ``differences`` (``config_differences``) that would change what
    the run's stored data means (``RUN_DEFINING_FIELDS``)."""
    refused = [change for change in differences if _defines_run(change.field)]
    if refused:
        first = refused[0]
        raise RunConfigConflictError(
            f"run {run_id} was created with {first.field}={json.dumps(first.before)}, this configuration "
            f"says {json.dumps(first.after)}: base model, environment, loss, LoRA shape and a value run's network, "
            "replay memory and dataset define the run's stored data; keep them or start a new run_id"
        )


def config_differences(before: dict[str, Any], after: dict[str, Any]) -> list[ConfigFieldChange]:
    """Fields (dotted paths) whose values differ, placement fields left out; a run-defining dict compares whole."""
    flat_before, flat_after = _flatten(before), _flatten(after)
    return [
        ConfigFieldChange(field=name, before=flat_before.get(name), after=flat_after.get(name))
        for name in sorted(flat_before.keys() | flat_after.keys())
        if flat_before.get(name) != flat_after.get(name) and not _is_placement(name)
    ]


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in data.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict) and path not in RUN_DEFINING_FIELDS:
            flat.update(_flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat


def _defines_run(field: str) -> bool:
    return field in RUN_DEFINING_FIELDS


def _is_placement(field: str) -> bool:
    return field.startswith(_PLACEMENT_PREFIXES) or field.endswith(_PLACEMENT_SUFFIXES)


def _change_keys(store: ObjectStore, run_id: str) -> list[str]:
    return [key for key in store.list(f"runs/{run_id}/config-changes") if key.endswith(".json")]


def _latest_key(store: ObjectStore, run_id: str, changes: list[str]) -> str:
    return changes[-1] if changes else f"runs/{run_id}/run.json"


class StopFlag:
    """Set by SIGTERM/SIGINT (or by code); loops check it between phases."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name: str | None = None
        self.run_stopped = False  # set by its run's RunStopped (``pipeline.run_stop.RunStopFollower``)

    def install(self) -> StopFlag:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is not None and self.event.is_set():  # a second signal: stop now (a flag its run's
            raise KeyboardInterrupt                                # RunStopped set is no first Ctrl-C)
        self.signal_name = signal.Signals(signum).name
        log.info("received %s: finishing cleanly (again to abort)", self.signal_name)
        self.event.set()

    def __call__(self) -> bool:
        return self.event.is_set()

    def set(self) -> None:
        self.event.set()


@dataclass
class RateMeter:
    """Counts since the last reading -> per-second rates (heartbeats, progress lines)."""

    clock: Callable[[], float]
    last_time: float = 0.0
    last_values: dict[str, float] | None = None

    def rates(self, values: dict[str, float]) -> tuple[dict[str, float], float]:
        now = self.clock()
        interval = now - self.last_time if self.last_values is not None else 0.0
        previous = self.last_values or values
        rates = {k: (v - previous.get(k, 0.0)) / interval if interval > 0 else 0.0 for k, v in values.items()}
        self.last_time, self.last_values = now, dict(values)
        return rates, interval
