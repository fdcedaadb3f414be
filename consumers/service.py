"""The learner process: set up each component, resume, then run the training loop.

One line per component (store, bus, model, policy, registry, checkpoints,
source), then ``Learner.run`` with a progress line per step.  SIGTERM stops the
loop between steps and writes a final checkpoint, so nothing trained is lost; a
learner that reaches ``max_steps`` between two ``publish_every`` steps publishes
its last step before that checkpoint, as a replay does when its data runs out.
Offline replay (``replay_train``) is the same loop fed from the store.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from consumers.checkpoint import CheckpointStore
from consumers.learner import Learner
from consumers.lease import FencedStore, LearnerLease
from consumers.policy import LoraPolicy
from consumers.sources import KafkaSource, ReplaySource, TrajectorySource
from consumers.tracking import open_metric_logger
from pipeline.health import HealthServer
from pipeline.io.archive import ArchiveError, TrajectoryArchive
from pipeline.io.archive_layout import damaged_run_fix
from pipeline.io.bus import BusError, EventPublisher
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.models import resolve_base_model
from pipeline.runtime import Announcer, StopFlag, create_run, open_store, resolved_bus
from schemas.config import RunConfig
from schemas.events import DeadLetter, LearnerLeft, Payload

log = logging.getLogger("rlpipe.learner")


def build_learner(
    config: RunConfig,
    store: ObjectStore,
    source: TrajectorySource,
    announce: Callable[[Payload], Any],
    base_model: str | None = None,
    policy: LoraPolicy | None = None,
    stopping: Callable[[], bool] = lambda: False,
    reannounce: bool = True,
) -> Learner:
    """The learner of ``config.run_id`` over ``store``, fed by ``source``.

    Its versions and checkpoints are fenced by the run's learner lease (taken by
    ``resume``): their manifests are written through a store that checks it.
    ``policy``: the run's adapter of a shared engine (packed learning); None loads a model of its own.
    ``stopping``: the process's stop flag, which ends a wait for a broker that is away (``consumers.broker_wait``).
    ``reannounce``: whether a start announces again what a learner before it left unannounced (False: no broker).
    """
    base_model = base_model or resolve_base_model(config.model)
    if policy is None:
        log.info("initialising policy on %s (LoRA rank %d)", base_model, config.learner.lora_rank)
        policy = LoraPolicy(base_model, config.learner, dtype=config.model.dtype)
    lease = LearnerLease(store, config.run_id)
    fenced: Any = FencedStore(store, lease)
    return Learner(
        run_id=config.run_id, base_model=config.model.base_model if config.model.base_model != "tiny" else base_model,
        config=config.learner, policy=policy, archive=TrajectoryArchive(store),
        registry=AdapterRegistry(fenced, config.run_id),
        checkpoints=CheckpointStore(fenced, config.run_id, keep=config.learner.keep_checkpoints),
        source=source, announce=announce, metric_logger=open_metric_logger(config, store), lease=lease,
        stopping=stopping, reannounce=reannounce,
    )


def progress_line(metrics: dict[str, Any]) -> str:
    """One log line per step: the numbers a person watches."""
    return (
        f"step {metrics['step']} v{metrics.get('version', 0)} rows {metrics.get('rows', 0)} "
        f"reward {metrics.get('reward_mean', float('nan')):.3f} loss {metrics.get('loss', float('nan')):.4f} "
        f"ratio {metrics.get('ratio_mean', float('nan')):.3f} ess {metrics.get('effective_sample_size', float('nan')):.3f} "
        f"dropped {metrics.get('dropped_stale_rows', 0)} tok/s {metrics.get('tokens_per_s', 0.0):.0f}"
        + (f" kl {metrics['full_step_kl']:.4f} x{metrics['step_scale']:g}" if "step_scale" in metrics else "")
    )


def record_step_metrics(health: HealthServer, metrics: dict[str, Any], labels: dict[str, str] | None = None) -> None:
    """A step's numbers on ``/metrics``: a gauge per numeric metric, and the run-long counters.

    ``labels``: those of the run's series (``{"run": id}`` in a packed learner); None for a learner of one run.
    """
    for key, value in metrics.items():
        if isinstance(value, int | float):
            health.set_gauge(f"rlpipe_learner_{key}", float(value), f"learner {key}", labels)
    health.inc_counter("rlpipe_learner_dead_lettered_batches", float(metrics.get("batches_dead_lettered", 0)),
                       "trajectory batches that could not be read, sent to the dead-letter topic and skipped", labels)


def record_resumed(health: HealthServer, learner: Learner, labels: dict[str, str] | None = None) -> None:
    """A resumed learner's step and version on ``/metrics`` (its counters at 0 until its first step)."""
    health.set_gauge("rlpipe_learner_step", float(learner.state.step), "learner step", labels)
    health.set_gauge("rlpipe_learner_version", float(learner.state.version), "learner version", labels)
    record_step_metrics(health, {"batches_dead_lettered": 0}, labels)


