"""The store's record of a learner's events the broker has not taken: kept on the first refusal, gone once taken,
read back oldest first with their event ids, and a damaged record refused in one line naming the fix."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from consumers.broker_wait import BrokerAwayOnStop
from consumers.unannounced import UnannouncedEvents
from pipeline.io.bus import PublishError
from pipeline.io.store import ObjectStore
from schemas.events import LearnerCheckpointed, make_event


@pytest.fixture
def store(tmp_path) -> ObjectStore:  # type: ignore[no-untyped-def]
    return ObjectStore(tmp_path.as_uri())


def checkpointed(step: int):  # type: ignore[no-untyped-def]
    """Step ``step``'s event, made ``step`` seconds into 2026 (the records are read back in the events' order)."""
    event = make_event("r", LearnerCheckpointed(step=step, version=step, path=f"runs/r/checkpoints/{step}", offsets={}))
    return event.model_copy(update={"time": datetime(2026, 1, 1, 0, 0, step, tzinfo=UTC)})


def test_an_event_refused_until_a_stop_stays_recorded_and_one_taken_later_does_not(store) -> None:  # type: ignore[no-untyped-def]
    events, sent = UnannouncedEvents(store, "r"), []

    def away(payload) -> None:  # type: ignore[no-untyped-def]
        sent.append(payload)
        raise PublishError("publishing a LearnerCheckpointed to ns.control failed: no acknowledgement within 2s")

    first, second = checkpointed(1), checkpointed(2)
    for event in (second, first):  # recorded out of order
        with pytest.raises(BrokerAwayOnStop):
            events.announce_until_taken(away, event, f"LearnerCheckpointed of step {event.payload.step}",
                                        stopping=lambda: True)
    assert events.owed() == [first, second]  # oldest first, each as it was tried (its event_id kept)
    assert events.announce_left(sent.append, stopping=lambda: False) == 2
    assert sent[-2:] == [first.payload, second.payload] and events.owed() == []


def test_a_damaged_record_is_refused_in_one_line_naming_the_fix(store) -> None:  # type: ignore[no-untyped-def]
    events = UnannouncedEvents(store, "r")
    store.put(f"{events.prefix}/x.json", b"{not json")
    with pytest.raises(ValueError, match="delete it to start the learner") as refused:
        events.owed()
    assert "\n" not in str(refused.value)
