"""Adapter hot-loading on the producer: follow new versions, pull, verify, switch.

The watcher learns of new versions from ``AdapterPublished`` events (prompt)
and from the registry itself every ``registry_poll_s`` (a fallback that also
covers events published before the producer started).  A new version is pulled
into the local cache (the registry verifies every digest and refuses a tampered
file), then handed to the sampler under a NEW integer id and name: vLLM may serve
a stale cache when a name is reused.  Groups already running keep their
adapter; the sampler keeps at most ``max_loaded`` versions.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Protocol

from pipeline.registry import AdapterRegistry
from producers.samplers.base import AdapterHandle, Sampler
from schemas.events import AdapterPublished

log = logging.getLogger("rlpipe.producer")


class AdapterEvents(Protocol):
    """Something that yields newly published versions without blocking (e.g. a Kafka consumer)."""

    def poll_versions(self) -> list[int]: ...


class KafkaAdapterEvents:
    """``AdapterPublished`` events of one run from ``<ns>.adapters`` (own group, newest only).

    Reads never block once the consumer owns its partitions.  Joining the group
    does: kafka-python 3.0 completes a join only inside a poll that is still
    waiting when the broker answers it (a zero-timeout poll starts the join over
    on every call, so it never joins and no event ever arrives).  So while the
    consumer owns nothing, it waits up to ``join_timeout_s`` for its assignment,
    at most once every ``join_retry_s`` (start-up, and after a rebalance).
    """

    def __init__(self, consumer: object, join_timeout_s: float = 15.0, join_retry_s: float = 60.0) -> None:
        self.consumer = consumer
        self.join_timeout_s, self.join_retry_s = join_timeout_s, join_retry_s
        self.next_join_at = float("-inf")

    def poll_versions(self) -> list[int]:
        if not self.consumer.assignment() and time.monotonic() >= self.next_join_at:  # type: ignore[attr-defined]
            self.consumer.wait_for_assignment(self.join_timeout_s)  # type: ignore[attr-defined]
            self.next_join_at = time.monotonic() + self.join_retry_s
        events = self.consumer.poll(0.0)  # type: ignore[attr-defined]
        if events:
            self.consumer.commit()  # type: ignore[attr-defined]
        return [e.event.payload.version for e in events if isinstance(e.event.payload, AdapterPublished)]


class AdapterWatcher:
    """Keeps the sampler on the newest verified adapter version (the producer's ``AdapterSource``)."""

    def __init__(
        self,
        registry: AdapterRegistry,
        sampler: Sampler,
        cache_dir: str | Path,
        max_loaded: int,
        events: AdapterEvents | None = None,
        registry_poll_s: float = 2.0,
    ) -> None:
        self.registry, self.sampler, self.cache_dir = registry, sampler, Path(cache_dir)
        self.max_loaded, self.events, self.registry_poll_s = max_loaded, events, registry_poll_s
        self.loaded: list[AdapterHandle] = []
        self.newest_seen = 0
        self.last_registry_poll = float("-inf")
        self.ids = itertools.count(1)  # lora_int_id: positive, never reused in this process
        self.load_failures = 0

    def current(self) -> AdapterHandle | None:
        return self.loaded[-1] if self.loaded else None

    def newest_published(self) -> int:
        return self.newest_seen

    def refresh(self) -> None:
        """Note newly announced versions; load the newest if it is newer than what is loaded."""
        if self.events is not None:
            for version in self.events.poll_versions():
                self.newest_seen = max(self.newest_seen, version)
        now = time.monotonic()
        if now - self.last_registry_poll >= self.registry_poll_s:
            self.last_registry_poll = now
            latest = self.registry.latest()
            if latest is not None:
                self.newest_seen = max(self.newest_seen, latest.version)
        current = self.current()
        if self.newest_seen > (current.version if current else 0):
            self.load(self.newest_seen)

    def load(self, version: int) -> AdapterHandle | None:
        """Pull, verify and load ``version``; on failure keep serving the current one (and say so)."""
        try:
            folder = self.registry.pull(version, self.cache_dir)
            sha = self.registry.adapter_sha256(version)
        except (OSError, ValueError, LookupError) as exc:
            self.load_failures += 1
            log.warning("could not pull adapter v%d (keeping v%s): %s", version,
                        self.current().version if self.current() else 0, exc)
            return None
        lora_id = next(self.ids)
        handle = AdapterHandle(version=version, lora_int_id=lora_id, name=f"v{version}-id{lora_id}",
                               path=str(folder), sha256=sha)
        self.sampler.load_adapter(handle)
        self.loaded.append(handle)
        log.info("serving adapter v%d (%s, sha256 %s...)", version, handle.name, sha[:12])
        while len(self.loaded) > self.max_loaded:
            self.sampler.unload_adapter(self.loaded.pop(0))
        return handle
