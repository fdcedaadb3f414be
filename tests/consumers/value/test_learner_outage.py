"""The value learner while the broker is away: its events and offset commits wait for the broker, in order, instead
of ending it, and a refused ``LearnerProgress`` is a warning, sent again later.

A scripted broker (``RefusingBroker``) refuses announcements and commits in most tests; the last one stops the
embedded stack's real broker as the learner commits (``tests/fixtures/outages.py``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from pathlib import Path

import pytest

from consumers.broker_wait import BrokerAwayOnStop
from consumers.sources import BatchRef, KafkaSource, learner_group_id
from consumers.value import learner as value_learner
from consumers.value.learner import ValueLearner
from pipeline.devstack.stack import DevStack
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.bus import CommitError, EventPublisher, PublishError, group_lag
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.runtime import Announcer
from producers.envs.classic import CartPole
from producers.value_actor import ValueActor, ValueNetworkWatcher
from schemas.config import BusConfig
from schemas.events import AdapterPublished, DeadLetter, LearnerCheckpointed, LearnerProgress, Payload
from schemas.value import ValueActorConfig
from tests.consumers.test_learner_reannounce import Broker
from tests.consumers.value.test_learner import ListSource, OpenSource, batches, make_learner  # noqa: F401 (a fixture)
from tests.fixtures import outages
from tests.fixtures.kafka import FAST_GROUP
from tests.fixtures.killing import Killed, KillingFaults
from tests.fixtures.outages import BrokerAwayAt, logged, train_in_thread, wait_for

stack = outages.stack  # the fixture: the embedded stack, its broker one a test stops and starts

WAITED_FOR = (AdapterPublished, LearnerCheckpointed, DeadLetter)


class RefusingBroker:
    """Refuses the first ``refusals`` sends of each of ``WAITED_FOR``'s kinds, then takes them; ``taken`` is the
    order events were taken in, with the source's commits ("commit") among them."""

    def __init__(self, refusals: int, kinds: tuple[type, ...] = WAITED_FOR) -> None:
        self.refusals, self.refused, self.taken = refusals, {kind: 0 for kind in kinds}, []

    def __call__(self, payload: Payload) -> None:
        kind = type(payload)
        if kind in self.refused and self.refused[kind] < self.refusals:
            self.refused[kind] += 1
            raise PublishError(f"publishing a {kind.__name__} to ns.control failed: no acknowledgement within 2s")
        self.taken.append(payload)


def wired(learner: ValueLearner, broker: RefusingBroker, commit_refusals: int = 0) -> ValueLearner:
    """``learner`` announcing to ``broker``, its source's commits recorded among the events taken; the first
    ``commit_refusals`` commits are refused (``broker.commits_refused`` counts them)."""
    source: ListSource = learner.source  # type: ignore[assignment]
    commit = source.commit
    broker.commits_refused = 0  # type: ignore[attr-defined]

    def commit_or_refuse(positions: dict[str, int]) -> None:
        if broker.commits_refused < commit_refusals:  # type: ignore[attr-defined]
            broker.commits_refused += 1  # type: ignore[attr-defined]
            raise CommitError("commit to group g failed: the broker did not answer within 2s")
        broker.taken.append("commit")
        commit(positions)

    source.commit = commit_or_refuse  # type: ignore[method-assign]
    learner.announce = broker
    return learner


def test_events_the_broker_refuses_are_sent_again_in_order_and_the_learner_trains_on(batches) -> None:  # noqa: F811
    store, refs = batches
    tampered = BatchRef(refs[1].batch_id + "x", refs[1].path, "0" * 64, {"mem:0": 2})
    log = [refs[0], tampered, *(BatchRef(r.batch_id, r.path, r.sha256, {"mem:0": i + 3})
                                for i, r in enumerate(refs[2:4]))]
    broker = RefusingBroker(refusals=1)
    learner = wired(make_learner(store, "outage", log, publish_every=1, min_replay_size=1, checkpoint_every=2),
                    broker)
    learner.run(poll_timeout_s=0.0)
    learner.finish()  # step 3 is no checkpoint_every-th: the stop's checkpoint
    assert learner.state.step == 3 and broker.refused == {kind: 1 for kind in WAITED_FOR}
    events = [p for p in broker.taken if not isinstance(p, LearnerProgress)]
    assert [type(p).__name__ if p != "commit" else p for p in events] == [
        "AdapterPublished", "DeadLetter", "AdapterPublished", "AdapterPublished", "LearnerCheckpointed", "commit",
        "AdapterPublished", "LearnerCheckpointed", "commit"]
    assert [p.version for p in events if isinstance(p, AdapterPublished)] == learner.registry.versions()


def test_a_stop_while_the_broker_is_away_ends_the_learner_in_one_line_before_any_commit(batches) -> None:  # noqa: F811
    store, refs = batches
    broker = RefusingBroker(refusals=10**6)
    learner = wired(make_learner(store, "outage-stop", refs[:2], publish_every=1, min_replay_size=1,
                                 checkpoint_every=1), broker)
    learner.stopping = lambda: True
    with pytest.raises(BrokerAwayOnStop, match=r"never took AdapterPublished v1 \(step 1\)") as stopped:
        learner.run(poll_timeout_s=0.0)
    assert "\n" not in str(stopped.value) and "commit" not in broker.taken
    assert learner.source.committed == {}  # type: ignore[attr-defined]


