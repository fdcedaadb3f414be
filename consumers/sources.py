"""Where the learner's batch announcements come from: Kafka, or the store itself.

``KafkaSource`` reads ``TrajectoryBatchCommitted`` events of one run through a
consumer group and commits offsets only when told (after a checkpoint).
``ReplaySource`` walks the Parquet batches already in the store in the order the
run's learner trained them (then commit order), digests checked, for offline training without a broker.  Both hand the learner ``BatchRef``s
carrying the position just after each one, which checkpoints store.

``TrajectorySource`` is the protocol both follow, which the LoRA and value learners
read through; ``origin_of`` names where a batch was announced (for its dead letter) and
``rewind_if_the_log_changed`` restarts positions that point into a log the broker replaced.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from typing import Any, Protocol

from pipeline.io.archive import BatchCommit, TrajectoryArchive
from pipeline.io.bus import EventConsumer, describe_topic, group_timings_from_env
from pipeline.io.steplog import StepLog, in_trained_order
from schemas.config import BusConfig
from schemas.events import TrajectoryBatchCommitted

log = logging.getLogger("rlpipe.learner")

# What reading a batch raises when the batch itself is bad (wrong digest, not Parquet, wrong schema, NaN, gone, a
# path naming a folder or passing through a file on a local store): retrying cannot help, so it is quarantined.
# Other errors (a storage hiccup) stop the learner, which retries.
POISON_BATCH_ERRORS: tuple[type[Exception], ...] = (ValueError, FileNotFoundError, IsADirectoryError,
                                                    NotADirectoryError)


@dataclass(frozen=True)
class BatchRef:
    """One announced trajectory batch and the source position just after it."""

    batch_id: str
    path: str
    sha256: str | None
    position: dict[str, int]  # e.g. {"rlpipe.trajectories:0": 13}
    producer_id: str | None = None  # who wrote it, where the announcement says (None: a source that does not)


class TrajectorySource(Protocol):
    """Where batch announcements come from (Kafka or the store)."""

    def poll(self, timeout_s: float) -> list[BatchRef]: ...
    def seek(self, positions: dict[str, int]) -> None: ...
    def commit(self, positions: dict[str, int], timeout_s: float | None = None) -> None: ...  # (None: its own)
    def keep_alive(self) -> None: ...
    def exhausted(self) -> bool: ...
    # Optional, for sources whose log can be replaced under the same name (Kafka):
    # log_identity() -> {topic: id}; positions_elsewhere(positions, recorded identity) -> keys to read from 0.


def origin_of(ref: BatchRef) -> tuple[str, int, int]:
    """(topic, partition, offset) a batch was announced at, from its position (the offset just after it).

    Positions that are not ``topic:partition`` (offline replay's cursor) give the
    whole key as the topic and partition 0.
    """
    key, after = next(iter(ref.position.items()), ("unknown", 1))
    topic, _, partition = key.rpartition(":")
    if topic and partition.isdigit():
        return topic, int(partition), max(0, after - 1)
    return key, 0, max(0, after - 1)


def rewind_if_the_log_changed(source: object, state: Any) -> None:
    """Point ``state.positions`` back to 0 where they point into another log than the one ``source`` reads.

    A broker that lost its log numbers events from 0 again, so resumed positions
    would skip them.  Sources that know their log's identity (Kafka: the topic id)
    say which positions point elsewhere; those start over at 0, and batches already
    trained are skipped by their ids.  ``state.log_identity`` becomes the identity of
    the log read from now on (recorded with the next checkpoint).  Sources without
    an identity (replay from the store) leave ``state`` alone.
    """
    identify = getattr(source, "log_identity", None)
    pointing_elsewhere = getattr(source, "positions_elsewhere", None)
    if identify is None or pointing_elsewhere is None:
        return
    elsewhere = pointing_elsewhere(state.positions, state.log_identity)
    if elsewhere:
        log.warning("the event log is not the one the checkpoint points into (%s): reading it from the start; "
                    "batches already trained are skipped", ", ".join(elsewhere))
        state.positions.update(dict.fromkeys(elsewhere, 0))
    state.log_identity = identify()


def learner_group_id(run_id: str) -> str:
    """The consumer group of a run's learner."""
    return f"rlpipe-learner-{run_id}"


def _position_key(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


def _parse_position(key: str) -> tuple[str, int]:
    topic, _, partition = key.rpartition(":")
    return topic, int(partition)


class KafkaSource:
    """Batch announcements from ``<ns>.trajectories`` for one run (every partition, manual commit).

    The learner reads without joining its group (``membership=False``): the run's
    lease already makes it the only learner, its checkpoints say where to read, and
    the group id only keeps the committed offsets that ``rlpipe topics lag`` and
    the producers' backlog read.  A learner that takes over therefore never waits
    on a rebalance, and one that goes away cannot strand the group.
    """

    def __init__(self, bus: BusConfig, run_id: str, group_id: str | None = None, **consumer_options: Any) -> None:
        options = {**group_timings_from_env(), **consumer_options}
        self.bus = bus
        # an announcement from a newer rlpipe stops the learner (upgrade it): skipping would lose the batch
        self.consumer = EventConsumer(bus, "trajectories", group_id or learner_group_id(run_id), run_id=run_id,
                                      membership=False, refuse_newer=True, **options)

    def log_identity(self) -> dict[str, str]:
        """The topic's id (``{topic: id}``; empty where the broker reports none)."""
        info = describe_topic(self.bus, self.consumer.topic)
        return {info.name: info.topic_id} if info.topic_id else {}

    def positions_elsewhere(self, positions: dict[str, int], recorded: dict[str, str]) -> list[str]:
        """Keys of ``positions`` that point into another log than the one here now.

        Another log: the topic's id differs from the ``recorded`` one (the topic was
        created again), or a partition ends before the position (a log that
        restarted empty, on a broker without topic ids).
        """
        info = describe_topic(self.bus, self.consumer.topic)
        ends = {_position_key(info.name, p.partition): p.end_offset for p in info.partitions}
        renewed = info.topic_id is not None and recorded.get(info.name) not in (None, info.topic_id)
        return sorted(key for key, offset in positions.items() if not key.startswith("replay:") and (
            (_parse_position(key)[0] == info.name and renewed) or offset > ends.get(key, offset)))

    def poll(self, timeout_s: float) -> list[BatchRef]:
        refs = []
        consumed_events = self.consumer.poll(timeout_s)
        for consumed in consumed_events:
            payload = consumed.event.payload
            if isinstance(payload, TrajectoryBatchCommitted):
                refs.append(BatchRef(payload.batch_id, payload.path, payload.sha256,
                                     {_position_key(consumed.topic, consumed.partition): consumed.offset + 1},
                                     payload.producer_id))
        return refs

    def seek(self, positions: dict[str, int]) -> None:
        """Read from ``positions`` next, and every partition they do not name from its start.

        Not from the group's committed offset there: that may come from a newer
        checkpoint than the one resumed (the newer one damaged), and would skip
        batches the resumed weights never trained.  Batches already trained are
        skipped by their ids.
        """
        named = {_parse_position(k): v for k, v in positions.items() if not k.startswith("replay:")}
        self.consumer.seek({**dict.fromkeys(self.consumer.assignment(), 0), **named})

    def commit(self, positions: dict[str, int], timeout_s: float | None = None) -> None:
        """Commit the positions (under the run's learner group id), refused after ``timeout_s`` at most (None: the
        consumer's own timeout)."""
        offsets = {_parse_position(k): v for k, v in positions.items() if not k.startswith("replay:")}
        if offsets:
            self.consumer.commit(offsets, timeout_s=timeout_s)

    def keep_alive(self) -> None:
        self.consumer.keep_alive()

    def join(self, timeout_s: float) -> bool:
        """Whether this source reads its partitions (at once: it joins no group)."""
        return bool(self.consumer.wait_for_assignment(timeout_s))

    def exhausted(self) -> bool:
        return False  # a live topic never runs dry

    def lag(self) -> int:
        return sum(self.consumer.lag().values())

    def close(self) -> None:
        self.consumer.close()


def replay_order(archive: TrajectoryArchive, run_id: str, date_from: date | str | None = None,
                 date_to: date | str | None = None) -> list[BatchCommit]:
    """``run_id``'s stored batches (within the dates) in the order a replay hands them out or re-announces them:
    those its learner trained, in its step log's order, then the rest in commit order (see ``ReplaySource``)."""
    in_range = [c for c in archive.commits(run_id) if in_date_range(c.key, date_from, date_to)]
    return in_trained_order(in_range, lambda c: c.batch_id, StepLog(archive.store, run_id).read())


class ReplaySource:
    """Batches of a run straight from the store, in the order its learner trained them (offline training,
    no broker).

    Order: the batches the run's step log names first, in the order its steps trained
    them; a learner trains batches as their announcements reach it, which commit
    times do not record (a producer that restarts announces the batches it wrote but
    never announced late; producers' clocks differ), and its steps form from them in
    that order, so only that order reproduces its weights.  The batches it never
    trained (written after it stopped, or a run without a learner) follow in commit
    order: each batch's recorded commit time, then its id (``TrajectoryArchive.commits``),
    so batches of several producers interleave as they were committed, whatever their
    names.  Each ``BatchRef`` carries the digest recorded at commit, so a file changed
    since is refused when read.  The position is a cursor, the newest commit time (in
    microseconds) among the batches handed out.  Resuming cannot skip: every batch
    not trained yet (``already_trained``, the learner's idempotency check) is offered
    again in that order, also one that appeared later with an older name or an
    earlier time; without ``already_trained`` every batch is offered and the learner
    skips those it trained.  A damaged step object in the source run fails the replay
    (``StepLogError``, naming it): without it the trained order is unknown.
    """

    def __init__(
        self,
        archive: TrajectoryArchive,
        run_id: str,
        date_from: date | str | None = None,
        date_to: date | str | None = None,
        batches_per_poll: int = 1,
        already_trained: Callable[[str], bool] | None = None,
    ) -> None:
        self.archive, self.run_id = archive, run_id
        self.date_from, self.date_to = date_from, date_to
        self.position_key = f"replay:{run_id}"
        self.batches_per_poll = batches_per_poll
        self.already_trained = already_trained
        self.cursor = 0
        self.queue: deque[BatchCommit] = deque(self._listing())

    def _listing(self) -> list[BatchCommit]:
        return replay_order(self.archive, self.run_id, self.date_from, self.date_to)

    def poll(self, timeout_s: float) -> list[BatchRef]:
        refs = []
        while self.queue and len(refs) < self.batches_per_poll:
            commit = self.queue.popleft()
            self.cursor = max(self.cursor, commit_cursor(commit))
            refs.append(BatchRef(commit.batch_id, commit.key, commit.sha256, {self.position_key: self.cursor}))
        return refs

    def seek(self, positions: dict[str, int]) -> None:
        """Resume: offer, in the listing's order, every batch not trained yet (the listing is read again, unless this
        is a seek to the start before anything was handed out: the listing just read stands)."""
        if not positions.get(self.position_key) and not self.cursor:
            return
        self.cursor = positions.get(self.position_key, 0)
        trained = self.already_trained or (lambda batch_id: False)
        self.queue = deque(c for c in self._listing() if not trained(c.batch_id))

    def commit(self, positions: dict[str, int], timeout_s: float | None = None) -> None:
        """Nothing to commit: the checkpoint's position is the replay cursor."""

    def keep_alive(self) -> None:
        """Nothing to keep alive."""

    def exhausted(self) -> bool:
        return not self.queue


def commit_cursor(commit: BatchCommit) -> int:
    """A batch's commit time in microseconds since the epoch (the replay position)."""
    return int(commit.committed_at.timestamp() * 1_000_000)


def in_date_range(key: str, date_from: date | str | None, date_to: date | str | None) -> bool:
    """Whether a batch key's ``date=`` folder lies within the (inclusive) range."""
    part = next((p for p in key.split("/") if p.startswith("date=")), None)
    if part is None:
        return True
    day = part.removeprefix("date=")
    return (date_from is None or day >= str(date_from)) and (date_to is None or day <= str(date_to))
