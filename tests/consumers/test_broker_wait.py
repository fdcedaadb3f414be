"""A learner's write the broker refuses is tried again until it is taken, saying so once, then every so often."""

from __future__ import annotations

import logging

import pytest

from consumers import broker_wait
from consumers.broker_wait import BrokerAwayOnStop, until_the_broker_takes
from pipeline.io.bus import BusUnavailableError, PublishError


class Refusing:
    """A write the broker refuses ``times`` times, then takes (its result: how many tries it took)."""

    def __init__(self, times: int) -> None:
        self.times, self.tries = times, 0

    def __call__(self) -> int:
        self.tries += 1
        if self.tries <= self.times:
            raise PublishError("publishing a LearnerCheckpointed to ns.control failed: no acknowledgement within 2s")
        return self.tries


class Clock:
    """``consumers.broker_wait``'s clock: it moves only as the wait sleeps (each try takes no time)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_refused_write_is_tried_again_until_taken_with_one_warning_then_a_line_every_so_often(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(broker_wait, "time", Clock())
    write = Refusing(times=6)
    with caplog.at_level(logging.WARNING, logger="rlpipe.learner"):
        taken = until_the_broker_takes(write, "LearnerCheckpointed of step 2", "r", lambda: False,
                                       retry_wait_s=1.0, report_every_s=1.5)
    assert taken == write.tries == 7
    lines = [record.getMessage() for record in caplog.records]
    assert "did not take LearnerCheckpointed of step 2" in lines[0] and "no acknowledgement" in lines[0]
    assert "the broker took LearnerCheckpointed of step 2 after 6s" in lines[-1]
    # refused at 0, 1, ..., 5 s: a line at 2 s and at 4 s (1.5 s or more since the last), none at the other tries
    assert [line for line in lines[1:-1] if "still waiting" in line] == [
        "run r: still waiting for the broker to take LearnerCheckpointed of step 2, for 2s now (publishing a "
        "LearnerCheckpointed to ns.control failed: no acknowledgement within 2s)",
        "run r: still waiting for the broker to take LearnerCheckpointed of step 2, for 4s now (publishing a "
        "LearnerCheckpointed to ns.control failed: no acknowledgement within 2s)"]
    assert len(lines) == 4


def test_a_stop_during_the_wait_ends_it_in_one_line_naming_what_the_broker_never_took() -> None:
    write = Refusing(times=10**6)
    with pytest.raises(BrokerAwayOnStop) as stopped:
        until_the_broker_takes(write, "AdapterPublished v3 (step 6)", "r", lambda: write.tries >= 2,
                               retry_wait_s=0.01)
    message = str(stopped.value)
    assert write.tries == 2 and "\n" not in message
    assert "never took AdapterPublished v3 (step 6)" in message and "rlpipe learner start" in message


def test_a_write_taken_at_once_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rlpipe.learner"):
        assert until_the_broker_takes(Refusing(times=0), "x", "r", lambda: True) == 1
    assert not caplog.records


class Permanent(Refusing):
    """A write no try can get taken (an event over the broker's message size limit)."""

    def __call__(self) -> int:
        self.tries += 1
        raise PublishError("publishing a LearnerCheckpointed of 2000000 bytes to ns.control failed: it exceeds the "
                           "message size limit", transient=False)


def test_a_write_no_try_can_get_taken_is_raised_at_once_not_tried_again() -> None:
    write = Permanent(times=0)
    with pytest.raises(PublishError, match="message size limit"):
        until_the_broker_takes(write, "x", "r", lambda: write.tries >= 3, retry_wait_s=0.01)  # (a bound if retried)
    assert write.tries == 1


def test_before_each_try_again_the_caller_keeps_its_consumer_in_its_group_and_a_refusal_there_is_one_more_try(
        ) -> None:
    write, kept_alive = Refusing(times=3), []

    def keep_alive() -> None:
        kept_alive.append(write.tries)
        if len(kept_alive) == 1:
            raise BusUnavailableError("poll: the broker at 127.0.0.1:1 did not answer within 5s")

    assert until_the_broker_takes(write, "x", "r", lambda: False, retry_wait_s=0.01, before_retry=keep_alive) == 4
    assert kept_alive == [1, 1, 2, 3]  # before every try but the first; the poll refused once: that try again
