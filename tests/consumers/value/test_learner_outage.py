"""The value learner while the broker is away: its events wait for the broker, in order, instead of ending it."""

from __future__ import annotations

import pytest

from consumers.broker_wait import BrokerAwayOnStop
from consumers.sources import BatchRef
from consumers.value.learner import ValueLearner
from pipeline.io.bus import PublishError
from schemas.events import AdapterPublished, DeadLetter, LearnerCheckpointed, LearnerProgress, Payload
from tests.consumers.value.test_learner import ListSource, batches, make_learner  # noqa: F401 (a fixture)

WAITED_FOR = (AdapterPublished, LearnerCheckpointed, DeadLetter)


class RefusingBroker:
    """Refuses the first ``refusals`` sends of each of ``WAITED_FOR``'s kinds, then takes them; ``taken`` is the
    order events were taken in, with the source's commits ("commit") among them."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.refused, self.taken = refusals, {kind: 0 for kind in WAITED_FOR}, []

    def __call__(self, payload: Payload) -> None:
        kind = type(payload)
        if kind in self.refused and self.refused[kind] < self.refusals:
            self.refused[kind] += 1
            raise PublishError(f"publishing a {kind.__name__} to ns.control failed: no acknowledgement within 2s")
        self.taken.append(payload)


def wired(learner: ValueLearner, broker: RefusingBroker) -> ValueLearner:
    """``learner`` announcing to ``broker``, its source's commits recorded among the events taken."""
    source: ListSource = learner.source  # type: ignore[assignment]
    commit = source.commit
    source.commit = lambda positions: (broker.taken.append("commit"), commit(positions))  # type: ignore[method-assign]
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