def test_offset_commits_the_broker_refuses_are_tried_again_after_their_checkpoints_event(batches) -> None:  # noqa: F811
    store, refs = batches
    broker = RefusingBroker(refusals=0)
    learner = wired(make_learner(store, "outage-commit", refs[:4], publish_every=4, min_replay_size=1,
                                 checkpoint_every=2), broker, commit_refusals=2)
    learner.run(poll_timeout_s=0.0)
    assert learner.state.step == 4 and broker.commits_refused == 2  # type: ignore[attr-defined]
    events = [type(p).__name__ if p != "commit" else p for p in broker.taken if not isinstance(p, LearnerProgress)]
    assert events == ["LearnerCheckpointed", "commit", "AdapterPublished", "LearnerCheckpointed", "commit"]
    assert learner.source.committed == {"mem:0": 4}  # type: ignore[attr-defined]


def test_a_stop_while_a_commit_waits_ends_the_learner_in_one_line_and_the_next_start_trains_each_batch_once(
        batches) -> None:  # noqa: F811
    store, refs = batches
    first = wired(make_learner(store, "outage-commit-stop", refs[:4], publish_every=1, min_replay_size=1,
                               checkpoint_every=2), RefusingBroker(refusals=0), commit_refusals=10**6)
    first.stopping = lambda: True
    with pytest.raises(BrokerAwayOnStop, match=r"never took the offsets of step 2's checkpoint") as stopped:
        first.run(poll_timeout_s=0.0)
    assert "\n" not in str(stopped.value) and first.source.committed == {}  # type: ignore[attr-defined]
    broker = RefusingBroker(refusals=0)
    second = wired(make_learner(store, "outage-commit-stop", refs[:4], publish_every=1, min_replay_size=1,
                                checkpoint_every=2), broker, commit_refusals=1)
    assert second.resume()  # its commit of the checkpoint's offsets, refused once, waits too
    resumed, committed = broker.taken[:2]  # the checkpoint resumed from is announced again before its commit
    assert isinstance(resumed, LearnerCheckpointed) and resumed.step == 2 and committed == "commit"
    assert second.source.committed == {"mem:0": 2}  # type: ignore[attr-defined]
    second.run(poll_timeout_s=0.0)
    assert second.state.step == 4 and second.duplicates_skipped == 0
    assert list(second.state.trained.items()) == [(ref.batch_id, step) for step, ref in enumerate(refs[:4], 1)]
    assert second.source.committed == {"mem:0": 4}  # type: ignore[attr-defined]


