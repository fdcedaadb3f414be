"""The producer's backlog pause against the real broker: only its own run's unconsumed rows count.

Every run on a stack shares ``<ns>.trajectories``, and a learner commits only past
its own run's batches.  Judged by the learner group's lag, another run's batches
written after this run's last trained one paused this run's producers, and this
run's learner, with nothing new to train, never committed past them: a stall that
outlived the other run.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.io.bus import EventConsumer, EventPublisher
from pipeline.runtime import Announcer, create_run
from pipeline.topics import topic_name
from producers.service import LearnerBacklog, check_run_lora_rank, unconsumed_rows
from schemas.config import BusConfig, RunConfig
from schemas.events import LearnerProgress, TrajectoryBatchCommitted

ROWS = 16  # rows per batch, and the learner's batch_rows: max_backlog_steps 1 = one batch
WRITTEN: Any = SimpleNamespace(stats=SimpleNamespace(batches=1))  # a producer that has written a batch


def test_unconsumed_rows_count_from_the_committed_offset() -> None:
    rows_at_P = {0: {3: 16, 7: 8}, 1: {2: 4}}
    # partition 0 committed past offset 3 (its 16 rows are consumed); partition 1 never committed: all count
    assert unconsumed_rows(rows_at_P, {0: 4}) == 8 + 4
    assert unconsumed_rows(rows_at_P, {0: 8, 1: 3}) == 0
    assert unconsumed_rows(rows_at_P, {}) == 16 + 8 + 4


def announce_batch(publisher: EventPublisher, run_id: str, index: int) -> int:
    """A ``TrajectoryBatchCommitted`` of ``ROWS`` rows for ``run_id``; returns its offset."""
    batch_id = f"{run_id}-b{index}"
    event = TrajectoryBatchCommitted(
        batch_id=batch_id, path=f"runs/{run_id}/trajectories/{batch_id}.parquet", sha256="0" * 64, num_rows=ROWS,
        num_tokens=100, num_generated_tokens=10, num_groups=4, env="cartpole", producer_id=f"{run_id}-p0",
        policy_version_min=0, policy_version_max=0, reward_mean=0.0, reward_min=0.0, reward_max=0.0,
        success_rate=0.0, created_at=datetime.now(UTC),
    )
    return Announcer(publisher, run_id)(event)[1]


def judgements(backlog: LearnerBacklog, seconds: float) -> list[bool]:
    """What the rollout loop would be told on every pass for ``seconds``."""
    seen, until = [], time.monotonic() + seconds
    while time.monotonic() < until:
        seen.append(backlog())
        time.sleep(0.05)
    return seen


def becomes(backlog: LearnerBacklog, full: bool, timeout_s: float) -> bool:
    until = time.monotonic() + timeout_s
    while backlog() != full:
        if time.monotonic() > until:
            return False
        time.sleep(0.05)
    return True


def test_other_runs_batches_never_pause_this_runs_producers(bus_config: BusConfig, fast_group: dict) -> None:
    topic = topic_name(bus_config.namespace, "trajectories")
    with EventPublisher(bus_config) as publisher, \
            EventConsumer(bus_config, "trajectories", "rlpipe-learner-a", run_id="a", **fast_group) as learner:
        assert learner.wait_for_assignment(30.0)
        a1 = announce_batch(publisher, "a", 1)
        learner.commit({(topic, 0): a1 + 1})  # run a's learner trained a1
        for index in range(3):  # a busy neighbour on the same stack: three steps of rows after a1
            announce_batch(publisher, "b", index)
        backlog = LearnerBacklog(bus_config, "a", WRITTEN, max_rows=ROWS, check_interval_s=0.0)
        try:
            # nothing of run a's is unconsumed: its producers keep sampling (the bug: paused at once, for good)
            assert not any(judgements(backlog, 3.0))
            # one step of run a's own rows unconsumed: pause, until the learner commits past it
            a2 = announce_batch(publisher, "a", 2)
            assert becomes(backlog, True, timeout_s=5.0)
            learner.commit({(topic, 0): a2 + 1})
            assert becomes(backlog, False, timeout_s=5.0)
        finally:
            backlog.close()


def test_before_the_learner_commits_every_batch_of_the_run_counts_and_only_those(bus_config: BusConfig) -> None:
    with EventPublisher(bus_config) as publisher:
        for index in range(3):
            announce_batch(publisher, "b", index)
        backlog = LearnerBacklog(bus_config, "a", WRITTEN, max_rows=2 * ROWS, check_interval_s=0.0)
        try:
            announce_batch(publisher, "a", 1)  # half the limit, from any producer of run a
            assert not any(judgements(backlog, 2.0))
            announce_batch(publisher, "a", 2)
            assert becomes(backlog, True, timeout_s=5.0)
        finally:
            backlog.close()


def test_rows_the_learner_has_read_stop_counting_before_its_commit(bus_config: BusConfig) -> None:
    """The learner commits only after a checkpoint; rows it has read (``LearnerProgress``) are not a backlog."""
    topic = topic_name(bus_config.namespace, "trajectories")
    with EventPublisher(bus_config) as publisher:
        backlog = LearnerBacklog(bus_config, "a", WRITTEN, max_rows=ROWS, check_interval_s=0.0)
        try:
            a1 = announce_batch(publisher, "a", 1)
            assert becomes(backlog, True, timeout_s=5.0)  # nothing committed or read yet: one step waiting
            progress = Announcer(publisher, "a")
            progress(LearnerProgress(step=1, version=1, positions={f"{topic}:0": a1 + 1}))
            assert becomes(backlog, False, timeout_s=5.0)  # read and trained, the commit waits for a checkpoint
            # a learner restarted from an older checkpoint reads those rows again: they count again
            progress(LearnerProgress(step=0, version=0, positions={f"{topic}:0": a1}))
            assert becomes(backlog, True, timeout_s=5.0)
        finally:
            backlog.close()


def test_a_restarted_producer_announces_a_batch_too_young_at_its_start_once_old_enough(
        bus_config: BusConfig, tmp_path) -> None:
    """A producer killed between its batch's store write and its event, restarted at once: the file is too young
    to judge at the new start (a live producer may still announce it), and is announced on a later tick."""
    from pipeline.io.archive import TrajectoryArchive
    from pipeline.io.bus import tail
    from pipeline.io.store import ObjectStore
    from producers.service import RunProducer, connect_run
    from producers.sink import announced_batches
    from schemas.config import RunConfig
    from tests.pipeline.io.test_archive import two_rows

    config = RunConfig(run_id="lost", bus=bus_config, store={"root": f"file://{tmp_path}/store"},
                       producer={"batch_timeout_s": 4.0})  # files younger than 8 s are left to their writer
    info = TrajectoryArchive(ObjectStore(config.store.root)).write_batch("lost", two_rows(run_id="lost"))
    connection = connect_run(config)
    assert connection.orphans is not None and len(connection.orphans.pending) == 1  # judged later
    on_log = lambda: announced_batches(tail(bus_config, "trajectories", n=100, run_id="lost"))  # noqa: E731
    assert info.batch_id not in on_log()
    run: Any = RunProducer(None, None, SimpleNamespace(maybe_beat=lambda: None), connection.publisher, None,  # type: ignore[arg-type]
                           None, connection.orphans)
    deadline = time.monotonic() + 40
    while info.batch_id not in on_log():
        assert time.monotonic() < deadline, "the batch was never announced"
        run.tick()
        time.sleep(0.2)
    connection.publisher.close()


def test_a_producer_whose_sampler_cannot_load_the_runs_adapters_is_refused_before_it_samples(memory_store) -> None:
    """The run's learner trains at its stored learner.lora_rank; a vLLM sampler with a smaller max_lora_rank would
    refuse its first adapter mid-run, so the producer stops at start naming both settings."""
    created = RunConfig(run_id="wide", learner={"lora_rank": 12}, sampler={"max_lora_rank": 16})
    create_run(memory_store, created, "tiny")
    producer = RunConfig(run_id="wide")  # started without the run's settings: sampler.max_lora_rank 8
    with pytest.raises(ValueError, match=r"run wide .*learner\.lora_rank 12.*sampler\.max_lora_rank 8") as refused:
        check_run_lora_rank(producer, memory_store)
    assert "sampler.max_lora_rank=16" in str(refused.value) and "\n" not in str(refused.value)
    check_run_lora_rank(created, memory_store)
    check_run_lora_rank(RunConfig(run_id="not-created-yet"), memory_store)  # its own (validated) settings hold
    transformers = producer.model_copy(update={"sampler": producer.sampler.model_copy(update={"backend": "transformers"})})
    check_run_lora_rank(transformers, memory_store)  # no rank slots there
