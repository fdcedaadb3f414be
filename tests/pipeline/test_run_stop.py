"""A single-run process following its run's ``RunStopped``: ``RunStopFollower`` and ``following_run_stop``."""

from __future__ import annotations

import datetime
import logging
import threading
import time

from pipeline.io.bus.records import ConsumedEvent
from pipeline.runtime import StopFlag
from schemas.config import RunConfig
from schemas.events import Payload, RunStopped, make_event


def config(run_id: str, **values) -> RunConfig:
    return RunConfig.model_validate({"run_id": run_id, "bus": {"bootstrap_servers": "localhost:9092"}, **values})


class Feed:
    """A follower of the control topic that hands over what it was given, once."""

    def __init__(self, queued: list[ConsumedEvent]) -> None:
        self.queued = queued

    def poll(self, timeout_s: float = 0.0) -> list[ConsumedEvent]:
        items, self.queued = self.queued, []
        return items

    def close(self) -> None:
        pass


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_single_run_process_whose_broker_is_away_at_its_start_hears_of_it_once_from_itself(caplog):
    """The process's own "cannot reach Kafka" line is the only one: its RunStopped follower tries quietly meanwhile."""
    from pipeline.run_stop import following_run_stop

    cfg = config("mine", bus={"bootstrap_servers": f"127.0.0.1:{_closed_port()}", "connect_timeout_s": 1.0})
    with caplog.at_level(logging.WARNING, logger="rlpipe"), following_run_stop(cfg, StopFlag()) as follower:
        pass  # the process fails on its own connection here
    assert [r.getMessage() for r in caplog.records] == []
    assert follower is not None  # had the process gone on, its run's stop would be followed once the broker answered


class Outage:
    """How a ``RunStopFollower`` reaches the control topic in a test: the broker away until ``answer()``, then a feed
    of the events sent at or after the moment it asks for (``since_s``, as ``EventFollower`` places itself)."""

    def __init__(self) -> None:
        self.sent: list = []
        self.since_s: list[float] = []  # one per try
        self.answers = threading.Event()

    def send(self, run_id: str, payload: Payload) -> None:
        self.sent.append(make_event(run_id, payload))

    def __call__(self, since_s: float | None) -> Feed:
        """None: from the topic's end now (what the offsets say, whatever the events' clocks); a time: by the clocks."""
        from pipeline.io.bus import BusUnavailableError

        self.since_s.append(since_s)
        if not self.answers.is_set():
            raise BusUnavailableError("cannot reach Kafka at 127.0.0.1:1 within 1s: connection refused")
        end = len(self.sent)
        return Feed([ConsumedEvent("ns.control", 0, n, e.run_id, e) for n, e in enumerate(self.sent)
                     if (n >= end if since_s is None else e.time.timestamp() >= since_s)])


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_stop_sent_while_the_broker_was_away_at_the_start_stops_the_process_once_it_answers(monkeypatch, caplog):
    """Followed from the process's start, not from when the broker first answers: a stop sent in between is read, one
    sent before the start is not, and the tries meanwhile are quiet."""
    from pipeline.run_stop import RunStopFollower

    monkeypatch.setattr(RunStopFollower, "RETRY_S", 0.01)
    outage, stop = Outage(), StopFlag()
    outage.send("mine", RunStopped(reason="an earlier session's stop"))
    time.sleep(0.01)  # the process starts strictly after that stop was sent
    with caplog.at_level(logging.WARNING, logger="rlpipe"):
        follower = RunStopFollower(config("mine").bus, "mine", stop, connect=outage)
        try:
            assert _wait_for(lambda: len(outage.since_s) >= 3)  # the broker away for a few tries
            outage.send("other", RunStopped(reason="another run's stop"))
            assert not stop()
            outage.send("mine", RunStopped(reason="stopped by rlpipe runs stop"))
            outage.answers.set()
            assert _wait_for(stop)
        finally:
            follower.close()
    assert follower.stopped == RunStopped(reason="stopped by rlpipe runs stop") and stop.run_stopped
    assert outage.since_s[0] is None  # the first try from the topic's end; it failed, so later ones by time
    assert len(set(outage.since_s[1:])) == 1 and outage.since_s[1] > outage.sent[0].time.timestamp()
    assert [r.getMessage() for r in caplog.records] == []


def test_a_follower_that_still_cannot_read_the_topic_after_a_while_says_so_once(monkeypatch, caplog):
    from pipeline.run_stop import RunStopFollower

    monkeypatch.setattr(RunStopFollower, "RETRY_S", 0.01)
    monkeypatch.setattr(RunStopFollower, "WARN_AFTER_S", 0.0)
    outage = Outage()
    with caplog.at_level(logging.WARNING, logger="rlpipe"):
        follower = RunStopFollower(config("mine").bus, "mine", StopFlag(), connect=outage)
        try:
            assert _wait_for(lambda: len(outage.since_s) >= 3)
        finally:
            follower.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "run mine's RunStopped is not followed yet" in lines[0] and "keeps trying" in lines[0], lines
    assert "cannot reach Kafka at 127.0.0.1:1" in lines[0] and "SIGTERM" in lines[0], lines


def test_a_broker_that_answers_at_once_is_followed_from_the_topics_end_whatever_the_senders_clock(monkeypatch):
    """A stop sent before the start, stamped by a clock ahead of this one, is not read: the first try takes the
    topic's end (an offset)."""
    from pipeline.run_stop import RunStopFollower

    outage, stop = Outage(), StopFlag()
    outage.answers.set()
    early = make_event("mine", RunStopped(reason="an earlier session's stop"))
    outage.sent.append(early.model_copy(update={"time": early.time + datetime.timedelta(minutes=5)}))
    follower = RunStopFollower(config("mine").bus, "mine", stop, connect=outage)
    try:
        assert _wait_for(lambda: len(outage.since_s) >= 1)
        time.sleep(3 * RunStopFollower.POLL_S)
        assert not stop() and outage.since_s == [None]
    finally:
        follower.close()
