"""The rollout worker: groups of episodes, batched generation, batches out.

It keeps ``concurrent_groups`` groups (``group_size`` episodes of one seed each,
for group-relative advantages) in flight.  Each pass of the loop is three named
phases: *admit* new groups (if the adapter is fresh enough), *generate* for
every episode waiting on the model, *collect* environment steps that finished
in the thread pool.  On a sampler with ``concurrent_requests`` (the sampling
engine: vLLM's async engine, continuous batching) every episode's turn is its
own request, sent the moment its environment step returns, and collecting
waits for whichever turn or step finishes first, so no turn waits for the
slowest of a batch; on a sampler that decodes whole calls, the episodes waiting
go out as one batched call per adapter.  Environment steps run in threads so a slow
environment (a SQL query, a remote reward) never stalls generation for the
others.  Finished groups are written as one Parquet batch through a sink
(store first, then the event) when ``groups_per_batch`` are done or
``batch_timeout_s`` has passed.

Transport and storage stay behind the small ``BatchSink`` and ``AdapterSource``
protocols; this module never touches Kafka or the store.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import secrets
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from pipeline.io.archive_layout import producer_batch_id
from producers.envs.base import StepResult, TextEnv
from producers.episode import ChatFormat, ChatTokenizer, Episode, direct_tokenizer
from producers.rows import episode_rows
from producers.samplers.base import AdapterHandle, SampleOutput, Sampler, SampleRequest
from schemas.config import ProducerConfig, SamplerConfig
from schemas.trajectory import NO_ADAPTER_SHA, non_finite_column

log = logging.getLogger("rlpipe.producer")
UNPLAYABLE_GROUPS_LIMIT = 16  # groups in a row whose first prompt does not fit the context stop the producer


class StaleAdapterError(RuntimeError):
    """The producer waited longer than ``staleness_wait_s`` for a fresh enough adapter."""


class AdapterSource(Protocol):
    """Which adapter the producer may sample with (producer side of the registry)."""

    def current(self) -> AdapterHandle | None:
        """The newest adapter loaded into the sampler (None = the base model, version 0)."""

    def newest_published(self) -> int:
        """The newest version announced so far (0 when none)."""

    def refresh(self) -> None:
        """Load any newer published version (non-blocking beyond one pull)."""


class FixedAdapter:
    """An adapter source that always serves one version (None: the base model, version 0)."""

    def __init__(self, handle: AdapterHandle | None = None) -> None:
        self.handle = handle

    def current(self) -> AdapterHandle | None:
        return self.handle

    def newest_published(self) -> int:
        return self.handle.version if self.handle else 0

    def refresh(self) -> None:
        pass


class BatchSink(Protocol):
    """Where finished rows go (store first, then the event)."""

    def commit(self, rows: list[dict[str, Any]], batch_id: str) -> Any: ...


@dataclass
class Group:
    """``group_size`` episodes of one environment seed, sampled with one adapter."""

    group_id: str
    seed: int
    adapter: AdapterHandle | None
    episodes: list[Episode]

    @property
    def done(self) -> bool:
        return all(e.done for e in self.episodes)


@dataclass
class RolloutStats:
    """Counters since start (heartbeats derive rates from differences)."""

    samples: int = 0
    rows: int = 0
    groups: int = 0
    batches: int = 0
    tokens: int = 0
    generated_tokens: int = 0
    env_steps: int = 0
    dropped_groups: int = 0  # groups holding a number that is not finite, never written
    unplayable_groups: int = 0  # groups whose first prompt did not fit the context: never played, never written
    generate_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
    busy_intervals: list[tuple[float, float]] = field(default_factory=list)  # (start, end) unix times generating


class SamplingStreams:
    """The sampler seed of every ``generate`` call and every lone turn: a fresh random stream for every draw.

    Call ``n`` is seeded with a hash of (sampling seed, producer id, incarnation, ``n``),
    and the sampler derives request ``i``'s stream from that seed and ``i``
    (``request_seed``).  On a sampler that takes every turn alone, turn ``t`` of the
    episode at place ``p`` is seeded with a hash of (..., ``p``, ``t``) instead
    (``turn_seed``), so the streams do not depend on the order the turns go out in.
    So two turns of one episode, two calls between batches,
    two producers and two processes never share a stream.  ``engine_seed`` seeds
    an engine-wide stream (vLLM on the CPU cannot seed requests) the same way.

    ``incarnation`` is a random 64-bit nonce drawn when the process starts and
    logged.  Producer ids are stable across restarts (the launcher's
    ``<run>-p<i>``, a StatefulSet pod name), so without it a restarted producer
    would replay its predecessor's streams.  A nonce rather than a counter kept
    in the store: it needs no durable write before sampling starts, cannot be
    lost or raced by two processes that share an id, and two incarnations repeat
    with probability 2**-64.  Passing a logged nonce back reproduces a process's
    seeds (evaluation passes a fixed one so a score can be reproduced).
    """

    def __init__(self, seed: int, producer_id: str, incarnation: int | None = None) -> None:
        self.seed, self.producer_id = seed, producer_id
        self.incarnation = secrets.randbits(64) if incarnation is None else incarnation
        self.calls = 0

    def next_call_seed(self) -> int:
        """The seed of the next ``generate`` call (63 bits: any backend's generator accepts it)."""
        self.calls += 1
        return self._hash(f"call:{self.calls - 1}") & 0x7FFF_FFFF_FFFF_FFFF

    def turn_seed(self, place: str, turn: int) -> int:
        """The seed of turn ``turn`` of the episode at ``place`` (``Episode.place``), for a sampler that takes
        every turn alone: it follows from where the turn is in the run, not from when it went out, so a
        worker with a given incarnation draws the same streams however its turns interleave (63 bits)."""
        return self._hash(f"turn:{place}:{turn}") & 0x7FFF_FFFF_FFFF_FFFF

    def engine_seed(self) -> int:
        """The seed of an engine-wide stream (vLLM on the CPU draws from one): new per incarnation, 31 bits."""
        return self._hash("engine") & 0x7FFF_FFFF

    def _hash(self, what: str) -> int:
        key = f"{self.seed}:{self.producer_id}:{self.incarnation}:{what}"
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


class RolloutWorker:
    """Runs groups against one environment and commits finished groups as batches."""

    def __init__(
        self,
        *,
        run_id: str,
        producer_id: str,
        env_name: str,
        make_env: Callable[[], TextEnv],
        tokenizer: ChatTokenizer,
        sampler: Sampler,
        adapters: AdapterSource,
        sink: BatchSink,
        producer: ProducerConfig,
        sampling: SamplerConfig,
        env_seeds: range | None = None,
        incarnation: int | None = None,
    ) -> None:
        """``env_seeds``: the environment seeds to play, in order, wrapping around at the end (None =
        ``producer.seed_start`` upwards); ``incarnation``: see ``SamplingStreams`` (None = a random one)."""
        self.run_id, self.producer_id, self.env_name = run_id, producer_id, env_name
        self.make_env, self.tokenizer, self.sampler = make_env, direct_tokenizer(tokenizer), sampler
        self.adapters, self.sink, self.cfg, self.sampling = adapters, sink, producer, sampling
        self.chat = ChatFormat.from_tokenizer(self.tokenizer)
        # the context an episode may fill: the sampler's, which can be shorter than the configured one (the
        # transformers sampler caps it at the model's position count) and refuses any prompt that does not fit
        self.max_model_len = min(sampling.max_model_len, sampler.max_model_len)
        self.pool = ThreadPoolExecutor(max_workers=producer.env_workers, thread_name_prefix="env")
        self.active: list[Group] = []
        self.finished: list[Group] = []
        self.pending_steps: dict[Future[StepResult], Episode] = {}
        self.pending_generations: dict[Future[SampleOutput], tuple[Episode, SampleRequest]] = {}
        # on a concurrent sampler every turn and step puts its future here when it finishes (``collect``)
        self.finished_futures: queue.SimpleQueue[Future[Any]] = queue.SimpleQueue()
        self.generating_since = 0.0  # unix time the turns now out started to be out
        self.generating_counted = 0.0  # monotonic time up to which that stretch is in stats.generate_s
        self.env_seeds = env_seeds if env_seeds is not None else range(producer.seed_start, sys.maxsize)
        if not self.env_seeds:
            raise ValueError(f"producer {producer_id}: no environment seeds to play ({env_seeds})")
        self.next_seed = self.env_seeds.start
        self.streams = SamplingStreams(sampling.seed, producer_id, incarnation)
        log.info("producer %s: environment seeds %d..%d, sampling incarnation %d", producer_id,
                 self.env_seeds.start, self.env_seeds.stop - 1, self.streams.incarnation)
        self.groups_started = 0
        self.first_finished_at: float | None = None
        self.stale_since: float | None = None
        self.stats = RolloutStats()
        self.warned_first_prompt = False
        self.unplayable_in_a_row = 0  # groups in a row whose first prompt did not fit (UNPLAYABLE_GROUPS_LIMIT)
        self.stopping = False
        self.backlog_full: Callable[[], bool] = lambda: False  # set by the service (learner lag)
        self.paused_for_backlog_s = 0.0

    # ---- the loop ---------------------------------------------------------
    def run(self, should_stop: Callable[[], bool] = lambda: False, on_tick: Callable[[], None] = lambda: None) -> None:
        """Loop until stopped or ``max_groups`` are done; flush complete groups, drop the rest."""
        try:
            while not (should_stop() or self.exhausted):
                self.admit()
                self.generate()
                self.collect()
                self.maybe_flush()
                on_tick()
            self.flush()
        finally:
            for future in self.pending_generations:
                future.cancel()  # the engine aborts the request
            self.pool.shutdown(wait=False, cancel_futures=True)

    @property
    def exhausted(self) -> bool:
        limit = self.cfg.max_groups
        return limit is not None and self.groups_started >= limit and not self.active and not self.finished

    # ---- phase: admit -----------------------------------------------------
    def admit(self) -> None:
        """Start groups up to ``concurrent_groups``, on an adapter no more than ``max_staleness`` behind."""
        limit = self.cfg.max_groups
        while len(self.active) < self.cfg.concurrent_groups and (limit is None or self.groups_started < limit):
            if self.backlog_full():
                # The learner has more unconsumed rows than it trains before they go stale:
                # sampling more now would only produce rows it must drop.
                if not self.active and not self.pending_steps:
                    time.sleep(0.2)
                    self.paused_for_backlog_s += 0.2
                return
            adapter = self.fresh_adapter()
            if adapter is False:
                return
            self.active.append(self.new_group(adapter))

    def fresh_adapter(self) -> AdapterHandle | bool | None:
        """The adapter to start a group with, or False while waiting for a newer one."""
        self.adapters.refresh()
        adapter = self.adapters.current()
        loaded = adapter.version if adapter else 0
        newest = self.adapters.newest_published()
        if newest - loaded <= self.cfg.max_staleness:
            self.stale_since = None
            return adapter
        now = time.monotonic()
        if self.stale_since is None:
            self.stale_since = now
            log.info("waiting for adapter v%d (loaded v%d, max_staleness %d)", newest, loaded, self.cfg.max_staleness)
        elif now - self.stale_since > self.cfg.staleness_wait_s:
            raise StaleAdapterError(
                f"adapter v{newest} is published but only v{loaded} could be loaded after "
                f"{self.cfg.staleness_wait_s:.0f}s; check the registry and the producer's cache folder"
            )
        if not self.active and not self.pending_steps:
            time.sleep(0.05)  # nothing else to do: don't spin
        return False

    def new_group(self, adapter: AdapterHandle | None) -> Group:
        seed = self.next_seed
        self.next_seed = seed + 1 if seed + 1 < self.env_seeds.stop else self.env_seeds.start
        group_id = f"{self.producer_id}-g{uuid.uuid4().hex[:12]}"
        episodes = [self.new_episode(seed, group_id, adapter, f"{self.groups_started}.{index}")
                    for index in range(self.cfg.group_size)]
        self.groups_started += 1
        return Group(group_id, seed, adapter, episodes)

    def new_episode(self, seed: int, group_id: str, adapter: AdapterHandle | None, place: str) -> Episode:
        env = self.make_env()
        episode = Episode(
            env=env,
            tokenizer=self.tokenizer,
            chat=self.chat,
            seed=seed,
            episode_id=uuid.uuid4().hex,
            group_id=group_id,
            policy_version=adapter.version if adapter else 0,
            adapter_sha256=adapter.sha256 if adapter else NO_ADAPTER_SHA,
            per_turn=env.per_turn_prompts(),
            history_turns=env.config.history_turns,
            max_model_len=self.max_model_len,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            place=place,
        )
        episode.start()
        return episode

    # ---- phase: generate --------------------------------------------------
    def generate(self) -> None:
        """Every episode waiting on the model gets its turn: one request each, started at once, on a sampler with
        ``concurrent_requests`` (an engine's running batch); else one batched call per adapter."""
        if self.sampler.concurrent_requests:
            self.submit_waiting()
            return
        waiting = self.episodes_waiting()
        by_adapter: dict[int, list[tuple[Episode, AdapterHandle | None]]] = {}
        for episode, adapter in waiting:
            by_adapter.setdefault(adapter.version if adapter else 0, []).append((episode, adapter))
        for items in by_adapter.values():
            self.generate_for(items)

    def episodes_waiting(self) -> list[tuple[Episode, AdapterHandle | None]]:
        busy = {id(e) for e in self.pending_steps.values()} | {id(e) for e, _ in self.pending_generations.values()}
        return [(e, g.adapter) for g in self.active for e in g.episodes if not e.done and id(e) not in busy]

    def next_request(self, episode: Episode) -> SampleRequest | None:
        """The episode's next turn as a request; None (and the episode ends, truncated) when the context is full."""
        prompt = episode.next_prompt()
        room = episode.room_left(len(prompt))
        if room < 1:
            episode.done = episode.truncated = episode.overflow = True
            if not episode.turns and not self.warned_first_prompt:  # a setting to fix, said once
                self.warned_first_prompt = True
                log.warning("producer %s: a first prompt of %d tokens does not fit the context of %d tokens, so its "
                            "group is not played nor written; raise sampler.max_model_len (within the model's "
                            "context) or shorten the environment's prompt", self.producer_id, len(prompt),
                            self.max_model_len)
            return None
        return SampleRequest(prompt, min(self.sampling.max_new_tokens, room), self.chat.turn_stop_ids)

    def take_turn(self, episode: Episode, request: SampleRequest, output: SampleOutput) -> None:
        """Record what the model answered and step the environment with it (in the pool)."""
        answer = episode.record_generation(request.prompt_token_ids, output.token_ids, output.logprobs)
        self.stats.generated_tokens += len(output.token_ids)
        future = self.pool.submit(episode.env.step, answer)
        self.pending_steps[future] = episode
        if self.sampler.concurrent_requests:
            future.add_done_callback(self.finished_futures.put)

    def generate_for(self, items: list[tuple[Episode, AdapterHandle | None]]) -> None:
        requests, runnable = [], []
        for episode, _ in items:
            request = self.next_request(episode)
            if request is not None:
                requests.append(request)
                runnable.append(episode)
        if not requests:
            return
        start_wall, start = time.time(), time.monotonic()
        outputs = self.sampler.generate(
            requests, items[0][1], temperature=self.sampling.temperature, top_p=self.sampling.top_p,
            seed=self.streams.next_call_seed(),
        )
        self.stats.generate_s += time.monotonic() - start
        self.stats.busy_intervals.append((start_wall, time.time()))
        for episode, request, output in zip(runnable, requests, outputs, strict=True):
            self.take_turn(episode, request, output)

    def submit_waiting(self) -> None:
        """One request per waiting episode, each with a fresh stream named by the episode's place and turn (see
        ``SamplingStreams.turn_seed``); the sampler's busy time runs while any is out."""
        for episode, adapter in self.episodes_waiting():
            request = self.next_request(episode)
            if request is None:
                continue
            if not self.pending_generations:
                self.generating_since, self.generating_counted = time.time(), time.monotonic()
            future = self.sampler.submit(request, adapter, temperature=self.sampling.temperature,
                                         top_p=self.sampling.top_p,
                                         seed=self.streams.turn_seed(episode.place, len(episode.turns)))
            self.pending_generations[future] = (episode, request)
            future.add_done_callback(self.finished_futures.put)

    def finish_generation(self, future: Future[SampleOutput]) -> None:
        episode, request = self.pending_generations.pop(future)
        if not self.pending_generations:
            self.count_generating()
            self.stats.busy_intervals.append((self.generating_since, time.time()))
        self.take_turn(episode, request, future.result())

    def count_generating(self) -> None:
        """Add the time turns have been out since it was last counted to ``stats.generate_s``."""
        now = time.monotonic()
        self.stats.generate_s += now - self.generating_counted
        self.generating_counted = now

    # ---- phase: collect ---------------------------------------------------
    def collect(self, settle_s: float = 0.02) -> None:
        """Apply finished environment steps (and, on a concurrent sampler, finished turns); on a batching sampler
        wait briefly so fast steps batch together, on a concurrent one until anything finishes."""
        done: Iterable[Future[Any]]
        if self.sampler.concurrent_requests:
            done = self.next_finished(1.0) if self.pending_generations or self.pending_steps else []
        elif self.pending_steps:
            done, _ = wait(list(self.pending_steps), timeout=settle_s)
            if not done and not self.episodes_waiting():
                done, _ = wait(list(self.pending_steps), timeout=1.0, return_when=FIRST_COMPLETED)
        else:
            done = []  # nothing out; a group may still have ended (its episodes' context full): moved on below
        for future in done:
            if future in self.pending_generations:
                self.finish_generation(future)
                continue
            episode = self.pending_steps.pop(future)
            episode.apply_step(future.result())
            self.stats.env_steps += 1
        if self.pending_generations:
            self.count_generating()  # heartbeats read generate_s while turns are out
        for group in [g for g in self.active if g.done]:
            self.active.remove(group)
            self.finished.append(group)
            self.stats.groups += 1
            self.first_finished_at = self.first_finished_at or time.monotonic()

    def next_finished(self, timeout_s: float) -> list[Future[Any]]:
        """The turns and steps that finished since the last call, in the order they did, waiting up to
        ``timeout_s`` for the first: a queue their callbacks fill, rather than waiting on every future out,
        which costs each call a waiter on each of them."""
        try:
            done = [self.finished_futures.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while True:
            try:
                done.append(self.finished_futures.get_nowait())
            except queue.Empty:
                return done

    # ---- batches ----------------------------------------------------------
    def count_unplayable(self) -> None:
        """One more group whose first prompt did not fit; ``UNPLAYABLE_GROUPS_LIMIT`` of them in a row stop the
        producer: its settings leave nothing to play, and its learner would wait for ever."""
        self.stats.unplayable_groups += 1
        self.unplayable_in_a_row += 1
        if self.unplayable_in_a_row >= UNPLAYABLE_GROUPS_LIMIT:
            raise ValueError(f"producer {self.producer_id}: no episode of the last {self.unplayable_in_a_row} groups "
                             f"could start, their first prompt did not fit the context of {self.max_model_len} "
                             "tokens; raise sampler.max_model_len (within the model's context) or shorten the "
                             "environment's prompt (history_turns, the observation)")

    def maybe_flush(self) -> None:
        """Write a batch when enough groups are done, the oldest waited ``batch_timeout_s``, or no group is left.

        The last case: after ``max_groups`` the remainder can never fill a batch, and waiting
        for the timeout would spin the loop with nothing to do.
        """
        if not self.finished:
            return
        timed_out = time.monotonic() - (self.first_finished_at or time.monotonic()) >= self.cfg.batch_timeout_s
        limit = self.cfg.max_groups
        last = limit is not None and self.groups_started >= limit and not self.active
        if len(self.finished) >= self.cfg.groups_per_batch or timed_out or last:
            self.flush()

    def flush(self) -> None:
        """Commit every finished group as one batch (store first, then the event)."""
        if not self.finished:
            return
        groups, self.finished, self.first_finished_at = self.finished, [], None
        batch_id = producer_batch_id(self.producer_id, datetime.now(UTC))
        created = datetime.now(UTC)
        rows = []
        for group in list(groups):
            if any(not episode.turns for episode in group.episodes):  # its first prompt did not fit (warned)
                groups.remove(group)
                self.count_unplayable()
                continue
            self.unplayable_in_a_row = 0
            group_rows = [row for episode in group.episodes
                          for row in episode_rows(episode, run_id=self.run_id, batch_id=batch_id,
                                                  producer_id=self.producer_id, env_name=self.env_name,
                                                  created_at=created)]
            spoiled = non_finite_column(group_rows)
            if spoiled is None:
                rows += group_rows
                continue
            groups.remove(group)  # the learner would refuse the whole batch for it
            self.stats.dropped_groups += 1
            log.error("group %s dropped: its %s holds a value that is not a finite number (NaN or infinity); "
                      "fix what computes it (environment %s's reward?)", group.group_id, spoiled, self.env_name)
        if not rows:
            return
        self.sink.commit(rows, batch_id)
        self.stats.batches += 1
        self.stats.samples += sum(len(g.episodes) for g in groups)
        self.stats.rows += len(rows)
        self.stats.tokens += sum(len(r["tokens"]) for r in rows)
        log.info("batch %s: %d groups, %d rows", batch_id, len(groups), len(rows))