def run_learner(config: RunConfig, stop: StopFlag | None = None, on_step: Callable[[dict], None] | None = None,
                policy: LoraPolicy | None = None) -> Learner:
    """Consume ``<ns>.trajectories`` for one run and train until stopped or ``max_steps``.

    ``policy``: the run's adapter of an engine built by the caller (a torchrun
    group's, ``consumers.distributed_learner``); None loads a model of its own.

    The health server starts before anything slow, so ``/healthz`` answers while
    the policy loads; ``/readyz`` names the set-up steps still missing and is 200
    from the end of set-up (policy loaded, resumed) until a stop is requested.
    """
    stop = stop or StopFlag()
    log.info("initialising learner for run %s", config.run_id)
    health = HealthServer(config.learner.health_port).start()  # port None: metrics only, nothing listens
    try:
        return _set_up_and_run(config, stop, on_step, health, policy)
    finally:
        health.stop()


def announce_left(learner: Learner) -> None:
    """A learner its run's ``RunStopped`` ended, its final checkpoint written: ``LearnerLeft``, as a packed learner
    sends it, so what it sent after the stop reads as its wind-down and a learner started on the run later as the run
    going (``rlpipe runs show``).  It only informs: a failure is a warning."""
    try:
        learner.announce(LearnerLeft(step=learner.state.step, version=learner.state.version))
    except Exception as exc:  # the checkpoint is written; a broker away loses only this line of the record
        log.warning("run %s left, but its LearnerLeft was not announced (%s)", learner.run_id, exc)


def _set_up_and_run(config: RunConfig, stop: StopFlag, on_step: Callable[[dict], None] | None,
                    health: HealthServer, policy: LoraPolicy | None = None) -> Learner:
    done = health.add_setup_steps(("broker", "policy", "resumed"))
    health.add_readiness_check("stopping", lambda: not stop())
    bus = resolved_bus(config.bus)
    store = open_store(config.store)
    publisher = EventPublisher(bus)
    source = KafkaSource(bus, config.run_id)
    done.add("broker")
    announcer = Announcer(publisher, config.run_id)
    _, _, created = create_run(store, config, config.model.base_model)  # refuses a change of what the run is
    if created is not None:
        announcer(created)
    learner = build_learner(config, store, source, announcer, policy=policy, stopping=stop)
    done.add("policy")
    learner.resume()
    done.add("resumed")
    health.set_gauge("rlpipe_learner_up", 1.0, "1 once the learner is set up and training")
    record_resumed(health, learner)

    def after_step(metrics: dict[str, Any]) -> None:
        log.info(progress_line(metrics))
        record_step_metrics(health, metrics)
        if on_step is not None:
            on_step(metrics)

    try:
        learner.run(should_stop=stop, on_step=after_step)
        finish(learner, after_step)
        if stop.run_stopped:
            announce_left(learner)
    except BaseException:
        with contextlib.suppress(BusError):  # the error unwinding (a broker away, say) is the one to report
            publisher.close()
        raise
    else:
        publisher.close()
    finally:
        source.close()
        learner.metric_logger.close()
    log.info("learner stopped at step %d, version %d", learner.state.step, learner.state.version)
    return learner


def finish(learner: Learner, after_step: Callable[[dict], None]) -> None:
    """On a stop: train the rows still waiting, so the final checkpoint covers them, and write that checkpoint.

    A learner that reached ``max_steps`` between two ``publish_every`` steps also publishes its last step
    first, so the run's newest version holds everything it trained.  Batches read since the last step that no
    step trains (dead-lettered ones, duplicates) are covered too, so a restart does not read them again.  The
    choice is ``hand_over_final_writes``'s; this waits for those writes and commits the checkpoint's positions.
    """
    if learner.work_waiting():
        after_step(learner.step())
    learner.finish_writes()  # every caller's writer is idle by now; this keeps it so: the hand-over needs no job
    if hand_over_final_writes(learner):
        learner.finish_writes()


