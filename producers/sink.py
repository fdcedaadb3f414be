"""Where finished rollouts go: the store first (create-only Parquet), then the event.

Because the file is durable before its event exists, a crash can leave a file
without an event but never an event without a file.  A broker away for longer
than the publisher waits leaves the same gap in a live producer: the sink keeps
such batches owed and announces them once the broker takes events again.  ``OrphanSweep`` closes that
gap when a producer starts: batches of the run that are in the store but were
never announced on ``<ns>.trajectories`` are announced (the learner trains each
``batch_id`` once, so announcing twice is harmless).  A file too young to judge
then (a live producer may be about to announce it) is judged again once it is
old enough, so a producer restarted at once still announces what it lost.

The topic's retention trims a long run's oldest events.  A batch stored more than
a day before the oldest event the log still holds for the run (``LoggedBatches``)
is taken as announced: its event aged out, or, had its producer crashed before
announcing it, any producer start of the run within the retention announced it.
Only a batch orphaned by a crash and followed by no producer start for the whole
retention stays unannounced; it stays in the store (``rlpipe replay``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any

from pipeline.io.archive import BatchInfo, TrajectoryArchive, batch_committed_payload
from pipeline.io.archive_layout import key_date
from pipeline.io.bus.errors import BusError, PublishError
from pipeline.runtime import announcing_once
from schemas.events import Payload, TrajectoryBatchCommitted

if TYPE_CHECKING:
    from pipeline.io.bus import RunLog

log = logging.getLogger("rlpipe.producer")


class OwedBatchEvents:
    """The events of stored batches, owed to the broker until it takes them (a producer's, a value actor's).

    ``owe`` announces a batch's event at once; one the broker does not take (it is away longer than the publisher
    waits) stays owed: ``unannounced`` keeps it, oldest first, and it is announced before the next batch and on the
    caller's tick (``retry_due``), so a broker outage ends no producer and leaves no batch unannounced once it is
    over.  ``finish`` makes the last try when the producer stops.  Every try of one batch publishes one event (its
    envelope made when owed, ``announcing_once``): a try the broker wrote without acknowledging it and the try after
    it are counted once by readers that dedupe by ``event_id``.
    """

    def __init__(self, run_id: str, announce: Callable[[Payload], Any], retry_interval_s: float = 5.0) -> None:
        self.run_id, self.announce, self.retry_interval_s = run_id, announce, retry_interval_s
        # stored, their event not taken yet (the broker away), each with its try: the same event every time
        self.owed: list[tuple[TrajectoryBatchCommitted, Callable[[], Any]]] = []
        self.retry_at = 0.0  # monotonic time of the next try on the tick
        self.refused = False  # the last try was refused (said once it goes through)

    def owe(self, event: TrajectoryBatchCommitted) -> bool:
        """Announce a stored batch's ``event`` after those still owed; False when it stays owed.  While the broker's
        last refusal is recent (the next try not due), it is owed without a try: each refused try waits out the
        publisher, and a batch stored in an outage need not wait it out again."""
        self.owed.append((event, announcing_once(self.announce, event)))
        if self.refused and time.monotonic() < self.retry_at:
            return False
        return self.announce_owed()

    def announce_owed(self) -> bool:
        """Announce the stored batches still owed their event, oldest first; False when the broker refused one
        (it and those after it wait for the next try)."""
        while self.owed:
            event, announce = self.owed[0]
            try:
                announce()
            except BusError as exc:
                self.retry_at, self.refused = time.monotonic() + self.retry_interval_s, True
                count = len(self.unannounced)
                log.warning("%d stored batch%s of run %s not announced yet: the broker did not take %s (%s); "
                            "trying again in %gs", count, "es" if count != 1 else "", self.run_id, event.batch_id,
                            str(exc).splitlines()[0], self.retry_interval_s)
                return False
            self.owed.pop(0)
        if self.refused:
            self.refused = False
            log.warning("the broker takes events again: every stored batch of run %s is announced", self.run_id)
        return True

    @property
    def unannounced(self) -> list[TrajectoryBatchCommitted]:
        """The events still owed, oldest first."""
        return [event for event, _ in self.owed]

    def retry_due(self) -> None:
        """On the producer's tick: try the batches still owed their event, at most every ``retry_interval_s``."""
        if self.unannounced and time.monotonic() >= self.retry_at:
            self.announce_owed()

    def finish(self) -> None:
        """The last try when the producer stops; raises ``PublishError`` (one line) if batches stay unannounced."""
        if self.announce_owed():
            return
        count = len(self.unannounced)
        raise PublishError(
            f"{count} batch{'es' if count != 1 else ''} of run {self.run_id} stored but not announced: the broker "
            f"did not take {'their events' if count != 1 else 'its event'}; they stay in the store, and the run's "
            f"next producer start (`rlpipe producer start --run {self.run_id}`) announces them")


