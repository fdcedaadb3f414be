"""The packed learner process: runs set up, followed, joined, brought back and closed around one ``PackedLearner``.

``rlpipe learner start --run A --run B`` (and ``--follow-runs``) runs ``run_packed_learner``; what whose turn it is,
and how a run's writes and waits are kept from the others, is ``consumers.packed``'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from consumers.engine import TrainingEngine
from consumers.engine_data import EngineError
from consumers.engine_policy import EnginePolicy
from consumers.learner import Learner
from consumers.lease import LeaseLostError
from consumers.packed import PackedLearner
from consumers.service import build_learner, progress_line, record_resumed, record_step_metrics
from consumers.sources import KafkaSource
from pipeline.health import HealthServer, PackedRunsHealth
from pipeline.io.bus import EventPublisher
from pipeline.membership import Change, Comebacks, Joined, RunMembership, control_start, engine_config, runs_not_stopped
from pipeline.models import check_same_tiny_build, recorded_tiny_dir, resolve_base_model
from pipeline.runtime import Announcer, StopFlag, create_run, open_store, resolved_bus
from schemas.config import RunConfig
from schemas.config import check_packable as packable
from schemas.events import LearnerLeft

log = logging.getLogger("rlpipe.learner")


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
                       follow_runs: str | None = None, template: RunConfig | None = None) -> PackedLearner:
    """Train several runs in one process on one engine until stopped or each reaches its ``max_steps`` (or left,
    and was not started again while leaving: such a run joins once it has left).

    Every run is set up as ``run_learner`` sets up one (its ``run.json``, its own
    consumer group, lease, registry and checkpoints); a SIGTERM trains what each
    run has waiting and writes each one's final checkpoint.  With ``follow_runs``
    (a glob of run ids) runs announced later join and served runs stopped later
    leave (``pipeline.membership``), and the process serves until stopped; it may then start with no run, its
    engine set up from ``template`` (base model, device, event log and store).  A named run recorded stopped is
    not trained until ``rlpipe runs resume``.  The control topic is followed from where it ended as this starts,
    before the runs' records are read (``pipeline.membership.control_start``): a run stopped since leaves, even if
    its ``RunStopped`` came while it set up, and a stop sent before is not read as new.
    """
    control_from_P = control_start(configs, template)
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
    leaving: set[str] = set()  # runs asked to leave, settling in their turns
    rejoining: dict[str, RunConfig] = {}  # runs started again while still leaving: they join once they left
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
                                   control_from_P=control_from_P, named=named)
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
            if run_id in leaving:  # stopped: it stays so, as any failure the others go on
                leaving.discard(run_id)
                log.error("run %s failed while leaving (%s: %s); it resumes from its newest checkpoint when served "
                          "again", run_id, type(error).__name__, error)
            else:
                comebacks.failed(configs_of[run_id], error, again=not isinstance(error, LeaseLostError))
            note_runs()

        def left(learner: Learner) -> None:
            """``learner``'s run left: its final checkpoint written, taken by the broker and committed.  It left
            whatever follows: a failure closing it is logged, never reported as the run's (which would bring it
            back), and it is no longer ``leaving`` only at the end (a run failing while leaving stays stopped)."""
            run_id, step, version = learner.run_id, learner.state.step, learner.state.version
            try:
                try:
                    learner.announce(LearnerLeft(step=step, version=version))
                except Exception as exc:  # its checkpoint is written: the announcement only informs
                    log.warning("run %s left, but its LearnerLeft was not announced (%s)", run_id, exc)
                close_run(run_id)
                note_runs()
            except Exception as exc:  # its end is durable: it left all the same
                log.error("run %s left at step %d, version %d, but closing it failed (%s: %s)", run_id, step,
                          version, type(exc).__name__, exc)
            else:
                log.info("run %s left at step %d, version %d", run_id, step, version)
            finally:
                leaving.discard(run_id)

        def joined(config: RunConfig) -> Exception | None:
            error = join(packed, config, open_run, close_run)
            if error is None:
                record_resumed(health, learners[config.run_id], runs_health.labels(config.run_id))
            return error

        def follow(change: Change, serving: set[str]) -> None:
            """One membership change: a run joins, or waits to (started again while leaving), or is asked to leave
            (``serving``: the runs served and not leaving), or stays stopped."""
            if isinstance(change, Joined):
                if change.config.run_id in leaving:
                    rejoining[change.config.run_id] = change.config
                    log.info("run %s started again while leaving; it joins once it has left", change.config.run_id)
                else:
                    joined(change.config)
            elif change.run_id in rejoining:
                del rejoining[change.run_id]
                log.info("run %s stopped again before joining again; it stays stopped", change.run_id)
            elif change.run_id not in serving:  # stopped while waiting to come back
                comebacks.forget(change.run_id)
                log.info("run %s stopped while waiting to come back; it stays stopped", change.run_id)
            else:  # it settles in its turns while the others train, and ``left`` follows once it is settled
                log.info("run %s leaves: it trains what it has waiting and writes its final checkpoint in its turns",
                         change.run_id)
                leaving.add(change.run_id)
                packed.leave(change.run_id, left)

        def between_rounds(packed: PackedLearner) -> None:
            assert membership is not None
            for config in comebacks.due():
                log.info("run %s comes back", config.run_id)
                error = joined(config)
                if error is not None:
                    failed(config.run_id, error)
            note_runs()
            serving = {run.run_id for run in packed.runs if run.run_id not in leaving}
            # read before a run started again while leaving joins: a RunStopped since it left keeps it stopped
            for change in membership.changes(serving | set(comebacks.waiting) | set(rejoining)):
                follow(change, serving)
            for run_id in [run_id for run_id in rejoining if run_id not in leaving]:  # they have left
                joined(rejoining.pop(run_id))
            note_runs()

        def close_run(run_id: str) -> None:
            source, learner = sources.pop(run_id, None), learners.pop(run_id, None)
            try:
                if source is not None:
                    source.close()
            finally:  # (its metrics flushed even when its consumer fails to close)
                if learner is not None:
                    learner.metric_logger.close()

        # serving on while a run may still join: followed runs, runs to come back, a run resumed while leaving
        packed.run(should_stop=stop, on_step=after_step, between_rounds=between_rounds,
                   until_stopped=lambda: follow_runs is not None or bool(comebacks.waiting) or bool(rejoining),
                   on_failure=failed)
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
