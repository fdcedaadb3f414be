"""The learner's sources: offline replay (commit-time order across producers, a resume that cannot skip, digests
checked) and the Kafka source against the real broker (a commit asked for before the group assigned partitions)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from consumers.sources import KafkaSource, ReplaySource, learner_group_id
from pipeline.io.archive import TrajectoryArchive, parquet_bytes
from pipeline.io.bus import EventPublisher, group_lag
from pipeline.io.steplog import StepLog
from pipeline.io.store import ChecksumError, ObjectStore
from pipeline.topics import topic_name
from schemas.config import BusConfig
from schemas.trajectory import NO_ADAPTER_SHA
from tests.producers.test_service import announce_batch

RUN = "replay"
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def rows(batch_id: str, producer_id: str) -> list[dict]:
    return [dict(
        run_id=RUN, batch_id=batch_id, episode_id=f"{batch_id}-e", group_id=f"{batch_id}-g", env="toy", env_seed=0,
        producer_id=producer_id, policy_version=0, adapter_sha256=NO_ADAPTER_SHA, tokens=[1, 2, 3],
        loss_mask=[0, 0, 1], logprobs=[0.0, 0.0, -0.5], turn_rewards=[1.0], reward=1.0, num_turns=1, success=True,
        terminated=True, truncated=False, created_at=T0,
    )]


def commit(archive: TrajectoryArchive, batch_id: str, producer_id: str, minutes: int) -> str:
    """Write a batch committed ``minutes`` after T0 (one date folder for all)."""
    return archive.write_batch(RUN, rows(batch_id, producer_id), created=T0 + timedelta(minutes=minutes)).path


def drain(source: ReplaySource) -> list[str]:
    ids = []
    while not source.exhausted():
        ids += [ref.batch_id for ref in source.poll(0.0)]
    return ids


@pytest.fixture
def archive(tmp_path: Path) -> TrajectoryArchive:
    return TrajectoryArchive(ObjectStore(tmp_path.as_uri()))


def test_batches_of_two_producers_replay_in_commit_order_not_name_order(archive: TrajectoryArchive) -> None:
    commit(archive, "zeta-001", "zeta", minutes=1)
    commit(archive, "alpha-002", "alpha", minutes=2)
    commit(archive, "zeta-003", "zeta", minutes=3)
    commit(archive, "alpha-004", "alpha", minutes=4)
    assert drain(ReplaySource(archive, RUN)) == ["zeta-001", "alpha-002", "zeta-003", "alpha-004"]


def test_a_batch_that_appears_after_a_resume_is_not_skipped_whatever_its_name_or_time(
    archive: TrajectoryArchive,
) -> None:
    commit(archive, "m-001", "m", minutes=1)
    commit(archive, "m-002", "m", minutes=2)
    first = ReplaySource(archive, RUN)
    refs = first.poll(0.0) + first.poll(0.0)
    trained = {ref.batch_id for ref in refs}
    positions = {key: value for ref in refs for key, value in ref.position.items()}
    # Appear after the first replay stopped: one with a name sorting first, one committed earlier on a
    # producer whose clock is behind.
    commit(archive, "a-003", "a", minutes=3)
    commit(archive, "z-000", "z", minutes=0)
    second = ReplaySource(archive, RUN, already_trained=trained.__contains__)
    second.seek(positions)
    assert drain(second) == ["z-000", "a-003"]  # every untrained batch, in commit order; nothing trained again


def step_log_archive(name: str) -> TrajectoryArchive:
    """Four batches committed in the order orphan, b-002, b-003, b-004, and a step log whose learner trained
    b-002, then b-003 and the orphan together, and never b-004.

    The orphan was written first but announced last: its producer died between writing it and announcing it,
    and the restarted producer announced it late (a producer whose clock runs behind does the same).  The
    learner trains batches in the order their announcements reach it, not in commit-time order."""
    archive = TrajectoryArchive(ObjectStore(f"memory://{name}"))
    for minutes, batch_id in enumerate(("orphan", "b-002", "b-003", "b-004"), start=1):
        commit(archive, batch_id, "p", minutes)
    for step, batch_ids in enumerate((["b-002"], ["b-003", "orphan"]), start=1):
        StepLog(archive.store, RUN).write({"step": step, "batch_ids": batch_ids})
    return archive


def test_a_replay_follows_the_source_runs_step_log_then_commit_order_for_batches_it_never_trained() -> None:
    """Steps form from the batches in the order they arrive, so only the trained order reproduces the run."""
    archive = step_log_archive("replay-trained-order")
    assert drain(ReplaySource(archive, RUN)) == ["b-002", "b-003", "orphan", "b-004"]


def test_a_resumed_replay_offers_the_batches_not_trained_yet_in_the_source_runs_trained_order() -> None:
    archive = step_log_archive("replay-trained-order-resume")
    first = ReplaySource(archive, RUN)
    (ref,) = first.poll(0.0)
    assert ref.batch_id == "b-002"
    second = ReplaySource(archive, RUN, already_trained={"b-002"}.__contains__)
    second.seek(ref.position)
    assert drain(second) == ["b-003", "orphan", "b-004"]


def test_a_commit_record_whose_time_has_no_zone_is_refused_as_corrupt_naming_it(archive: TrajectoryArchive) -> None:
    from pipeline.io.archive import ArchiveError
    from pipeline.io.archive_layout import commit_record_key

    commit(archive, "m-001", "m", minutes=1)
    second = commit(archive, "m-002", "m", minutes=2)
    record = archive.store.get(commit_record_key(second))
    archive.store.put(commit_record_key(second), record.replace(b"+00:00", b"").replace(b"Z\"", b"\""))
    with pytest.raises(ArchiveError, match=r"m-002.commit.json is corrupt \(committed_at: .*rlpipe runs delete"):
        ReplaySource(archive, RUN)  # one line, not a comparison of naive and aware times deep in the sort


def test_refs_carry_the_recorded_digest_and_a_corrupted_batch_is_refused(
    archive: TrajectoryArchive, tmp_path: Path
) -> None:
    good = archive.write_batch(RUN, rows("b-001", "p"), created=T0)
    (ref,) = ReplaySource(archive, RUN).poll(0.0)
    assert ref.sha256 == good.sha256
    # The file is replaced by another valid Parquet file (a reward changed): it still parses.
    table = archive.read_batch(good.path)
    table = table.set_column(table.schema.get_field_index("reward"), "reward",
                             pc.multiply(table["reward"], pa.scalar(-1.0, pa.float32())))
    (tmp_path / good.path).write_bytes(parquet_bytes(table))
    (ref,) = ReplaySource(archive, RUN).poll(0.0)
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        archive.read_batch(ref.path, ref.sha256)


def test_a_resumed_source_reads_from_its_checkpoint_and_commits_at_once(bus_config: BusConfig,
                                                                        fast_group: dict[str, Any]) -> None:
    """A resumed learner seeks to its checkpoint's positions and commits them before its first poll."""
    topic = topic_name(bus_config.namespace, "trajectories")
    with EventPublisher(bus_config) as publisher:
        offsets = [announce_batch(publisher, "a", index) for index in range(3)]
    source = KafkaSource(bus_config, "a", **fast_group)
    try:
        source.seek({f"{topic}:0": offsets[1] + 1})
        source.commit({f"{topic}:0": offsets[1] + 1})  # no group to join first
        committed = {p.partition: p.committed for p in group_lag(bus_config, learner_group_id("a"))}
        assert committed == {0: offsets[1] + 1}
        refs, deadline = [], time.monotonic() + 30.0
        while not refs and time.monotonic() < deadline:
            refs = source.poll(0.5)
        assert [(ref.batch_id, ref.producer_id) for ref in refs] == [("a-b2", "a-p0")]  # the event's producer
    finally:
        source.close()


