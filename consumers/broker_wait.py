"""A learner's announcements and commits that wait out a broker outage instead of ending the learner.

A step's writes go in a fixed order (adapter files, manifest, ``AdapterPublished``,
step object, checkpoint, ``LearnerCheckpointed``, offsets), and each one is
owed before the next: offsets committed before their checkpoint's event would
let producers and ``rlpipe run`` act on a step nobody announced.  So a write the
broker refuses (it is away for longer than the publisher's wait) is tried again,
in place, until the broker takes it: the writes after it wait, and so does the
training loop (one step in flight, ``consumers.step_writer``).  One warning says
it started, a line every ``REPORT_EVERY_S`` says it goes on, one says it is over.

A stop (SIGTERM) during the wait ends it after the try in progress (at most the
publisher's wait) with ``BrokerAwayOnStop``: one line naming what was not
announced.  Nothing is lost by that: whatever was written is in the store
(producers find versions in the registry, ``rlpipe run`` looks at the store for
a run at its step budget), and the next ``rlpipe learner start`` announces again
the checkpoint it resumes from and the versions after it (``consumers.reannounce``:
a version's or checkpoint's event the broker did not take among them), then
commits that checkpoint's offsets, training each batch once.

``LearnerProgress`` is not waited for: producers go by the last one they read
until the next one, so a refused one is a warning (``progress_announced``) and the
learner sends it again within ``PROGRESS_INTERVAL_S``, training on meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pipeline.io.bus import BusError
from schemas.events import LearnerProgress, Payload

log = logging.getLogger("rlpipe.learner")

T = TypeVar("T")

RETRY_WAIT_S = 1.0  # between two tries (each try itself waits up to the publisher's send timeout)
REPORT_EVERY_S = 30.0  # while the broker stays away, a line this often
PROGRESS_INTERVAL_S = 5.0  # a learner waiting for rows announces its progress again within this after a refusal


class BrokerAwayOnStop(BusError):
    """The learner was stopped while a write waited for the broker; the message names what was not announced."""


class WaitReport:
    """The lines of one wait for the broker: a warning at its first refusal, a line every ``report_every_s`` while
    it lasts, one when the broker takes the write.  ``waiting`` says what waits meanwhile, in the first line."""

    def __init__(self, what: str, run_id: str, waiting: str, report_every_s: float = REPORT_EVERY_S) -> None:
        self.what, self.run_id, self.waiting, self.report_every_s = what, run_id, waiting, report_every_s
        self.started = self.reported = 0.0
        self.over = False  # the broker took the write

    @property
    def refusing(self) -> bool:
        """The broker refused the write and has not taken it yet."""
        return bool(self.started) and not self.over

    def refused(self, exc: BusError) -> None:
        """One more refusal (``exc``): the first one's line, or a line when ``report_every_s`` passed since the last."""
        reason, now = first_line(exc), time.monotonic()
        if not self.started:
            self.started = self.reported = now
            log.warning("run %s: the broker did not take %s (%s); %s", self.run_id, self.what, reason, self.waiting)
        elif now - self.reported >= self.report_every_s:
            self.reported = now
            log.warning("run %s: still waiting for the broker to take %s, for %.0fs now (%s)", self.run_id, self.what,
                        now - self.started, reason)

    def taken(self) -> None:
        """The broker took the write: a line saying after how long, if it refused it first."""
        self.over = True
        if self.started:
            log.warning("run %s: the broker took %s after %.0fs; the learner goes on", self.run_id, self.what,
                        time.monotonic() - self.started)


