"""What every long-running rlpipe process sets up the same way.

Resolving where the broker and the store are (configuration first, then the
embedded stack from ``rlpipe up``), routing each event type to its topic,
creating a run (``run.json`` create-only, then ``RunStarted``), and turning
SIGTERM/SIGINT into a stop flag that the loops check between phases.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.bus import EventPublisher
from pipeline.config import config_to_json
from pipeline.stack import read_stack_state, resolve_bootstrap_servers, resolve_store_root
from pipeline.store import ObjectStore, sha256_hex
from schemas.config import BusConfig, RunConfig, StoreConfig
from schemas.events import (
    AdapterPublished,
    DeadLetter,
    Payload,
    RunStarted,
    TrajectoryBatchCommitted,
    make_event,
)

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
        return self.publisher.publish(topic_kind_of(payload), make_event(self.run_id, payload))


def create_run(store: ObjectStore, config: RunConfig, base_model: str) -> tuple[str, str, RunStarted | None]:
    """Write ``runs/<run_id>/run.json`` create-only; return (key, sha256, RunStarted or None if it existed).

    Secrets are never written: the stored config shows them as ``***``.  If the run
    exists with a different configuration the caller is told, not silently
    overwritten (the stored one stays authoritative).
    """
    key = f"runs/{config.run_id}/run.json"
    data = config_to_json(config).encode()
    try:
        digest = store.put_create(key, data)
    except FileExistsError:
        existing = store.get(key)
        if json.loads(existing) != json.loads(data):
            log.warning("run %s already exists with a different run.json; keeping the stored one", config.run_id)
        return key, sha256_hex(existing), None
    return key, digest, RunStarted(config_path=key, config_sha256=digest, env=config.env.name, base_model=base_model)


class StopFlag:
    """Set by SIGTERM/SIGINT (or by code); loops check it between phases."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name: str | None = None

    def install(self) -> StopFlag:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name
        if self.event.is_set():  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
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
