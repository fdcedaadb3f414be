"""Adapter hot-loading on the producer: follow new versions, pull, verify, switch.

The watcher learns of new versions from ``AdapterPublished`` events (prompt)
and from the registry itself every ``registry_poll_s`` (a fallback that also
covers events published before the producer started).  A new version is pulled
into the local cache (the registry verifies every digest and refuses a tampered
file), then handed to the sampler under a NEW integer id and name: vLLM may serve
a stale cache when a name is reused.  Groups already running keep their
adapter; the sampler keeps at most ``max_loaded`` versions.  Versions only go
forward: the newest announced is the one loaded, never an older one announced late.

A version that does not load leaves the producer sampling the last good one,
with one warning line: a pull that fails (a file missing or not matching its
digest) or a load that fails for a passing reason (the sampler short of memory, a
cached file gone) is tried again after ``LOAD_RETRY_S``; a version it can never
serve (not a LoRA adapter, trained on another base model, weights the sampler
refuses: a ``ValueError``) is not.

The cache is the producer's own folder (``$RLPIPE_HOME/adapter-cache/<producer_id>``):
a version evicted from the sampler is deleted from it once no running group
samples with it any more (``in_use``: the sampler reloads an evicted adapter
from its folder when such a group generates again, and is told to unload it
again then), ``close`` removes the run's versions at exit (and the folder once
empty: packed runs with one configured producer id share it), and
``sweep_dead_process_caches`` removes, at start, the folders that producers of
this host left behind when they were killed (the default producer id is
``<host>_<pid>``, so a dead pid names a folder nobody will use).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Protocol

from pipeline.io.bus import EventFollower
from pipeline.io.registry import AdapterRegistry, RegistryError
from pipeline.models import serves_base_model
from producers.samplers.base import AdapterHandle, Sampler
from schemas.config import BusConfig
from schemas.events import AdapterPublished

log = logging.getLogger("rlpipe.producer")


class AdapterEvents(Protocol):
    """Something that yields newly published versions without blocking (e.g. a Kafka consumer)."""

    def poll_versions(self) -> list[int]: ...


class KafkaAdapterEvents:
    """``AdapterPublished`` versions of one run from ``<ns>.adapters``, read without a consumer group.

    Why no group: a producer needs each version announced while it runs, and
    nothing from before (its watcher reads the registry first, and every
    ``registry_poll_s`` after), so no offset has to outlive the process; and every
    producer must see every event, which is what a group-less reader gives.  A
    group member, by contrast, reads nothing until it has joined, and kafka-python
    completes a join only inside a poll that waits: the rollout loop stalled 15 s
    at start and again every 75 s on the local broker, where a join with default
    timings took about 23 s.  The ``EventFollower`` is placed at the end of the
    topic during set-up, before the watcher's first registry read, so no version
    falls between the two, and ``poll_versions`` never waits.
    """

    def __init__(self, follower: EventFollower) -> None:
        self.follower = follower

    @classmethod
    def open(cls, bus: BusConfig, run_id: str) -> KafkaAdapterEvents:
        """Follow ``run_id``'s events on the adapters topic from its current end."""
        return cls(EventFollower(bus, "adapters", run_id=run_id, start="latest"))

    def poll_versions(self) -> list[int]:
        events = self.follower.poll(0.0)
        return [e.event.payload.version for e in events if isinstance(e.event.payload, AdapterPublished)]

    def close(self) -> None:
        self.follower.close()


LOAD_RETRY_S = 10.0  # a version whose pull or load failed for a passing reason is tried again after this


