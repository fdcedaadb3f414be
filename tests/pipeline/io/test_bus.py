"""The event log against the real Tansu broker: publish, consume, commit, seek, lag, dead letters, failures.

Consumer-group joins take about 3 s on this broker, so each test uses as few
consumers as it can.  Expected offsets and counts are derived from what
``publish`` reported, not copied from the consumer's output.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from pipeline.devstack.gcs_emulator import free_port
from pipeline.io import bus
from pipeline.io.bus import (
    BusConfigError,
    BusUnavailableError,
    EventConsumer,
    EventPublisher,
    PublishError,
    TailRecord,
    WrongEventTypeError,
)
from schemas.config import BusConfig
from schemas.events import DeadLetter, NewerEventError, RunStopped, encode_event, make_event


def _stop(run_id: str, reason: str) -> Any:
    return make_event(run_id, RunStopped(reason=reason))


def _poll_until(consumer: EventConsumer, count: int, timeout_s: float = 20.0) -> list[bus.ConsumedEvent]:
    """Poll until ``count`` events arrived (the first poll includes the ~3 s group join)."""
    events: list[bus.ConsumedEvent] = []
    deadline = time.monotonic() + timeout_s
    while len(events) < count and time.monotonic() < deadline:
        events += consumer.poll(timeout_s=0.5)
    return events


# ---------------------------------------------------------------------------------------------------------------------
# settings (no network)


def test_client_settings_carry_security_and_hide_the_password(tmp_path: Path) -> None:
    config = BusConfig(
        bootstrap_servers="k1:9092, k2:9093",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="alice",
        sasl_password=SecretStr("s3cret"),
    )
    settings = bus.kafka_client_settings(config)
    assert settings["bootstrap_servers"] == ["k1:9092", "k2:9093"]
    assert settings["security_protocol"] == "SASL_SSL"
    assert settings["sasl_mechanism"] == "SCRAM-SHA-512"
    assert settings["sasl_plain_username"] == "alice"
    assert settings["sasl_plain_password"] == "s3cret"  # the client needs the real value...
    assert "s3cret" not in repr(settings)  # ...but it never shows up when the settings are logged
    assert "s3cret" not in str(bus.redacted(settings))
    assert settings["bootstrap_timeout_ms"] == int(config.connect_timeout_s * 1000)


def test_password_file_and_cafile(tmp_path: Path) -> None:
    password_file = tmp_path / "password"
    password_file.write_text("from-file\n")
    cafile = tmp_path / "ca.pem"
    cafile.write_text("-----BEGIN CERTIFICATE-----\n")
    config = BusConfig(
        bootstrap_servers="k:9092",
        security_protocol="SASL_SSL",
        sasl_mechanism="PLAIN",
        sasl_username="bob",
        sasl_password_file=str(password_file),
        ssl_cafile=str(cafile),
    )
    settings = bus.kafka_client_settings(config)
    assert settings["sasl_plain_password"] == "from-file"
    assert settings["ssl_cafile"] == str(cafile)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sasl_password_file": "/nonexistent/password"}, "cannot read bus.sasl_password_file"),
        ({"sasl_password": SecretStr("x"), "sasl_password_file": "/x"}, "only one of"),
        ({}, "needs a password"),
        ({"sasl_password": SecretStr("x"), "security_protocol": "SASL_SSL", "ssl_cafile": "/nonexistent/ca.pem"},
         "bus.ssl_cafile"),
        ({"sasl_password": SecretStr("x"), "bootstrap_servers": "no-port"}, "not host:port"),
    ],
)
def test_bad_security_settings_name_the_field(changes: dict[str, Any], message: str) -> None:
    base = {
        "bootstrap_servers": "k:9092",
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "PLAIN",
        "sasl_username": "u",
    }
    with pytest.raises(BusConfigError, match=message):
        bus.kafka_client_settings(BusConfig(**{**base, **changes}))


def test_topic_names_and_offset_helpers() -> None:
    assert bus.resolve_topic("ns", "control") == "ns.control"
    assert bus.resolve_topic("ns", "other.topic") == "other.topic"
    with pytest.raises(bus.UnknownTopicError, match="neither a topic kind"):
        bus.resolve_topic("ns", "controls")
    assert bus.normalize_offsets({"ns.control:3": 7, ("ns.dlq", 0): 1}) == {("ns.control", 3): 7, ("ns.dlq", 0): 1}
    with pytest.raises(ValueError, match="non-negative"):
        bus.normalize_offsets({("t.x", 0): -1})
    assert bus.offsets_as_strings({("ns.control", 3): 7}) == {"ns.control:3": 7}
    event = _stop("r", "x")
    items = [bus.ConsumedEvent("t.a", 0, 4, "r", event), bus.ConsumedEvent("t.a", 0, 2, "r", event)]
    items.append(bus.ConsumedEvent("t.a", 1, 0, "r", event))
    assert bus.next_offsets(items) == {("t.a", 0): 5, ("t.a", 1): 1}


# ---------------------------------------------------------------------------------------------------------------------
# topics and publishing


def test_ensure_topics_is_idempotent(bus_config: BusConfig) -> None:
    first = bus.ensure_topics(bus_config)
    expected = sorted(f"{bus_config.namespace}.{kind}" for kind in ("trajectories", "adapters", "control", "dlq"))
    assert sorted(first) == expected
    assert bus.ensure_topics(bus_config) == []
    assert bus.list_topics(bus_config) == expected


def test_a_namespace_lists_its_own_topics_and_lag_not_those_of_a_namespace_its_name_starts(
    bus_config: BusConfig,
) -> None:
    # "<ns>.eval" is a namespace of its own (names may hold dots): its "<ns>.eval.control" starts with "<ns>.",
    # but a topic of <ns> is "<ns>.<kind>", nothing more
    inner = bus_config.model_copy(update={"namespace": f"{bus_config.namespace}.eval"})
    bus.ensure_topics(bus_config)
    bus.ensure_topics(inner)
    assert bus.list_topics(bus_config) == sorted(f"{bus_config.namespace}.{kind}"
                                                 for kind in ("trajectories", "adapters", "control", "dlq"))
    assert f"{inner.namespace}.control" in bus.list_topics(bus_config, all_namespaces=True)
    for config in (bus_config, inner):  # one group (a learner's id names the run, not its namespace) reads both
        with EventPublisher(config) as publisher:
            publisher.publish("control", _stop("run-a", config.namespace))
        with EventConsumer(config, "control", "learner-run-a", membership=False) as reader:
            assert reader.commit(bus.next_offsets(_poll_until(reader, 1))), f"{config.namespace}: nothing read in 20 s"
    assert [lag.topic for lag in bus.group_lag(bus_config, "learner-run-a")] == [f"{bus_config.namespace}.control"]
    assert [lag.topic for lag in bus.group_lag(inner, "learner-run-a")] == [f"{inner.namespace}.control"]


def test_publish_returns_increasing_offsets_keyed_by_run(bus_config: BusConfig) -> None:
    with EventPublisher(bus_config) as publisher:
        placed = [publisher.publish("control", _stop("run-a", f"r{i}")) for i in range(3)]
    assert [offset for _, offset in placed] == [0, 1, 2]
    records = list(bus.tail(bus_config, "control", n=10))
    assert [r.key for r in records] == ["run-a"] * 3
    assert [r.event.payload.reason for r in records if r.event] == ["r0", "r1", "r2"]


def test_a_publisher_whose_producer_failed_for_good_starts_a_new_one(bus_config: BusConfig) -> None:
    """An idempotent producer that hit a sequence error asks the broker to bump its epoch; a broker that
    cannot (Tansu 0.6 answers UnknownServerError) leaves it refusing every later send."""
    from kafka.errors import OutOfOrderSequenceNumberError

    with EventPublisher(bus_config) as publisher:
        publisher.publish("control", _stop("run-a", "before"))
        publisher._producer._transaction_manager.transition_to_fatal_error(OutOfOrderSequenceNumberError())
        publisher.publish("control", _stop("run-a", "after"))
    records = list(bus.tail(bus_config, "control", n=10))
    assert [r.event.payload.reason for r in records if r.event] == ["before", "after"]


def test_a_sequence_error_before_the_producer_knows_it_failed_is_sent_again_by_a_new_producer(
        bus_config: BusConfig) -> None:
    """The send's future fails with the sequence error a moment before the producer's transaction
    manager records that its epoch bump failed; the event must not be lost to that race (an API
    engine raised it and stopped serving everyone)."""
    from kafka.errors import OutOfOrderSequenceNumberError

    class Failed:
        def get(self, timeout: float | None = None) -> None:
            raise OutOfOrderSequenceNumberError()

    with EventPublisher(bus_config) as publisher:
        publisher.publish("control", _stop("run-a", "before"))
        first = publisher._producer
        first.send = lambda *args, **kwargs: Failed()  # this producer's next send fails, as if mid-bump
        publisher.publish("control", _stop("run-a", "after"))
        assert publisher._producer is not first
    records = list(bus.tail(bus_config, "control", n=10))
    assert [r.event.payload.reason for r in records if r.event] == ["before", "after"]


def test_a_publisher_whose_send_expired_after_it_was_sent_gets_through_once_the_broker_answers(
        tmp_path: Path) -> None:
    """A send that reached the broker and then expired unacknowledged (the broker frozen past the publisher's wait)
    makes kafka-python 3.0 drop the producer's id without ever asking for a new one: that producer refuses every
    later send, even with the broker back (it held a learner's announcements for good after a broker restart)."""
    import os
    import signal

    from pipeline.devstack.broker import TansuBroker
    from pipeline.devstack.process import process_table

    with TansuBroker(log_path=tmp_path / "tansu.log") as broker:  # its own broker: this test freezes it
        config = BusConfig(bootstrap_servers=broker.bootstrap_servers, namespace="expired", connect_timeout_s=5.0)
        with EventPublisher(config, send_timeout_s=2.0) as publisher:  # a learner's wait: 1 s a request, 2 s a send
            publisher.publish("control", _stop("run-a", "before"))
            assert broker.pid is not None
            os.kill(broker.pid, signal.SIGSTOP)
            try:  # sent, unanswered for the request's 1 s, retried, expired at 2 s
                while (process_table() or {}).get(broker.pid, ("T",))[0] != "T":  # stopped (/proc: T)
                    time.sleep(0.01)
                with pytest.raises(PublishError):
                    publisher.publish("control", _stop("run-a", "frozen"))
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            answering, refusals = time.monotonic(), []
            while True:
                try:
                    publisher.publish("control", _stop("run-a", "after"))
                    break
                except PublishError as exc:
                    refusals.append(str(exc))
                    assert time.monotonic() - answering < 20, f"never published again: {refusals}"
        reasons = [r.event.payload.reason for r in bus.tail(config, "control", n=10) if r.event]
    assert reasons[0] == "before" and reasons[-1] == "after"  # "frozen" may be in between: it was sent


def test_a_producer_replaced_while_it_holds_a_send_is_stopped(bus_config: BusConfig) -> None:
    """A producer that dropped its id holds every later send unsent (kafka-python 3.0.12): one sent by another
    thread between the check and the drop is still held when the publisher replaces it.  Closing it waits for
    that send and gives up, so the replaced producer's thread and connections must be stopped all the same."""
    with EventPublisher(bus_config, send_timeout_s=2.0) as publisher:
        publisher.publish("control", _stop("run-a", "before"))
        stuck = publisher._producer
        stuck._transaction_manager.reset_producer_id()  # what its sender does when a sent batch expires
        held = stuck.send(bus.resolve_topic(bus_config.namespace, "control"), value=b"held", key=b"run-a")
        publisher.publish("control", _stop("run-a", "after"))  # replaces it
        assert publisher._producer is not stuck
        stuck._sender.join(5.0)
        assert not stuck._sender.is_alive() and stuck._closed
        assert held.is_done and not held.succeeded()  # the held send failed, not left waiting for ever


def test_a_publish_the_broker_never_acknowledged_is_reported_as_failed_naming_what_to_do(
        bus_config: BusConfig) -> None:
    from kafka.errors import KafkaTimeoutError

    class Unanswered:
        def get(self, timeout: float | None = None) -> None:
            raise KafkaTimeoutError(f"Timeout after waiting for {timeout} secs.")

    with EventPublisher(bus_config, send_timeout_s=1.0) as publisher:
        publisher._producer.send = lambda *args, **kwargs: Unanswered()
        with pytest.raises(PublishError) as caught:
            publisher.publish("control", _stop("run-a", "unanswered"))
    message = str(caught.value)
    assert "\n" not in message
    assert "no acknowledgement within 1s" in message and "rlpipe topics list" in message
    assert "may still arrive" in message  # not known to be lost either: a consumer must not rely on its absence


def test_closing_with_events_the_broker_never_acknowledged_names_them_and_still_closes_the_client(
        tmp_path: Path) -> None:
    import os
    import signal

    from pipeline.devstack.broker import TansuBroker

    with TansuBroker(log_path=tmp_path / "tansu.log") as broker:  # its own broker: this test freezes it
        config = BusConfig(bootstrap_servers=broker.bootstrap_servers, namespace="close", connect_timeout_s=5.0)
        publisher = EventPublisher(config, send_timeout_s=30.0)
        publisher.publish("control", _stop("run-a", "acknowledged"))  # connected, the topic's leader known
        assert broker.pid is not None
        os.kill(broker.pid, signal.SIGSTOP)
        try:
            producer = publisher._producer
            for reason in ("unanswered-1", "unanswered-2"):  # buffered without waiting, as a publish under way is
                producer.send("close.control", value=encode_event(_stop("run-a", reason)), key=b"run-a")
            started = time.monotonic()
            with pytest.raises(PublishError) as caught:
                publisher.close(timeout_s=1.0)
            assert time.monotonic() - started < 10
        finally:
            os.kill(broker.pid, signal.SIGCONT)
    message = str(caught.value)
    assert "\n" not in message
    assert "2 events to close.control were not acknowledged within 1s" in message
    assert "publish them again" in message
    assert producer._closed and not producer._sender.is_alive()  # the client closed all the same
    publisher.close()  # and closing again is harmless


def test_publish_refuses_an_event_on_the_wrong_topic(bus_config: BusConfig) -> None:
    with EventPublisher(bus_config) as publisher, pytest.raises(WrongEventTypeError, match="does not belong"):
        publisher.publish("trajectories", _stop("run-a", "x"))


def test_an_event_of_another_topic_does_not_pass_on_the_control_topic(bus_config: BusConfig) -> None:
    """The control topic takes every event type no other topic claims; a claimed one there would be ignored by
    every reader of it (a batch announcement never trained), so it is refused when published and skipped, counted,
    when read."""
    from tests.schemas.test_events import EXAMPLES
    announcement = make_event("run-a", EXAMPLES[0])
    letter = make_event("run-a", DeadLetter(reason="x", origin_topic="t", origin_partition=0, origin_offset=0, raw=""))
    with EventPublisher(bus_config) as publisher:
        for event in (announcement, letter):
            with pytest.raises(WrongEventTypeError, match=f"a {event.type} event does not belong on .*control"):
                publisher.publish("control", event)
        with bus.EventFollower(bus_config, "control", run_id="run-a") as follower:
            publisher.publish_raw(f"{bus_config.namespace}.control", encode_event(announcement), "run-a")
            publisher.publish("control", _stop("run-a", "after"))
            assert [e.event.payload.reason for e in _poll_until(follower, 1, timeout_s=10.0)] == ["after"]
            assert follower.stats == bus.ConsumerStats(delivered=1, skipped_invalid=1)


def test_oversized_event_raises_instead_of_vanishing(bus_config: BusConfig) -> None:
    letter = DeadLetter(reason="big", origin_topic="t.x", origin_partition=0, origin_offset=0, raw="x" * 2_000_000)
    started = time.monotonic()
    with EventPublisher(bus_config) as publisher, pytest.raises(PublishError, match="exceeds the message size"):
        publisher.publish("dlq", make_event("run-a", letter))
    assert time.monotonic() - started < 5, "not retried: a too-large message is not a retriable error"


# ---------------------------------------------------------------------------------------------------------------------
# consuming


def test_commit_then_restart_continues_after_the_committed_offset(bus_config: BusConfig, fast_group: dict) -> None:
    with EventPublisher(bus_config) as publisher:
        placed = [publisher.publish("control", _stop("run-a", f"e{i}")) for i in range(5)]
    topic = f"{bus_config.namespace}.control"
    with EventConsumer(bus_config, "control", "learner", **fast_group) as first:
        events = _poll_until(first, 5)
        assert [e.event.payload.reason for e in events] == [f"e{i}" for i in range(5)]
        assert [(e.partition, e.offset) for e in events] == placed
        committed = first.commit(bus.next_offsets(events[:3]))
        assert committed == {(topic, 0): placed[2][1] + 1}
        assert first.lag() == {0: 5 - 3}
    with EventConsumer(bus_config, "control", "learner", **fast_group) as second:
        rest = _poll_until(second, 2)
        rest += second.poll(timeout_s=0.5)  # nothing more may come
        assert [e.event.payload.reason for e in rest] == ["e3", "e4"]
        assert second.commit() == {(topic, 0): 5}
        assert second.lag() == {0: 0}
    (lag,) = bus.group_lag(bus_config, "learner")
    assert (lag.topic, lag.partition, lag.committed, lag.end_offset, lag.lag) == (topic, 0, 5, 5, 0)
    assert "learner" in bus.list_groups(bus_config)


def test_run_log_reads_the_runs_partition_and_says_since_when_it_is_complete(bus_config: BusConfig) -> None:
    config = bus_config.model_copy(update={"topic_partitions": 3})
    bus.ensure_topics(config)
    runs = [f"run{i}" for i in range(6)]  # over 3 partitions: some share one, some do not
    with EventPublisher(config) as publisher:
        sent = {(run, k): publisher.publish("control", _stop(run, f"{run}-{k}")) for k in range(2) for run in runs}
    placed = {run: sent[run, 0][0] for run in runs}
    for run in runs:
        log = bus.run_log(config, "control", run)
        assert [r.event.payload.reason for r in log.records] == [f"{run}-0", f"{run}-1"]
        assert {r.partition for r in log.records} == {placed[run]}  # the partition its events went to
        assert log.complete_since_ms is None  # nothing ever aged out of a new topic



def test_a_run_log_is_complete_since_its_oldest_retained_message_once_retention_trimmed_it() -> None:
    from pipeline.io.bus.tail import complete_since_ms

    records = [TailRecord("t", 0, offset, stamp, "r", None, None, None) for offset, stamp in ((7, 500), (8, 400))]
    assert complete_since_ms(0, records, now_ms=900) is None  # the partition starts at offset 0: nothing aged out
    assert complete_since_ms(7, records, now_ms=900) == 400  # the oldest message still held (clocks may disagree)
    assert complete_since_ms(9, [], now_ms=900) == 900  # every message aged out


def test_a_read_positioned_on_messages_retention_removed_goes_on_from_the_earliest_left(monkeypatch, caplog) -> None:
    """Not against Tansu: it neither trims on demand nor reports a position out of range, so the reader's reset
    policy is checked as set, and what the read makes of the jump with a consumer whose position jumps."""
    import importlib
    from types import SimpleNamespace

    from kafka import TopicPartition

    tail_module = importlib.import_module("pipeline.io.bus.tail")  # the module, not the function of that name

    settings: dict[str, Any] = {}
    closed = SimpleNamespace(close=lambda **kwargs: None)
    monkeypatch.setattr(tail_module, "_connect", lambda cls, config, given: settings.update(given) or closed)
    with tail_module._reader(BusConfig(bootstrap_servers="localhost:9092"), None, "tail"):
        pass
    assert settings["auto_offset_reset"] == "earliest"  # kafka-python's default, latest, would skip to the end

    tp = TopicPartition("ns.control", 0)

    class Trimmed:  # offsets 0-2 removed by retention after the read was positioned at 0
        at = 0

        def position(self, partition: TopicPartition) -> int:
            return self.at

        def poll(self, timeout_ms: int = 0) -> dict[TopicPartition, list[Any]]:
            self.at = 5
            return {tp: [SimpleNamespace(topic=tp.topic, partition=0, offset=offset, timestamp=offset, key=b"r",
                                         value=encode_event(_stop("r", f"m{offset}"))) for offset in (3, 4)]}

    with caplog.at_level(logging.WARNING, logger="pipeline.io.bus"):
        backlog, newer = tail_module._read_until(Trimmed(), {tp: 5}, idle_timeout_s=1.0)  # type: ignore[arg-type]
    assert [item.offset for item in backlog] == [3, 4] and newer == []
    (line,) = [r.getMessage() for r in caplog.records]
    assert "ns.control" in line and "offsets 0 to 2" in line and "removed by retention" in line


def test_seek_and_lag_per_partition(bus_config: BusConfig, fast_group: dict) -> None:
    config = bus_config.model_copy(update={"topic_partitions": 2})
    with EventPublisher(config) as publisher:
        placed = {(run, i): publisher.publish("control", _stop(run, f"{run}-{i}")) for run in "abcd" for i in range(2)}
    per_partition = Counter(partition for partition, _ in placed.values())
    topic = f"{config.namespace}.control"
    with EventConsumer(config, "control", "seeker", **fast_group) as consumer:
        assert consumer.lag() == {p: per_partition.get(p, 0) for p in (0, 1)}  # nothing committed yet
        # Seek before the group assigned anything: applied when the partitions arrive.
        consumer.seek({(topic, p): 1 for p in (0, 1)})
        expected = {f"{run}-{i}" for (run, i), (_, offset) in placed.items() if offset >= 1}
        events = _poll_until(consumer, len(expected))
        assert {e.event.payload.reason for e in events} == expected
        # Seek again now that the partitions are assigned: everything comes back.
        consumer.seek({f"{topic}:{p}": 0 for p in (0, 1)})
        again = _poll_until(consumer, len(placed))
        assert sorted(e.event.payload.reason for e in again) == sorted(f"{r}-{i}" for r, i in placed)
        assert consumer.positions() == {(topic, p): per_partition.get(p, 0) for p in (0, 1)}
        consumer.commit()
        assert consumer.lag() == {0: 0, 1: 0}


def test_a_reader_without_membership_reads_every_partition_and_commits_for_its_group(bus_config: BusConfig) -> None:
    # The learner's way of reading: no group join (nothing to wait for, nothing a departed member can strand),
    # the group id keeping only the committed offsets, which the next reader of that id starts from.
    config = bus_config.model_copy(update={"topic_partitions": 2})
    with EventPublisher(config) as publisher:
        placed = {run: publisher.publish("control", _stop(run, run)) for run in "abcdef"}
    topic = f"{config.namespace}.control"
    first = EventConsumer(config, "control", "solo", membership=False)
    with EventConsumer(config, "control", "solo", membership=False) as beside:  # no rebalance: both read at once
        assert first.assignment() == beside.assignment() == [(topic, 0), (topic, 1)]
        assert not first.rebalancing
        assert {e.event.payload.reason for e in _poll_until(beside, 6)} == set("abcdef")
    events = _poll_until(first, 6)
    committed = first.commit(bus.next_offsets([e for e in events if e.event.payload.reason in "abc"]))
    first.close()
    assert committed  # the first three runs' events, on one partition or both
    lags = {lag.partition: lag.committed for lag in bus.group_lag(config, "solo")}
    assert all(lags[partition] == offset for (_, partition), offset in committed.items())
    with EventConsumer(config, "control", "solo", membership=False) as second:
        rest = _poll_until(second, sum(1 for r, (p, o) in placed.items() if o >= committed.get((topic, p), 0)))
    assert {e.event.payload.reason for e in rest} == {r for r, (p, o) in placed.items()
                                                      if o >= committed.get((topic, p), 0)}


def test_a_renamed_group_adopts_its_former_names_offsets_while_it_has_none_and_no_members(
        bus_config: BusConfig, fast_group: dict, caplog: pytest.LogCaptureFixture) -> None:
    config = bus_config.model_copy(update={"topic_partitions": 2})
    other = config.model_copy(update={"namespace": f"{config.namespace}-other"})
    with EventPublisher(config) as publisher:
        placed = {run: publisher.publish("control", _stop(run, run)) for run in "abcdef"}
    assert {partition for partition, _ in placed.values()} == {0, 1}
    topic, other_topic = f"{config.namespace}.control", f"{other.namespace}.control"
    with EventPublisher(other) as publisher:
        publisher.publish("control", _stop("a", "other"))
    with EventConsumer(config, "control", "former", membership=False) as former:
        former.commit({(topic, 0): 1, (topic, 1): 2})
    with EventConsumer(other, "control", "former", membership=False) as former:
        former.commit({(other_topic, 0): 1})  # another namespace's topic: not this one's to adopt
    with EventConsumer(config, "control", "renamed", **fast_group) as member:
        member.wait_for_assignment()
        with caplog.at_level(logging.INFO, logger="pipeline.io.bus.admin"):
            assert bus.adopt_group_offsets(config, "control", "renamed", "former") == {}, "the group has a member"
    refusal = next(r.getMessage() for r in caplog.records if "adopted no offsets" in r.getMessage())
    assert "Error" in refusal and "no members" not in refusal  # the broker's own error names, nothing assumed
    assert bus.adopt_group_offsets(config, "control", "renamed", "former") == {(topic, 0): 1, (topic, 1): 2}
    assert {lag.partition: lag.committed for lag in bus.group_lag(config, "renamed")} == {0: 1, 1: 2}
    assert bus.adopt_group_offsets(config, "control", "renamed", "former") == {}  # it has its own now
    expected = {run for run, (partition, offset) in placed.items() if offset >= (1 if partition == 0 else 2)}
    with EventConsumer(config, "control", "renamed", membership=False) as reader:
        assert {e.event.payload.reason for e in _poll_until(reader, len(expected))} == expected


def test_a_renamed_group_with_an_offset_on_any_partition_of_the_topic_adopts_nothing(bus_config: BusConfig) -> None:
    # Its own offset on partition 1 says it has read this topic under its new name: partition 0 without one is
    # where it has read nothing yet, not where the former name's offset still applies.
    config = bus_config.model_copy(update={"topic_partitions": 2})
    with EventPublisher(config) as publisher:
        for run in "abcd":
            publisher.publish("control", _stop(run, run))
    topic = f"{config.namespace}.control"
    with EventConsumer(config, "control", "former", membership=False) as former:
        former.commit({(topic, 0): 1, (topic, 1): 1})
    with EventConsumer(config, "control", "renamed", membership=False) as own:
        own.commit({(topic, 1): 0})
    assert bus.adopt_group_offsets(config, "control", "renamed", "former") == {}
    assert {lag.partition: lag.committed for lag in bus.group_lag(config, "renamed")} == {1: 0}


def test_poison_messages_go_to_the_dlq_and_consumption_continues(bus_config: BusConfig, fast_group: dict) -> None:
    topic = f"{bus_config.namespace}.control"
    newer = json.loads(encode_event(_stop("run-a", "from the future")))
    newer["schema_version"] = "2.0"
    poison = {
        "raw bytes": (b"\x80\x81\x82 binary", "not JSON"),
        "invalid json": (b"{not json", "not JSON"),
        "unknown type": (
            json.dumps({"type": "Bogus", "run_id": "run-a", "payload": {}}).encode(),
            "unknown event type",
        ),
        "newer major": (json.dumps(newer).encode(), "newer than this rlpipe reads"),
        "null value": (None, "empty message"),
    }
    with EventPublisher(bus_config) as publisher:
        publisher.publish("control", _stop("run-a", "good-1"))
        origin = {name: publisher.publish_raw(topic, value, "run-a")[1] for name, (value, _) in poison.items()}
        publisher.publish("control", _stop("run-b", "someone else's"))
        publisher.publish("control", _stop("run-a", "good-2"))
    with EventConsumer(bus_config, "control", "worker", run_id="run-a", **fast_group) as consumer:
        events = _poll_until(consumer, 2)
        assert [e.event.payload.reason for e in events] == ["good-1", "good-2"]
        assert consumer.stats == bus.ConsumerStats(delivered=2, dead_lettered=len(poison), skipped_other_runs=1)
        consumer.commit()  # skipped and dead-lettered messages are covered too
        assert consumer.lag() == {0: 0}
    letters = [r.event for r in bus.tail(bus_config, "dlq", n=20) if r.event is not None]
    assert len(letters) == len(poison)
    by_offset = {letter.payload.origin_offset: letter for letter in letters}
    for name, (value, reason) in poison.items():
        letter = by_offset[origin[name]]
        assert reason in letter.payload.reason, name
        assert (letter.payload.origin_topic, letter.payload.origin_partition) == (topic, 0)
        assert letter.payload.key == "run-a"
        assert letter.run_id == "run-a"
        assert letter.payload.raw == (value or b"").decode("utf-8", errors="replace")


def test_a_poison_message_with_a_huge_key_is_dead_lettered_not_retried_for_ever(
        bus_config: BusConfig, fast_group: dict) -> None:
    # The message fits the broker's limit; its dead letter would carry the key twice (as its key and in the
    # letter), exceed it, and fail on every poll: one poison message would block the topic.
    topic = f"{bus_config.namespace}.control"
    huge_key = "k" * 700_000
    with EventPublisher(bus_config) as publisher:
        publisher.publish_raw(topic, b"{poison", huge_key)
        publisher.publish("control", _stop("run-a", "after"))
    with EventConsumer(bus_config, "control", "worker", **fast_group) as consumer:
        assert [e.event.payload.reason for e in _poll_until(consumer, 1)] == ["after"]
        assert consumer.stats.dead_lettered == 1
    (letter,) = [r for r in bus.tail(bus_config, "dlq", n=5) if r.event is not None]
    assert letter.event.payload.key == huge_key[:bus.DEAD_LETTER_RAW_BYTES]
    assert letter.event.run_id == "unknown"


def test_a_reader_that_must_not_skip_stops_at_a_newer_event_instead_of_dead_lettering_it(
        bus_config: BusConfig, fast_group: dict) -> None:
    """``refuse_newer``: an event from a newer rlpipe is readable after an upgrade, so a reader that must not
    skip one (the learner's batch announcements) stops there, asking for the upgrade, and reads it again next."""
    topic = f"{bus_config.namespace}.control"
    newer = json.loads(encode_event(_stop("run-a", "from the future")))
    newer["schema_version"] = "2.0"
    with EventPublisher(bus_config) as publisher:
        publisher.publish("control", _stop("run-a", "before"))
        publisher.publish_raw(topic, json.dumps(newer).encode(), "run-a")
    with EventConsumer(bus_config, "control", "strict", refuse_newer=True, run_id="run-a", **fast_group) as consumer:
        consumer.wait_for_assignment()
        for _ in range(2):
            with pytest.raises(NewerEventError, match="upgrade rlpipe"):
                _poll_until(consumer, 2)
        assert consumer.stats.dead_lettered == 0 and consumer.commit() == {}
    # another run's reader goes past it: that run's own readers stop on it (the topic is shared by every run);
    # whose run it is comes from the envelope, not the key (which a newer rlpipe may use otherwise)
    keyed_otherwise = {**newer, "run_id": "run-c"}
    with EventPublisher(bus_config) as publisher:
        publisher.publish_raw(topic, json.dumps(keyed_otherwise).encode(), "producer-7")
    with EventConsumer(bus_config, "control", "third", refuse_newer=True, run_id="run-c", **fast_group) as consumer:
        consumer.wait_for_assignment()
        with pytest.raises(NewerEventError):
            _poll_until(consumer, 3)
    with EventConsumer(bus_config, "control", "other", refuse_newer=True, run_id="run-b", **fast_group) as consumer:
        consumer.wait_for_assignment()
        assert _poll_until(consumer, 1, timeout_s=5.0) == []
        assert consumer.stats.skipped_other_runs == 3 and consumer.stats.dead_lettered == 0
    assert not [r for r in bus.tail(bus_config, "dlq", n=20) if r.event is not None]


def test_an_event_type_added_by_a_newer_minor_is_skipped_and_counted_not_dead_lettered(
        bus_config: BusConfig, fast_group: dict) -> None:
    """A newer rlpipe of the same major may add event types; an older reader skips them (counted in its stats),
    the strict ones too, since a minor version adds only what older readers may ignore: no dead letter."""
    topic = f"{bus_config.namespace}.control"
    added = {**json.loads(encode_event(_stop("run-a", "x"))), "type": "RunPaused", "schema_version": "1.9",
             "payload": {"reason": "a later feature"}}
    with EventPublisher(bus_config) as publisher:
        publisher.publish("control", _stop("run-a", "before"))
        publisher.publish_raw(topic, json.dumps(added).encode(), "run-a")
        publisher.publish("control", _stop("run-a", "after"))
    for group, strict in (("lenient", False), ("strict", True)):
        with EventConsumer(bus_config, "control", group, refuse_newer=strict, run_id="run-a", **fast_group) as consumer:
            events = _poll_until(consumer, 2)
            assert [e.event.payload.reason for e in events] == ["before", "after"]
            assert consumer.stats == bus.ConsumerStats(delivered=2, skipped_newer_types=1), group
            consumer.commit()
            assert consumer.lag() == {0: 0}
    follower = bus.EventFollower(bus_config, "control", run_id="run-a", start="earliest")
    try:
        events = _poll_until(follower, 2)
        assert [e.event.payload.reason for e in events] == ["before", "after"]
        assert follower.stats.skipped_newer_types == 1 and follower.stats.skipped_invalid == 0
    finally:
        follower.close()
    assert not [r for r in bus.tail(bus_config, "dlq", n=20) if r.event is not None]


def test_a_failed_dead_letter_loses_nothing(bus_config: BusConfig, fast_group: dict, monkeypatch) -> None:
    topic = f"{bus_config.namespace}.control"
    with EventPublisher(bus_config) as publisher:
        publisher.publish("control", _stop("run-a", "before"))
        publisher.publish_raw(topic, b"{poison", "run-a")
        publisher.publish("control", _stop("run-a", "after"))
    with EventConsumer(bus_config, "control", "careful", **fast_group) as consumer:
        consumer.wait_for_assignment()
        real_publisher = consumer._dead_letter_publisher()
        real_publish_raw = real_publisher.publish_raw
        calls = []

        def failing_once(*args: Any, **kwargs: Any) -> tuple[int, int]:
            calls.append(args)
            if len(calls) == 1:
                raise PublishError("the DLQ is unavailable")
            return real_publish_raw(*args, **kwargs)

        monkeypatch.setattr(real_publisher, "publish_raw", failing_once)
        with pytest.raises(PublishError):
            _poll_until(consumer, 2)
        assert consumer.stats == bus.ConsumerStats(), "the failed batch counts for nothing"
        events = _poll_until(consumer, 2)
        assert [e.event.payload.reason for e in events] == ["before", "after"]
        assert consumer.stats.dead_lettered == 1
        assert consumer.commit() == {(topic, 0): 3}


def test_json_the_parser_gives_up_on_is_dead_lettered_and_every_reader_goes_on(
        bus_config: BusConfig, fast_group: dict) -> None:
    """Nesting deeper than Python's JSON parser recurses, or an integer of more digits than ``int()`` takes, fails
    the parser with other errors than a syntax error: still a poison message, dead-lettered by a group member and
    skipped by a follower, the events around it delivered."""
    topic = f"{bus_config.namespace}.control"
    poison = {"deeply nested": b"[" * 100_000, "huge integer": b'{"type": "RunStopped", "n": ' + b"9" * 5_000 + b"}"}
    with EventPublisher(bus_config) as publisher:
        publisher.publish("control", _stop("run-a", "before"))
        origin = {name: publisher.publish_raw(topic, value, "run-a")[1] for name, value in poison.items()}
        publisher.publish("control", _stop("run-a", "after"))
    with bus.EventFollower(bus_config, "control", run_id="run-a", start="earliest") as follower:
        events = _poll_until(follower, 2, timeout_s=10.0)
        assert [e.event.payload.reason for e in events] == ["before", "after"]
        assert follower.stats == bus.ConsumerStats(delivered=2, skipped_invalid=len(poison))
    with EventConsumer(bus_config, "control", "worker", run_id="run-a", **fast_group) as consumer:
        events = _poll_until(consumer, 2)
        assert [e.event.payload.reason for e in events] == ["before", "after"]
        assert consumer.stats == bus.ConsumerStats(delivered=2, dead_lettered=len(poison))
        assert consumer.commit() == {(topic, 0): origin["huge integer"] + 2}
    letters = {r.event.payload.origin_offset: r.event.payload for r in bus.tail(bus_config, "dlq", n=20) if r.event}
    assert sorted(letters) == sorted(origin.values())
    for name, offset in origin.items():
        assert letters[offset].reason.startswith("not JSON"), name
        assert letters[offset].raw_truncated == (len(poison[name]) > bus.DEAD_LETTER_RAW_BYTES), name


def test_a_key_that_is_not_utf8_neither_hides_an_event_nor_stops_its_dead_letter(
        bus_config: BusConfig, fast_group: dict) -> None:
    topic = f"{bus_config.namespace}.control"
    poison = b'{"run_id": "run-a", "type": "RunStopped"'  # cut short: whose run it is still shows
    with EventPublisher(bus_config) as publisher:
        publisher.publish_raw(topic, encode_event(_stop("run-a", "good")), b"\xff\xfe")
        at = publisher.publish_raw(topic, poison, b"\x80run")[1]
    with EventConsumer(bus_config, "control", "worker", run_id="run-a", **fast_group) as consumer:
        events = _poll_until(consumer, 1)
        assert len(events) == 1, f"{len(events)} events read in 20 s, expected the good one"
        (event,) = events
        assert (event.event.payload.reason, event.key) == ("good", "\ufffd\ufffd")
        assert consumer.stats == bus.ConsumerStats(delivered=1, dead_lettered=1)
        assert consumer.commit() == {(topic, 0): at + 1}
    (letter,) = [r for r in bus.tail(bus_config, "dlq", n=5) if r.event is not None]
    assert (letter.key, letter.event.run_id) == ("\ufffdrun", "run-a")
    assert (letter.event.payload.key, letter.event.payload.origin_offset) == ("\ufffdrun", at)


def test_follower_reads_without_a_group_from_where_it_was_placed(bus_config: BusConfig) -> None:
    topic = f"{bus_config.namespace}.control"
    with EventPublisher(bus_config) as publisher:
        first = publisher.publish("control", _stop("run-a", "before"))[1]
        with bus.EventFollower(bus_config, "control", run_id="run-a") as latest, \
                bus.EventFollower(bus_config, "control", run_id="run-a", start="earliest") as earliest, \
                bus.EventFollower(bus_config, "control", run_id="run-a", offsets={0: first + 1}) as placed:
            assert latest.positions() == {(topic, 0): first + 1}  # "latest" is fixed before the constructor returns
            publisher.publish_raw(topic, b"{not json", "run-a")
            publisher.publish("control", _stop("run-b", "someone else's"))
            publisher.publish("control", _stop("run-a", "after"))
            expected = {"latest": ["after"], "earliest": ["before", "after"], "placed": ["after"]}
            seen: dict[str, list[str]] = {name: [] for name in expected}  # what each delivered, over every poll
            deadline = time.monotonic() + 10.0
            while seen != expected and time.monotonic() < deadline:
                for name, follower in (("latest", latest), ("earliest", earliest), ("placed", placed)):
                    seen[name] += [e.event.payload.reason for e in follower.poll(0.0)]
                time.sleep(0.05)
            assert seen == expected
            assert latest.stats == bus.ConsumerStats(delivered=1, skipped_other_runs=1, skipped_invalid=1)
    assert list(bus.tail(bus_config, "dlq", n=20)) == []  # skipped, not dead-lettered: every follower sees it


def test_keep_alive_keeps_the_member_in_its_group(bus_config: BusConfig, fast_group: dict) -> None:
    fast_group["max_poll_interval_ms"] = 2000
    with EventPublisher(bus_config) as publisher:
        publisher.publish("control", _stop("run-a", "first"))
        with EventConsumer(bus_config, "control", "slow-worker", **fast_group) as consumer:
            assert [e.event.payload.reason for e in _poll_until(consumer, 1)] == ["first"]
            publisher.publish("control", _stop("run-a", "during-work"))
            topic_partition = (f"{bus_config.namespace}.control", 0)
            work_until = time.monotonic() + 3.0  # longer than max_poll_interval_ms
            while time.monotonic() < work_until:
                consumer.keep_alive()
                time.sleep(0.2)
            assert consumer.positions() == {topic_partition: 1}, "keep_alive consumed nothing"
            assert consumer.commit() == {topic_partition: 1}, "still a member: the commit is accepted"
            assert [e.event.payload.reason for e in consumer.poll(timeout_s=2.0)] == ["during-work"]
            time.sleep(3.0)  # the same work without keep_alive: the group drops the member
            # its heartbeat thread leaves the group about 2.1 s after the last poll, later on a loaded machine:
            # the broker takes commits until it has
            deadline = time.monotonic() + 30.0
            with pytest.raises(bus.CommitError, match="dropped from the group"):
                while time.monotonic() < deadline:
                    consumer.commit()
                    time.sleep(0.2)
                pytest.fail("the group never dropped the member that stopped polling")


def _settle(members: list[EventConsumer], timeout_s: float = 60.0) -> None:
    """Poll every member, consuming nothing, until each owns one partition and none is rejoining.

    Every member polls on every round, an assigned one too: a member that stops polling while the group
    rebalances holds the rebalance up until ``max_poll_interval_ms`` drops it.
    """
    deadline = time.monotonic() + timeout_s
    while not all(len(m.assignment()) == 1 and not m.rebalancing for m in members):
        assert time.monotonic() < deadline, f"the group never settled: {[m.assignment() for m in members]}"
        for member in members:
            member.keep_alive()
            member.wait_for_assignment(timeout_s=0.3)
        time.sleep(0.05)  # assigned members' polls return at once: the broker's rebalance needs the cores too


def test_a_commit_after_a_rebalance_leaves_the_partitions_another_member_owns_now(
        bus_config: BusConfig, fast_group: dict) -> None:
    # The broker accepts a member's commit for any partition of the group; a member that commits what it read
    # before a rebalance would overwrite the offsets of the partition's new owner.
    config = bus_config.model_copy(update={"topic_partitions": 2})
    with EventPublisher(config) as publisher:
        placed = {run: publisher.publish("control", _stop(run, run)) for run in "abcdef"}
    assert {partition for partition, _ in placed.values()} == {0, 1}
    first = EventConsumer(config, "control", "pair", **fast_group)
    try:
        events = _poll_until(first, len(placed))
        assert len(events) == len(placed)
        with EventConsumer(config, "control", "pair", **fast_group) as newcomer:
            _settle([first, newcomer])
            (mine,), (theirs,) = first.assignment(), newcomer.assignment()
            committed = first.commit(bus.next_offsets(events))
            assert committed == {mine: bus.next_offsets(events)[mine]}
            assert newcomer.committed()[theirs[1]] is None, "the newcomer's partition was committed by the other"
    finally:
        first.close()


def test_a_member_closed_during_a_rebalance_hands_its_partitions_over(bus_config: BusConfig, fast_group: dict) -> None:
    # A learner fenced out while a newer one joins: it is closed with its rejoin still in flight (keep_alive
    # polls without waiting).  Leaving then must not strand the newcomer in a generation led by a gone member.
    topic_partition = (f"{bus_config.namespace}.control", 0)
    first = EventConsumer(bus_config, "control", "learner", **fast_group)
    try:
        assert first.wait_for_assignment() == [topic_partition]
        with EventConsumer(bus_config, "control", "learner", **fast_group) as newcomer:
            newcomer.wait_for_assignment(timeout_s=0.1)  # its join is under way: the group rebalances
            deadline = time.monotonic() + 15.0
            while not first.rebalancing and time.monotonic() < deadline:
                first.keep_alive()
                newcomer.wait_for_assignment(timeout_s=0.1)
            assert first.rebalancing, "the first member never saw the rebalance"
            first.close()
            assert newcomer.wait_for_assignment(timeout_s=30.0) == [topic_partition]
    finally:
        first.close()


def test_a_member_that_only_keeps_alive_finishes_its_rejoin(bus_config: BusConfig, fast_group: dict) -> None:
    # A learner in long work calls only keep_alive while a newcomer joins.  Its rejoin's JoinGroup and SyncGroup
    # complete in the background between two calls (the sleeps make sure of it); kafka-python drops such a finished
    # rejoin and starts another unless a poll is waiting on it, so zero-timeout polls alone never finish one.
    config = bus_config.model_copy(update={"topic_partitions": 2})
    first = EventConsumer(config, "control", "keeper", **fast_group)
    try:
        assert len(first.wait_for_assignment()) == 2
        with EventConsumer(config, "control", "keeper", **fast_group) as newcomer:
            deadline = time.monotonic() + 30.0
            while not newcomer.assignment() and time.monotonic() < deadline:
                first.keep_alive()
                newcomer.wait_for_assignment(timeout_s=0.3)
            (theirs,) = newcomer.assignment()
            deadline = time.monotonic() + 15.0
            while (first.rebalancing or len(first.assignment()) != 1) and time.monotonic() < deadline:
                first.keep_alive()
                newcomer.keep_alive()
                time.sleep(0.3)  # longer than a JoinGroup and SyncGroup to the local broker take
            assert not first.rebalancing, f"the first member never finished its rejoin: {first.assignment()}"
            (mine,) = first.assignment()
            assert mine != theirs
    finally:
        first.close()

# ---------------------------------------------------------------------------------------------------------------------
# failures within bounded time


def test_unreachable_broker_fails_fast_with_one_line() -> None:
    port = free_port()
    config = BusConfig(bootstrap_servers=f"127.0.0.1:{port}", connect_timeout_s=2.0)
    for attempt in (
        lambda: EventPublisher(config),
        lambda: bus.list_topics(config),
        lambda: list(bus.tail(config, "control")),
    ):
        started = time.monotonic()
        with pytest.raises(BusUnavailableError) as caught:
            attempt()
        assert time.monotonic() - started < 3.0
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith(f"cannot reach Kafka at 127.0.0.1:{port} within 2s: ")
        assert "rlpipe up" in message


def test_silent_listener_times_out_within_the_connect_timeout() -> None:
    with socket.socket() as silent:  # accepts connections (the kernel does) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        config = BusConfig(bootstrap_servers=f"127.0.0.1:{port}", connect_timeout_s=1.5)
        started = time.monotonic()
        with pytest.raises(BusUnavailableError, match=r"within 1\.5s"):
            bus.list_topics(config)
        assert time.monotonic() - started < 1.5 + 1.5


def test_wrong_sasl_setting_fails_within_bounded_time(kafka_broker: Any) -> None:
    config = BusConfig(
        bootstrap_servers=kafka_broker.bootstrap_servers,
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="PLAIN",
        sasl_username="mallory",
        sasl_password=SecretStr("hunter2"),
        connect_timeout_s=1.5,
    )
    started = time.monotonic()
    with pytest.raises(BusUnavailableError) as caught:
        bus.list_topics(config)
    assert time.monotonic() - started < 1.5 + 1.5
    assert "sasl" in str(caught.value).lower()
    assert "hunter2" not in str(caught.value)


def test_a_timeout_at_the_deadline_does_not_hide_the_failure_that_explains_it() -> None:
    """kafka-python retries a refused SASL handshake until the deadline; on a busy machine its last attempt can
    end in a connect timeout, which must not replace the refusal (the reason the user can act on)."""
    from pipeline.io.bus.connection import _KafkaReasons

    reasons = _KafkaReasons()
    kafka_log = logging.getLogger("kafka.net.manager")
    kafka_log.addHandler(reasons)
    try:
        for failure in (
            "[Error 33] UnsupportedSaslMechanismError (backoff 0.05 secs)",
            "KafkaConnectionError: Connection timed out (backoff 0.11 secs)",
            "KafkaTimeoutError: Connection timed out",
        ):
            kafka_log.warning("Bootstrap connection to bootstrap-0 failed: %s", failure)
    finally:
        kafka_log.removeHandler(reasons)
    assert reasons.last == "[Error 33] UnsupportedSaslMechanismError"

    only_timeouts = _KafkaReasons()
    only_timeouts.emit(logging.LogRecord("kafka", logging.WARNING, "", 0, "Bootstrap connection to b failed: %s",
                                         ("KafkaConnectionError: Connection timed out",), None))
    assert only_timeouts.last == "KafkaConnectionError: Connection timed out"


def test_tls_against_a_plaintext_broker_fails_within_bounded_time(kafka_broker: Any) -> None:
    config = BusConfig(bootstrap_servers=kafka_broker.bootstrap_servers, security_protocol="SSL", connect_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(BusUnavailableError, match="TLS handshake failed"):
        EventPublisher(config)
    assert time.monotonic() - started < 1.0 + 1.5


# ---------------------------------------------------------------------------------------------------------------------
# rewinding (no network: a stand-in for the Kafka client)


class _SeekingClient:
    """The two calls ``_rewind`` makes, with a seek that can fail."""

    def __init__(self, assigned: set[Any], error: Exception | None) -> None:
        self.assigned, self.error, self.seeks = assigned, error, []

    def assignment(self) -> set[Any]:
        return self.assigned

    def seek(self, tp: Any, offset: int) -> None:
        if self.error is not None:
            raise self.error
        self.seeks.append((tp, offset))


def _record(offset: int) -> Any:
    return type("Record", (), {"offset": offset})()


def test_a_failed_seek_while_rewinding_is_raised_not_swallowed() -> None:
    from kafka import TopicPartition

    tp, gone = TopicPartition("ns.trajectories", 0), TopicPartition("ns.trajectories", 1)
    consumer = EventConsumer.__new__(EventConsumer)  # no broker: only the client stand-in below is used
    consumer._consumer = _SeekingClient({tp}, ValueError("Unassigned partition"))
    with pytest.raises(bus.RewindError, match=r"ns.trajectories:0 back to offset 7 .*would be skipped"):
        consumer._rewind({tp: [_record(7), _record(8)]})
    # a partition the group took away is not ours to rewind: its next owner starts from the committed offset
    consumer._consumer = _SeekingClient({tp}, None)
    consumer._rewind({tp: [_record(7), _record(8)], gone: [_record(3)]})
    assert consumer._consumer.seeks == [(tp, 7)]


class _LateMetadataClient:
    """A client whose broker learns of a topic another process has just created only after a few requests."""

    def __init__(self, unknown_for: int) -> None:
        self.unknown_for, self.assigned, self.positioned = unknown_for, [], []

    def partitions_for_topic(self, topic: str) -> set[int]:
        self.unknown_for -= 1
        return set() if self.unknown_for >= 0 else {0, 1}

    def assign(self, tps: list[Any]) -> None:
        self.assigned = list(tps)

    def seek_to_end(self, tp: Any) -> None:
        self.positioned.append(tp.partition)

    def position(self, tp: Any, timeout_ms: int | None = None) -> int:
        return 0


def test_a_follower_placed_at_a_moment_reads_what_was_published_since_and_nothing_before(
        bus_config: BusConfig) -> None:
    topic = f"{bus_config.namespace}.control"
    with EventPublisher(bus_config) as publisher:
        publisher.publish("control", _stop("run-a", "before"))
        time.sleep(0.05)  # the next event's timestamp after the moment, in milliseconds
        moment = time.time()
        since = publisher.publish("control", _stop("run-a", "since"))[1]
        with bus.EventFollower(bus_config, "control", since_s=moment) as placed, \
                bus.EventFollower(bus_config, "control", since_s=time.time() + 60) as later:
            assert placed.positions() == {(topic, 0): since}
            assert later.positions() == {(topic, 0): since + 1}  # nothing published since: its end
    with pytest.raises(ValueError, match="since_s must be unix seconds"):
        bus.EventFollower(bus_config, "control", since_s=float("nan"))


def test_a_follower_waits_for_a_topic_just_created_elsewhere_to_reach_its_metadata() -> None:
    # Two processes of a run create the namespace's topics at once: the one that lost the race (the topic already
    # exists) goes on at once, before the broker it asks for metadata may know the topic.
    follower = bus.EventFollower.__new__(bus.EventFollower)  # no broker: only the client stand-in below is used
    follower.topic, follower._timeout_ms = "ns.adapters", 5000
    follower._consumer = _LateMetadataClient(unknown_for=3)
    follower._assign("latest", {})
    assert [tp.partition for tp in follower._consumer.assigned] == follower._consumer.positioned == [0, 1]
    follower._consumer = _LateMetadataClient(unknown_for=10**6)
    follower._timeout_ms = 300
    with pytest.raises(bus.UnknownTopicError, match=r"ns\.adapters does not exist"):
        follower._assign("latest", {})


class _TimingOutCommits:
    """A client whose commits run out of their timeout (its coordinator unknown); records each one's timeout."""

    def __init__(self) -> None:
        self.timeouts_ms: list[int] = []

    def commit(self, offsets: dict, timeout_ms: int) -> None:
        from kafka.errors import KafkaTimeoutError

        self.timeouts_ms.append(timeout_ms)
        raise KafkaTimeoutError(f"Timeout after {timeout_ms}ms")


def test_a_commit_waits_for_the_broker_for_the_timeout_it_is_given_and_is_refused_as_transient() -> None:
    consumer = EventConsumer.__new__(EventConsumer)  # no broker: only the client stand-in below is used
    consumer._consumer, consumer.membership, consumer.group_id = _TimingOutCommits(), False, "rlpipe-learner-a"
    consumer._timeout_ms, consumer._polled = 10_000, {}
    for timeout_s in (None, 0.3):
        with pytest.raises(bus.CommitError, match="commit to group rlpipe-learner-a failed") as refused:
            consumer.commit({("ns.trajectories", 0): 4}, timeout_s=timeout_s)
        assert refused.value.transient  # tried again later, not the end of the learner
    assert consumer._consumer.timeouts_ms == [10_000, 300]  # its own timeout, then the one given
