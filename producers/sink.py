"""Where finished rollouts go: the store first (create-only Parquet), then the event.

Because the file is durable before its event exists, a crash can leave a file
without an event but never an event without a file.  ``announce_orphans`` closes
that gap on start: batches of the run that are in the store but were never
announced on ``<ns>.trajectories`` are announced then (the learner trains each
``batch_id`` once, so announcing twice is harmless).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from pipeline.io.archive import BatchInfo, TrajectoryArchive, batch_committed_payload
from schemas.events import Payload, TrajectoryBatchCommitted

log = logging.getLogger("rlpipe.producer")


class StoreThenEventSink:
    """Commits a batch: Parquet to the archive (create-only), then ``TrajectoryBatchCommitted``."""

    def __init__(
        self,
        archive: TrajectoryArchive,
        run_id: str,
        env_name: str,
        producer_id: str,
        announce: Callable[[Payload], Any],
    ) -> None:
        self.archive, self.run_id, self.env_name, self.producer_id = archive, run_id, env_name, producer_id
        self.announce = announce
        self.committed: list[BatchInfo] = []

    def commit(self, rows: list[dict[str, Any]], batch_id: str) -> BatchInfo:
        info = self.archive.write_batch(self.run_id, rows, batch_id=batch_id)
        self.announce(batch_committed_payload(info, env=self.env_name, producer_id=self.producer_id))
        self.committed.append(info)
        return info


def announce_orphans(
    archive: TrajectoryArchive,
    run_id: str,
    announced_batch_ids: Iterable[str],
    announce: Callable[[Payload], Any],
    min_age_s: float = 0.0,
) -> list[str]:
    """Announce every stored batch of ``run_id`` that no event names; return their batch ids.

    ``min_age_s`` leaves alone files younger than that, which a live producer may
    be about to announce itself.
    """
    known = set(announced_batch_ids)
    orphans = []
    for key in archive.list_batches(run_id):
        batch_id = key.rsplit("/", 1)[-1].removesuffix(".parquet")
        if batch_id in known:
            continue
        if min_age_s and _age_s(archive, key) < min_age_s:
            continue
        info = archive.describe_batch(key, run_id)
        payload = batch_committed_payload(info)
        announce(payload)
        orphans.append(batch_id)
        log.warning("announced orphaned batch %s (stored but never announced)", batch_id)
    return orphans


def _age_s(archive: TrajectoryArchive, key: str) -> float:
    try:
        modified = archive.store.filesystem.modified(archive.store.path(key))
        return time.time() - modified.timestamp()
    except (NotImplementedError, OSError, AttributeError):
        return float("inf")


def announced_batches(events: Iterable[Any]) -> set[str]:
    """batch ids named by ``TrajectoryBatchCommitted`` events (tail records or envelopes)."""
    ids = set()
    for item in events:
        event = getattr(item, "event", item)
        if event is not None and isinstance(getattr(event, "payload", None), TrajectoryBatchCommitted):
            ids.add(event.payload.batch_id)
    return ids