class RefusedVersion(ValueError):
    """A committed version this producer cannot serve (another artifact kind, another base model)."""


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
        base_models: Collection[str] | None = None,
    ) -> None:
        """``base_models``: what a manifest may name as its base model for this producer to serve it (the
        learner records ``model.base_model``, or the tiny model's folder: any folder of the same build fits,
        ``serves_base_model``); None serves any base model."""
        self.base_models = None if base_models is None else frozenset(base_models)
        self.registry, self.sampler, self.cache_dir = registry, sampler, Path(cache_dir)
        self.max_loaded, self.events, self.registry_poll_s = max_loaded, events, registry_poll_s
        self.loaded: list[AdapterHandle] = []
        self.newest_seen = 0
        self.last_registry_poll = float("-inf")
        self.ids = itertools.count(1)  # lora_int_id: positive, never reused in this process
        self.load_failures = 0
        self.failed_at: dict[int, float] = {}  # version -> when its last load failed (inf: never retried)
        self.in_use: Callable[[], set[int]] = set  # versions running groups sample with (the producer sets it)
        self.retired: list[AdapterHandle] = []  # evicted from the sampler; folder deleted once not in use

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
            # a listing at the first poll, then a probe of the next number (a manifest that does not read fails
            # its load instead)
            self.newest_seen = max(self.newest_seen, self.registry.newest_from(self.newest_seen))
        current = self.current()
        retry_at = self.failed_at.get(self.newest_seen, float("-inf")) + LOAD_RETRY_S
        if self.newest_seen > (current.version if current else 0) and now >= retry_at:
            self.load(self.newest_seen)
        if self.retired:
            self.delete_retired()

    def load(self, version: int) -> AdapterHandle | None:
        """Pull, verify and load ``version``; on failure keep serving the current one (and say so in one line).

        A pull that fails (a file missing or damaged, the store unreachable) or a load that fails for a passing
        reason (``OSError``, ``RuntimeError``: out of memory) is tried again after ``LOAD_RETRY_S``; a version
        this producer can never serve (another artifact kind, another base model, weights the sampler refuses
        with a ``ValueError``) is not tried again.
        """
        try:
            self.check_servable(version)
            folder = self.registry.pull(version, self.cache_dir)  # check_servable read its kind
            sha = self.registry.adapter_sha256(version)
        except RefusedVersion as exc:
            return self.failed(version, "refused", str(exc), retry=False)
        except (OSError, ValueError, LookupError, RegistryError) as exc:
            return self.failed(version, "could not pull", str(exc), retry=True)
        lora_id = next(self.ids)
        handle = AdapterHandle(version=version, lora_int_id=lora_id, name=f"v{version}-id{lora_id}",
                               path=str(folder), sha256=sha)
        try:
            self.sampler.load_adapter(handle)
        except (OSError, ValueError, RuntimeError) as exc:
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                self.sampler.unload_adapter(handle)  # whatever part of it the sampler took
            shutil.rmtree(folder, ignore_errors=True)
            if isinstance(exc, ValueError):  # vLLM's and peft's refusals of the weights: for good
                return self.failed(version, "the sampler refused", str(exc), retry=False)
            # short of memory, a file gone from the cache: pulled and loaded again after LOAD_RETRY_S
            return self.failed(version, "the sampler could not load", str(exc), retry=True)
        self.loaded.append(handle)
        self.forget_failures_below(version + 1)
        log.info("serving adapter v%d (%s, sha256 %s...)", version, handle.name, sha[:12])
        while len(self.loaded) > self.max_loaded:
            evicted = self.loaded.pop(0)
            self.sampler.unload_adapter(evicted)
            self.retired.append(evicted)
        return handle

    def check_servable(self, version: int) -> None:
        """Refuse (``RefusedVersion``) a version that is not a LoRA adapter of this producer's base model."""
        manifest = self.registry.show(version)
        if manifest.kind != "lora":
            raise RefusedVersion(f"it is a {manifest.kind}, not a LoRA adapter; point the producer at a run "
                                 "that publishes adapters")
        if self.base_models is not None and not serves_base_model(manifest.base_model, self.base_models):
            raise RefusedVersion(
                f"it was trained on {manifest.base_model}, not on this producer's base model "
                f"({' / '.join(sorted(self.base_models))}); give the producer and the learner one model.base_model"
            )

    def failed(self, version: int, what: str, reason: str, retry: bool) -> None:
        """Count and log (one line) a version that did not load; it is tried again after ``LOAD_RETRY_S`` when
        ``retry``, else never."""
        self.load_failures += 1
        self.forget_failures_below(version)
        self.failed_at[version] = time.monotonic() if retry else float("inf")
        first_line = reason.strip().splitlines()[0] if reason.strip() else "no reason given"
        current = self.current()
        log.warning("%s adapter v%d of run %s (keeping v%d): %s", what, version, self.registry.run_id,
                    current.version if current else 0, first_line)
        return None

    def forget_failures_below(self, version: int) -> None:
        """Drop the failures of versions below ``version``: versions only go forward, so none of them is tried
        again, and a producer told of every version of a long run it cannot serve keeps one entry, not one each."""
        for old in [v for v in self.failed_at if v < version]:
            del self.failed_at[old]

    def delete_retired(self) -> None:
        """Unload and delete the cached folders of evicted versions that no loaded handle and no running group uses.

        Unloaded again: a running group's turn after the eviction made the sampler load the version back.
        """
        busy = self.in_use() | {h.version for h in self.loaded}
        for handle in [h for h in self.retired if h.version not in busy]:
            self.sampler.unload_adapter(handle)  # a no-op when nothing loaded it back
            shutil.rmtree(handle.path, ignore_errors=True)
            self.retired.remove(handle)

    def unload_all(self) -> None:
        """Unload every version this watcher gave the sampler (loaded, and evicted ones a running group may have
        loaded back), for a run leaving an engine that serves on for other runs (``producers.packed``)."""
        for handle in self.retired + self.loaded:
            self.sampler.unload_adapter(handle)  # a no-op for a version not loaded
        self.retired, self.loaded = [], []

    def close(self) -> None:
        """Delete this run's versions from the cache, and the cache folder once no other run's are in it (packed
        runs with one configured producer id share it); call after the sampler is closed or the run left it."""
        shutil.rmtree(self.cache_dir / self.registry.run_id, ignore_errors=True)
        with contextlib.suppress(OSError):  # another run's versions are still there, or it is gone already
            self.cache_dir.rmdir()


def sweep_dead_process_caches(cache_root: str | Path, host: str) -> list[Path]:
    """Delete the cache folders ``<host>_<pid>`` (and a packed producer's ``<host>_<pid>-<run>``) under
    ``cache_root`` whose process is gone; return them.

    Only this host's folders are touched (a pid means nothing on another machine): ``host`` holds no ``_``
    (``producers.service.host_name``), so the first ``_`` ends it and host ``node`` never takes host ``node-7``'s
    folders for its own.  Only names of the default producer-id shape are touched: a configured producer id
    (a Kubernetes replica's) is reused by its restart, which then reuses the cache.
    """
    if "_" in host:
        raise ValueError(f"host {host!r} holds '_', which ends the host in a cache folder's name; replace it by '-'")
    shape = re.compile(rf"{re.escape(host)}_(?P<pid>[0-9]+)(-.+)?")
    removed = []
    root = Path(cache_root)
    if not root.is_dir():
        return removed
    for folder in sorted(root.iterdir()):
        match = shape.fullmatch(folder.name)
        if match is not None and not _process_alive(int(match["pid"])):
            shutil.rmtree(folder, ignore_errors=True)
            log.info("removed the adapter cache of dead producer process %s", folder.name)
            removed.append(folder)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True
