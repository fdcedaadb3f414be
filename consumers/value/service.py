"""The value learner process: set up store, bus, lease and source, resume, then run ``ValueLearner``.

``rlpipe learner start`` with a run whose configuration has a ``value`` section
lands here (``rlpipe run`` starts it that way).  The network's shape is the run's
(``value.observation_size``, ``value.num_actions``; each actor checks its
environment against them).  Versions and checkpoints are fenced by the run's
learner lease like the LoRA learner's.  SIGTERM stops between steps and writes a
final checkpoint, so nothing trained is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from consumers.checkpoint import CheckpointStore
from consumers.lease import FencedStore, LearnerLease
from consumers.sources import KafkaSource
from consumers.value.learner import ValueLearner
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.bus import EventPublisher
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.runtime import Announcer, StopFlag, create_run, open_store, resolved_bus
from schemas.config import RunConfig
from schemas.events import Payload

log = logging.getLogger("rlpipe.value")


def build_value_learner(config: RunConfig, store: ObjectStore, source: Any,
                        announce: Callable[[Payload], Any]) -> ValueLearner:
    """The value learner of ``config.run_id`` over ``store``, fed by ``source``, fenced by the run's lease."""
    if config.value is None:
        raise ValueError(f"run {config.run_id} has no value section; use a value preset such as dqn-cartpole")
    value = config.value
    lease = LearnerLease(store, config.run_id)
    fenced: Any = FencedStore(store, lease)
    return ValueLearner(
        run_id=config.run_id, env_name=config.env.name, config=value.learner,
        observation_size=value.observation_size, num_actions=value.num_actions,
        archive=TrajectoryArchive(store), registry=AdapterRegistry(fenced, config.run_id),
        checkpoints=CheckpointStore(fenced, config.run_id, keep=value.learner.keep_checkpoints),
        source=source, announce=announce, lease=lease,
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
    learner = build_value_learner(config, store, source, announcer)
    try:
        learner.resume()
        learner.run(should_stop=stop, on_step=lambda metrics: log.info(progress_line(metrics)))
        if learner.state.step % learner.cfg.checkpoint_every:
            learner.checkpoint()
    finally:
        source.close()
        publisher.close()
    log.info("value learner stopped at step %d, version %d", learner.state.step, learner.state.version)
    return learner
