"""One dead letter per poison message and process, without one reader's slow dead letter holding up the others.

The readers here are ``EventConsumer``s over a scripted Kafka client (what each poll returns) and a scripted
dead-letter publisher, so the timing between readers can be set exactly: the broker side of dead-lettering is
tested against the real broker in ``tests/consumers/test_sources.py``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from kafka import TopicPartition

from pipeline.io.bus import BusError, EventConsumer
from pipeline.io.bus.dead_letters import DeadLettered
from pipeline.io.bus.records import ConsumerStats
from schemas.config import BusConfig
from schemas.events import decode_event

TOPIC = "deadletters.trajectories"
SERVERS = ["127.0.0.1:9"]  # never dialled: the client and the publisher are scripted
FRESH_OFFSETS = itertools.count(1_000)  # offsets no other test of this process dead-lettered


def poison(offset: int, value: bytes, timestamp: int = 1_000) -> Any:
    """A record no reader can decode, as the Kafka client hands it out."""
    return SimpleNamespace(topic=TOPIC, partition=0, offset=offset, timestamp=timestamp, key=b"a", value=value)


class ScriptedClient:
    """Hands each poll the next batch of records; seeks are recorded (a failed dead letter rewinds)."""

    def __init__(self, *batches: list[Any]) -> None:
        self.batches, self.seeks = list(batches), []

    def poll(self, timeout_ms: int, max_records: int | None = None) -> dict[TopicPartition, list[Any]]:
        return {TopicPartition(TOPIC, 0): self.batches.pop(0)} if self.batches else {}

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition(TOPIC, 0)}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append(offset)


class ScriptedPublisher:
    """Publishes dead letters by calling ``publish`` (default: take them at once)."""

    def __init__(self, publish: Callable[[], None] = lambda: None) -> None:
        self.publish, self.sent = publish, []

    def publish_raw(self, topic: str, value: bytes | None, key: bytes | None, what: str = "message") -> tuple[int, int]:
        self.publish()
        self.sent.append(value)
        return 0, len(self.sent) - 1

    def close(self) -> None:
        pass


def reader(client: ScriptedClient, publisher: ScriptedPublisher) -> EventConsumer:
    """An ``EventConsumer`` of the trajectories topic reading ``client`` (set up as its constructor would)."""
    consumer = EventConsumer.__new__(EventConsumer)
    consumer.bus_config = BusConfig(bootstrap_servers=SERVERS[0], namespace="deadletters")
    consumer.topic, consumer.kind, consumer.run_id = TOPIC, "trajectories", None
    consumer.dlq_topic, consumer.stats = "deadletters.dlq", ConsumerStats()
    consumer._polled, consumer._pending_seeks = {}, {}
    consumer._dlq, consumer._servers, consumer._consumer = publisher, SERVERS, client
    consumer.membership, consumer.refuse_newer = False, False
    return consumer


def test_a_new_poison_message_where_a_recreated_topic_reuses_an_offset_is_dead_lettered(
        request: pytest.FixtureRequest) -> None:
    """A topic deleted and created again under its name numbers its messages from 0 again: a poison message there
    is another message than the one dead-lettered at that offset before, and gets its own dead letter."""
    unique = request.node.name.encode()  # offsets this process's other tests did not see
    first, again = poison(0, b"{first log " + unique), poison(0, b"{second log " + unique, timestamp=9_000)
    publisher = ScriptedPublisher()
    before, sibling, after = (reader(ScriptedClient([record]), publisher) for record in (first, first, again))
    for consumer in (before, sibling, after):
        assert consumer.poll() == []
    assert [c.stats.dead_lettered for c in (before, sibling, after)] == [1, 0, 1]
    assert sibling.stats.skipped_dead_lettered == 1  # the same message of the same log: one dead letter
    assert len(publisher.sent) == 2
    assert len({decode_event(value).event_id for value in publisher.sent}) == 2  # two letters to readers too


@pytest.mark.parametrize(("first_value", "second_value"), [
    (b"{" + b"x" * 5000 + b"first", b"{" + b"x" * 5000 + b"second"),  # alike in the 4096 bytes a letter keeps
    (b"\xff\xfe\x00", b"\xfe\xff\x00"),  # alike once undecodable bytes are replaced
], ids=["differ past the bytes kept", "differ in undecodable bytes"])
def test_new_poison_messages_at_a_reused_offset_get_letters_of_their_own_ids(
        first_value: bytes, second_value: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two poison messages at offset 0 of a topic created again between them, whose letters' ``raw`` reads the same
    (cut at ``DEAD_LETTER_RAW_BYTES``, or undecodable bytes replaced): each gets its letter, and the letters carry
    distinct ids, so readers that dedupe by ``event_id`` count two."""
    monkeypatch.setattr("pipeline.io.bus.consumer.DEAD_LETTERED", DeadLettered())
    first, second = poison(0, first_value, timestamp=1_000), poison(0, second_value, timestamp=9_000)
    publisher = ScriptedPublisher()
    for record in (first, second):
        assert reader(ScriptedClient([record]), publisher).poll() == []
    letters = [decode_event(value) for value in publisher.sent]
    assert len(letters) == 2
    assert letters[0].payload.raw == letters[1].payload.raw  # what the letters keep cannot tell them apart
    assert letters[0].event_id != letters[1].event_id


