"""The off-policy learner loop: ingest announced batches, train, publish, checkpoint.

Phases of one pass: *ingest* (read and verify each announced Parquet batch,
skip batches already trained, drop rows more than ``max_staleness`` versions
old), and when enough rows are waiting, *train* one optimizer step on them,
*publish* an adapter version every ``publish_every`` steps and *checkpoint*
every ``checkpoint_every`` steps, committing the source's offsets only after the
checkpoint is durable.  In ``run`` the publish and checkpoint writes of a step
run in a background thread while the next step trains (``consumers.step_writer``:
one step in flight, the same order of writes); ``step`` called on its own
returns with its writes done.

Exactly-once effect: an optimizer step always consumes whole batches, so the
position stored in a checkpoint never splits a batch; the step log records
every trained ``batch_id`` (the idempotency key) in the step object written
before the checkpoint that covers it, and loading a checkpoint rebuilds the full
set from the step objects up to its step, so a batch announced twice is trained
once however far apart the announcements are; and on restart the learner loads
the newest complete checkpoint and seeks its source to the stored positions
(``consumers.learner_start``).
A crash after a version was published but before the checkpoint that records
it retrains that step from the previous checkpoint (same batches, same RNG
state, so the same weights), rewrites its step object, and publishes it again
under the next version number: versions stay dense, and a step's adapter may
appear under two consecutive versions.

Keeping a run moving: after every step, and while it waits for rows, the
learner announces how far it has read (``LearnerProgress`` on the control
topic), so producers' backpressure never waits for a checkpoint's commit; a
batch that can never be read is dead-lettered and skipped instead of crashing
the learner at the same offset forever; and the run's learner lease
(``consumers.lease``), taken on resume, is checked before every commit point,
so a second learner of the run fences this one out; a checkpoint this one still
commits after the second resumed is skipped by later resumes once the second
rewrote the step objects it covers (each checkpoint records the step log's
hash-chain head, ``pipeline.io.steplog``).

The source is a small protocol: Kafka (``consumers.sources.KafkaSource``) and
offline replay from the store (``consumers.sources.ReplaySource``) feed the same
loop, so both give the same weights on the same batches in the same order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from consumers import learner_start
from consumers.advantages import EpisodeColumns, compute_advantages, training_weights
from consumers.batching import PendingBatch, checked_for_training, drop_stale, micro_batches
from consumers.broker_wait import (
    PROGRESS_INTERVAL_S,
    WaitReport,
    commit_until_taken,
    keep_alive_quietly,
    progress_announced,
    until_the_broker_takes,
)
from consumers.checkpoint import CheckpointStore
from consumers.collapse import CollapseMonitor, collapse_signs, keep_uncertain_groups, zero_advantage_share
from consumers.faults import FaultInjector
from consumers.lease import LearnerLease
from consumers.policy import LoraPolicy
from consumers.read_ahead import BatchReader
from consumers.sources import POISON_BATCH_ERRORS, BatchRef, TrajectorySource, origin_of
from consumers.step_writer import StepOutputs
from consumers.tracking import MetricLogger, NullMetricLogger
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.runtime import announcing_once
from schemas.checkpoint import LearnerState
from schemas.config import LearnerConfig
from schemas.events import DeadLetter, LearnerProgress, Payload
from schemas.trajectory import TRAJECTORY_SCHEMA
from schemas.versions import NewerSchemaError

log = logging.getLogger("rlpipe.learner")


class Learner:
    """Trains one run's adapter from a stream of trajectory batches."""

    def __init__(
        self,
        *,
        run_id: str,
        base_model: str,
        config: LearnerConfig,
        policy: LoraPolicy,
        archive: TrajectoryArchive,
        registry: AdapterRegistry,
        checkpoints: CheckpointStore,
        source: TrajectorySource,
        announce: Callable[[Payload], None] = lambda payload: None,
        metric_logger: MetricLogger | None = None,
        lease: LearnerLease | None = None,
        stopping: Callable[[], bool] = lambda: False,
        reannounce: bool = True,
    ) -> None:
        """``reannounce``: whether ``resume`` announces again what the learner before it may have left unannounced
        (``consumers.reannounce``); False where no broker takes the events (a replay)."""
        self.run_id, self.base_model, self.cfg = run_id, base_model, config
        self.reannounce = reannounce
        self.policy, self.archive, self.registry = policy, archive, registry
        self.checkpoints, self.source, self.announce = checkpoints, source, announce
        self.lease = lease  # None: nothing fences this learner (tests, benchmarks)
        self.state = LearnerState()
        self.pending: list[PendingBatch] = []
        self.incoming: deque[BatchRef] = deque()
        self.reader = BatchReader(archive)  # reads the next batches while a step trains
        self.duplicates_skipped = 0
        self.dead_lettered = 0
        self.ingested: dict[str, int] = {}  # positions read so far: ahead of state.positions between steps
        self.progress_sent: tuple[dict[str, int], float] = ({}, float("-inf"))  # what was announced, and when
        self.lease_checked_at = float("-inf")
        self.last_metrics: dict[str, Any] = {}
        self.unpublished_training = True  # whether a step trained rows since the last version (unknown: assume so)
        self.faults = FaultInjector.from_env()  # read once: crash tests only
        if config.lr_schedule != "constant" and not config.max_steps:
            log.warning("run %s: learner.lr_schedule=%s decays over learner.max_steps, which is not set: the learning "
                        "rate stays constant; set learner.max_steps (or rlpipe run --max-steps)", run_id,
                        config.lr_schedule)
        self.metric_logger = metric_logger or NullMetricLogger()  # TensorBoard / W&B (consumers.tracking)
        self.collapse = CollapseMonitor(config)
        # a step's publish and checkpoint: prepared here, written beside the next step's training
        # ``stopping`` (the process's stop flag) ends a wait for a broker that is away (``consumers.broker_wait``)
        self.outputs = StepOutputs(run_id, base_model, registry, checkpoints, announce, self.faults, stopping,
                                   keep_versions=config.keep_versions,
                                   keep_also=frozenset({1}) if config.init_from else frozenset())  # the warm start
        self.pipelined = False  # True inside ``pipelining`` (``run``): step() returns before its writes are done
        self.letters_beside = False  # True in a packed run's turn: a dead letter is sent beside the others' turns

    # ---- set up (``consumers.learner_start``) -------------------------------
    def resume(self, between_tries: Callable[[], None] | None = None, beside: bool = False) -> bool:
        """Take the run's learner lease, load the newest complete checkpoint and seek the source to its positions
        (committed again, after its events are announced again); whether there was one.  ``between_tries`` runs
        before each try again of a wait for the broker; ``beside``: a packed run's start, whose announcements and
        commit its turns wait for (``learner_start.resume``)."""
        return learner_start.resume(self, between_tries, beside)

    def warm_start(self, init_from: str, between_tries: Callable[[], None] | None = None) -> None:
        """Start from another run's published adapter, published unchanged as this run's v1, and checkpoint at step 0
        (``learner_start.warm_start``); ``between_tries`` runs before each try again of their waits for the broker."""
        learner_start.warm_start(self, init_from, between_tries)

    # ---- the loop -----------------------------------------------------------
    def run(self, should_stop: Callable[[], bool] = lambda: False, on_step: Callable[[dict], None] = lambda m: None,
            poll_timeout_s: float = 1.0, wait_for_writes: bool = True) -> LearnerState:
        """Loop until stopped, ``max_steps`` is reached, or a finite source runs dry.

        Refs are ingested one at a time and a step is taken as soon as enough rows
        wait, so what goes into each step does not depend on how the source
        happened to group its deliveries (Kafka and replay give the same steps).
        With ``wait_for_writes`` False the last step's writes may still be going
        when this returns (a packed learner's turn): the next step, ``checkpoint``
        or ``finish_writes`` waits for them; so may a batch's dead letter (``quarantine``), and the caller must
        read nothing more before it is taken; and the batches it started reading
        ahead are kept for the next call (``reader.close()`` drops them).
        """
        with self.pipelining(letters_beside=not wait_for_writes):
            try:
                while not should_stop() and not self.budget_reached():
                    if not self.incoming:
                        self.incoming.extend(self.source.poll(poll_timeout_s))
                    if self.incoming:
                        self.ingest([self.incoming.popleft()])
                        if self.ready():
                            self.read_ahead()
                            on_step(self.step())
                    elif self.source.exhausted():
                        if self.work_waiting():
                            on_step(self.step())
                        break
                    else:
                        if self.outputs.writer.busy and self.outputs.writer.done:
                            self.finish_writes()  # commit what the last step's checkpoint covers while idle
                        self.announce_progress()  # waiting for rows: producers must not wait for this learner
                        self.check_lease_while_waiting()
            except BaseException:
                self.outputs.abandon()
                self.reader.close()
                raise
        if wait_for_writes:
            self.reader.close()
            self.finish_writes()
        return self.state

    @contextlib.contextmanager
    def pipelining(self, letters_beside: bool = False) -> Iterator[None]:
        """Inside, ``step`` returns with its writes still going, as in ``run``: the next step, ``checkpoint`` or
        ``finish_writes`` waits for them.  ``letters_beside``: a dead letter is sent beside too (a packed run's
        turn, ``quarantine``).  Both flags are as they were on leaving."""
        was = self.pipelined, self.letters_beside
        self.pipelined, self.letters_beside = True, letters_beside
        try:
            yield
        finally:
            self.pipelined, self.letters_beside = was

    def read_ahead(self) -> None:
        """Start reading the batches already delivered (polling without waiting if none is) for the next step."""
        if not self.incoming:
            self.incoming.extend(self.source.poll(0.0))
        self.reader.read_ahead(self.incoming, skip=lambda ref: ref.batch_id in self.state.trained)

    def budget_reached(self) -> bool:
        return self.cfg.max_steps is not None and self.state.step >= self.cfg.max_steps

    # ---- phase: ingest ------------------------------------------------------
    def ingest(self, refs: list[BatchRef]) -> None:
        """Read, verify and staleness-filter each new batch; skip ones already trained, quarantine bad ones."""
        for ref in refs:
            for key, value in ref.position.items():
                self.ingested[key] = max(value, self.ingested.get(key, 0))
            if ref.batch_id in self.state.trained or any(p.ref.batch_id == ref.batch_id for p in self.pending):
                self.duplicates_skipped += 1
                self.reader.forget(ref)  # read ahead before it was known to be a duplicate
                log.info("batch %s already trained; skipped", ref.batch_id)
                self.pending.append(PendingBatch(ref, TRAJECTORY_SCHEMA.empty_table(), 0, {}))
                continue
            try:  # a row training refuses would stop every restart at this batch; a NaN would poison the weights
                table = checked_for_training(self.reader.read(ref), self.policy.input_vocab, self.cfg)
            except NewerSchemaError:
                raise  # written by a newer rlpipe: readable once this one is upgraded, so never skipped
            except POISON_BATCH_ERRORS as exc:
                self.quarantine(ref, exc)
                continue
            keep, dropped, histogram = drop_stale(
                table.column("policy_version").to_numpy(), self.state.version, self.cfg.max_staleness
            )
            if dropped:
                log.info("batch %s: dropped %d rows older than %d versions", ref.batch_id, dropped,
                         self.cfg.max_staleness)
            self.pending.append(PendingBatch(ref, table.filter(pa.array(keep)), dropped, histogram))

    def quarantine(self, ref: BatchRef, error: Exception) -> None:
        """Dead-letter a batch that can never be read, and go on past it.

        Restarting cannot help (the store's objects are immutable), so raising
        would restart the learner at the same offset forever.  The batch goes to
        ``<ns>.dlq`` with the reason, is counted in the step's metrics
        (``batches_dead_lettered``), and its position advances with the next step,
        so the checkpoint commits past it; it is never recorded as trained.  A
        learner stopped or killed before that checkpoint dead-letters the batch
        again on its next start, under the same ``event_id`` (derived from the
        batch's origin: ``schemas.events.announcement_id``), so readers that
        dedupe by it count one letter.  In a packed run's turn (``letters_beside``)
        the letter is sent from a thread of its own, so a broker refusing it holds
        only this run, which passes its turns until it is taken
        (``consumers.packed_writes``); nothing is read past the batch, nor written
        after it, before then (``finish_writes`` waits for it).
        """
        reason = f"trajectory batch {ref.batch_id} quarantined: {str(error).strip().splitlines()[0]}"[:2000]
        topic, partition, offset = origin_of(ref)
        raw = json.dumps({"batch_id": ref.batch_id, "path": ref.path, "sha256": ref.sha256}, sort_keys=True)
        letter = DeadLetter(reason=reason, origin_topic=topic, origin_partition=partition, origin_offset=offset,
                            key=ref.batch_id, raw=raw)
        what = f"the DeadLetter of batch {ref.batch_id}"
        if self.letters_beside:
            self.outputs.send_beside(announcing_once(self.announce, letter), what)
            sent = "sending to the dead-letter topic"  # (the letter's thread may still wait for the broker)
        else:
            until_the_broker_takes(announcing_once(self.announce, letter), what, self.run_id, self.outputs.stopping)
            sent = "sent to the dead-letter topic"
        self.dead_lettered += 1
        log.warning("%s (%s)", reason, sent)
        self.pending.append(PendingBatch(ref, TRAJECTORY_SCHEMA.empty_table(), 0, {}, quarantined=True))

    def announce_progress(self, force: bool = False) -> None:
        """Tell producers how far this learner has read (``LearnerProgress``): after every step (``force``),
        and while it waits for rows whenever that changed or every ``PROGRESS_INTERVAL_S``."""
        if not self.ingested:
            return
        sent, sent_at = self.progress_sent
        now = time.monotonic()
        if not force and self.ingested == sent and now - sent_at < PROGRESS_INTERVAL_S:
            return
        progress_announced(self.announce, LearnerProgress(step=self.state.step, version=self.state.version,
                                                           positions=dict(self.ingested)), self.run_id)
        self.progress_sent = (dict(self.ingested), now)

    def check_lease_while_waiting(self) -> None:
        """Every ``PROGRESS_INTERVAL_S`` while waiting for rows, stop if a newer learner holds the lease.

        Publishes and checkpoints check it anyway; this makes a learner that the
        group left without partitions (the newer one reads them) exit too.
        """
        now = time.monotonic()
        if self.lease is not None and now - self.lease_checked_at >= PROGRESS_INTERVAL_S:
            self.lease_checked_at = now
            self.lease.check()

    def ready(self) -> bool:
        """Enough rows wait for a step; stale rows count, or a producer that waits for the learner to
        consume its batches (``producer.max_backlog_steps``) and a learner that waits for fresh rows
        would wait for each other forever once a whole step's worth of rows went stale."""
        return sum(p.table.num_rows + p.dropped for p in self.pending) >= self.cfg.batch_rows

    def work_waiting(self) -> bool:
        """Whether a pending batch has rows to train or stale rows to record.

        Already-trained duplicates alone are not worth a step: it would publish an
        unchanged adapter as a new version.  Left pending, they are delivered again
        after a restart and skipped again.
        """
        return any(p.table.num_rows or p.dropped for p in self.pending)

    def pass_untrainable(self) -> bool:
        """When every pending batch is one no step trains (dead-lettered, or already trained), move the read
        position past them and drop them; whether the position moved.

        For a stop: the checkpoint written then covers them, so a restart neither dead-letters a batch a second
        time nor reads a duplicate again.  No step is made for them (it would train nothing).
        """
        if not self.pending or self.work_waiting():
            return False
        before = dict(self.state.positions)
        for batch in self.pending:
            for key, value in batch.ref.position.items():
                self.state.positions[key] = max(value, self.state.positions.get(key, 0))
        self.pending = []
        return self.state.positions != before

    # ---- phase: train -------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """Train on every pending batch (one optimizer step), then publish/checkpoint when due."""
        batches, self.pending = self.pending, []
        rows = pa.concat_tables([b.table for b in batches]) if batches else None
        started = time.time()
        metrics: dict[str, Any] = {"step": self.state.step + 1, "started_at": started}
        if rows is not None and rows.num_rows:
            metrics.update(self.train(rows))
            self.unpublished_training = True
        else:
            metrics.update({"rows": 0, "skipped": True})
        self.state.step += 1
        newly_trained = []
        for batch in batches:
            if batch.ref.batch_id not in self.state.trained and not batch.quarantined:
                self.state.trained[batch.ref.batch_id] = self.state.step
                newly_trained.append(batch.ref.batch_id)
            for key, value in batch.ref.position.items():
                self.state.positions[key] = max(value, self.state.positions.get(key, 0))
        dropped = sum(b.dropped for b in batches)
        self.state.dropped_stale_rows += dropped
        histogram: dict[int, int] = {}
        for b in batches:
            for staleness, count in b.staleness.items():
                histogram[staleness] = histogram.get(staleness, 0) + count
        metrics.update({
            "batch_ids": newly_trained,  # the step log's record of what this step trained (dedup on resume)
            "dropped_stale_rows": dropped,
            "batches_dead_lettered": sum(b.quarantined for b in batches),
            "staleness_histogram": {str(k): v for k, v in sorted(histogram.items())},
            "version_trained_from": self.state.version,
            "finished_at": time.time(),
        })
        metrics["tokens_per_s"] = metrics.get("tokens", 0) / max(1e-9, metrics["finished_at"] - started)
        self.finish_writes()  # the previous step's writes ran beside this step's training
        publication = None
        if self.state.step % self.cfg.publish_every == 0 and not metrics.get("skipped"):
            publication = self.outputs.prepare_publication(self.policy, self.state, metrics)  # none if nothing trained
            self.unpublished_training = False
        metrics["version"] = self.state.version
        self.last_metrics = metrics
        # the step object's content (a copy, whatever callers do with ``metrics``), linked before the checkpoint
        # that records its digest is prepared
        recorded = self.checkpoints.link_step(self.state, metrics)
        prepared = (self.outputs.prepare_checkpoint(self.policy, self.state, metrics)
                    if self.state.step % self.cfg.checkpoint_every == 0 else None)
        self.metric_logger.log(metrics)
        self.outputs.writer.submit(lambda: self.outputs.write_step(recorded, publication, prepared))
        if not self.pipelined:
            self.finish_writes()
        self.announce_progress(force=True)
        return metrics

    def train(self, rows: pa.Table) -> dict[str, Any]:
        """One optimizer step on ``rows`` (advantages computed over the whole step)."""
        signs = collapse_signs(rows)  # every row, before the uncertain-group filter
        rows = keep_uncertain_groups(rows, self.cfg.keep_uncertain_groups)
        cols = rows.to_pydict()
        rewards_R = np.asarray(cols["reward"], dtype=np.float64)
        episode = EpisodeColumns(cols["state"], cols["turn_rewards"], cols["episode_id"], cols["terminated"],
                                 self.cfg.discount, self.cfg.gae_lambda) if self.cfg.advantage == "gae" else None
        advantages_R = compute_advantages(
            self.cfg.advantage, rewards_R, cols["group_id"], returns_to_go_R=cols["return_to_go"],
            turns_R=cols["turn"], normalize_std=self.cfg.normalize_advantage_std,
            return_to_go_baseline=self.cfg.return_to_go_baseline, episode=episode,
        )
        weights_R = training_weights(self.cfg, advantages_R, cols.get("weight"))
        batches = micro_batches(cols["tokens"], cols["loss_mask"], cols["logprobs"], advantages_R,
                                self.cfg.micro_batch_tokens, weights_R, temperatures_R=cols["temperature"])
        self.source.keep_alive()
        result = self.policy.train_step(batches, normaliser=float(rows.num_rows))
        self.source.keep_alive()
        metrics = {
            "rows": rows.num_rows,
            "tokens": int(sum(len(t) for t in cols["tokens"])),
            "generated_tokens": int(sum(sum(m) for m in cols["loss_mask"])),
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "learning_rate": result.learning_rate,
            "reward_mean": float(rewards_R.mean()),
            "success_rate": float(np.mean(cols["success"])),
            "policy_version_min": int(min(cols["policy_version"])),
            "policy_version_max": int(max(cols["policy_version"])),
            **result.stats.to_dict(),
            **signs,
            "zero_advantage_share": zero_advantage_share(advantages_R),
        }
        if result.trust is not None:
            metrics.update(step_kl=result.trust.step_kl, full_step_kl=result.trust.full_step_kl,
                           step_scale=result.trust.step_scale)  # fmt: skip
        self.collapse.check({"step": self.state.step + 1, **metrics})
        return metrics

    # ---- phase: publish / checkpoint ------------------------------------------
    def publish(self, metrics: dict[str, Any], between_tries: Callable[[], None] | None = None) -> None:
        """Save the adapter and publish it as the next version, then announce it (now, in this thread);
        ``between_tries`` runs before each try again of the announcement (a warm start's, ``resume``)."""
        self.finish_writes()
        self.outputs.write_publication(self.outputs.prepare_publication(self.policy, self.state, metrics),
                                       between_tries)
        self.unpublished_training = False

    def publish_last_steps(self) -> bool:
        """Publish the adapter if steps since the newest version trained rows (a run that ended between two
        ``publish_every`` steps); whether it did.  The caller checkpoints after it, so the version is recorded."""
        if not self.unpublished_training:
            return False
        self.publish(self.last_metrics)
        return True

    def checkpoint(self, between_tries: Callable[[], None] | None = None) -> str:
        """Write the checkpoint (manifest last), announce it, then commit the source's offsets (now);
        ``between_tries`` runs before each try again of the announcement and the commit (a warm start's,
        ``resume``)."""
        self.finish_writes()
        prepared = self.outputs.prepare_checkpoint(self.policy, self.state, self.last_metrics)
        key = self.outputs.write_checkpoint(prepared, between_tries)
        self.commit(dict(self.state.positions), f"the offsets of step {self.state.step}'s checkpoint",
                    between_tries=between_tries)
        return key

    def finish_writes(self) -> None:
        """Wait for a dead letter or start's announcements being sent (``wait_for_letter``) and the step in flight
        (raising their errors) and commit what its checkpoint covers."""
        self.wait_for_letter()
        self.finish_step_writes()

    def wait_for_letter(self) -> None:
        """Wait for a dead letter being sent (a packed run's, ``quarantine``), raising its error: no offsets past
        its batch are committed before the broker took it; so are a packed run's start's announcements
        (``learner_start.resume``'s ``beside``)."""
        self.outputs.beside.wait(lambda: keep_alive_quietly(self.source.keep_alive))

    def finish_step_writes(self) -> None:
        """Wait for the step in flight (raising its error) and commit what its checkpoint covers; the caller waited
        for a dead letter or start's announcements being sent first (``finish_writes``)."""
        written = self.outputs.writer.wait(lambda: keep_alive_quietly(self.source.keep_alive))
        if written is not None and written.positions:
            self.commit(written.positions, f"the offsets of step {written.checkpoint.step}'s checkpoint")

    def commit(self, positions: dict[str, int], what: str, report: WaitReport | None = None,
               between_tries: Callable[[], None] | None = None) -> None:
        """Commit the source's ``positions`` once the broker takes them (``broker_wait.commit_until_taken``);
        ``report``: the lines of a wait for this commit that began elsewhere (a packed run's turns), which this one
        goes on; ``between_tries``: run after each poll before a try again (``resume``)."""
        commit_until_taken(lambda: self.source.commit(positions), self.source.keep_alive, what, self.run_id,
                           self.outputs.stopping, report, between_tries)
