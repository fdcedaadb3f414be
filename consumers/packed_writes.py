"""Whether a packed run's writes let it take its turn, found out without waiting for them.

A learner of one run waits for its last step's writes (``consumers.step_writer``) and their offset commit before
its next step, and a write the broker refuses is tried again until it is taken (``consumers.broker_wait``).  In a
packed learner that wait, inside one run's turn, would hold every run, and the broker can refuse one run while it
takes the others': a run's events go to the partition its run id keys (one whose leader is away, or which has
fewer in-sync replicas than the topic asks for, refuses them while the other partitions take theirs), and its
offsets to its group's coordinator (the broker leading the offsets partition its group id hashes to).  So before
each turn the packed loop asks ``RunWrites``, which never blocks: a run whose last step's writes are still going
(for the one run going, only while the broker refuses one of them: it trains beside writes that are merely slow),
or whose offset commit the broker refused, passes its turn with its state untouched (nothing polled or ingested,
no step started), and the others train.  The refused commit is tried again at each of its turns, the first try given
``TRY_COMMIT_TIMEOUT_S`` (the client retries a refusal, or waits for an unknown coordinator, until its timeout:
the consumer's own one would hold every run up to 10 s a round), each try that timed out doubling the next one's up
to the consumer's own (a broker whose commits all take longer than 0.3 s, far away or reconnecting, would otherwise
refuse every try); once its writes are taken the run goes on, its
writes in a learner's order (a step's commit before the next step's writes: offsets never before their
checkpoint's event).  A try that timed out may still reach the broker later; it carries the same offsets as the
next try, and no later step's commit is sent before one of them is taken.

A run joining or coming back (``PackedLearner.add``) sends the events its start announces again
(``consumers.reannounce``) from that thread too, and owes the commit of the positions it resumed from
(``ResumedPositions``): it passes its turns, reading and training nothing, until the broker took both, as a learner
of one run does nothing before its start took them.

A batch dead-lettered in a run's turn (``Learner.quarantine``) is announced from a thread of its own in the same way:
the run passes its turns until the broker takes the letter (whoever goes alone waits for it, as a learner of one run
does), so nothing is read past the batch, and nothing written after it, before its letter is taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from consumers.broker_wait import RETRY_WAIT_S, WaitReport, keep_alive_quietly, wait_unless_stopping
from consumers.step_writer import KEEP_ALIVE_EVERY_S, PreparedStep, StepWriter, wait_for_any
from pipeline.io.bus import BusError

if TYPE_CHECKING:
    from consumers.learner import Learner

TRY_COMMIT_TIMEOUT_S = 0.3  # the first try of an owed commit in a packed run's turn; refused after this at most
CONSUMER_TIMEOUT_FLOOR_S = 5.0  # a try's timeout doubled to this or more is the consumer's own (at least 5 s)


@dataclass(frozen=True)
class ResumedPositions:
    """The positions of the checkpoint a packed run joining or coming back resumed from (its ``step``), committed
    again in its turns once the broker took its start's announcements (``RunWrites.owed``)."""

    positions: dict[str, int]
    step: int


