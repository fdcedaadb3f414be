"""The value learner loop: ingest steps batches, feed the replay memory, train DQN/C51, publish, checkpoint.

Actors -> steps batches in the store -> ``TrajectoryBatchCommitted`` -> source
(``consumers.sources``: Kafka, or any ``TrajectorySource``) -> ``ValueLearner``.
One *step* is one ingested batch (one not trained before and readable): its n-step transitions go into the bounded
replay memory, then ``updates_per_transition`` gradient updates per transition
(a fractional credit carries over) sample the memory, once it holds
``min_replay_size``.  A value-network version (registry kind ``value-network``) is
published every ``publish_every`` batches read (and at the last step: a replay's last batch, or
``max_steps`` reached, so the checkpoint of that step records it) and a checkpoint written every
``checkpoint_every`` steps, the source's offsets committed only after it.  A batch read
counts whether it trained or was dead-lettered, and each version records how many were read
(``batches_read``) and, per actor, how many of that actor's (``batches_read/<producer_id>``):
an actor bounded by ``max_batches_ahead`` compares its own count with its own, so neither
another actor's batches nor a dead-lettered batch of its leave it writing or waiting wrongly.
A version due at a dead-lettered batch is published then, with the weights of the last step.  With a
``slate`` (agent ``slateq``) the agent is SlateQ (``consumers.value.slateq``): the
transitions' action is the consumed item, and the published network the item values.

Exactly once, as the LoRA learner (``consumers.learner``): every step records the
``batch_id`` it trained in the step log before the checkpoint that covers it, a
batch already trained is skipped, and on restart the newest complete checkpoint is
loaded and the source seeks to its positions.  Sampling draws from the learner's
own generator, whose state is checkpointed, so a step repeated after a crash gives
the same weights.  After every step, and while it waits, the learner announces how far it has read
(``LearnerProgress``), the batches it passed without a step (dead-lettered, already trained) included; one the
broker refuses is a warning, sent again within ``PROGRESS_INTERVAL_S`` while the learner waits.
A dead letter, ``AdapterPublished``, ``LearnerCheckpointed`` or offset commit the broker refuses is tried again until
it takes it (``consumers.broker_wait``), the writes after it waiting: the offsets are never committed before their
checkpoint's event.  A stop during that wait ends the learner with one line naming what was never taken; the next
start, as every start, announces again the checkpoint it resumes from and the versions newer than it
(``consumers.reannounce``: a version or checkpoint a stop or a kill left unannounced among them), then commits its
offsets and trains each batch once.

The replay memory is not checkpointed: the store is the memory.  Each step-log
entry names the batches (path, digest, transitions formed) the step added, and
``resume`` reads back the newest batches up to the memory's capacity and adds them
in order after replaying the ring buffer's bookkeeping for the older ones, so the
rebuilt memory equals the one before the restart slot for slot.  Only the
priorities (which training changed) and the counters come from the checkpoint,
as tensors; nothing is pickled.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from consumers.broker_wait import (
    PROGRESS_INTERVAL_S,
    commit_until_taken,
    progress_announced,
    until_the_broker_takes,
)
from consumers.checkpoint import CheckpointStore
from consumers.faults import FaultInjector
from consumers.lease import LearnerLease
from consumers.reannounce import announce_again, checkpoint_event
from consumers.retention import VersionRetention
from consumers.sources import POISON_BATCH_ERRORS, BatchRef, TrajectorySource, origin_of, rewind_if_the_log_changed
from consumers.step_writer import finite_numbers
from consumers.tracking import NOT_SCALARS
from consumers.value.agent import ValueAgent, build_agent
from consumers.value.config import ValueLearnerConfig
from consumers.value.networks import network_spec
from consumers.value.replay import ReplayMemory, build_replay_memory
from consumers.value.slateq import SlateQLearnerAgent
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.runtime import announcing_once
from pipeline.value_network import network_files
from schemas.checkpoint import LearnerState
from schemas.events import DeadLetter, LearnerCheckpointed, LearnerProgress, Payload
from schemas.value import READ_BY_PRODUCER_METRIC, SlateSpec
from schemas.versions import NewerSchemaError

log = logging.getLogger("rlpipe.value")


@dataclass
class IngestedBatch:
    """A batch taken from the source: its table and transitions (None when already trained or quarantined)."""

    ref: BatchRef
    table: pa.Table | None
    quarantined: bool = False
    transitions: dict[str, np.ndarray] | None = None


class ValueLearner:
    """Trains one run's value network from a stream of steps batches."""

    def __init__(
        self,
        *,
        run_id: str,
        env_name: str,
        config: ValueLearnerConfig,
        observation_size: int,
        num_actions: int,
        archive: TrajectoryArchive,
        registry: AdapterRegistry,
        checkpoints: CheckpointStore,
        source: TrajectorySource,
        announce: Callable[[Payload], Any] = lambda payload: None,
        lease: LearnerLease | None = None,
        slate: SlateSpec | None = None,
        stopping: Callable[[], bool] = lambda: False,
        reannounce: bool = True,
    ) -> None:
        """``stopping``: the process's stop flag, which ends a wait for a broker that is away.  ``reannounce``:
        whether ``resume`` announces again what the learner before it may have left unannounced
        (``consumers.reannounce``); False where no broker takes the events (a replay)."""
        if (config.agent == "slateq") != (slate is not None):
            raise ValueError(f"agent {config.agent} with{'' if slate else 'out'} a slate: slateq needs the run's "
                             "value.slate, dqn and c51 take none")
        self.run_id, self.env_name, self.cfg = run_id, env_name, config
        self.spec = network_spec(config, observation_size, num_actions, slate)
        self.agent: ValueAgent | SlateQLearnerAgent = (
            SlateQLearnerAgent(config, slate, slate.selection) if slate is not None
            else build_agent(config, observation_size, num_actions)
        )
        self.num_actions = slate.num_candidates if slate is not None else num_actions  # what an action indexes
        self.memory: ReplayMemory = build_replay_memory(config, observation_size, self.num_actions)
        self.rng = np.random.default_rng(config.seed)
        self.update_credit = 0.0
        self.archive, self.registry, self.checkpoints = archive, registry, checkpoints
        self.retention = VersionRetention(registry, "value.learner.keep_versions", config.keep_versions)
        self.source, self.announce, self.lease, self.stopping = source, announce, lease, stopping
        self.reannounce = reannounce
        self.state = LearnerState()
        self.incoming: deque[BatchRef] = deque()
        self.duplicates_skipped = self.dead_lettered = self.dead_lettered_unrecorded = 0
        self.batches_read = 0  # trained or dead-lettered (a duplicate is neither): what publish_every counts
        self.read_by_producer: Counter[str] = Counter()  # the same, per producer (what max_batches_ahead bounds)
        self.reads_attributed = True  # False once a batch read has no producer (such a source, an older step log)
        self.dead_lettered_producers: list[str | None] = []  # since the last step (its log entry records them)
        self.carried: dict[str, int] = {}  # positions read since the last step (skipped batches' included)
        self.progress_sent: dict[str, int] = {}  # the read positions last announced (LearnerProgress)
        self.progress_refused_at: float | None = None  # time.monotonic() of the last refused one (None: taken)
        self.last_metrics: dict[str, Any] = {}
        self.faults = FaultInjector.from_env()

    # ---- set up ----------------------------------------------------------------------
    def resume(self) -> bool:
        """Take the lease, load the newest checkpoint, rebuild the replay memory from the store, seek the source."""
        if self.lease is not None:
            self.lease.acquire()
        checkpoint = self.checkpoints.latest()
        # what a kill or a stop may have left unannounced (``consumers.reannounce``), before the offsets' commit
        if self.reannounce:
            resumed = checkpoint_event(self.checkpoints, checkpoint, NOT_SCALARS) if checkpoint is not None else None
            announce_again(self.announce, self.run_id, self.registry, resumed, self.stopping)
        if checkpoint is None:
            log.info("no checkpoint for run %s: starting at step 0", self.run_id)
            self.rewind_if_the_log_changed()
            self.source.seek({})  # every partition from its start, whatever the group committed
            return False
        self.agent.load_state_dict(checkpoint.adapter)
        self.state = checkpoint.state
        self.rewind_if_the_log_changed()
        self.rng.bit_generator.state = checkpoint.scalars["rng"]
        self.update_credit = float(checkpoint.scalars["update_credit"])
        entries = self.checkpoints.steps.read(upto=self.state.step)
        # dead-lettered batches a stop passed count as read; the next step's log entry records them
        self.dead_lettered_unrecorded = int(checkpoint.scalars.get("dead_lettered_unrecorded", 0))
        self.batches_read = self.dead_lettered_unrecorded + sum(
            1 + int(entry.get("batches_dead_lettered", 0)) for entry in entries)
        self.dead_lettered_producers = list(checkpoint.scalars.get("dead_lettered_producers",
                                                                   [None] * self.dead_lettered_unrecorded))
        self.count_reads_by_producer(entries)
        self.memory = self.rebuild_memory([batch for entry in entries for batch in entry.get("batches", [])])
        self.restore_memory_counters(checkpoint.optimizer, checkpoint.scalars["replay"])
        self.source.seek(self.state.positions)
        self.commit(dict(self.state.positions), f"the offsets of step {self.state.step}'s checkpoint")
        log.info("resumed from %s: step %d, version %d, replay memory %d", checkpoint.key, self.state.step,
                 self.state.version, len(self.memory))
        return True

    def count_reads_by_producer(self, entries: list[dict[str, Any]]) -> None:
        """The batches read per producer, from the step log's entries and the dead-lettered ones no entry records
        yet; a read the log does not attribute (an entry of an older rlpipe) leaves versions without the counts."""
        producers: list[str | None] = [*self.dead_lettered_producers]
        for entry in entries:
            producers += [batch.get("producer_id") for batch in entry.get("batches", [])]
            dead = entry.get("dead_lettered_producers", [None] * int(entry.get("batches_dead_lettered", 0)))
            producers += dead
        self.read_by_producer = Counter(producer for producer in producers if producer is not None)
        self.reads_attributed = None not in producers
        if not self.reads_attributed:
            log.warning("the step log does not name the actor of every batch read: versions record no per-actor "
                        "counts, and actors bounded by max_batches_ahead compare theirs with the run's")

    def count_read(self, producer_id: str | None) -> None:
        """One more batch read (trained or dead-lettered), of ``producer_id``."""
        self.batches_read += 1
        if producer_id is None:
            self.reads_attributed = False
        else:
            self.read_by_producer[producer_id] += 1

    def rewind_if_the_log_changed(self) -> None:
        """Read a log that is not the one the checkpoint's positions point into from its start.

        As the LoRA learner on resume (``consumers.learner_start.resume``): a broker that lost its log numbers
        events from 0 again; positions that point elsewhere start over at 0 and batches already trained
        are skipped by their ids.  The identity of the log read from now on goes into the next checkpoint.
        """
        rewind_if_the_log_changed(self.source, self.state)

    def rebuild_memory(self, batches: list[dict[str, Any]]) -> ReplayMemory:
        """The replay memory after adding ``batches`` in order, reading only those still in it from the store."""
        memory = build_replay_memory(self.cfg, self.spec.observation_size, self.num_actions)
        newest, covered = len(batches), 0
        while newest > 0 and covered < memory.capacity:  # the suffix of batches the memory still holds
            newest -= 1
            covered += int(batches[newest]["transitions"])
        for batch in batches[:newest]:  # older batches: only the ring buffer's bookkeeping
            count = int(batch["transitions"])
            keep = min(count, memory.capacity)
            memory.cursor = (memory.cursor + keep) % memory.capacity
            memory.size = min(memory.size + keep, memory.capacity)
            memory.add_count += count
        for batch in batches[newest:]:
            added = memory.add_steps_table(self.archive.read_steps(batch["path"], batch["sha256"]))
            if added != int(batch["transitions"]):
                raise ValueError(f"steps batch {batch['batch_id']} now forms {added} transitions, the step log says "
                                 f"{batch['transitions']}; the replay memory cannot be rebuilt, start a new run")
        return memory

    def restore_memory_counters(self, tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
        """Priorities and counters from the checkpoint; the counters must agree with the rebuilt memory."""
        expected = (int(scalars["size"]), int(scalars["cursor"]), int(scalars["add_count"]))
        rebuilt = (self.memory.size, self.memory.cursor, self.memory.add_count)
        if rebuilt != expected:
            raise ValueError(f"replay memory rebuilt from the store has size/cursor/count {rebuilt}, the checkpoint "
                             f"{expected}; steps batches are missing from the store, start a new run")
        self.memory.tree.set(np.arange(self.memory.capacity), tensors["replay/priority"].numpy())
        self.memory.max_priority = float(scalars["max_priority"])

    # ---- the loop --------------------------------------------------------------------
    def run(self, should_stop: Callable[[], bool] = lambda: False, on_step: Callable[[dict], None] = lambda m: None,
            poll_timeout_s: float = 1.0) -> LearnerState:
        """One step per batch until stopped, ``max_steps`` is reached, or a finite source runs dry."""
        while not should_stop() and not self.budget_reached():
            if not self.incoming:
                self.incoming.extend(self.source.poll(poll_timeout_s))
            if self.incoming:
                batch = self.ingest(self.incoming.popleft())
                if batch.table is not None:
                    on_step(self.step(batch))
                elif batch.quarantined and self.version_due():
                    self.publish({**self.last_metrics, "batches_read": self.batches_read})
            elif self.source.exhausted():
                break
            else:
                self.announce_progress()  # waiting: batches passed since the last step are read too
                if self.lease is not None:
                    self.lease.check()
        return self.state

    def budget_reached(self) -> bool:
        return self.cfg.max_steps is not None and self.state.step >= self.cfg.max_steps

    def version_due(self) -> bool:
        """Whether the batch just read (trained or dead-lettered) is a ``publish_every``-th, once the network trains."""
        return self.batches_read % self.cfg.publish_every == 0 and self.agent.training_steps > 0

    # ---- phase: ingest ---------------------------------------------------------------
    def ingest(self, ref: BatchRef) -> IngestedBatch:
        """Read and verify one batch and form its transitions; a batch already trained is skipped, one unreadable
        or whose contents cannot train (a NaN, another observation width, an action outside the agent's) is
        dead-lettered before anything of it reaches the memory.

        Neither makes a step (a step without data would publish unchanged weights as a new version):
        their positions are carried into the next step's, so its checkpoint commits past them.
        """
        for key, value in ref.position.items():
            self.carried[key] = max(value, self.carried.get(key, 0))
        if ref.batch_id in self.state.trained:
            self.duplicates_skipped += 1
            log.info("batch %s already trained; skipped", ref.batch_id)
            return IngestedBatch(ref, None)
        try:
            table = self.archive.read_steps(ref.path, ref.sha256)
            return IngestedBatch(ref, table, transitions=self.memory.transitions_of(table))
        except NewerSchemaError:
            raise  # written by a newer rlpipe: readable once this one is upgraded, so never skipped
        except POISON_BATCH_ERRORS as exc:
            reason = f"steps batch {ref.batch_id} quarantined: {str(exc).strip().splitlines()[0]}"[:2000]
            topic, partition, offset = origin_of(ref)
            raw = json.dumps({"batch_id": ref.batch_id, "path": ref.path, "sha256": ref.sha256}, sort_keys=True)
            self.announce_until_taken(DeadLetter(reason=reason, origin_topic=topic, origin_partition=partition,
                                                 origin_offset=offset, key=ref.batch_id, raw=raw),
                                      f"the DeadLetter of batch {ref.batch_id}")
            self.dead_lettered += 1
            self.dead_lettered_unrecorded += 1
            self.dead_lettered_producers.append(ref.producer_id)
            self.count_read(ref.producer_id)
            log.warning("%s (sent to the dead-letter topic)", reason)
            return IngestedBatch(ref, None, quarantined=True)

    # ---- phase: train ----------------------------------------------------------------
    def step(self, batch: IngestedBatch) -> dict[str, Any]:
        """Add the batch's transitions, train, then record, publish and checkpoint when due."""
        if batch.table is None or batch.transitions is None:
            raise ValueError(f"batch {batch.ref.batch_id} has no table to train (skipped or quarantined)")
        started = time.time()  # with finished_at: the learner's lane of the report's duty cycle
        self.memory.add(batch.transitions)
        added = len(batch.transitions["action"])
        metrics: dict[str, Any] = {"step": self.state.step + 1, "started_at": started, **self.train(added),
                                   **episode_metrics(batch.table)}
        metrics["batch_ids"] = [batch.ref.batch_id]
        metrics["batches"] = [{"batch_id": batch.ref.batch_id, "path": batch.ref.path,
                               "sha256": batch.ref.sha256, "transitions": added,
                               "producer_id": batch.ref.producer_id}]
        self.state.step += 1
        self.state.trained[batch.ref.batch_id] = self.state.step
        for key, value in self.carried.items():
            self.state.positions[key] = max(value, self.state.positions.get(key, 0))
        self.carried = {}
        metrics.update(replay_size=len(self.memory), training_steps=self.agent.training_steps,
                       batches_dead_lettered=self.dead_lettered_unrecorded,
                       dead_lettered_producers=self.dead_lettered_producers)
        self.dead_lettered_unrecorded, self.dead_lettered_producers = 0, []
        self.count_read(batch.ref.producer_id)
        metrics["batches_read"] = self.batches_read
        # the last step (a replay's last batch, or max_steps reached): publish what the run ends with, before the
        # step's checkpoint, so that it records the version
        last = (not self.incoming and self.source.exhausted()) or self.budget_reached()
        if self.version_due() or last:
            self.publish(metrics)
        metrics["version"] = self.state.version
        metrics["finished_at"] = time.time()
        self.checkpoints.record_step(self.checkpoints.link_step(self.state, metrics))  # before its checkpoint
        self.last_metrics = metrics
        if self.state.step % self.cfg.checkpoint_every == 0:
            self.checkpoint()
        self.announce_progress(force=True)
        return metrics

    def announce_progress(self, force: bool = False) -> None:
        """Announce how far this learner has read (``LearnerProgress``): after every step (``force``), and while it
        waits whenever that changed.  Waiting, the positions include batches no step covers (dead-lettered, already
        trained): read all the same, and ``rlpipe run`` stops the learner only once it is seen to have read every
        batch of the run's.  One the broker refuses is a warning: the learner trains on, and waiting it tries again
        once ``PROGRESS_INTERVAL_S`` passed since the refusal (each try may last the publisher's whole wait)."""
        read = dict(self.state.positions)
        for key, value in self.carried.items():
            read[key] = max(value, read.get(key, 0))
        now = time.monotonic()
        refused_lately = self.progress_refused_at is not None and now - self.progress_refused_at < PROGRESS_INTERVAL_S
        if not force and (not read or read == self.progress_sent or refused_lately):
            return
        progress = LearnerProgress(step=self.state.step, version=self.state.version, positions=read)
        if progress_announced(self.announce, progress, self.run_id):
            self.progress_sent, self.progress_refused_at = read, None
        else:
            self.progress_refused_at = now

    def train(self, transitions_added: int) -> dict[str, Any]:
        """The gradient updates this many new transitions pay for (none before ``min_replay_size``)."""
        self.update_credit += transitions_added * self.cfg.updates_per_transition
        updates = int(self.update_credit)
        self.update_credit -= updates
        if len(self.memory) < self.cfg.min_replay_size:
            return {"transitions": transitions_added, "updates": 0}
        totals = np.zeros(3)
        for _ in range(updates):
            sample = self.memory.sample(self.cfg.batch_size, self.rng, beta=self.cfg.priority_beta)
            result = self.agent.train_step(sample)
            self.memory.update_priorities(sample["indices"], result.priorities_B)
            totals += (result.loss, result.td_abs_mean, result.q_mean)
        metrics: dict[str, Any] = {"transitions": transitions_added, "updates": updates}
        if updates:
            metrics.update(zip(("loss", "td_abs_mean", "q_mean"), (totals / updates).tolist(), strict=True))
        return metrics

    # ---- phase: publish / checkpoint -------------------------------------------------
    def finish(self) -> None:
        """On a stop: write a checkpoint unless the last step's is the newest state.

        Batches read since the last step that no step trains (dead-lettered, duplicates) are covered too: the
        checkpoint's positions pass them and it keeps the count of those dead-lettered (the step log records it
        only with the next step), so a restart neither dead-letters one again nor publishes again a version that
        fell due at one.
        """
        passed = bool(self.carried)
        for key, value in self.carried.items():
            self.state.positions[key] = max(value, self.state.positions.get(key, 0))
        self.carried = {}
        if passed or self.state.step % self.cfg.checkpoint_every:
            self.checkpoint()

    def publish(self, metrics: dict[str, Any]) -> None:
        """Publish the online network as the next value-network version, then announce it.

        Its metrics carry ``batches_read/<producer_id>`` for each actor whose batches were read (none when a read
        batch named no producer: an actor would then take its count for too low and could wait for ever)."""
        per_producer = {READ_BY_PRODUCER_METRIC + producer: count for producer, count in self.read_by_producer.items()}
        manifest = self.registry.publish_files(
            network_files(self.spec, self.agent.online), base_model=f"{self.cfg.agent}:{self.env_name}",
            parent_version=self.state.version, learner_step=self.state.step,
            metrics={**finite_numbers(metrics, exclude=NOT_SCALARS), **(per_producer if self.reads_attributed else {})},
            kind="value-network",
        )
        self.state.version = manifest.version
        self.faults.reached("before_version_event")
        self.announce_until_taken(self.registry.published_event(manifest),
                                  f"AdapterPublished v{manifest.version} (step {self.state.step})")
        log.info("published value network v%d at step %d", manifest.version, self.state.step)
        self.faults.reached("after_publish")
        self.retention.after_publish(manifest.version)

    def checkpoint(self) -> str:
        """Agent tensors, replay priorities and counters, sampling RNG; then announce and commit offsets."""
        self.faults.reached("before_checkpoint")
        memory = self.memory
        scalars = {
            "rng": self.rng.bit_generator.state, "update_credit": self.update_credit,
            "dead_lettered_unrecorded": self.dead_lettered_unrecorded,
            "dead_lettered_producers": list(self.dead_lettered_producers),
            "replay": {"size": memory.size, "cursor": memory.cursor, "add_count": memory.add_count,
                       "max_priority": memory.max_priority},
        }
        priorities = {"replay/priority": torch.from_numpy(memory.tree.leaves().copy())}
        key = self.checkpoints.save(self.state, self.agent.state_dict(), priorities, scalars)
        self.faults.reached("before_checkpoint_event")
        self.announce_until_taken(LearnerCheckpointed(step=self.state.step, version=self.state.version, path=key,
                                                      offsets=dict(self.state.positions),
                                                      metrics=finite_numbers(self.last_metrics, exclude=NOT_SCALARS)),
                                  f"LearnerCheckpointed of step {self.state.step} (its offsets not committed)")
        self.faults.reached("after_checkpoint")
        self.commit(dict(self.state.positions), f"the offsets of step {self.state.step}'s checkpoint")
        return key

    def commit(self, positions: dict[str, int], what: str) -> None:
        """Commit the source's ``positions`` once the broker takes them (``broker_wait.commit_until_taken``)."""
        commit_until_taken(lambda: self.source.commit(positions), self.source.keep_alive, what, self.run_id,
                           self.stopping)

    def announce_until_taken(self, payload: Payload, what: str) -> None:
        """Announce ``payload``, waiting out a broker that refuses it (until it takes it, or a stop); every try
        publishes the same event (``announcing_once``).  A version's or checkpoint's event still refused at a stop
        is announced again by the next start (``consumers.reannounce``); a dead letter is not (the next start reads
        its batch again, and dead-letters it then, under the same ``event_id``: ``schemas.events.announcement_id``)."""
        until_the_broker_takes(announcing_once(self.announce, payload), what, self.run_id, self.stopping)


def episode_metrics(table: pa.Table) -> dict[str, float]:
    """Return per finished episode in a steps batch (mean and count), for the report."""
    ends = table.filter(table["is_last"])
    if ends.num_rows == 0:
        return {}
    episode_R = table["episode_id"].to_numpy(zero_copy_only=False)
    reward_R = table["reward"].to_numpy().astype(np.float64)
    finished = set(ends["episode_id"].to_pylist())
    returns = [reward_R[episode_R == episode].sum() for episode in finished]
    return {"episode_return_mean": float(np.mean(returns)), "episodes": float(len(returns))}
