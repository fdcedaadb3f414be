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
(``consumers.packed_writes``); it goes on once they are taken.  The one run going takes its turns as a learner
of one run does: its next step trains while its writes go on, and waits for them.  While another run waits to come
back or runs are followed for joins it still passes its turns while the broker refuses its writes or its commit,
so joins and comebacks, run between two rounds, do not wait for the broker to take them; a run joining or coming
back polls the served runs' consumers while its own start waits for the broker (``PackedLearner.add``).

Membership: runs may join and leave between two rounds (``add``, ``remove``),
e.g. as ``RunStarted`` and ``RunStopped`` arrive on the control topic
(``pipeline.membership``, ``rlpipe learner start --follow-runs PATTERN``); a
leaving run trains what it has waiting and writes its checkpoint first, as on a
stop, and its adapter is deleted from the engine.  The others never restart.

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
import torch

from consumers.engine import TrainingEngine
from consumers.engine_data import EngineError
from consumers.engine_policy import EnginePolicy
from consumers.learner import Learner
from consumers.lease import LeaseLostError
from consumers.packed_writes import RunWrites, wait_for_writes
from consumers.service import build_learner, finish, progress_line, record_resumed, record_step_metrics
from consumers.sources import KafkaSource
from pipeline.health import HealthServer, PackedRunsHealth
from pipeline.io.bus import BusError, EventPublisher
from pipeline.membership import Comebacks, Joined, RunMembership, engine_config, runs_not_stopped
from pipeline.models import check_same_tiny_build, recorded_tiny_dir, resolve_base_model
from pipeline.runtime import Announcer, StopFlag, create_run, open_store, resolved_bus
from schemas.config import RunConfig
from schemas.config import check_packable as packable
from schemas.events import LearnerLeft

log = logging.getLogger("rlpipe.learner")

JOIN_TIMEOUT_S = 60.0  # at most this long joining the runs' consumer groups before training starts
JOIN_POLL_S = 0.2  # each run's share of one joining round