def hand_over_final_writes(learner: Learner) -> bool:
    """The writes that end a run, handed to the learner's writer as one job without waiting for it: the version of
    its last steps (at ``max_steps``, when steps since the newest version trained rows), then a checkpoint, when
    the version was published, batches no step trains were passed (``Learner.pass_untrainable``), or the last step
    was no ``checkpoint_every``-th; whether there was anything to write (not when its last step's own checkpoint
    covers everything).  Whoever waits for that job commits the checkpoint's positions (``finish``; a packed run at
    its end, ``consumers.packed_writes.RunWrites``).  A replay (``replay_train``) makes its own choice: it publishes
    when its data runs out, not at a budget.

    The writer must have no job (the last step's writes taken), and no rows may wait: a stop trains them first
    (``finish``), and a packed run is finished only once its last turn trained them (``PackedRun.finished``).
    """
    if learner.work_waiting():
        raise RuntimeError(f"run {learner.run_id}: rows still wait for a step; train them before its final writes")
    passed = learner.pass_untrainable()
    publication = None
    if learner.budget_reached() and learner.unpublished_training:  # as ``publish_last_steps``
        publication = learner.outputs.prepare_publication(learner.policy, learner.state, learner.last_metrics)
        learner.unpublished_training = False
    if not (passed or publication or learner.state.step % learner.cfg.checkpoint_every):
        return False
    prepared = learner.outputs.prepare_checkpoint(learner.policy, learner.state, learner.last_metrics)
    learner.outputs.writer.submit(lambda: learner.outputs.write_step(None, publication, prepared))
    return True


def replay_train(config: RunConfig, source_run: str, date_from: str | None = None, date_to: str | None = None,
                 announce: Callable[[Payload], Any] | None = None, policy: LoraPolicy | None = None) -> Learner:
    """Train ``config.run_id``'s adapter from the stored batches of ``source_run`` (no broker needed).

    ``policy``: as for ``run_learner``.

    A damaged batch (its file rewritten, its commit record missing, corrupt or naming
    another file) refuses the whole replay before anything is written or trained: with
    no broker there is no dead-letter topic, and training on the rest would silently
    train on part of the data.  Every batch is read once for that check.
    """
    store = open_store(config.store)
    archive = TrajectoryArchive(store)
    source = ReplaySource(archive, source_run, date_from, date_to)  # refuses a batch without a sound commit record
    log.info("checking the digests of %d batches of run %s", len(source.queue), source_run)
    archive.check_digests(source_run, source.queue)
    create_run(store, config, config.model.base_model)  # run.json, so eval/report know the run
    broker = announce is not None  # without one, nothing is announced: nor again at the start
    announce = refuse_dead_letters(announce or (lambda payload: None), source_run)  # no dead-letter topic here
    learner = build_learner(config, store, source, announce, policy=policy, reannounce=broker)
    source.already_trained = lambda batch_id: batch_id in learner.state.trained
    learner.resume()
    started = time.monotonic()
    learner.run(on_step=lambda m: log.info(progress_line(m)), poll_timeout_s=0.0)
    # the data ran out between two publish_every steps (steps with no rows: nothing to publish)
    if learner.publish_last_steps() or learner.state.step % config.learner.checkpoint_every:
        learner.checkpoint()  # after a publish too: the checkpoint records the version
    learner.metric_logger.close()
    log.info("replay trained %d steps in %.1fs", learner.state.step, time.monotonic() - started)
    return learner


def refuse_dead_letters(announce: Callable[[Payload], Any], source_run: str) -> Callable[[Payload], Any]:
    """``announce`` for a replay: a batch the learner would dead-letter (one that became unreadable after the
    digest check) stops the replay instead, so nothing is skipped silently and a rerun resumes before it."""

    def replay_announce(payload: Payload) -> Any:
        if isinstance(payload, DeadLetter):
            error = payload.reason.partition(" quarantined: ")[2] or payload.reason
            raise ArchiveError(f"replay stopped at trajectory batch {payload.key} of run {source_run}: {error}; "
                               f"{damaged_run_fix(source_run)}")
        return announce(payload)

    return replay_announce