def until_the_broker_takes(write: Callable[[], T], what: str, run_id: str, stopping: Callable[[], bool],
                           retry_wait_s: float = RETRY_WAIT_S, report_every_s: float = REPORT_EVERY_S,
                           before_retry: Callable[[], None] | None = None, report: WaitReport | None = None) -> T:
    """``write()``'s result once the broker takes it, trying again every ``retry_wait_s`` while it refuses
    (``BusError``); ``what`` names the write in the log lines ("AdapterPublished v3 (step 6)").

    ``before_retry`` runs before each try but the first, as part of it (its ``BusError`` is one more refusal): an
    offset commit polls there (``keep_alive``), as only a poll rejoins a group that dropped the learner while the
    broker was away.  A refusal no try can change (``BusError.transient`` false: an event over the message size
    limit, a permission the broker denies) is raised at once.  Raises ``BrokerAwayOnStop`` when ``stopping()`` is
    true after a refused try.  ``report``: a wait for the same write that began elsewhere (refused already), which
    this one goes on: its first line was logged, and this logs only the ones after it.
    """
    if report is None:
        report = WaitReport(what, run_id, learner_waits(retry_wait_s), report_every_s)
    while True:
        try:
            if report.started and before_retry is not None:
                before_retry()
            result = write()
        except BusError as exc:
            if not exc.transient:
                raise
            report.refused(exc)
            if stopping():
                raise BrokerAwayOnStop(
                    f"run {run_id} stopped while the broker was away: it never took {what}; what the learner "
                    "wrote is in the store, and the next `rlpipe learner start` announces what was not taken and "
                    "resumes from the run's newest checkpoint, training each batch exactly once") from exc
            wait_unless_stopping(retry_wait_s, stopping)
            continue
        report.taken()
        return result


def commit_until_taken(commit: Callable[[], Any], keep_alive: Callable[[], None], what: str, run_id: str,
                       stopping: Callable[[], bool], report: WaitReport | None = None,
                       between_tries: Callable[[], None] | None = None) -> None:
    """A learner's offset ``commit``, only ever after the checkpoint that covers it is durable and announced, waiting
    out a broker that is away and polling (``keep_alive``) before each try again: a group that dropped the member
    meanwhile refuses its commits until a poll rejoins.  ``report``: the lines of a wait for this commit that began
    elsewhere (a packed run's turns); ``between_tries``: run after that poll (a packed learner's start of a run,
    which holds every run it serves and polls their consumers there; the first line says so)."""
    def before_retry() -> None:
        keep_alive()
        if between_tries is not None:
            between_tries()

    if report is None:
        report = WaitReport(what, run_id, learner_waits(RETRY_WAIT_S, holding_others=between_tries is not None))
    until_the_broker_takes(commit, what, run_id, stopping, before_retry=before_retry, report=report)


def learner_waits(retry_wait_s: float, holding_others: bool = False) -> str:
    """What a learner's wait for the broker holds, as its first line says; ``holding_others``: a packed learner's
    start of a run (``PackedLearner.add``), between two rounds, which every run it serves waits for."""
    if holding_others:
        return ("the packed learner waits for it, and every run it serves with it (their consumers are polled "
                f"meanwhile), trying again every {retry_wait_s:g}s")
    return f"the learner waits for it (the writes after it and the next step wait too), trying again every {retry_wait_s:g}s"


def progress_announced(announce: Callable[[Payload], Any], progress: LearnerProgress, run_id: str) -> bool:
    """Whether the broker took ``progress``; a refusal is a warning, not a wait (the caller sends it again within
    ``PROGRESS_INTERVAL_S``)."""
    try:
        announce(progress)
    except BusError as exc:  # the broker away: producers go by the last one they read until the next one
        log.warning("run %s: progress of step %d not announced (%s); announced again within %gs", run_id,
                    progress.step, first_line(exc), PROGRESS_INTERVAL_S)
        return False
    return True


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when it has none."""
    return str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__


def keep_alive_quietly(keep_alive: Callable[[], None]) -> None:
    """Poll a consumer (no records) while a learner waits for its step's writes, so its group keeps the member; with
    the broker away that poll is refused too, which the writes' own wait reports."""
    try:
        keep_alive()
    except BusError as exc:
        if not exc.transient:
            raise
        log.debug("a keep-alive poll was refused while the step's writes wait: %s", exc)


def wait_unless_stopping(seconds: float, stopping: Callable[[], bool]) -> None:
    """Sleep ``seconds``, in short naps, returning early once ``stopping()`` is true."""
    deadline = time.monotonic() + seconds
    while not stopping() and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(0.1, left))
