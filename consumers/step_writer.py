"""Writing a learner step's results beside the next step's training: one background thread, one step in flight.

A step's publish (adapter files, manifest, ``AdapterPublished``), its step object
and its checkpoint (files, manifest, ``LearnerCheckpointed``) are store and
broker round trips; the learner hands them here as a job once the step's
snapshot is taken (copies of the adapter's weights and of the checkpoint's
tensors with the RNG states, serialised by the job), and trains
the next step meanwhile.  The
learner waits for the job before it hands over the next one, so at most one
step is in flight, the commit order of a synchronous learner holds (adapter,
manifest, event, step object, checkpoint, offsets), and a failure (a store
error, a lost lease) is raised in the learner's thread by that wait.  Offsets
are committed by the learner's thread after the wait: Kafka consumers are not
thread-safe.  An announcement the broker refuses (it is away) is tried again
until it is taken (``consumers.broker_wait``): the job, and so the next step's
wait for it, lasts as long as the outage, and nothing after it goes first.  An
announcement the learner never saw taken (a stop during that wait, a kill) is
sent again by the next start (``consumers.reannounce``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from consumers.broker_wait import RETRY_WAIT_S, WaitReport, learner_waits, until_the_broker_takes
from consumers.checkpoint import CheckpointStore, PreparedCheckpoint
from consumers.faults import FaultInjector
from consumers.retention import VersionRetention
from pipeline.io.registry import AdapterRegistry
from pipeline.runtime import announcing_once
from schemas.checkpoint import LearnerState
from schemas.events import LearnerCheckpointed, Payload

if TYPE_CHECKING:
    from consumers.policy import AdapterSnapshot

log = logging.getLogger("rlpipe.learner")

KEEP_ALIVE_EVERY_S = 1.0  # while the learner waits for a step's writes, it polls its consumer this often


def finite_numbers(metrics: dict[str, Any], exclude: tuple[str, ...] = ()) -> dict[str, float]:
    """The finite numeric metrics (cross-entropy steps have no importance ratios: NaN is left out)."""
    return {
        k: float(v) for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and k not in exclude
    }


class SavablePolicy(Protocol):
    """What publishing and checkpointing need of a policy."""

    def adapter_snapshot(self) -> AdapterSnapshot: ...
    def adapter_tensors(self) -> dict[str, torch.Tensor]: ...
    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...


@dataclass(frozen=True)
class Publication:
    """An adapter as it was at a step (a snapshot, not yet written), to be published as ``version``."""

    snapshot: AdapterSnapshot
    version: int
    parent_version: int
    step: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class PreparedStep:
    """A checkpoint taken at a step (not yet written), the positions it covers and its announcement's metrics."""

    checkpoint: PreparedCheckpoint
    positions: dict[str, int]
    metrics: dict[str, float]


class StepWriter:
    """Runs one job at a time in a background thread; ``wait`` returns its result or raises its error."""

    def __init__(self, name: str = "rlpipe-step-writer") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._job: Future[Any] | None = None

    def submit(self, job: Callable[[], Any]) -> None:
        """Start ``job``; the previous one must have been waited for."""
        if self._job is not None:
            raise RuntimeError("StepWriter.submit: the previous job was not waited for; call wait() first")
        self._job = self._executor.submit(job)

    @property
    def busy(self) -> bool:
        """A job is submitted and has not been waited for."""
        return self._job is not None

    @property
    def done(self) -> bool:
        """The submitted job (if any) has finished: ``wait`` would not block."""
        return self._job is None or self._job.done()

    @property
    def going(self) -> bool:
        """A job is submitted and still running: ``wait`` would block."""
        return self.busy and not self.done

    def wait(self, keep_alive: Callable[[], None] | None = None) -> Any:
        """The submitted job's result (None when there is none); its exception is raised here.

        ``keep_alive`` is called every ``KEEP_ALIVE_EVERY_S`` while the job runs: a job waiting for the broker may
        last longer than the consumer group lets a member go without polling (``max_poll_interval_ms``).
        """
        job = self._job
        if job is None:
            return None
        while keep_alive is not None and not futures.wait([job], timeout=KEEP_ALIVE_EVERY_S).done:
            keep_alive()
        self._job = None
        return job.result()

    def wait_quietly(self) -> None:
        """Let the submitted job end, logging instead of raising its error (while another error unwinds)."""
        try:
            self.wait()
        except Exception as exc:  # the error already unwinding is the one to report; this one is logged
            log.warning("the step writer's last job failed too: %s", exc)


