"""The value learner process: set up store, bus, lease and source, resume, then run ``ValueLearner``.

``rlpipe learner start`` with a run whose configuration has a ``value`` section
lands here (``rlpipe run`` starts it that way).  The network's shape is the run's
(``value.observation_size``, ``value.num_actions``; each actor checks its
environment against them).  Versions and checkpoints are fenced by the run's
learner lease like the LoRA learner's.  SIGTERM stops between steps and writes a
final checkpoint, so nothing trained is lost; during a wait for a broker that is away
(``consumers.broker_wait``: an event or an offset commit) it ends the wait with one line
naming what was never taken.  ``rlpipe replay --train`` on a value run lands in
``replay_train_value``: the same learner fed by another run's stored steps batches
(``StepsReplaySource``, the value runs' ``ReplaySource``), no broker, each batch trained once,
in the order that run's learner trained them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from consumers.checkpoint import CheckpointStore
from consumers.lease import FencedStore, LearnerLease
from consumers.sources import BatchRef, KafkaSource, in_date_range
from consumers.value.learner import ValueLearner
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.bus import EventPublisher
from pipeline.io.registry import AdapterRegistry
from pipeline.io.steplog import StepLog, in_trained_order
from pipeline.io.store import ObjectStore
from pipeline.runtime import Announcer, StopFlag, create_run, open_store, resolved_bus
from schemas.config import RunConfig
from schemas.events import DeadLetter, Payload, RunStarted

log = logging.getLogger("rlpipe.value")
CONTINUOUS_ACTION_ENVS = ("building-hvac",)  # setpoints, not action indices: offline CQL (value.offline)


def build_value_learner(config: RunConfig, store: ObjectStore, source: Any, announce: Callable[[Payload], Any],
                        stopping: Callable[[], bool] = lambda: False, reannounce: bool = True) -> ValueLearner:
    """The value learner of ``config.run_id`` over ``store``, fed by ``source``, fenced by the run's lease.

    ``stopping``: the process's stop flag, which ends a wait for a broker that is away (``consumers.broker_wait``).
    ``reannounce``: whether a start announces again what a learner before it left unannounced (False: no broker).
    """
    if config.value is None:
        raise ValueError(f"run {config.run_id} has no value section; use a value preset such as dqn-cartpole")
    if config.value.offline is not None:
        raise ValueError(f"run {config.run_id} trains offline CQL from a dataset: rlpipe replay --run DATASET --train")
    value = config.value
    lease = LearnerLease(store, config.run_id)
    fenced: Any = FencedStore(store, lease)
    return ValueLearner(
        run_id=config.run_id, env_name=config.env.name, config=value.learner,
        observation_size=value.observation_size, num_actions=value.num_actions,
        archive=TrajectoryArchive(store), registry=AdapterRegistry(fenced, config.run_id),
        checkpoints=CheckpointStore(fenced, config.run_id, keep=value.learner.keep_checkpoints),
        source=source, announce=announce, lease=lease, slate=value.slate, stopping=stopping,
        reannounce=reannounce,
    )


def progress_line(metrics: dict[str, Any]) -> str:
    """One log line per step: the numbers a person watches."""
    return (
        f"step {metrics['step']} v{metrics.get('version', 0)} replay {metrics.get('replay_size', 0)} "
        f"updates {metrics.get('updates', 0)} return {metrics.get('episode_return_mean', float('nan')):.1f} "
        f"loss {metrics.get('loss', float('nan')):.4f} td {metrics.get('td_abs_mean', float('nan')):.3f} "
        f"q {metrics.get('q_mean', float('nan')):.2f}"
    )


def run_value_learner(config: RunConfig, stop: StopFlag | None = None) -> ValueLearner:
    """Consume ``<ns>.trajectories`` for one value run and train until stopped or ``max_steps``."""
    stop = stop or StopFlag()
    store = open_store(config.store)
    bus = resolved_bus(config.bus)
    publisher = EventPublisher(bus)
    source = KafkaSource(bus, config.run_id)
    announcer = Announcer(publisher, config.run_id)
    _, _, created = create_run(store, config, config.env.name)
    if created is not None:
        announcer(created)
    learner = build_value_learner(config, store, source, announcer, stopping=stop)
    if config.learner.torch_threads is not None:  # small networks: extra threads mostly contend for the CPU
        torch.set_num_threads(config.learner.torch_threads)
    try:
        learner.resume()
        learner.run(should_stop=stop, on_step=lambda metrics: log.info(progress_line(metrics)))
        learner.finish()
    finally:
        source.close()
        publisher.close()
    log.info("value learner stopped at step %d, version %d", learner.state.step, learner.state.version)
    return learner


def replay_train_value(config: RunConfig, source_run: str, date_from: str | None = None,
                       date_to: str | None = None) -> ValueLearner:
    """Train ``config.run_id``'s value network from the stored steps batches of ``source_run`` (no broker)."""
    if config.env.name in CONTINUOUS_ACTION_ENVS:
        raise ValueError(f"the value learner needs discrete actions and {config.env.name} has none; for offline "
                         "CQL on logged building days use --preset cql-building (--run names the dataset)")
    store = open_store(config.store)
    _, _, created = create_run(store, config, config.env.name)  # run.json, so eval/report know the run
    source = StepsReplaySource(store, source_run, date_from, date_to)

    def refuse_unusable(payload: Payload) -> None:  # no log to dead-letter onto: a batch that cannot train stops it
        if isinstance(payload, DeadLetter):
            why = payload.reason.split(": ", 1)[-1]
            raise ValueError(f"steps batch {payload.key} of run {source_run} cannot be trained ({why}); the replay "
                             "stopped there: leave its day out with --date-from/--date-to")

    learner = build_value_learner(config, store, source, refuse_unusable, reannounce=False)  # no broker
    source.already_trained = lambda batch_id: batch_id in learner.state.trained
    learner.resume()
    try:
        learner.run(on_step=lambda metrics: log.info(progress_line(metrics)), poll_timeout_s=0.0)
    except ValueError:  # the batches do not suit this agent: a run this call created and never trained goes
        if isinstance(created, RunStarted) and learner.state.step == 0:
            store.delete(f"runs/{config.run_id}", recursive=True)
        raise
    published = learner.registry.latest()  # the learner publishes a replay's last batch itself, before its checkpoint
    tail = bool(learner.state.step) and (published is None or published.learner_step < learner.state.step)
    if tail:  # a resumed replay whose last step was never published
        learner.publish(learner.last_metrics)
    if tail or learner.state.step % learner.cfg.checkpoint_every:  # a checkpoint that records the newest version
        learner.checkpoint()
    log.info("value replay trained %d steps, version %d", learner.state.step, learner.state.version)
    return learner