class RunWrites:
    """One packed run's writes as its turns see them: its step in flight, and a checkpoint whose offsets the broker
    has not yet taken (owed)."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        # positions not yet committed: a step's checkpoint's, once written and announced, or the checkpoint's a
        # start resumed from, tried once the broker took that start's announcements
        self.owed: PreparedStep | ResumedPositions | None = None
        self.report: WaitReport | None = None  # the wait for the owed commit, while the broker refuses it
        self.kept_alive_at = float("-inf")
        self.try_timeout_s: float | None = TRY_COMMIT_TIMEOUT_S  # the next try's (None: the consumer's own)

    def waiting(self, lone: bool = False) -> bool:
        """Whether the run's writes are not all taken yet, so it passes its turn; never waits.  The error of a
        write that failed (a store error, a lost lease, a refusal no try can change) is raised here.

        ``lone``: no other run is going (runs may still join or come back between rounds): writes that are only
        going (none refused) do not make it pass, as its step trains beside them and waits for them before its own,
        as a learner of one run does; it passes while the broker refuses a write or its owed commit."""
        outputs = self.learner.outputs
        # only once a dead letter is taken may the run read past its batch, and only once its start's announcements
        # are taken may it read at all: even alone, it passes
        if self.letter_going():
            self.keep_alive()
            return True
        outputs.beside.wait()  # sent (or none): returns at once, raising the error that ended it
        writer = outputs.writer
        if writer.going:
            if lone and not outputs.waiting_for_broker():
                return False
            self.keep_alive()
            return True
        written = writer.wait()  # done (or none): returns at once
        if written is not None and written.positions:
            self.owed = written
        return self.owed is not None and not self.try_commit()

    def pending(self) -> bool:
        """Whether the run's writes are not all taken (still going, a dead letter or start's announcements still
        being sent, or a commit owed), as last seen; no I/O."""
        writer = self.learner.outputs.writer
        return writer.going or self.letter_going() or self.owed is not None

    def letter_going(self) -> bool:
        """Whether the run's ``beside`` job is still being sent (or refused): a dead letter, or the events its start
        announces again (``learner_start.resume``'s ``beside``)."""
        return self.learner.outputs.beside.going

    def try_commit(self) -> bool:
        """One try of the owed commit (polling first when it was refused before); whether the broker took it."""
        owed = self.owed
        assert owed is not None
        run_id, source, timeout_s = self.learner.run_id, self.learner.source, self.try_timeout_s
        started = time.monotonic()
        try:
            if self.report is not None:
                source.keep_alive()  # as a learner of one run polls before each try again
            source.commit(owed.positions, timeout_s=timeout_s)
        except BusError as exc:
            if not exc.transient:
                raise
            if timeout_s is not None and time.monotonic() - started >= 0.9 * timeout_s:  # timed out: not at once
                self.try_timeout_s = None if 2 * timeout_s >= CONSUMER_TIMEOUT_FLOOR_S else 2 * timeout_s
            if self.report is None:
                self.report = WaitReport(self.what(owed), run_id, "the run passes its turns while the other runs "
                                         "train, and it is tried again at each of them")
            self.report.refused(exc)
            return False
        if self.report is not None:
            self.report.taken()
            self.report = None
        self.owed, self.try_timeout_s = None, TRY_COMMIT_TIMEOUT_S
        return True

    def finish(self) -> None:
        """Wait for the run's writes and commit what they cover, as a learner of one run does (a stop ends a wait
        for the broker in one line, ``BrokerAwayOnStop``): its dead letter or start's announcements and owed offsets
        (``finish_owed``), then its step in flight and the offsets of its checkpoint."""
        self.finish_owed()
        self.learner.finish_step_writes()  # (its ``beside`` job is taken: ``finish_owed`` waited for it)

    def finish_owed(self) -> None:
        """Wait for a dead letter or start's announcements being sent, and commit the owed offsets, waiting for the
        broker to take them as a learner of one run does; a wait its turns began goes on with the same lines
        (``report``): no second start line, one end line."""
        self.learner.wait_for_letter()
        if self.owed is not None:
            self.learner.commit(self.owed.positions, self.what(self.owed), self.report)
            self.owed, self.report = None, None

    def keep_alive(self) -> None:
        """Poll the run's consumer (no records) at most every ``KEEP_ALIVE_EVERY_S`` while it passes its turns."""
        now = time.monotonic()
        if now - self.kept_alive_at >= KEEP_ALIVE_EVERY_S:
            self.kept_alive_at = now
            keep_alive_quietly(self.learner.source.keep_alive)

    @staticmethod
    def what(owed: PreparedStep | ResumedPositions) -> str:
        step = owed.step if isinstance(owed, ResumedPositions) else owed.checkpoint.step
        return f"the offsets of step {step}'s checkpoint"


def writers_of(learner: Learner) -> list[StepWriter]:
    """The threads a packed run's turns wait on: its step's writes, and its dead letter or its start's announcements
    (``beside``)."""
    return [learner.outputs.writer, learner.outputs.beside]


def wait_for_writes(writers: list[StepWriter], should_stop: Callable[[], bool]) -> None:
    """Every run passed its turn: wait until one of ``writers``' jobs ends, or, where none is going (commits the
    broker refused), until the next try (``RETRY_WAIT_S``), returning early on a stop."""
    going = [writer for writer in writers if not writer.done]
    if going:
        wait_for_any(going, RETRY_WAIT_S)
    else:
        wait_unless_stopping(RETRY_WAIT_S, should_stop)
