"""How a learner starts (``Learner.resume``): from its run's newest complete checkpoint, or fresh, from a warm start.

The start's half of the exactly-once argument (``consumers.learner``): the run's
learner lease is taken first, so a learner of the run still running is fenced out
at its next commit point; the checkpoint's weights, optimizer, RNG states and
state (positions, and the batches trained, from the step log) are restored, and
its positions are committed again, as a learner killed between a durable
checkpoint and its commit left the group's offsets behind it; and the checkpoint
and every version newer than it are announced again first
(``consumers.reannounce``), as the learner before may have been stopped or killed
before the broker took their events.  A run with no checkpoint starts at step 0,
from every partition's start; with ``learner.init_from`` it first publishes the
warm start as its v1 and checkpoints at step 0, so a restart resumes instead.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

from consumers.broker_wait import RETRY_WAIT_S, learner_waits
from consumers.checkpoint import Checkpoint
from consumers.reannounce import announce_again, checkpoint_event
from consumers.sources import rewind_if_the_log_changed
from pipeline.io.registry import AdapterRegistry
from schemas.config import parse_init_from

if TYPE_CHECKING:
    from consumers.learner import Learner

log = logging.getLogger("rlpipe.learner")


def resume(learner: Learner, between_tries: Callable[[], None] | None = None, beside: bool = False) -> bool:
    """Take the run's learner lease, load the newest complete checkpoint and seek the source to its positions;
    whether there was one.

    The checkpoint's positions are committed again: a learner killed after a
    checkpoint was durable but before its commit left the group's offsets
    behind what that checkpoint trained.  Before that commit the checkpoint and
    every version newer than it are announced again (``consumers.reannounce``):
    the learner before this one may have been killed or stopped before their
    events were taken.  ``between_tries`` runs before each try again of those waits for the broker (a packed
    learner keeps its other runs' consumers alive there).  ``beside`` (a packed run joining or coming back): the
    announcements are sent from the run's ``beside`` thread instead of waited for here, and the commit is left to
    the caller, which makes the run read and train nothing before both are taken (``PackedLearner.add``); a warm
    start, which publishes after them, waits for them first.  A source whose log is not the one the positions point
    into (a broker that lost its log numbers events from 0 again) is read from its start
    (``consumers.sources.rewind_if_the_log_changed``); batches already trained are skipped by their ids.
    """
    if learner.lease is not None:
        learner.lease.acquire()
    learner.outputs.next_version = None  # versions a learner before this one published count
    checkpoint = learner.checkpoints.latest()
    if beside:
        announce_again_beside(learner, checkpoint)
    else:
        announce_again_from(learner, checkpoint, between_tries)
    if checkpoint is None:
        log.info("no checkpoint for run %s: starting at step 0", learner.run_id)
        rewind_if_the_log_changed(learner.source, learner.state)
        learner.source.seek({})  # every partition from its start, whatever the group committed
        learner.unpublished_training = False
        if learner.cfg.init_from:
            learner.outputs.beside.wait(between_tries)  # (its v1 is announced after the versions announced again)
            warm_start(learner, learner.cfg.init_from, between_tries)
        return False
    learner.policy.load_state(checkpoint.adapter, checkpoint.optimizer, checkpoint.scalars)
    checkpoint.restore_rng()
    learner.state = state = checkpoint.state
    rewind_if_the_log_changed(learner.source, state)
    learner.ingested = dict(state.positions)
    if learner.cfg.init_from and learner.cfg.kl_coef > 0:
        restore_reference(learner)
    learner.source.seek(state.positions)
    if not beside:
        learner.commit(dict(state.positions), f"the offsets of step {state.step}'s checkpoint",
                       between_tries=between_tries)
    published = learner.registry.latest()  # the steps resumed past the newest version trained rows, if any
    learner.unpublished_training = bool(state.step) and (published is None or published.learner_step < state.step)
    log.info("resumed from %s: step %d, version %d", checkpoint.key, state.step, state.version)
    return True


def announce_again_from(learner: Learner, checkpoint: Checkpoint | None,
                        between_tries: Callable[[], None] | None = None) -> None:
    """Announce ``checkpoint`` (the one resumed from) and the versions newer than it, as they were first
    sent (``consumers.reannounce``); nothing without a broker (``Learner.reannounce`` False)."""
    if not learner.reannounce:
        return
    resumed = checkpoint_event(learner.checkpoints, checkpoint) if checkpoint is not None else None
    announce_again(learner.announce, learner.run_id, learner.registry, resumed, learner.outputs.stopping,
                   between_tries)


def announce_again_beside(learner: Learner, checkpoint: Checkpoint | None) -> None:
    """``announce_again_from`` in ``learner``'s ``beside`` thread (``StepOutputs.send_beside``'s), its wait for the
    broker ended by a stop or an abandon; ``Learner.wait_for_letter`` waits for it, raising its error."""
    if not learner.reannounce:
        return
    outputs = learner.outputs
    resumed = checkpoint_event(learner.checkpoints, checkpoint) if checkpoint is not None else None
    if checkpoint is None and learner.cfg.init_from:  # ``resume`` waits for them, then publishes the warm start
        waiting = learner_waits(RETRY_WAIT_S, holding_others=True)
    else:
        waiting = "the run passes its turns, reading and training nothing, until the broker takes it"
    outputs.beside.submit(lambda: announce_again(
        learner.announce, learner.run_id, learner.registry, resumed,
        lambda: outputs.stopping() or outputs.abandoning.is_set(), waiting=waiting))


def warm_start(learner: Learner, init_from: str, between_tries: Callable[[], None] | None = None) -> None:
    """Start from another run's published adapter and publish it unchanged as this run's v1.

    Producers then sample the warm start from the beginning, and the registry
    keeps base (v0), warm start (v1) and everything trained after it side by
    side for evaluation.  The optimizer starts fresh.  A checkpoint follows at
    step 0, so a restart resumes instead of warm-starting (and publishing) again.
    The adapter must have this learner's LoRA shape (rank, alpha, target modules).
    ``between_tries`` runs before each try again of the publish's and the checkpoint's waits for the broker (a
    packed learner polls the consumers of the runs it serves there, as they wait for this start).
    """
    source_run, wanted = parse_init_from(init_from)
    source = AdapterRegistry(learner.registry.store, source_run)
    manifest = source.show(wanted) if wanted is not None else source.latest()
    if manifest is None:
        raise ValueError(f"learner.init_from={init_from!r}: run {source_run} has no published adapter; "
                         "train it first (e.g. rlpipe replay --train) or fix the name")
    if manifest.base_model != learner.base_model:
        raise ValueError(f"learner.init_from={init_from!r} was trained on {manifest.base_model}, not "
                         f"{learner.base_model}; warm-start from an adapter of the same base model")
    with tempfile.TemporaryDirectory(prefix="rlpipe-warm-") as cache:
        learner.policy.load_adapter_folder(source.pull(manifest.version, cache))
    learner.policy.keep_reference()  # the KL penalty keeps the policy near its warm start
    log.info("warm start from %s v%d", source_run, manifest.version)
    learner.publish({"warm_start_version": manifest.version}, between_tries)
    learner.checkpoint(between_tries)


def restore_reference(learner: Learner) -> None:
    """After a restart, the KL reference is the warm start again: this run's v1, published unchanged."""
    if "warm_start_version" not in learner.registry.show(1).metrics:
        raise ValueError(f"run {learner.run_id}: v1 is not a warm start, so learner.kl_coef has no reference to "
                         "restore; start a fresh run or set learner.kl_coef to 0")
    with tempfile.TemporaryDirectory(prefix="rlpipe-reference-") as cache:
        learner.policy.keep_reference_folder(learner.registry.pull(1, cache))