def test_partitions_the_positions_do_not_name_are_read_from_their_start_not_from_the_committed_offset(
        bus_config: BusConfig, fast_group: dict[str, Any]) -> None:
    """A learner resuming from an older checkpoint (the newest one damaged) or from none at all: the group's
    committed offsets may come from a newer checkpoint, and reading a partition it names but the resumed one does
    not from there would skip batches the resumed weights never trained."""
    with EventPublisher(bus_config) as publisher:
        for index in range(3):
            announce_batch(publisher, "a", index)
    topic = topic_name(bus_config.namespace, "trajectories")
    first = KafkaSource(bus_config, "a", **fast_group)
    try:
        first.commit({f"{topic}:0": 3})  # what a newer checkpoint committed
    finally:
        first.close()
    source = KafkaSource(bus_config, "a", **fast_group)
    try:
        source.seek({})  # the resumed checkpoint names no partition
        assert [ref.batch_id for ref in poll_until_some(source, timeout_s=10.0)] == ["a-b0", "a-b1", "a-b2"]
    finally:
        source.close()


def test_a_learner_taking_over_reads_at_once_beside_the_one_it_replaces(bus_config: BusConfig) -> None:
    """No group join: the new learner's source neither waits for the old one nor depends on how it leaves."""
    with EventPublisher(bus_config) as publisher:
        announce_batch(publisher, "a", 0)
    old = KafkaSource(bus_config, "a")  # Kafka's default group timings: a rebalance would take tens of seconds
    try:
        assert [ref.batch_id for ref in poll_until_some(old)] == ["a-b0"]
        new = KafkaSource(bus_config, "a")
        try:
            assert new.join(0.0)
            assert [ref.batch_id for ref in poll_until_some(new)] == ["a-b0"]
        finally:
            new.close()
    finally:
        old.close()


