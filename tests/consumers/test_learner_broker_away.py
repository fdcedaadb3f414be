"""A learner while the broker is away, with a scripted source (no broker): its consumer stays in its group, an
error meanwhile ends it instead of waiting for the broker, and each announcement is one event however often tried.

The real broker's outages are in test_learner_outage.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from consumers import step_writer
from consumers.packed import PackedLearner
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.bus import CommitError, PublishError
from pipeline.runtime import Announcer
from schemas.events import LearnerProgress
from tests.consumers import test_learner
from tests.consumers.test_learner import write_batches
from tests.consumers.test_learner_progress import TOPIC, ScriptedSource, scripted_learner, stored_refs
from tests.fixtures.outages import WrittenButUnacknowledged

store, setup = test_learner.store, test_learner.setup  # a file store, the tiny model's prompt


class DroppedFromGroup(ScriptedSource):
    """A consumer the group dropped (no poll within max_poll_interval_ms): its commits fail until a poll
    (``keep_alive``) rejoins."""

    def __init__(self) -> None:
        super().__init__([])
        self.member, self.tries = False, 0

    def commit(self, positions: dict[str, int]) -> None:
        self.tries += 1
        if not self.member:
            raise CommitError("commit to group g failed: this member was dropped from the group (no poll within "
                              "max_poll_interval_ms, or a rebalance); call keep_alive() during long work")
        super().commit(positions)

    def keep_alive(self) -> None:
        self.member = True


def test_a_commit_refused_because_the_group_dropped_the_learner_is_taken_once_a_poll_rejoins(store, setup):
    learner, _ = scripted_learner(store, setup, [])
    learner.source = source = DroppedFromGroup()
    learner.outputs.stopping = lambda: source.tries >= 3  # a bound: never rejoining would retry forever
    learner.commit({f"{TOPIC}:0": 3}, "the offsets of step 1's checkpoint")
    assert source.commits == [{f"{TOPIC}:0": 3}] and source.tries == 2


def test_a_learner_waiting_for_its_step_writes_keeps_its_consumer_in_its_group(store, setup, monkeypatch):
    monkeypatch.setattr(step_writer, "KEEP_ALIVE_EVERY_S", 0.05)
    learner, _ = scripted_learner(store, setup, [])
    polled = threading.Event()
    learner.source.keep_alive = polled.set
    learner.outputs.writer.submit(lambda: polled.wait(5) and None)  # the writes last until the learner polls
    started = time.monotonic()
    learner.finish_writes()
    assert polled.is_set() and time.monotonic() - started < 4


class FailingAfter(ScriptedSource):
    """Hands out its refs, then fails (a store error, a lost lease) on the poll after them."""

    def __init__(self, refs, polls_before_failing: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__(refs)
        self.polls, self.polls_before_failing = 0, polls_before_failing

    def poll(self, timeout_s: float):  # type: ignore[no-untyped-def]
        self.polls += 1
        if self.polls > self.polls_before_failing:
            raise OSError("reading runs/r/trajectories failed: the store did not answer")
        return super().poll(timeout_s)


def test_an_error_while_a_step_write_waits_for_the_broker_ends_the_learner_instead_of_waiting(store, setup):
    write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(0))
    learner, _ = scripted_learner(store, setup, [])
    learner.source = FailingAfter(stored_refs(store), polls_before_failing=2)  # a step, then the error
    refused: list = []

    def away(payload) -> None:  # type: ignore[no-untyped-def]
        refused.append(payload)
        raise PublishError("publishing an AdapterPublished to ns.adapters failed: no acknowledgement within 2s")

    learner.announce = learner.outputs.announce = away
    stop, errors = threading.Event(), []
    learner.outputs.stopping = stop.is_set  # (ends the thread if the error does not)

    def train() -> None:
        try:
            learner.run(poll_timeout_s=0)
        except BaseException as exc:  # the assertions name it
            errors.append(exc)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        thread.join(10)
        assert not thread.is_alive(), "the learner waits for the broker with its error unraised"
    finally:
        stop.set()
        thread.join(10)
    assert refused and len(errors) == 1 and isinstance(errors[0], OSError), errors


def test_a_step_write_tried_again_publishes_the_same_event_so_readers_count_it_once(store, setup):
    learner, _ = scripted_learner(store, setup, [])
    publisher = WrittenButUnacknowledged()
    learner.outputs.announce = Announcer(publisher, "r")  # type: ignore[arg-type]
    learner.outputs.announce_until_taken(LearnerProgress(step=1, version=1, positions={}), "LearnerProgress")
    first, second = publisher.sent
    assert first.event_id == second.event_id and first == second


class Engine:
    """What ``PackedLearner.drop`` needs of a training engine."""

    def __init__(self) -> None:
        self.deleted: list[str] = []

    def delete_adapter(self, run_id: str) -> None:
        self.deleted.append(run_id)


def test_a_packed_run_dropped_on_an_error_while_its_write_waits_for_the_broker_lets_the_others_go_on(store, setup):
    learner, _ = scripted_learner(store, setup, [])
    refused: list = []

    def away(payload) -> None:  # type: ignore[no-untyped-def]
        refused.append(payload)
        raise PublishError("publishing a LearnerCheckpointed to ns.control failed: no acknowledgement within 2s")

    learner.outputs.announce = away
    stop = threading.Event()
    learner.outputs.stopping = stop.is_set  # (ends the wait if dropping does not)
    packed = PackedLearner(Engine(), [learner])  # type: ignore[arg-type]
    learner.outputs.writer.submit(lambda: learner.outputs.announce_until_taken(
        LearnerProgress(step=1, version=1, positions={}), "LearnerCheckpointed of step 1"))
    dropping = threading.Thread(target=packed.drop, args=(packed.runs[0],), daemon=True)
    try:
        deadline = time.monotonic() + 10
        while not refused and time.monotonic() < deadline:
            time.sleep(0.05)
        dropping.start()
        dropping.join(10)
        assert not dropping.is_alive(), "dropping a run waits for the broker, and every other run with it"
    finally:
        stop.set()
        if dropping.ident is not None:
            dropping.join(10)
    assert refused and not packed.runs and packed.engine.deleted == [learner.run_id]