def test_a_message_dead_lettered_again_by_a_restarted_reader_is_one_letter_to_readers(
        request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader stopped after a message's dead letter but before its group committed past the message reads it
    again in its next process and dead-letters it again, perhaps for a reason worded otherwise: both letters carry
    one ``event_id``, so readers that dedupe by it count the message once."""
    record = poison(next(FRESH_OFFSETS), b"{poison " + request.node.name.encode())
    publisher = ScriptedPublisher()
    assert reader(ScriptedClient([record]), publisher).poll() == []
    monkeypatch.setattr("pipeline.io.bus.consumer.DEAD_LETTERED", DeadLettered())  # the next process's
    monkeypatch.setattr("pipeline.io.bus.consumer.decode_record",
                        lambda record, refuse_newer: (None, "not JSON: worded by a newer JSON library"))
    restarted = reader(ScriptedClient([record]), publisher)
    assert restarted.poll() == [] and restarted.stats.dead_lettered == 1
    first, again = (decode_event(value) for value in publisher.sent)
    assert first.payload.reason != again.payload.reason and first.payload.origin_offset == record.offset
    assert first.event_id == again.event_id


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = target()
        except BaseException as exc:  # handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("first_publish", ["taken", "refused"])
def test_a_dead_letter_waiting_on_the_broker_holds_up_only_readers_of_the_same_message(
        first_publish: str, request: pytest.FixtureRequest) -> None:
    """While one reader's dead letter waits on a broker that is away, another poison message is dead-lettered at
    once; a reader meeting the same message waits for the first one's outcome: once taken it skips the message,
    once refused (the first reader's poll fails and reads it again later) it sends the dead letter itself."""
    unique = request.node.name.encode()
    slow_record, other_record = (poison(next(FRESH_OFFSETS), b"{%s " % name + unique) for name in (b"slow", b"other"))
    broker_back, publishing = threading.Event(), threading.Event()

    def broker_away() -> None:
        publishing.set()
        assert broker_back.wait(10)
        if first_publish == "refused":
            raise BusError("publishing a DeadLetter failed: the broker did not answer")

    slow = reader(ScriptedClient([slow_record]), ScriptedPublisher(broker_away))
    slow_thread, slow_outcome = in_thread(slow.poll)
    assert publishing.wait(5)

    other = reader(ScriptedClient([other_record]), ScriptedPublisher())
    other_thread, _ = in_thread(other.poll)
    other_thread.join(2)
    assert not other_thread.is_alive(), "another message's dead letter waited on the first one's broker"
    assert other.stats.dead_lettered == 1

    same_publisher = ScriptedPublisher()
    same = reader(ScriptedClient([slow_record]), same_publisher)
    same_thread, same_outcome = in_thread(same.poll)
    time.sleep(0.3)
    assert same_thread.is_alive() and same_publisher.sent == []  # it waits for the first reader's outcome
    broker_back.set()
    for thread in (slow_thread, same_thread):
        thread.join(5)
        assert not thread.is_alive()
    assert "error" not in same_outcome, same_outcome
    if first_publish == "taken":
        assert slow.stats.dead_lettered == 1 and "error" not in slow_outcome
        assert (same.stats.dead_lettered, same.stats.skipped_dead_lettered, same_publisher.sent) == (0, 1, [])
    else:
        assert isinstance(slow_outcome.get("error"), BusError)  # its poll fails, the batch is read again
        assert slow.stats.dead_lettered == 0 and slow._consumer.seeks == [slow_record.offset]
        assert (same.stats.dead_lettered, len(same_publisher.sent)) == (1, 1)