def test_one_run_id_in_two_namespaces_keeps_its_offsets_apart_in_the_learner_group_both_name(
        bus_config: BusConfig) -> None:
    """The learner's group id (``rlpipe-learner-<run>``) names no namespace and needs none: the learner joins no
    group, so neither namespace's learner waits on a rebalance of the other's, and a group's offsets are kept per
    topic, each namespace's own; readers of the offsets (``group_lag``) read their namespace's topics only."""
    prod = bus_config.model_copy(update={"namespace": f"{bus_config.namespace}p"})
    sources = []
    try:
        for config, batches in ((bus_config, 2), (prod, 1)):
            with EventPublisher(config) as publisher:
                for index in range(batches):
                    announce_batch(publisher, "a", index)
            sources.append(KafkaSource(config, "a"))  # Kafka's default group timings: a join takes tens of seconds
            assert sources[-1].join(0.0)
            sources[-1].commit({f"{topic_name(config.namespace, 'trajectories')}:0": batches})
        for config, batches in ((bus_config, 2), (prod, 1)):
            lags = group_lag(config, learner_group_id("a"))
            assert [(p.topic, p.committed) for p in lags] == [(topic_name(config.namespace, "trajectories"), batches)]
        sources[1].seek({})  # the learner's resume with no checkpoint: prod's log from its start, staging's not in it
        assert [ref.batch_id for ref in poll_until_some(sources[1])] == ["a-b0"]
    finally:
        for source in sources:
            source.close()


def poll_until_some(source: KafkaSource, timeout_s: float = 30.0) -> list:
    refs, deadline = [], time.monotonic() + timeout_s
    while not refs and time.monotonic() < deadline:
        refs = source.poll(0.5)
    return refs


def test_a_run_and_namespace_of_the_longest_allowed_names_read_their_batches(bus_config: BusConfig) -> None:
    """Run ids and namespaces may be 64 characters; the learner's group id (``rlpipe-learner-<run>``) and the
    full topic names built from them are longer, and Kafka takes names up to 249 characters."""
    run = "r" * 60  # its batch ids (``<run>-b0``) stay within 64 characters
    config = bus_config.model_copy(update={"namespace": "n" * 52 + bus_config.namespace[-12:]})
    assert len(learner_group_id(run)) > 64 and len(topic_name(config.namespace, "trajectories")) > 64
    with EventPublisher(config) as publisher:
        announce_batch(publisher, run, 0)
    source = KafkaSource(config, run)
    try:
        assert source.log_identity() == source.log_identity()  # the topic is described by its full name
        refs = poll_until_some(source)
        assert [ref.batch_id for ref in refs] == [f"{run}-b0"]
        source.commit(refs[0].position)
    finally:
        source.close()
    assert [lag.committed for lag in group_lag(config, learner_group_id(run))] == [1]


def test_to_topic_announces_the_batches_in_the_order_a_replay_trains_them(bus_config: BusConfig) -> None:
    """A run seeded with ``replay --to-topic`` forms its steps from the announcements in the order they come, so they
    come in the source run's trained order (then commit order), as ``ReplaySource`` hands them out."""
    from consumers.replay import announce_batches
    from pipeline.config import resolve_config
    from pipeline.io.bus import tail

    step_log_archive("to-topic-trained-order")
    config = resolve_config("cartpole", overrides=["store.root=memory://to-topic-trained-order", "run_id=seeded"])
    assert announce_batches(config.model_copy(update={"bus": bus_config}), RUN) == 4
    announced = [record.event.payload.batch_id for record in tail(bus_config, "trajectories", n=10, run_id="seeded")
                 if record.event is not None]
    assert announced == ["b-002", "b-003", "orphan", "b-004"]


def test_runs_packed_in_one_learner_dead_letter_a_poison_announcement_once(
        bus_config: BusConfig, fast_group: dict[str, Any]) -> None:
    """A packed learner reads the shared trajectories topic once per run (a source each, in one process): an
    unreadable message there is one dead letter, sent by the first run's reader; the others skip it, counted, and
    every run still gets its own batches around it."""
    from pipeline.io.bus import tail

    topic = topic_name(bus_config.namespace, "trajectories")
    with EventPublisher(bus_config) as publisher:
        announce_batch(publisher, "a", 0)
        poison_at = publisher.publish_raw(topic, b"{not json", "a")[1]
        announce_batch(publisher, "b", 0)
    sources = {run: KafkaSource(bus_config, run, **fast_group) for run in ("a", "b", "c")}
    try:
        for run, expected in (("a", ["a-b0"]), ("b", ["b-b0"])):
            assert [ref.batch_id for ref in poll_until_some(sources[run], timeout_s=10.0)] == expected
        deadline = time.monotonic() + 10.0
        while sources["c"].consumer.stats.skipped_other_runs < 2 and time.monotonic() < deadline:
            sources["c"].poll(0.5)
        letters = [r.event.payload for r in tail(bus_config, "dlq", n=20) if r.event is not None]
        assert [(letter.origin_topic, letter.origin_offset) for letter in letters] == [(topic, poison_at)]
        stats = [source.consumer.stats for source in sources.values()]
        assert [s.dead_lettered for s in stats] == [1, 0, 0]
        assert [s.skipped_dead_lettered for s in stats] == [0, 1, 1]
    finally:
        for source in sources.values():
            source.close()