@dataclass
class PackedRun:
    """One run of a packed learner: its learner and the numpy and Python RNG states between its turns."""

    run_id: str
    learner: Learner
    rng: tuple[Any, Any] = field(default_factory=lambda: (np.random.get_state(), random.getstate()))
    settled: bool = False  # finished, its final checkpoint written: nothing more to train or write
    writes: RunWrites = field(init=False)  # its last step's writes, as its turns see them

    def __post_init__(self) -> None:
        self.writes = RunWrites(self.learner)

    def finished(self) -> bool:
        """At ``max_steps``, or a finite source (replay) that has nothing more to give."""
        learner = self.learner
        return learner.budget_reached() or (not learner.incoming and learner.source.exhausted())


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
        """Serve ``learner``'s run from the next round: resumed from its newest checkpoint, its group joined."""
        if any(run.run_id == learner.run_id for run in self.runs):
            raise ValueError(f"run {learner.run_id} is already packed here")
        run = PackedRun(learner.run_id, learner, seeded_rng(learner.cfg.seed))
        with self.turn(run):
            learner.resume(between_tries=self.keep_others_alive)  # (its waits for the broker poll the others)
        source = learner.source
        deadline = time.monotonic() + join_timeout_s
        while hasattr(source, "join") and not source.join(JOIN_POLL_S) and time.monotonic() < deadline:
            self.keep_others_alive()
        self.runs.append(run)  # (last: a run whose group join failed is not served)

    def keep_others_alive(self) -> None:
        """Poll the consumers of the runs served (no records, each at most every ``KEEP_ALIVE_EVERY_S``) while a run
        joining or coming back waits (the broker refusing its announcements or commit, its group join), so their
        groups keep them; a refusal of one of those polls is that run's, seen at its own turn, not the joining
        run's."""
        for run in self.runs:
            with contextlib.suppress(BusError):
                run.writes.keep_alive()

    def remove(self, run_id: str, on_step: Callable[[str, dict], None] = lambda run_id, metrics: None) -> Learner:
        """Let ``run_id`` go: train what it has waiting, write its checkpoint (as on a stop), delete its adapter."""
        run = next((run for run in self.runs if run.run_id == run_id), None)
        if run is None:
            raise KeyError(f"run {run_id} is not packed here")
        if not run.settled:
            self.settle(run, on_step)
        self.runs.remove(run)
        self.engine.delete_adapter(run_id)
        return run.learner

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
        ``between_rounds`` (runs joining and leaving) is called before every round;
        while ``until_stopped`` (or what it returns) is true the loop also goes on while no run is going,
        waiting for one to join, and no run counts as going alone (``passes``).
        A run that finishes writes its final checkpoint at once (``settle``), so its end is durable and
        announced while the others train.  A run's publish and checkpoint are written while the next runs
        take their turns; every run's writes are done when this returns.
        With ``on_failure``, a run whose turn raises (its lease taken, its store failing, a step that cannot
        run) or whose last writes fail is dropped (``drop``) and reported, and the others go on; without, the
        error ends the loop.
        """
        try:
            self._rounds(should_stop, on_step, poll_timeout_s, between_rounds, until_stopped, on_failure)
        except BaseException:
            for run in self.runs:
                run.learner.outputs.abandon()
                run.learner.reader.close()
            raise
        for run in list(self.runs):
            try:
                run.writes.finish()
            except Exception as exc:
                self._failed(run, exc, on_failure)

    def _rounds(self, should_stop: Callable[[], bool], on_step: Callable[[str, dict], None], poll_timeout_s: float,
                between_rounds: Callable[[PackedLearner], None] | None, until_stopped: bool | Callable[[], bool],
                on_failure: Callable[[str, Exception], None] | None) -> None:
        while not should_stop():
            if between_rounds is not None:
                between_rounds(self)
            going = [run for run in self.runs if not run.finished()]
            awaiting = until_stopped() if callable(until_stopped) else until_stopped  # runs to join or come back
            if not going and not awaiting:
                return
            if not going:
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
                    if self.passes(run, lone=len(going) == 1, awaiting=awaiting):
                        passed.append(run)
                        continue
                    with self.turn(run) as learner:
                        for metrics in one_pass(learner, 0.0 if busy else poll_timeout_s / len(going)):
                            on_step(run.run_id, metrics)
                    if run.finished():
                        self.settle(run, on_step)
                except Exception as exc:
                    self._failed(run, exc, on_failure)
            if passed and len(passed) == len(going):  # every run's writes wait: not a loop that spins
                wait_for_writes([run.learner.outputs.writer for run in passed], should_stop)

    @staticmethod
    def passes(run: PackedRun, lone: bool, awaiting: bool) -> bool:
        """Whether ``run`` passes its turn, its writes not all taken (``RunWrites.waiting``).  A ``lone`` run (no
        other going) holds no other run's turn: its step trains while its writes go on, as alone.  Going alone
        (nobody ``awaiting`` to join or come back) it also waits for a commit it owes; while runs may join or come
        back (``between_rounds``, which its wait would hold) it passes its turns while the broker refuses its
        writes or its commit instead."""
        if lone and not awaiting:
            run.writes.finish_owed()
            return False
        return run.writes.waiting(lone=lone)

    def settle(self, run: PackedRun, on_step: Callable[[str, dict], None] = lambda run_id, metrics: None) -> None:
        """``run`` is finished: train what it has waiting, write its final checkpoint and wait for its writes."""
        run.writes.finish()  # a commit it owes first, in its order
        with self.turn(run) as learner:
            learner.reader.close()  # (batches read ahead for turns it will not take)
            finish(learner, lambda metrics: on_step(run.run_id, metrics))
        run.settled = True

    def finish_all(self, on_step: Callable[[str, dict], None] = lambda run_id, metrics: None,
                   on_failure: Callable[[str, Exception], None] | None = None) -> None:
        """On a stop: every run not yet settled trains what it has waiting and writes its final checkpoint (with
        ``on_failure``, a run that fails to is dropped and reported, and the others still settle)."""
        for run in list(self.runs):
            if run.settled:
                continue
            try:
                self.settle(run, on_step)
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


def one_pass(learner: Learner, poll_timeout_s: float) -> list[dict]:
    """One pass of ``learner``'s own loop (``Learner.run``): poll, ingest one batch, step if ready; the steps taken."""
    passes = iter((False,))  # lets the loop's condition pass once
    steps: list[dict] = []
    learner.run(should_stop=lambda: next(passes, True), on_step=steps.append, poll_timeout_s=poll_timeout_s,
                wait_for_writes=False)
    return steps