class StoreThenEventSink(OwedBatchEvents):
    """Commits a batch: Parquet to the archive (create-only), then ``TrajectoryBatchCommitted`` (owed until the
    broker takes it: ``OwedBatchEvents``)."""

    def __init__(
        self,
        archive: TrajectoryArchive,
        run_id: str,
        env_name: str,
        producer_id: str,
        announce: Callable[[Payload], Any],
        retry_interval_s: float = 5.0,
    ) -> None:
        super().__init__(run_id, announce, retry_interval_s)
        self.archive, self.env_name, self.producer_id = archive, env_name, producer_id
        self.committed: list[BatchInfo] = []

    def commit(self, rows: list[dict[str, Any]], batch_id: str) -> BatchInfo:
        info = self.archive.write_batch(self.run_id, rows, batch_id=batch_id)
        self.committed.append(info)
        self.owe(batch_committed_payload(info, env=self.env_name, producer_id=self.producer_id))
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
    complete_since: datetime | None = None,
    aged_out_keys: list[str] | None = None,
) -> list[str]:
    """Announce every stored batch of ``run_id`` (or of ``keys``) that no event names; return their batch ids.

    ``min_age_s`` leaves alone files younger than that, which a live producer may
    be about to announce itself; each is noted in ``too_young`` with the seconds
    until it is old enough.  ``describe`` makes a file's event (default: a
    trajectory batch's, from its rows); None leaves the file alone.
    ``complete_since``: the log holds every event since then (None: every event
    ever); a file in a date folder more than a day older is taken as announced (and noted in
    ``aged_out_keys``).
    """
    known = set(announced_batch_ids)
    describe = describe or (lambda key: batch_committed_payload(archive.describe_batch(key, run_id)))
    aged_out_before = _aged_out_before(complete_since)
    orphans, aged_out = [], 0
    for key in archive.list_batches(run_id) if keys is None else keys:
        batch_id = key.rsplit("/", 1)[-1].removesuffix(".parquet")
        if batch_id in known:
            continue
        day = key_date(key) if aged_out_before is not None else None
        if day is not None and aged_out_before is not None and day < aged_out_before:
            aged_out += 1
            if aged_out_keys is not None:
                aged_out_keys.append(key)
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
    if aged_out:
        log.info("%d batches of run %s stored before %s, older than the events the log still holds, are taken "
                 "as announced", aged_out, run_id, aged_out_before)
    return orphans


@dataclass(frozen=True)
class LoggedBatches:
    """The batch ids a run's events name on the log, and since when the log holds every one of them.

    ``complete_since`` None: no event of the run's partition ever aged out.
    """

    ids: set[str]
    complete_since: datetime | None = None


def logged_batches(log: RunLog) -> LoggedBatches:
    """The batches a run's retained events on ``<ns>.trajectories`` name (``pipeline.io.bus.run_log``)."""
    since = None if log.complete_since_ms is None else datetime.fromtimestamp(log.complete_since_ms / 1000, UTC)
    return LoggedBatches(announced_batches(log.records), since)


def _aged_out_before(complete_since: datetime | None) -> date | None:
    """The first date folder still judged: a day before ``complete_since``'s (a margin for writers' clocks)."""
    return None if complete_since is None else complete_since.date() - timedelta(days=1)


class OrphanSweep:
    """``announce_orphans`` when a producer starts, and again for the files too young to judge then.

    The second look (``maybe_sweep``, on the producer's tick) comes once the last of those files is
    ``min_age_s`` old, against the events on the log by then; it looks at those files only.  Files written
    after the start are their writers' to announce (or the next starting producer's).
    """

    def __init__(self, archive: TrajectoryArchive, run_id: str, announce: Callable[[Payload], Any],
                 min_age_s: float, announced: Callable[[], Iterable[str] | LoggedBatches],
                 list_keys: Callable[[], list[str]] | None = None,
                 describe: Callable[[str], Payload | None] | None = None) -> None:
        self.archive, self.run_id, self.announce, self.min_age_s = archive, run_id, announce, min_age_s
        self.announced = announced  # the batch ids the run's events name, read from the log when called
        self.list_keys = list_keys or (lambda: archive.list_batches(run_id))  # default: the run's trajectory batches
        self.describe = describe
        self.pending: list[str] = []  # keys too young at the last look
        self.aged_out: list[str] = []  # keys taken as announced: stored before the events the log still holds
        self.due = 0.0  # monotonic time they are all old enough
        self._looked = False

    def sweep(self, announced: Iterable[str] | LoggedBatches | None = None) -> list[str]:
        """Announce the orphans old enough (at the first call, of the whole run); note the younger ones.
        ``announced``: the batch ids the log names, if just read (else they are read now)."""
        young: dict[str, float] = {}
        keys = self.pending if self._looked else self.list_keys()
        known = self.announced() if announced is None else announced
        logged = known if isinstance(known, LoggedBatches) else LoggedBatches(set(known))
        found = announce_orphans(self.archive, self.run_id, logged.ids, self.announce, self.min_age_s, keys=keys,
                                 too_young=young, describe=self.describe, complete_since=logged.complete_since,
                                 aged_out_keys=self.aged_out)
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