def wait_for_any(writers: list[StepWriter], timeout_s: float) -> None:
    """Return once the job of one of ``writers`` has ended (at once if none has a job), or after ``timeout_s``."""
    jobs = [writer._job for writer in writers if writer._job is not None]
    if jobs:
        futures.wait(jobs, timeout=timeout_s, return_when=futures.FIRST_COMPLETED)


class StepOutputs:
    """A learner's publishing and checkpointing: each prepared in the learner's thread, written by ``writer``."""

    def __init__(self, run_id: str, base_model: str, registry: AdapterRegistry, checkpoints: CheckpointStore,
                 announce: Callable[[Payload], None], faults: FaultInjector,
                 stopping: Callable[[], bool] = lambda: False, keep_versions: int | None = None,
                 keep_also: frozenset[int] = frozenset()) -> None:
        """``stopping``: the process's stop flag, which ends a wait for the broker (``consumers.broker_wait``);
        ``keep_versions``: the newest versions whose files stay in the registry after each publish (None: every
        version's); ``keep_also``: versions kept whatever their age (a warm start's v1)."""
        self.run_id, self.base_model = run_id, base_model
        self.registry, self.checkpoints, self.announce, self.faults = registry, checkpoints, announce, faults
        self.stopping = stopping
        self.abandoning = threading.Event()  # set while the learner, stopping on an error, lets the job in flight end
        self.retention = VersionRetention(registry, "learner.keep_versions", keep_versions, keep_also)
        self.writer = StepWriter()
        self.next_version: int | None = None  # the registry's next version number, read at the first publish
        self.broker_wait: WaitReport | None = None  # the writer's announcement in progress, as its wait reports it
        # a packed run's dead letter, or the events its start announces again, sent beside the others' turns
        self.beside = StepWriter("rlpipe-beside")

    def prepare_publication(self, policy: SavablePolicy, state: LearnerState, metrics: dict[str, Any]) -> Publication:
        """The adapter of now as the next version (its number is taken, ``state.version``, now); a memory copy,
        written by ``write_publication``."""
        snapshot = policy.adapter_snapshot()
        if self.next_version is None:
            self.next_version = self.registry.next_version()
        publication = Publication(snapshot, self.next_version, state.version, state.step,
                                  finite_numbers(metrics, exclude=("step",)))
        self.next_version += 1
        state.version = publication.version
        return publication

    def write_publication(self, publication: Publication, between_tries: Callable[[], None] | None = None) -> None:
        """Serialise the snapshot, publish it under the version it took, announce it (``between_tries``:
        ``announce_until_taken``'s)."""
        manifest = self.registry.publish_files(
            publication.snapshot.files(), base_model=self.base_model, parent_version=publication.parent_version,
            learner_step=publication.step, metrics=publication.metrics, expected_version=publication.version,
        )
        if manifest.version != publication.version:
            raise RuntimeError(f"run {self.run_id}: step {publication.step} was published as v{manifest.version}, "
                               f"not v{publication.version}: another writer publishes to this run; run one learner "
                               "per run")
        event = self.registry.published_event(manifest)
        self.faults.reached("before_version_event")
        self.announce_until_taken(event, f"AdapterPublished v{manifest.version} (step {publication.step})",
                                  between_tries)
        log.info("published adapter v%d at step %d", manifest.version, publication.step)
        self.faults.reached("after_publish")
        self.retire_old_versions(manifest.version)

    def retire_old_versions(self, newest: int) -> int:
        """``VersionRetention.after_publish``: how many versions older than the ``keep_versions`` newest were retired."""
        return self.retention.after_publish(newest)

    def prepare_checkpoint(self, policy: SavablePolicy, state: LearnerState, metrics: dict[str, Any]) -> PreparedStep:
        """The checkpoint of now, serialised, with what its announcement says."""
        optimizer, scalars = policy.optimizer_state()
        prepared = self.checkpoints.prepare(state, policy.adapter_tensors(), optimizer, scalars)
        return PreparedStep(prepared, dict(state.positions), finite_numbers(metrics))

    def write_checkpoint(self, prepared: PreparedStep, between_tries: Callable[[], None] | None = None) -> str:
        """Write a prepared checkpoint (manifest last) and announce it (``between_tries``: ``announce_until_taken``'s);
        the caller commits its positions."""
        self.faults.reached("before_checkpoint")
        key = self.checkpoints.write(prepared.checkpoint)
        event = LearnerCheckpointed(step=prepared.checkpoint.step, version=prepared.checkpoint.version, path=key,
                                    offsets=prepared.positions, metrics=prepared.metrics)
        self.faults.reached("before_checkpoint_event")
        self.announce_until_taken(event, f"LearnerCheckpointed of step {event.step} (its offsets not committed)",
                                  between_tries)
        self.faults.reached("after_checkpoint")
        return key

    def abandon(self) -> None:
        """Let the job in flight (and a dead letter or start's announcements being sent) end without waiting for the broker (the learner stops
        on another error: a store failure, a lost lease): a wait for the broker ends after the try under way, as on
        a stop, and any error of the job is logged (``StepWriter.wait_quietly``)."""
        self.abandoning.set()
        try:
            self.writer.wait_quietly()
            self.beside.wait_quietly()
        finally:
            self.abandoning.clear()

    def send_beside(self, announce: Callable[[], Any], what: str) -> None:
        """Announce a dead letter (``announce``, which sends the same event at every try) from the ``beside`` writer's thread,
        waiting out a broker that refuses it: a packed run's turn, which does not hold the other runs; the run passes
        its turns until the broker takes it (``consumers.packed_writes``), and ``Learner.finish_writes`` waits for
        it before anything after it is written."""
        report = WaitReport(what, self.run_id, "the run passes its turns (nothing read past the batch) while the "
                            "other runs train")
        self.beside.submit(lambda: until_the_broker_takes(
            announce, what, self.run_id, lambda: self.stopping() or self.abandoning.is_set(), report=report))

    def announce_until_taken(self, payload: Payload, what: str, between_tries: Callable[[], None] | None = None) -> None:
        """Announce ``payload``, waiting out a broker that refuses it (until it takes it, or a stop); every try
        publishes the same event (``announcing_once``), and a stop before the broker took it leaves it for the next
        start to announce again (``consumers.reannounce``).  ``between_tries`` runs before each try again: a packed
        learner's start of a run (a warm start's v1 and checkpoint, ``learner_start.warm_start``), which holds every
        run it serves, polls their consumers there, so their groups keep them."""
        waiting = learner_waits(RETRY_WAIT_S, holding_others=between_tries is not None)
        self.broker_wait = WaitReport(what, self.run_id, waiting)
        try:
            until_the_broker_takes(announcing_once(self.announce, payload), what, self.run_id,
                                   lambda: self.stopping() or self.abandoning.is_set(), before_retry=between_tries,
                                   report=self.broker_wait)
        finally:
            self.broker_wait = None

    def waiting_for_broker(self) -> bool:
        """Whether the job in flight waits for the broker to take a write it refused (else it only writes)."""
        report = self.broker_wait  # (set and cleared by the writer's thread)
        return report is not None and report.refusing

    def write_step(self, metrics: dict[str, Any] | None, publication: Publication | None,
                   prepared: PreparedStep | None) -> PreparedStep | None:
        """A step's writes in a synchronous learner's order; its checkpoint, once durable and announced (the
        caller commits its positions then), or None when the step had none.  ``metrics`` None: no new step to
        record (a packed run's final version and checkpoint after its last step, ``consumers.packed``)."""
        if publication is not None:
            self.write_publication(publication)
        if metrics is not None:
            self.checkpoints.record_step(metrics)  # before the checkpoint that covers this step
        if prepared is None:
            return None
        self.write_checkpoint(prepared)
        return prepared