class StepsReplaySource:
    """A run's stored steps batches (``runs/<run>/env-steps/date=.../<id>.parquet``) in the order its learner
    trained them.

    Steps batches carry no commit record and their ids are random, so their keys say
    nothing of the order the run's learner read them in (its actors' announcements,
    interleaved), and the replay memory, so the weights, depend on that order.  The
    run's step log records it: the batches it names come first, in its steps' order;
    the others (none trained there: written after its learner stopped, or a run with
    no learner) follow in key order (date, then batch id).  No digest is checked.
    The position is the count handed out; resuming offers again, in the same order,
    every batch the learner has not trained (``already_trained``), like
    ``consumers.sources.ReplaySource``.  A damaged step object in the source run fails the
    replay (``StepLogError``, naming it): without it the trained order is unknown.
    """

    def __init__(self, store: ObjectStore, run_id: str, date_from: str | None = None, date_to: str | None = None,
                 already_trained: Callable[[str], bool] | None = None) -> None:
        self.store, self.run_id, self.date_from, self.date_to = store, run_id, date_from, date_to
        self.position_key = f"replay-steps:{run_id}"
        self.already_trained = already_trained
        self.handed_out = 0
        self.queue: list[str] = self._listing()

    def _listing(self) -> list[str]:
        keys = TrajectoryArchive(self.store).list_steps(self.run_id)
        in_range = sorted(k for k in keys if in_date_range(k, self.date_from, self.date_to))
        return in_trained_order(in_range, lambda key: key.rsplit("/", 1)[-1].removesuffix(".parquet"),
                                StepLog(self.store, self.run_id).read())

    def poll(self, timeout_s: float) -> list[BatchRef]:
        if not self.queue:
            return []
        key = self.queue.pop(0)
        self.handed_out += 1
        batch_id = key.rsplit("/", 1)[-1].removesuffix(".parquet")
        return [BatchRef(batch_id, key, None, {self.position_key: self.handed_out})]

    def seek(self, positions: dict[str, int]) -> None:
        """Resume: offer every batch not trained yet, in the listing's order (a seek to the start before anything
        was handed out keeps the listing just read)."""
        if not positions.get(self.position_key) and not self.handed_out:
            return
        self.handed_out = positions.get(self.position_key, 0)
        trained = self.already_trained or (lambda batch_id: False)
        self.queue = [k for k in self._listing() if not trained(k.rsplit("/", 1)[-1].removesuffix(".parquet"))]

    def commit(self, positions: dict[str, int]) -> None:
        """Nothing to commit: the checkpoint's position is the count handed out."""

    def keep_alive(self) -> None:
        """Nothing to keep alive."""

    def exhausted(self) -> bool:
        return not self.queue
