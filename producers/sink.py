"""Where finished rollouts go: the store first (create-only Parquet), then the event.

Because the file is durable before its event exists, a crash can leave a file
without an event but never an event without a file.  ``OrphanSweep`` closes that
gap when a producer starts: batches of the run that are in the store but were
never announced on ``<ns>.trajectories`` are announced (the learner trains each
``batch_id`` once, so announcing twice is harmless).  A file too young to judge
then (a live producer may be about to announce it) is judged again once it is
old enough, so a producer restarted at once still announces what it lost.
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
    keys: Iterable[str] | None = None,
    too_young: dict[str, float] | None = None,
    describe: Callable[[str], Payload | None] | None = None,
) -> list[str]:
    """Announce every stored batch of ``run_id`` (or of ``keys``) that no event names; return their batch ids.

    ``min_age_s`` leaves alone files younger than that, which a live producer may
    be about to announce itself; each is noted in ``too_young`` with the seconds
    until it is old enough.  ``describe`` makes a file's event (default: a
    trajectory batch's, from its rows); None leaves the file alone.
    """
    known = set(announced_batch_ids)
    describe = describe or (lambda key: batch_committed_payload(archive.describe_batch(key, run_id)))
    orphans = []
    for key in archive.list_batches(run_id) if keys is None else keys:
        batch_id = key.rsplit("/", 1)[-1].removesuffix(".parquet")
        if batch_id in known:
            continue
        age = _age_s(archive, key) if min_age_s else float("inf")
        if age < min_age_s:
            if too_young is not None:
                too_young[key] = min_age_s - age
            continue
        try:
            payload = describe(key)
        except Exception as exc:  # unreadable or gone: the others are still announced, and the process starts
            log.error("batch %s of run %s cannot be announced: %s", key, run_id, exc)
            continue
        if payload is None:
            continue
        announce(payload)
        orphans.append(batch_id)
        log.warning("announced orphaned batch %s (stored but never announced)", batch_id)
    return orphans


class OrphanSweep:
    """``announce_orphans`` when a producer starts, and again for the files too young to judge then.

    The second look (``maybe_sweep``, on the producer's tick) comes once the last of those files is
    ``min_age_s`` old, against the events on the log by then; it looks at those files only.  Files written
    after the start are their writers' to announce (or the next starting producer's).
    """

    def __init__(self, archive: TrajectoryArchive, run_id: str, announce: Callable[[Payload], Any],
                 min_age_s: float, announced: Callable[[], Iterable[str]],
                 list_keys: Callable[[], list[str]] | None = None,
                 describe: Callable[[str], Payload | None] | None = None) -> None:
        self.archive, self.run_id, self.announce, self.min_age_s = archive, run_id, announce, min_age_s
        self.announced = announced  # the batch ids the run's events name, read from the log when called
        self.list_keys = list_keys or (lambda: archive.list_batches(run_id))  # default: the run's trajectory batches
        self.describe = describe
        self.pending: list[str] = []  # keys too young at the last look
        self.due = 0.0  # monotonic time they are all old enough
        self._looked = False

    def sweep(self, announced: Iterable[str] | None = None) -> list[str]:
        """Announce the orphans old enough (at the first call, of the whole run); note the younger ones.
        ``announced``: the batch ids the log names, if just read (else they are read now)."""
        young: dict[str, float] = {}
        keys = self.pending if self._looked else self.list_keys()
        known = self.announced() if announced is None else announced
        found = announce_orphans(self.archive, self.run_id, known, self.announce, self.min_age_s, keys=keys,
                                 too_young=young, describe=self.describe)
        self._looked, self.pending = True, list(young)
        self.due = time.monotonic() + max(young.values(), default=0.0)
        return found

    def maybe_sweep(self) -> None:
        """Look again at the files that were too young, once they are old enough; a failed look is tried later."""
        if not self.pending or time.monotonic() < self.due:
            return
        try:
            self.sweep()
        except Exception as exc:  # the log or store out of reach for a moment: the files stay noted
            log.warning("could not look for unannounced batches of %s (%s); trying again", self.run_id, exc)
            self.due = time.monotonic() + self.min_age_s


def _age_s(archive: TrajectoryArchive, key: str) -> float:
    try:
        modified = archive.store.filesystem.modified(archive.store.path(key))
        return time.time() - modified.timestamp()
    except (NotImplementedError, OSError, AttributeError):
        return float("inf")


def batch_events(items: Iterable[Any]) -> list[TrajectoryBatchCommitted]:
    """The ``TrajectoryBatchCommitted`` events among tail records, envelopes or payloads."""
    payloads = [getattr(event, "payload", event) for event in (getattr(item, "event", item) for item in items)]
    return [payload for payload in payloads if isinstance(payload, TrajectoryBatchCommitted)]


def announced_batches(events: Iterable[Any]) -> set[str]:
    """batch ids named by ``TrajectoryBatchCommitted`` events (tail records, envelopes or payloads)."""
    return {event.batch_id for event in batch_events(events)}
