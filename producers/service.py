"""The producer process: set up each component, then run the rollout loop.

Set-up reads one line per component (store, bus, model, sampler, registry,
adapter watcher, sink); the loop is ``RolloutWorker.run`` with a heartbeat on
the control topic every ``heartbeat_interval_s``.  SIGTERM/SIGINT stop the loop
between phases: finished groups are flushed as a batch, unfinished ones are
abandoned (nothing partial is ever written), and the process exits 0.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from pipeline.health import HealthServer
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.bus import BusError, EventFollower, EventPublisher, group_lag, run_log
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.models import resolve_base_model
from pipeline.runtime import Announcer, RateMeter, StopFlag, effective_run_config, open_store, resolved_bus
from pipeline.topics import topic_name
from producers.adapters import AdapterWatcher, KafkaAdapterEvents, sweep_dead_process_caches
from producers.envs.registry import env_from_spec
from producers.rollout import RolloutWorker, SamplingStreams
from producers.samplers import Sampler, sampler_for_run
from producers.sink import OrphanSweep, StoreThenEventSink, logged_batches
from producers.tiny_model import resolve_model
from schemas.config import BusConfig, RunConfig, check_sampler_holds_rank
from schemas.events import LearnerProgress, ProducerHeartbeat, TrajectoryBatchCommitted

log = logging.getLogger("rlpipe.producer")


def host_name() -> str:
    """This machine's name as producer ids carry it (characters other than ``[A-Za-z0-9.-]`` become ``-``: never
    ``_``, which ends the host in a default producer id)."""
    return "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:40] or "host"


def default_producer_id() -> str:
    """``<host>_<pid>``: unique per process, so a restart never reuses episode or batch ids.  The host never holds
    ``_``, so a cache folder of this shape names its host unambiguously (``sweep_dead_process_caches``): host
    ``node``'s ``node_7`` is not host ``node-7``'s ``node-7_123``."""
    return f"{host_name()}_{os.getpid()}"


class Heartbeat:
    """Publishes ``ProducerHeartbeat`` with rates since the previous beat, and sets them on ``/metrics``.

    ``labels``: those of the run's series (``{"run": id}`` in a packed producer); None for a producer of one run.
    """

    def __init__(self, worker: RolloutWorker, watcher: AdapterWatcher, announce: Announcer, interval_s: float,
                 health: HealthServer | None = None, labels: Mapping[str, str] | None = None) -> None:
        self.worker, self.watcher, self.announce, self.interval_s = worker, watcher, announce, interval_s
        self.meter = RateMeter(time.monotonic)
        self.meter.rates(self._totals())
        self.next_at = time.monotonic() + interval_s
        self.health, self.labels = health, labels

    def _totals(self) -> dict[str, float]:
        s = self.worker.stats
        return {"samples": s.samples, "tokens": s.tokens, "env_steps": s.env_steps, "generate_s": s.generate_s}

    def maybe_beat(self) -> None:
        if time.monotonic() >= self.next_at:
            self.beat()

    def beat(self) -> ProducerHeartbeat:
        totals = self._totals()
        rates, interval = self.meter.rates(totals)
        current = self.watcher.current()
        stats = self.worker.stats
        payload = ProducerHeartbeat(
            producer_id=self.worker.producer_id,
            adapter_version=current.version if current else 0,
            samples_total=stats.samples, batches_total=stats.batches, tokens_total=stats.tokens,
            env_steps_total=stats.env_steps,
            samples_per_s=rates["samples"], tokens_per_s=rates["tokens"], env_steps_per_s=rates["env_steps"],
            busy_fraction=min(1.0, max(0.0, rates["generate_s"])), interval_s=interval,
        )
        try:
            self.announce(payload)
        except BusError as exc:  # the broker away: a missed beat, never a stopped producer (the next one is due later)
            log.warning("producer %s: heartbeat not published (%s)", self.worker.producer_id,
                        str(exc).splitlines()[0])
        if self.health is not None:
            for name, value in payload.model_dump().items():
                if isinstance(value, int | float):
                    self.health.set_gauge(f"rlpipe_producer_{name}", float(value), f"producer {name}", self.labels)
            self.health.set_gauge("rlpipe_producer_groups_dropped_total", float(stats.dropped_groups),
                                  "groups never written: a number in them was not finite (the log names each)",
                                  self.labels)
            self.health.set_gauge("rlpipe_producer_groups_unplayable_total", float(stats.unplayable_groups),
                                  "groups never played: their first prompt did not fit the context", self.labels)
        self.next_at = time.monotonic() + self.interval_s
        return payload


def unconsumed_rows(rows_at_P: Mapping[int, Mapping[int, int]], committed_P: Mapping[int, int]) -> int:
    """Rows of the batches at or after the learner's offset: ``{partition: {offset: rows}}``, ``{partition: offset}``.

    A partition the learner has not read counts from its first offset (the
    learner reads from the beginning there).
    """
    return sum(rows for partition, rows_at in rows_at_P.items()
               for offset, rows in rows_at.items() if offset >= committed_P.get(partition, 0))


def positions_on(topic: str, positions: Mapping[str, int]) -> dict[int, int]:
    """``{"topic:partition": offset}`` (a learner's positions) -> ``{partition: offset}`` of ``topic`` only."""
    found = {}
    for key, offset in positions.items():
        name, _, partition = key.rpartition(":")
        if name == topic and partition.isdigit():
            found[int(partition)] = offset
    return found


class LearnerBacklog:
    """Whether this run's learner has ``max_rows`` or more of the run's rows announced but not consumed.

    Backlog rows = the ``num_rows`` of this run's ``TrajectoryBatchCommitted``
    events (every producer's) at or after the learner's read position on
    ``<ns>.trajectories``, re-judged at most every ``check_interval_s``.  The read
    position is the newer of the learner group's committed offsets and the
    positions in the learner's latest ``LearnerProgress`` on ``<ns>.control``.  Rows
    queued beyond about ``max_staleness`` learner steps would be dropped as stale
    when their turn comes, so sampling them is wasted work.  A producer that has
    written nothing yet never pauses, so an added or restarted one always
    contributes.

    Why not the committed offsets alone: the learner commits only after a
    checkpoint.  With ``checkpoint_every`` above ``max_backlog_steps`` the
    producer then paused on rows the learner had already trained, and the
    learner waited for rows: the run stalled before its first checkpoint, and
    again after a learner restarted from a checkpoint whose commit it had not
    made.  The learner announces how far it has read after every step and while
    it waits, so the backlog counts only rows it has not taken yet.

    Why not the group's lag (end - committed offset): the topic is shared by every
    run on a stack, and the learner commits only past its own run's batches, so
    the lag also counts other runs' batches written after this run's last trained
    one.  A busy neighbour then paused this run's producers, and with nothing new
    to train on, this run's learner never committed past the neighbour's batches:
    a stall that outlived the neighbour.  So the producer follows the topic itself
    (no group, from the committed offsets) and counts its own run's rows only.
    """

    def __init__(self, bus: BusConfig, run_id: str, worker: RolloutWorker, max_rows: float,
                 check_interval_s: float = 1.0) -> None:
        self.bus, self.group = bus, f"rlpipe-learner-{run_id}"
        self.worker, self.max_rows, self.check_interval_s = worker, max_rows, check_interval_s
        self.topic = topic_name(bus.namespace, "trajectories")
        committed = self._committed()
        self.follower = EventFollower(bus, "trajectories", run_id=run_id, start="earliest", offsets=committed)
        try:
            self.progress = EventFollower(bus, "control", run_id=run_id, start="latest")
        except BaseException:
            self.follower.close()
            raise
        self.rows_at_P: dict[int, dict[int, int]] = {}  # this run's batches not yet known to be consumed
        self.ingested_P: dict[int, int] = {}  # the learner's latest announced read positions on the topic
        self.checked_at, self.full = float("-inf"), False

    def _committed(self) -> dict[int, int] | None:
        """The learner group's committed offset per partition (None if the broker did not say)."""
        try:
            return {p.partition: p.committed for p in group_lag(self.bus, self.group) if p.topic == self.topic}
        except BusError as exc:  # an admin hiccup must not stop sampling
            log.debug("could not read the learner's offsets: %s", exc)
            return None

    def _read_announcements(self) -> None:
        try:
            events = self.follower.poll(0.0)
        except BusError as exc:
            log.debug("could not read the trajectories topic: %s", exc)
            return
        for item in events:
            if isinstance(item.event.payload, TrajectoryBatchCommitted):
                self.rows_at_P.setdefault(item.partition, {})[item.offset] = item.event.payload.num_rows

    def _read_progress(self) -> None:
        """The learner's newest read positions (the latest wins: a restarted learner reads from its checkpoint)."""
        try:
            events = self.progress.poll(0.0)
        except BusError as exc:
            log.debug("could not read the control topic: %s", exc)
            return
        for item in events:
            payload = item.event.payload
            if isinstance(payload, LearnerProgress):
                self.ingested_P = positions_on(self.topic, payload.positions)

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self.checked_at < self.check_interval_s:
            return self.full
        self.checked_at = now
        self._read_announcements()
        self._read_progress()
        if not self.worker.stats.batches:
            self.full = False
            return False
        committed = self._committed()
        if committed is None:
            return self.full
        for partition, rows_at in self.rows_at_P.items():  # forget what the learner has consumed
            for offset in [o for o in rows_at if o < committed.get(partition, 0)]:
                del rows_at[offset]
        read_P = {p: max(committed.get(p, 0), self.ingested_P.get(p, 0)) for p in {*committed, *self.ingested_P}}
        self.full = unconsumed_rows(self.rows_at_P, read_P) >= self.max_rows
        return self.full

    def close(self) -> None:
        self.follower.close()
        self.progress.close()


def run_producer(config: RunConfig, stop: StopFlag | None = None) -> RolloutWorker:
    """Run one producer until stopped or ``producer.max_groups`` groups are written.

    The health server starts before anything slow, so ``/healthz`` answers while
    the model loads; ``/readyz`` names the set-up steps still missing and is 200
    from the end of set-up until a stop is requested.
    """
    stop = stop or StopFlag()
    producer_id = config.producer.producer_id or default_producer_id()
    log.info("initialising producer %s for run %s (env %s)", producer_id, config.run_id, config.env.name)
    health = HealthServer(config.producer.health_port).start()  # port None: metrics only, nothing listens
    try:
        return _set_up_and_run(config, stop, producer_id, health)
    finally:
        health.stop()


def _set_up_and_run(config: RunConfig, stop: StopFlag, producer_id: str, health: HealthServer) -> RolloutWorker:
    done = health.add_setup_steps(("broker", "store", "sampler", "adapters"))
    health.add_readiness_check("stopping", lambda: not stop())
    connection = connect_run(config, done)
    check_run_lora_rank(config, connection.archive.store)
    model_path = resolve_model(config.model)
    log.info("initialising sampler %s on %s", config.sampler.backend, model_path)
    streams = SamplingStreams(config.sampler.seed, producer_id)  # this process's incarnation: new streams
    sampler_config = config.sampler.model_copy(update={"seed": streams.engine_seed()})
    sampler = sampler_for_run(config.model_copy(update={"sampler": sampler_config}), model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    done.add("sampler")
    run = open_run_producer(config, connection, producer_id, sampler, tokenizer, streams.incarnation, health)
    done.add("adapters")
    health.set_gauge("rlpipe_producer_up", 1.0, "1 once the producer is set up and sampling")
    log.info("producer %s running", producer_id)
    try:
        run.run(stop)
    finally:
        run.close()
        sampler.close()
        run.watcher.close()
    worker = run.worker
    log.info("producer %s stopped: %d batches, %d samples", producer_id, worker.stats.batches, worker.stats.samples)
    return worker


def check_run_lora_rank(config: RunConfig, store: ObjectStore) -> None:
    """Refuse, before the sampler starts, a vLLM sampler that cannot load the run's adapters: one whose
    ``max_lora_rank`` is below the ``learner.lora_rank`` of the run's stored configuration (a producer
    started with other settings than the run's learner), or of ``config`` while the run is not created."""
    try:
        stored = effective_run_config(store, config.run_id)
        lora_rank = int(stored.get("learner", {}).get("lora_rank", config.learner.lora_rank))
    except FileNotFoundError:
        lora_rank = config.learner.lora_rank
    except (ValueError, TypeError, AttributeError):  # a stored configuration that does not read: the learner names it
        return
    check_sampler_holds_rank(config.sampler, lora_rank, config.run_id, "this producer's")


@dataclass
class RunConnection:
    """One run's event log and store, as a producer writes to them."""

    bus: BusConfig
    archive: TrajectoryArchive
    publisher: EventPublisher
    announce: Announcer
    orphans: OrphanSweep | None = None  # looks again at the batches too young to judge at the start


def connect_run(config: RunConfig, done: set[str] | None = None) -> RunConnection:
    """Connect to the run's event log and store, and announce batches a crashed producer stored but never announced."""
    bus = resolved_bus(config.bus)
    store = open_store(config.store)
    archive = TrajectoryArchive(store)
    publisher = EventPublisher(bus)
    announce = Announcer(publisher, config.run_id)
    orphans = OrphanSweep(archive, config.run_id, announce, 2 * config.producer.batch_timeout_s,
                          lambda: logged_batches(run_log(bus, "trajectories", config.run_id)))
    announced = orphans.announced()
    if done is not None:
        done.add("broker")
    orphans.sweep(announced)
    if done is not None:
        done.add("store")
    return RunConnection(bus, archive, publisher, announce, orphans)


@dataclass
class RunProducer:
    """One run's rollout worker and what keeps it fed and heard: adapter watcher, heartbeat, backlog bound."""

    worker: RolloutWorker
    watcher: AdapterWatcher
    heartbeat: Heartbeat
    publisher: EventPublisher
    events: KafkaAdapterEvents
    backlog: LearnerBacklog | None
    orphans: OrphanSweep | None = None
    sink: StoreThenEventSink | None = None  # announces again the batches stored while the broker was away

    def run(self, stop: Callable[[], bool]) -> None:
        """The rollout loop until stopped or ``max_groups``, then a last heartbeat; raises ``PublishError`` when
        batches it stored stay unannounced (the broker still away)."""
        self.worker.run(should_stop=stop, on_tick=self.tick)
        if self.sink is not None and self.sink.refused:  # the broker away: a refused last try ends the stop at once,
            self.sink.finish()                             # not after a last beat's wait too
        self.heartbeat.beat()
        if self.sink is not None:
            self.sink.finish()

    def tick(self) -> None:
        """Between the rollout loop's rounds: a heartbeat when due, the batches whose event the broker refused,
        and the start's second look for orphans."""
        self.heartbeat.maybe_beat()
        if self.sink is not None:
            self.sink.retry_due()
        if self.orphans is not None:
            self.orphans.maybe_sweep()

    def close(self) -> None:
        """Close the run's connections (then close the sampler, then ``watcher.close()``: it deletes the cache)."""
        self.publisher.close()
        self.events.close()
        if self.backlog is not None:
            self.backlog.close()


def open_run_producer(config: RunConfig, connection: RunConnection, producer_id: str, sampler: Sampler,
                      tokenizer: Any, incarnation: int, health: HealthServer | None,
                      health_labels: Mapping[str, str] | None = None) -> RunProducer:
    """The producer of ``config.run_id`` on ``sampler`` (its own, or its view of an engine several runs share).

    ``health_labels``: those of its series on ``health`` (``{"run": id}`` when several runs share the process).
    """
    from pipeline.devstack.stack import rlpipe_home

    registry = AdapterRegistry(connection.archive.store, config.run_id)
    events = KafkaAdapterEvents.open(connection.bus, config.run_id)  # before the watcher's first registry read
    cache_root = Path(rlpipe_home()) / "adapter-cache"
    sweep_dead_process_caches(cache_root, host_name())
    cache = cache_root / producer_id
    watcher = AdapterWatcher(registry, sampler, cache, max_loaded=config.sampler.max_loras, events=events,
                             base_models={config.model.base_model, resolve_base_model(config.model)})
    sink = StoreThenEventSink(connection.archive, config.run_id, config.env.name, producer_id, connection.announce)
    worker = RolloutWorker(
        run_id=config.run_id, producer_id=producer_id, env_name=config.env.name,
        make_env=lambda: env_from_spec(config.env), tokenizer=tokenizer, sampler=sampler,
        adapters=watcher, sink=sink, producer=config.producer, sampling=config.sampler,
        env_seeds=config.training_seeds(producer_id), incarnation=incarnation,
    )
    watcher.in_use = lambda: {g.adapter.version for g in worker.active if g.adapter is not None}
    backlog = None
    if config.producer.max_backlog_steps is not None:
        backlog = LearnerBacklog(connection.bus, config.run_id, worker,
                                 config.producer.max_backlog_steps * config.learner.batch_rows)
        worker.backlog_full = backlog
    heartbeat = Heartbeat(worker, watcher, connection.announce, config.producer.heartbeat_interval_s, health,
                          health_labels)
    return RunProducer(worker, watcher, heartbeat, connection.publisher, events, backlog, connection.orphans, sink)