@pytest.mark.parametrize("interval_s", [0.0, 3600.0])
def test_a_refused_learner_progress_is_a_warning_and_is_sent_again_while_the_learner_waits(
        batches, interval_s: float, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """The step's ``LearnerProgress`` is refused once: the learner trains on and waits, and announces it again once
    ``PROGRESS_INTERVAL_S`` passed since the refusal (not on every idle poll before that)."""
    monkeypatch.setattr(value_learner, "PROGRESS_INTERVAL_S", interval_s)
    store, refs = batches
    broker = RefusingBroker(refusals=1, kinds=(LearnerProgress,))
    learner = wired(make_learner(store, f"outage-progress-{interval_s:g}", refs[:1], publish_every=1,
                                 min_replay_size=1), broker)
    learner.source = OpenSource(refs[:1])
    idle = itertools.count()
    with caplog.at_level(logging.WARNING):
        learner.run(should_stop=lambda: learner.state.step == 1 and next(idle) >= 3, poll_timeout_s=0.0)
    assert learner.state.step == 1 and broker.refused == {LearnerProgress: 1}
    assert any("progress of step 1 not announced" in record.getMessage() for record in caplog.records)
    progress = [p for p in broker.taken if isinstance(p, LearnerProgress)]
    if interval_s:
        assert progress == []  # refused a moment ago: not tried again yet
    else:
        assert [(p.step, p.positions) for p in progress] == [(1, {"mem:0": 1})]  # sent again once, then unchanged


@pytest.mark.integration
@pytest.mark.slow
def test_a_value_learner_waits_out_a_real_broker_outage_in_its_commit_and_commits_every_checkpoint(
        stack: DevStack, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The broker goes away as step 2's checkpoint commits its offsets: the learner waits (step 3 waits with it),
    then commits, trains the rest and commits its last checkpoint's offsets: each batch trained once."""
    caplog.set_level(logging.WARNING, logger="rlpipe.learner")
    store = ObjectStore((tmp_path / "store").as_uri())
    actor = ValueActor(run_id="actors", actor_id="a0", env=CartPole(), archive=TrajectoryArchive(store),
                       watcher=ValueNetworkWatcher(AdapterRegistry(store, "actors"), tmp_path / "cache"),
                       config=ValueActorConfig(steps_per_batch=40))
    run_id, events = "value-outage", [actor.write_batch() for _ in range(4)]
    bus = BusConfig(bootstrap_servers=f"127.0.0.1:{stack.broker.port}", namespace="value-commit",
                    connect_timeout_s=5.0)
    with EventPublisher(bus, send_timeout_s=20.0) as producer_side:
        for event in events:
            Announcer(producer_side, run_id)(event)
    learner_side = EventPublisher(bus, send_timeout_s=2.0, create_topics=False)
    learner = make_learner(store, run_id, [], publish_every=1, min_replay_size=1, checkpoint_every=2, max_steps=4)
    learner.announce = Announcer(learner_side, run_id)
    learner.source = source = KafkaSource(bus, run_id, **FAST_GROUP)
    away = BrokerAwayAt(stack, source.commit, lambda positions: True, 1)  # step 2's checkpoint's commit
    source.commit = away  # type: ignore[method-assign]
    stop = threading.Event()
    learner.stopping = stop.is_set
    learner.resume()
    errors: list[BaseException] = []
    thread = train_in_thread(learner, stop, errors, name="value-learner")
    what = "the offsets of step 2's checkpoint"
    try:
        assert away.stopped.wait(90), "the learner never reached step 2's commit"
        refused = logged(caplog, f"the broker did not take {what}")
        wait_for(lambda: refused() or bool(errors), 90, f"the broker never refused {what}")
        assert not errors, f"the learner ended during the outage: {errors[0]!r}"
        assert learner.state.step == 2  # nothing after the commit goes first
        stack.broker.start()
        thread.join(90)
        assert not errors, f"the learner ended: {errors[0]!r}"
        assert not thread.is_alive(), "the learner never finished its steps after the outage"
    finally:
        stop.set()
        thread.join(60)
        learner_side.close()
        source.close()
    assert logged(caplog, f"the broker took {what} after")(), "the wait never said it was over"
    assert list(learner.state.trained.items()) == [(event.batch_id, step) for step, event in enumerate(events, 1)]
    (lag,) = group_lag(bus, learner_group_id(run_id))
    assert lag.committed == 4  # the last checkpoint's offsets


def test_the_next_start_announces_the_version_a_stop_left_unannounced_once(batches) -> None:  # noqa: F811
    """Stopped while the broker refuses v1's event: v1 is in the registry, and the next start announces it (as
    it was first tried) before it trains step 1 again as v2."""
    store, refs = batches
    overrides = {"publish_every": 1, "min_replay_size": 1, "checkpoint_every": 1}
    first = wired(make_learner(store, "outage-again", refs[:2], **overrides), RefusingBroker(refusals=10**6))
    first.stopping = lambda: True
    with pytest.raises(BrokerAwayOnStop, match=r"never took AdapterPublished v1 \(step 1\)"):
        first.run(poll_timeout_s=0.0)
    broker = RefusingBroker(refusals=0)
    again = wired(make_learner(store, "outage-again", refs[:2], **overrides), broker)
    again.resume()
    again.run(poll_timeout_s=0.0)
    published = [p.version for p in broker.taken if isinstance(p, AdapterPublished)]
    assert published == again.registry.versions() == [1, 2, 3]  # v1 first, once; then steps 1 and 2
    assert [p.step for p in broker.taken if isinstance(p, LearnerCheckpointed)] == [1, 2]


KILLS = [("before_version_event", 1), ("before_version_event", 3), ("after_publish", 3), ("before_checkpoint", 1),
         ("before_checkpoint_event", 1), ("after_checkpoint", 1), ("before_checkpoint_event", 2)]


@pytest.mark.parametrize(("point", "at"), KILLS, ids=[f"{p}:{n}" for p, n in KILLS])
def test_a_value_learner_killed_at_any_point_leaves_every_version_and_checkpoint_announced_once_after_its_restart(
        batches, point: str, at: int) -> None:  # noqa: F811
    """Killed (in the process: ``tests.fixtures.killing``) at each fault point, a version or checkpoint written
    but not announced included; after the restart every version and checkpoint is in the log under one event id."""
    store, refs = batches
    run_id = f"killed-{point.replace('_', '-')}-{at}"
    overrides = {"publish_every": 1, "min_replay_size": 1, "checkpoint_every": 2}
    broker = Broker("never", nth=0, writes_refused=False)  # the broker takes everything
    killed = make_learner(store, run_id, refs[:4], **overrides)
    killed.announce = Announcer(broker, run_id)  # type: ignore[assignment]
    killed.faults = KillingFaults(point, at)  # type: ignore[arg-type]
    killed.resume()
    with pytest.raises(Killed):
        killed.run(poll_timeout_s=0.0)
    again = make_learner(store, run_id, refs[:4], **overrides)
    again.announce = Announcer(broker, run_id)  # type: ignore[assignment]
    again.resume()
    again.run(poll_timeout_s=0.0)
    assert again.state.step == 4
    versions = [p.version for p in broker.deduped(AdapterPublished)]
    paths = [p.path for p in broker.deduped(LearnerCheckpointed)]
    assert versions == again.registry.versions()
    assert sorted(paths) == sorted(key for _, key in again.checkpoints.complete())