# ---- the packed learner process ---------------------------------------------------------------------------------
def check_packable(configs: list[RunConfig]) -> None:
    """Refuse, in one line, runs that cannot share one engine and one event log: one base model (for the tiny
    model, one build: a run naming no model.tiny_dir has the folder recorded on this machine, as
    ``resolve_base_model`` loads it), device and event log."""
    packable(configs, ("model.base_model", "model.dtype", "learner.device", "learner.gradient_checkpointing",
                       "bus.bootstrap_servers", "bus.namespace"),
             "one base model (its gradient checkpointing too), device and event log")
    for cfg in configs[1:]:
        check_same_tiny_build(configs[0], cfg, recorded_tiny_dir(),
                              "a packed learner trains every run on one base model: start a learner per base model")


def run_packed_learner(configs: list[RunConfig], stop: StopFlag | None = None,
                       on_step: Callable[[str, dict], None] | None = None,
                       follow_runs: str | None = None, template: RunConfig | None = None,
                       started_s: float | None = None) -> PackedLearner:
    """Train several runs in one process on one engine until stopped or each reaches its ``max_steps``.

    Every run is set up as ``run_learner`` sets up one (its ``run.json``, its own
    consumer group, lease, registry and checkpoints); a SIGTERM trains what each
    run has waiting and writes each one's final checkpoint.  With ``follow_runs``
    (a glob of run ids) runs announced later join and served runs stopped later
    leave (``pipeline.membership``), and the process serves until stopped; it may then start with no run, its
    engine set up from ``template`` (base model, device, event log and store).  A named run recorded stopped is
    not trained until ``rlpipe runs resume``.  ``started_s`` (unix seconds, default now) is when the process
    started: a run stopped since then leaves, even if its ``RunStopped`` came while it was still importing.
    """
    started_s = time.time() if started_s is None else started_s
    named = [cfg.run_id for cfg in configs]
    configs = runs_not_stopped(configs, follow_runs)
    first = engine_config(configs, follow_runs, template, check_packable)
    stop = stop or StopFlag()
    health = HealthServer(first.learner.health_port).start()
    done = health.add_setup_steps(("broker", "engine", "resumed"))
    health.add_readiness_check("stopping", lambda: not stop())
    bus = resolved_bus(first.bus)
    publisher = EventPublisher(bus)
    sources: dict[str, KafkaSource] = {}
    learners: dict[str, Learner] = {}
    configs_of: dict[str, RunConfig] = {}
    comebacks = Comebacks()
    membership: RunMembership | None = None
    runs_health = PackedRunsHealth(health, "rlpipe_learner")

    def after_step(run_id: str, metrics: dict[str, Any]) -> None:
        comebacks.progressed(run_id)
        log.info("%s: %s", run_id, progress_line(metrics))
        record_step_metrics(health, metrics, runs_health.labels(run_id))
        if on_step is not None:
            on_step(run_id, metrics)

    try:
        # every packed learner lets a run go on its RunStopped; with --follow-runs it also takes new runs up.
        # Followed from before the model loads, so a run announced meanwhile is not missed.
        membership = RunMembership(follow_runs, first, open_store(first.store), check_packable,
                                   since_s=started_s, named=named)
        base_model = resolve_base_model(first.model)
        if first.learner.torch_threads:
            torch.set_num_threads(first.learner.torch_threads)
        log.info("initialising a training engine on %s for runs %s", base_model,
                 ", ".join(c.run_id for c in configs) or f"matching {follow_runs}")
        # the base model's dropout off, as in a run's own learner (``consumers.policy``): samplers never drop
        engine = TrainingEngine(base_model, device=first.learner.device, dtype=first.model.dtype)
        done.add("engine")

        def open_run(cfg: RunConfig) -> Learner:
            configs_of[cfg.run_id] = cfg
            store = open_store(cfg.store)
            announcer = Announcer(publisher, cfg.run_id)
            _, _, created = create_run(store, cfg, cfg.model.base_model)
            if created is not None:
                announcer(created)
            sources[cfg.run_id] = KafkaSource(bus, cfg.run_id)
            policy = EnginePolicy(engine, cfg.run_id, cfg.learner)
            learners[cfg.run_id] = build_learner(cfg, store, sources[cfg.run_id], announcer, base_model, policy=policy,
                                                   stopping=stop)
            return learners[cfg.run_id]

        packed = PackedLearner(engine, [open_run(cfg) for cfg in configs])
        done.add("broker")
        packed.resume()
        for learner in learners.values():
            record_resumed(health, learner, runs_health.labels(learner.run_id))
        done.add("resumed")
        health.add_readiness_check("runs", lambda: bool(packed.runs) or not comebacks.waiting)  # not all failing
        health.set_gauge("rlpipe_learner_up", 1.0, "1 once the learner is set up and training")

        def note_runs() -> None:
            """Who is served and who waits, on ``/metrics`` and ``/readyz``; the series of a run gone removed."""
            health.set_gauge("rlpipe_learner_runs_waiting", float(len(comebacks.waiting)),
                             "runs stopped on an error, waiting to come back from their newest checkpoint")
            runs_health.sync([run.run_id for run in packed.runs],
                             {run_id: comebacks.errors.get(run_id, "") for run_id in comebacks.waiting})

        note_runs()

        def failed(run_id: str, error: Exception) -> None:
            close_run(run_id)
            comebacks.failed(configs_of[run_id], error, again=not isinstance(error, LeaseLostError))
            note_runs()

        def joined(config: RunConfig) -> Exception | None:
            error = join(packed, config, open_run, close_run)
            if error is None:
                record_resumed(health, learners[config.run_id], runs_health.labels(config.run_id))
            return error

        def between_rounds(packed: PackedLearner) -> None:
            assert membership is not None
            for config in comebacks.due():
                log.info("run %s comes back", config.run_id)
                error = joined(config)
                if error is not None:
                    failed(config.run_id, error)
            note_runs()
            serving = {run.run_id for run in packed.runs}
            for change in membership.changes(serving | set(comebacks.waiting)):
                if isinstance(change, Joined):
                    joined(change.config)
                elif change.run_id not in serving:  # stopped while waiting to come back
                    comebacks.forget(change.run_id)
                    log.info("run %s stopped while waiting to come back; it stays stopped", change.run_id)
                else:
                    try:
                        learner = packed.remove(change.run_id, after_step)
                    except Exception as exc:  # its last step or checkpoint failed: as any failure, the others go on
                        run = next((run for run in packed.runs if run.run_id == change.run_id), None)
                        if run is not None:
                            packed.drop(run)
                        close_run(change.run_id)
                        log.error("run %s failed while leaving (%s: %s); it resumes from its newest checkpoint "
                                  "when served again", change.run_id, type(exc).__name__, exc)
                        continue
                    try:
                        learner.announce(LearnerLeft(step=learner.state.step, version=learner.state.version))
                    except Exception as exc:  # its checkpoint is written: the announcement only informs
                        log.warning("run %s left, but its LearnerLeft was not announced (%s)", change.run_id, exc)
                    close_run(change.run_id)
                    log.info("run %s left at step %d, version %d", learner.run_id, learner.state.step,
                             learner.state.version)
            note_runs()

        def close_run(run_id: str) -> None:
            source, learner = sources.pop(run_id, None), learners.pop(run_id, None)
            if source is not None:
                source.close()
            if learner is not None:
                learner.metric_logger.close()

        packed.run(should_stop=stop, on_step=after_step, between_rounds=between_rounds,
                   until_stopped=lambda: follow_runs is not None or bool(comebacks.waiting), on_failure=failed)
        packed.finish_all(after_step, on_failure=failed)
    finally:
        if membership is not None:
            membership.close()
        for source in sources.values():
            source.close()
        publisher.close()
        for learner in learners.values():
            learner.metric_logger.close()
        health.stop()
    for learner in learners.values():
        log.info("run %s stopped at step %d, version %d", learner.run_id, learner.state.step, learner.state.version)
    comebacks.check_settled()  # a run lost or still failing: the exit says so, as a single-run learner's does
    return packed


def join(packed: PackedLearner, config: RunConfig, open_run: Callable[[RunConfig], Learner],
         close_run: Callable[[str], None]) -> Exception | None:
    """Add ``config``'s run to ``packed``; a run that cannot start (its lease held elsewhere, a broken store) is
    logged and dropped, and the others go on.  The error it could not join on, if any."""
    log.info("run %s joins", config.run_id)
    try:
        packed.add(open_run(config))
    except Exception as exc:  # one run's failure to start must not stop the runs already served
        log.error("run %s could not join: %s", config.run_id, exc)
        close_run(config.run_id)
        with contextlib.suppress(EngineError):  # it failed before its adapter was made
            packed.engine.delete_adapter(config.run_id)
        return exc
    return None
