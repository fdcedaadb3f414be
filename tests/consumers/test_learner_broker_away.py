"""A learner while the broker is away, with a scripted source (no broker): its consumer stays in its group, an
error meanwhile ends it instead of waiting for the broker, and each announcement is one event however often tried.

The real broker's outages are in test_learner_outage.py.
"""

from __future__ import annotations

import threading
import time

from consumers import step_writer
from pipeline.io.bus import CommitError
from tests.consumers import test_learner
from tests.consumers.test_learner_progress import TOPIC, ScriptedSource, scripted_learner

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
