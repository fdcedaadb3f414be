"""Packed learning: several runs trained in one process, each as one adapter of one training engine.

The base model is loaded once (``consumers.engine.TrainingEngine``); every run
gets a LoRA adapter in it and an ``EnginePolicy`` over that adapter
(``consumers.engine_policy``), which is ``LoraPolicy``'s training code (losses,
schedule, KL reference, checkpoint tensors under the same names) on the shared
model.  Each run keeps a whole
``Learner`` of its own: configuration, source (its own consumer group and
offsets), registry, checkpoints, lease, fault points and exactly-once
guarantee; the packed loop only decides whose turn it is.

Fairness: round-robin.  Each turn is one pass of that run's own learner loop
(poll, ingest at most one announced batch, train a step once enough rows
wait), so a run whose episodes are slow, or which waits for rows, never makes
another wait a whole step: its poll waits for rows only while no other run has
batches delivered and not yet ingested, and returns at once otherwise.

Writes: a run's publish and checkpoint are written by its own writer while the next runs take their turns.  A
run whose last step's writes are not all taken when its turn comes (still going, or refused by the broker,
which can refuse one run and take the others') passes that turn, its state untouched, and the others train
(``consumers.packed_writes``); it goes on once they are taken.  The one run going, while no other is settling
(below), takes its turns as a learner of one run does: its next step trains while its writes go on, and waits for
them; while another run still settles (or leaves) it passes its turns as packed, so a broker refusing it does not
hold that run's settling.  While another run waits to come
back or runs are followed for joins it still passes its turns while the broker refuses its writes or its commit,
so joins and comebacks, run between two rounds, do not wait for the broker to take them.  Nor does a run joining or
coming back: the events its start announces again are sent from its own thread, and it passes its turns, reading
and training nothing, until the broker took them and the commit of its checkpoint's positions (``PackedLearner.add``).
A batch dead-lettered in a run's turn has its letter sent the same way: the run passes its turns, reading nothing
past the batch, until the broker takes it (``Learner.quarantine``).  A run that reaches its end in the round-robin
(``max_steps``, or its replay ran dry) settles the same way: once its last step's writes are taken its final version
and checkpoint are handed to its writer, and it passes its turns until they and their offsets are taken
(``PackedLearner.settle_in_turn``).  A run asked to leave (``leave``) settles the
same way, training what it has waiting in its turn first, and is taken out once settled.  A stop (``finish_all``)
writes the final checkpoint of every run not settled yet, one leaving too, and waits for the broker to take it,
holding the others: that happens at the end.

Membership: runs may join between two rounds and be asked to leave there (``add``, ``leave``),
e.g. as ``RunStarted`` and ``RunStopped`` arrive on the control topic
(``pipeline.membership``, ``rlpipe learner start --follow-runs PATTERN``); a
leaving run trains what it has waiting and writes its checkpoint first, as on a
stop, in its turns while the others train, and once the broker took them its adapter is deleted from the engine
and its leaving is reported (``on_left``).  The others never restart.

Failures: a run whose turn raises (its lease taken by another learner, its
store failing, a step that cannot run) is dropped, as a single-run learner
that stopped on the error, while the others train on; the packed process
brings it back from its newest checkpoint after a pause
(``pipeline.membership.Comebacks``), except a run whose lease was taken.  A
process stopped while a run waits to come back, or after a run's lease was
taken, ends with ``RunsFailedError`` naming it (the command exits 1).

Isolation: a turn holds the engine with the run's adapter active (only its LoRA
weights require gradients) and the run's own torch, numpy and Python RNG states
in place, so what one run draws never depends on the others; a run trained
packed reaches the weights it reaches alone on the same batches.

Health: ``/metrics`` carries every series of a single-run learner for each run,
labelled ``run="<id>"``, and ``rlpipe_learner_run_serving{run}``; ``/readyz`` names
each run; a run that leaves is no longer reported (``pipeline.health.PackedRunsHealth``).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from consumers.engine import TrainingEngine
from consumers.engine_data import EngineError
from consumers.learner import Learner
from consumers.packed_writes import ResumedPositions, RunWrites, wait_for_writes, writers_of
from consumers.service import finish, hand_over_final_writes
from pipeline.io.bus import BusError

log = logging.getLogger("rlpipe.learner")

JOIN_TIMEOUT_S = 60.0  # at most this long joining the runs' consumer groups before training starts
JOIN_POLL_S = 0.2  # each run's share of one joining round


@dataclass
class PackedRun:
    """One run of a packed learner: its learner and the numpy and Python RNG states between its turns."""

    run_id: str
    learner: Learner
    rng: tuple[Any, Any] = field(default_factory=lambda: (np.random.get_state(), random.getstate()))
    ending: bool = False  # finished in its turn: settled in its next turns, while the others train
    on_left: Callable[[Learner], None] | None = None  # asked to leave (``PackedLearner.leave``): told once it left
    final_handed_over: bool = False  # its final version and checkpoint (if it needed them) are with its writer
    settled: bool = False  # finished, its final checkpoint written and committed: nothing more to train or write
    writes: RunWrites = field(init=False)  # its last step's writes, as its turns see them

    def __post_init__(self) -> None:
        self.writes = RunWrites(self.learner)

    @property
    def leaving(self) -> bool:
        """Asked to leave: it trains nothing new, and is taken out once settled."""
        return self.on_left is not None

    def settling(self) -> bool:
        """Finished in its turn or asked to leave, and not settled yet: its next turns settle it."""
        return (self.ending or self.leaving) and not self.settled

    def finished(self) -> bool:
        """At ``max_steps``, or a finite source (replay) that has nothing more to give and no rows left to train
        (its next turn trains them)."""
        learner = self.learner
        return learner.budget_reached() or (
            not learner.incoming and learner.source.exhausted() and not learner.work_waiting())


def seeded_rng(seed: int) -> tuple[Any, Any]:
    """The numpy and Python RNG states a single-run learner starts with (``seed_everything``)."""
    saved = np.random.get_state(), random.getstate()
    np.random.seed(seed % 2**32)
    random.seed(seed)
    state = np.random.get_state(), random.getstate()
    np.random.set_state(saved[0])
    random.setstate(saved[1])
    return state


class PackedLearner:
    """Several runs' learners on one training engine, served round-robin one pass of their loop at a time."""

    def __init__(self, engine: TrainingEngine, learners: list[Learner]) -> None:
        names = [learner.run_id for learner in learners]
        if len(set(names)) != len(names):
            raise ValueError(f"runs {names} name a run twice; pack each run once")
        self.engine = engine
        self.runs = [PackedRun(learner.run_id, learner, seeded_rng(learner.cfg.seed)) for learner in learners]

    @contextlib.contextmanager
    def turn(self, run: PackedRun) -> Iterator[Learner]:
        """Hold the engine for ``run``: its adapter active, its torch, numpy and Python RNG states in place."""
        with self.engine.holding(run.run_id):
            saved = np.random.get_state(), random.getstate()
            np.random.set_state(run.rng[0])
            random.setstate(run.rng[1])
            try:
                yield run.learner
            finally:
                run.rng = np.random.get_state(), random.getstate()
                np.random.set_state(saved[0])
                random.setstate(saved[1])

    def resume(self, join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Resume every run from its own newest checkpoint (its lease, its positions), then join their groups."""
        for run in self.runs:
            with self.turn(run) as learner:
                learner.resume()
        self.join(join_timeout_s)

    def join(self, timeout_s: float) -> None:
        """Take part in every run's consumer group, in turns, until each has its partitions or ``timeout_s`` passed.

        A join takes several round trips with the broker, each finished only by a
        poll of that run's consumer; in the round-robin a run is polled once per
        turn, so a run still joining while another trains would wait a whole step
        per round trip.  Sources without a group (replay) have nothing to join.
        """
        deadline = time.monotonic() + timeout_s
        joining = [run for run in self.runs if hasattr(run.learner.source, "join")]
        while joining and time.monotonic() < deadline:
            joining = [run for run in joining if not run.learner.source.join(JOIN_POLL_S)]  # type: ignore[attr-defined]
        if joining:
            log.warning("runs %s have not joined their consumer groups after %.0fs; they join while the others train",
                        ", ".join(run.run_id for run in joining), timeout_s)

    def add(self, learner: Learner, join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Serve ``learner``'s run from the next round: resumed from its newest checkpoint, its group joined.

        The events its start announces again are sent from its own thread (``learner_start.resume``'s ``beside``)
        and the commit of its checkpoint's positions is owed (``packed_writes.ResumedPositions``): its turns pass
        until the broker took both, reading and training nothing (as a learner of one run starts), while the others
        train, so a broker refusing them holds none of the others."""
        if any(run.run_id == learner.run_id for run in self.runs):
            raise ValueError(f"run {learner.run_id} is already packed here")
        run = PackedRun(learner.run_id, learner, seeded_rng(learner.cfg.seed))
        try:
            with self.turn(run):
                # (a warm start's waits for the broker poll the others)
                if learner.resume(between_tries=self.keep_others_alive, beside=True):
                    run.writes.owed = ResumedPositions(dict(learner.state.positions), learner.state.step)
            source = learner.source
            deadline = time.monotonic() + join_timeout_s
            while hasattr(source, "join") and not source.join(JOIN_POLL_S) and time.monotonic() < deadline:
                self.keep_others_alive()
        except BaseException:  # not served: its announcements under way end after the try under way
            learner.outputs.abandon()
            raise
        self.runs.append(run)  # (last: a run whose group join failed is not served)

    def keep_others_alive(self) -> None:
        """Poll the consumers of the runs served (no records, each at most every ``KEEP_ALIVE_EVERY_S``) while a run
        joining or coming back waits (its group join, the broker refusing a warm start's writes), so their groups
        keep them; a refusal of one of those polls is that run's, seen at its own turn, not the joining run's."""
        for run in self.runs:
            with contextlib.suppress(BusError):
                run.writes.keep_alive()

    def leave(self, run_id: str, on_left: Callable[[Learner], None]) -> None:
        """Let ``run_id`` go without holding the others: from now on it reads nothing new, and its turns train what
        it has waiting and write its final checkpoint (as on a stop), passing while the broker has not taken its
        writes and commit (``settle_in_turn``); once settled it is taken out (``let_go``) and ``on_left`` is called
        with its learner.  A run already settled is taken out now; a run asked again still leaves once (its first
        ``on_left``).  A stop settles a run still leaving, waiting for the broker, and then lets it go
        (``run``'s return, ``finish_all``)."""
        run = next((run for run in self.runs if run.run_id == run_id), None)
        if run is None:
            raise KeyError(f"run {run_id} is not packed here")
        if run.on_left is None:
            run.on_left = on_left
        if run.settled:
            self.let_go(run)

    def let_go(self, run: PackedRun) -> None:
        """Take ``run``, asked to leave and settled, out: its reader closed, its adapter deleted; tell ``on_left``.
        Its end is durable by now, so it left whatever deleting its adapter does: a failure there is logged, never
        raised (as a run's failure it would be dropped and reported instead of let go, and brought back)."""
        assert run.on_left is not None and run.settled
        run.learner.reader.close()
        self.runs.remove(run)
        try:
            self.engine.delete_adapter(run.run_id)
        except Exception as exc:
            log.error("run %s left, but deleting its adapter failed (%s: %s)", run.run_id, type(exc).__name__, exc)
        run.on_left(run.learner)

    def drop(self, run: PackedRun) -> None:
        """Let ``run`` go at once, as a learner that stopped on an error: its writes under way end (or fail), its
        adapter is deleted, and nothing more is trained or committed; it resumes from its newest checkpoint."""
        run.learner.outputs.abandon()
        run.learner.reader.close()
        if run in self.runs:
            self.runs.remove(run)
        with contextlib.suppress(EngineError):
            self.engine.delete_adapter(run.run_id)

    def run(self, should_stop: Callable[[], bool] = lambda: False,
            on_step: Callable[[str, dict], None] = lambda run_id, metrics: None, poll_timeout_s: float = 1.0,
            between_rounds: Callable[[PackedLearner], None] | None = None,
            until_stopped: bool | Callable[[], bool] = False,
            on_failure: Callable[[str, Exception], None] | None = None) -> None:
        """Round-robin until stopped or every run is finished (``max_steps``, or its finite source ran dry).

        A waiting run polls for ``poll_timeout_s`` divided among the runs still
        going, so one full round waits about ``poll_timeout_s`` when none has rows; while another run has
        batches delivered and not yet ingested, it polls without waiting.
        ``between_rounds`` (runs joining, and asked to leave) is called before every round;
        while ``until_stopped`` (or what it returns) is true the loop also goes on while no run is going,
        waiting for one to join, and no run counts as going alone (``passes``).
        A run that finishes, or is asked to leave, hands its final checkpoint to its writer as soon as its last
        step's writes are taken, and passes its turns until that checkpoint and its offsets are (``settle_in_turn``),
        so its end is durable and announced while the others train, and a broker refusing it holds none of them; a
        run leaving is let go then.  A run's publish and checkpoint are written while the next runs take their
        turns; every run's writes, and the final checkpoint of every run that finished in its turns or was
        leaving, are done when this returns, and the runs leaving are let go.  A run already finished when it was
        resumed or added takes no turn: only its writes are finished here, and its final checkpoint, if it needs
        one, is ``finish_all``'s.
        With ``on_failure``, a run whose turn raises (its lease taken, its store failing, a step that cannot
        run) or whose last writes fail is dropped (``drop``) and reported, and the others go on; without, the
        error ends the loop, and the writes of the runs still served are abandoned (``StepOutputs.abandon``).
        """
        try:
            self._rounds(should_stop, on_step, poll_timeout_s, between_rounds, until_stopped, on_failure)
            self._finish_writes(on_step, on_failure)
        except BaseException:  # the runs still served: their writes under way end, nothing more is committed
            for run in self.runs:
                run.learner.outputs.abandon()
                run.learner.reader.close()
            raise

    def _finish_writes(self, on_step: Callable[[str, dict], None],
                       on_failure: Callable[[str, Exception], None] | None) -> None:
        """The loop's end: every run's writes finished, a run still settling settled (``settle``), a run leaving
        let go."""
        for run in list(self.runs):
            try:
                if run.settling():
                    self.settle(run, on_step)
                else:
                    run.writes.finish()
                if run.leaving:
                    self.let_go(run)
            except Exception as exc:
                self._failed(run, exc, on_failure)

    def _rounds(self, should_stop: Callable[[], bool], on_step: Callable[[str, dict], None], poll_timeout_s: float,
                between_rounds: Callable[[PackedLearner], None] | None, until_stopped: bool | Callable[[], bool],
                on_failure: Callable[[str, Exception], None] | None) -> None:
        while not should_stop():
            if between_rounds is not None:
                between_rounds(self)
            settling = self._settling_turns(on_step, on_failure)
            going = [run for run in self.runs if not (run.finished() or run.leaving)]
            awaiting = until_stopped() if callable(until_stopped) else until_stopped  # runs to join or come back
            if not going and not awaiting:
                return  # (``run`` waits for the runs still settling)
            if not going:
                if settling:
                    wait_for_writes([writer for run in settling for writer in writers_of(run.learner)], should_stop)
                else:
                    time.sleep(poll_timeout_s)
                continue
            passed = []
            for run in going:
                if should_stop():
                    return
                # a poll waits only while no other run has batches delivered and not yet ingested (and writes that
                # let it ingest them: a run whose writes wait for the broker must not make the others' polls spin)
                busy = any(other.learner.incoming and not other.writes.pending() for other in going if other is not run)
                try:
                    # a run still settling shares the process too: the one going waits for none of its writes in
                    # its turn, which would hold that run's settling (and its leaving) until the broker took them
                    if self.passes(run, lone=len(going) == 1 and not settling, awaiting=awaiting):
                        passed.append(run)
                        continue
                    with self.turn(run) as learner:
                        for metrics in one_pass(learner, 0.0 if busy else poll_timeout_s / len(going)):
                            on_step(run.run_id, metrics)
                    if run.finished():
                        run.ending = True
                        self.settle_in_turn(run, on_step)
                except Exception as exc:
                    self._failed(run, exc, on_failure)
            if passed and len(passed) == len(going):  # every run's writes wait: not a loop that spins
                wait_for_writes([writer for run in passed + settling for writer in writers_of(run.learner)],
                                should_stop)

    @staticmethod
    def passes(run: PackedRun, lone: bool, awaiting: bool) -> bool:
        """Whether ``run`` passes its turn, its writes not all taken (``RunWrites.waiting``).  A ``lone`` run (no
        other going, and none settling: a wait in its turn would hold that one's settling) holds no other run's
        turn: its step trains while its writes go on, as alone.  Going alone (nobody ``awaiting`` to join or come
        back) it also waits for a commit it owes; while runs may join or come back (``between_rounds``, which its
        wait would hold) it passes its turns while the broker refuses its writes or its commit instead."""
        if lone and not awaiting:
            run.writes.finish_owed()
            return False
        return run.writes.waiting(lone=lone)

    def settle_in_turn(self, run: PackedRun,
                       on_step: Callable[[str, dict], None] = lambda run_id, metrics: None) -> None:
        """A turn of ``run``, which finished in the round-robin or is leaving; never waits.  While its writes are
        not all taken (``RunWrites.waiting``: its last step's, then its final ones) it passes, its state untouched;
        once its last step's are, a run leaving with rows waiting trains them in one step (as ``service.finish``
        does on a stop), its writes going on beside the others' turns; then its final version and checkpoint
        (``service.finish``'s) are handed to its writer (``service.hand_over_final_writes``), in a learner's
        order; once those and their offsets are taken it is ``settled``.  So a slow store, or a broker refusing its
        events or its commit, holds only this run."""
        if run.writes.waiting():
            return
        if not run.final_handed_over:
            with self.turn(run) as learner:
                learner.reader.close()  # (batches read ahead for turns it will not take)
                if learner.work_waiting():
                    on_step(run.run_id, step_beside(learner))
                    return
                handed = hand_over_final_writes(learner)
            run.final_handed_over = True
            if handed:
                return
        run.settled = True

    def _settling_turns(self, on_step: Callable[[str, dict], None],
                        on_failure: Callable[[str, Exception], None] | None) -> list[PackedRun]:
        """A turn of each run that finished in the round-robin or is leaving, and is not settled yet
        (``settle_in_turn``); a run leaving that is settled then is let go.  The runs still settling after it."""
        for run in [run for run in self.runs if run.settling()]:
            try:
                self.settle_in_turn(run, on_step)
                if run.leaving and run.settled:
                    self.let_go(run)
            except Exception as exc:
                self._failed(run, exc, on_failure)
        return [run for run in self.runs if run.settling()]

    def settle(self, run: PackedRun, on_step: Callable[[str, dict], None] = lambda run_id, metrics: None) -> None:
        """``run`` is stopped (``finish_all``, or the loop's return while it still settles): train what it has
        waiting, write its final checkpoint and wait for its writes, and for the broker to take them and its commit.
        This one waits, holding every run: a stop happens at the end, and a run's end in the round-robin or its
        leaving is settled in its turns (``settle_in_turn``).  A run whose turns already handed its final writes
        over only waits for them."""
        run.writes.finish()  # a commit it owes first, in its order
        if not run.final_handed_over:
            with self.turn(run) as learner:
                learner.reader.close()  # (batches read ahead for turns it will not take)
                finish(learner, lambda metrics: on_step(run.run_id, metrics))
        run.settled = True

    def finish_all(self, on_step: Callable[[str, dict], None] = lambda run_id, metrics: None,
                   on_failure: Callable[[str, Exception], None] | None = None) -> None:
        """On a stop: every run not yet settled trains what it has waiting and writes its final checkpoint, and a
        run asked to leave is let go then (with ``on_failure``, a run that fails to is dropped and reported, and the
        others still settle)."""
        for run in list(self.runs):
            try:
                if not run.settled:
                    self.settle(run, on_step)
                if run.leaving:
                    self.let_go(run)
            except Exception as exc:
                self._failed(run, exc, on_failure)

    def _failed(self, run: PackedRun, error: Exception, on_failure: Callable[[str, Exception], None] | None) -> None:
        """``run`` raised ``error``: without ``on_failure`` it is raised again, with it the run is dropped and
        reported while the others go on."""
        if on_failure is None:
            raise error
        log.error("run %s stopped on an error (%s: %s); the other runs go on", run.run_id, type(error).__name__,
                  error)
        self.drop(run)
        on_failure(run.run_id, error)


def step_beside(learner: Learner) -> dict:
    """``learner.step()`` with its writes left going when it returns, as in its own loop's steps (``Learner.run``)."""
    with learner.pipelining():
        return learner.step()  # (an error drops the run: ``PackedLearner.drop`` lets its writes under way end)


def one_pass(learner: Learner, poll_timeout_s: float) -> list[dict]:
    """One pass of ``learner``'s own loop (``Learner.run``): poll, ingest one batch, step if ready; the steps taken."""
    passes = iter((False,))  # lets the loop's condition pass once
    steps: list[dict] = []
    learner.run(should_stop=lambda: next(passes, True), on_step=steps.append, poll_timeout_s=poll_timeout_s,
                wait_for_writes=False)
    return steps
