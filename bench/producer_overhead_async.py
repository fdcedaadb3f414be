"""Producer overhead on the async engine: the rollout worker against vLLM's ``AsyncLLM`` fed the same requests.

Both arms run in one process on one engine (``VLLMEngine``: vLLM's async engine, continuous batching), one
after the other, round by round:

- producer: ``RolloutWorker`` on the engine (``SyncSampler``): every episode's turn is its own request, sent
  the moment its environment step returns (chat bookkeeping, environment steps in threads, row building);
  finished batches go to an in-memory sink, so no store or broker time is counted.  A recording wrapper
  keeps every request: its episode and group, its prompt (token ids), token budget and seed.
- bare: the same requests straight into ``AsyncLLM.generate`` with the same arrival pattern: each episode
  is a coroutine that sends its recorded turns one after the other, each when the previous one is done
  (after the same environment delay, ``--step-delay-s``), and at most ``--concurrent-groups`` groups are
  in flight, started in the producer's order, as the worker admits them.  The same ``SamplingParams`` the
  engine builds, the same seeds (``request_seed(seed, 0)``, as the engine derives them): vLLM seeds every request here, so both arms generate the very same
  tokens.

Reported per arm: wall seconds, requests/s and generated tokens/s, and the ratio producer/bare (1.0 = no
overhead); the median of the per-round ratios is the headline.  Also this process's CPU time in each arm
(``time.process_time``: every thread of the process that holds the engine's front end, the worker and its
environment threads; not vLLM's engine-core and worker processes): the difference is what the producer's
own work costs a turn.

With ``--loop-tasks`` every round also runs its groups with each episode a task on the engine's own event
loop (no worker thread: ``run_loop_tasks``), against the bare replay of its own requests, the two designs
alternately first.

Run: .venv/bin/python bench/producer_overhead_async.py [--env sokoban] [--groups 32] [--rounds 5] [--loop-tasks]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import producer_overhead
from bench.cpu import LoadAverage
from bench.producer_overhead import MemorySink, rounds_table, total, workload_arguments
from bench.stats import spread
from producers.envs.registry import make_env
from producers.episode import Episode
from producers.rollout import FixedAdapter, RolloutWorker
from producers.samplers.base import AdapterHandle, SampleOutput, SampleRequest, request_seed
from producers.samplers.sync import SyncSampler
from producers.tiny_model import resolve_model
from schemas.config import ModelConfig, ProducerConfig, SamplerConfig


@dataclass
class Turn:
    """One request as the worker sent it, and what came back."""

    group_id: str
    episode_id: str
    request: SampleRequest
    seed: int | None
    generated_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)


class RecordingSampler(producer_overhead.RecordingSampler):
    """Passes each request to the engine and records it with the episode the worker was serving."""

    concurrent_requests = True

    def __init__(self, inner: SyncSampler) -> None:
        super().__init__(inner)
        self.turns: list[Turn] = []
        self.episode: Episode | None = None  # set by the worker's next_request, just before it submits

    def submit(self, request: SampleRequest, adapter: AdapterHandle | None = None, temperature: float = 1.0,
               top_p: float = 1.0, seed: int | None = None) -> Future[SampleOutput]:
        assert self.episode is not None
        turn = Turn(self.episode.group_id, self.episode.episode_id, request, seed)
        self.turns.append(turn)
        future = self.inner.submit(request, adapter, temperature, top_p, seed)

        def record(done: Future[SampleOutput]) -> None:
            if not done.cancelled() and done.exception() is None:
                turn.token_ids = list(done.result().token_ids)
                turn.generated_tokens = len(turn.token_ids)

        future.add_done_callback(record)
        return future

    def generate(self, requests, adapter=None, temperature=1.0, top_p=1.0, seed=None):  # type: ignore[no-untyped-def]
        raise AssertionError("the worker sends one request per turn to a concurrent sampler")


@dataclass
class Measurement:
    seconds: float
    requests: int
    generated_tokens: int
    generate_s: float = 0.0  # producer only: time with at least one request out
    cpu_s: float = 0.0  # CPU time of this process (the engine's front end and, in the producer arm, the worker)

    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


def make_worker(engine: SyncSampler, sampler: Any, args: argparse.Namespace, seed_start: int) -> RolloutWorker:
    """The rollout worker of one round: ``args.groups`` groups from ``seed_start``, rows to memory; the
    tokenizer is ``args.tokenizer`` if given, else the vLLM engine's own."""
    cfg = ProducerConfig(
        producer_id="bench", group_size=args.group_size, groups_per_batch=args.groups_per_batch,
        concurrent_groups=args.concurrent_groups, max_groups=args.groups, seed_start=seed_start,
        batch_timeout_s=3600, env_workers=args.env_workers,
    )
    sampling = SamplerConfig(max_new_tokens=args.max_new_tokens, max_model_len=args.max_model_len, seed=seed_start)
    tokenizer = getattr(args, "tokenizer", None) or engine.engine._engine().get_tokenizer()
    return RolloutWorker(
        run_id="bench", producer_id="bench", env_name=args.env,
        make_env=lambda: make_env(args.env, step_delay_s=args.step_delay_s), tokenizer=tokenizer,
        sampler=sampler, adapters=FixedAdapter(), sink=MemorySink(), producer=cfg, sampling=sampling,
    )


def run_producer(engine: SyncSampler, args: argparse.Namespace, seed_start: int) -> tuple[Measurement, list[Turn]]:
    """The worker for ``args.groups`` groups; its measurement and the turns it sent."""
    recorder = RecordingSampler(engine)
    worker = make_worker(engine, recorder, args, seed_start)
    next_request = worker.next_request

    def recorded_next_request(episode: Episode) -> SampleRequest | None:
        recorder.episode = episode
        return next_request(episode)

    worker.next_request = recorded_next_request  # type: ignore[method-assign]
    cpu, started = time.process_time(), time.perf_counter()
    worker.run()
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    turns = recorder.turns
    generated = sum(t.generated_tokens for t in turns)
    return Measurement(seconds, len(turns), generated, worker.stats.generate_s, cpu), turns


def run_loop_tasks(engine: SyncSampler, args: argparse.Namespace, seed_start: int) -> tuple[Measurement, list[Turn]]:
    """The same groups with every episode a task on the engine's own event loop (``--loop-tasks``).

    No worker thread and no thread pool: a task builds its turn's request with the worker's own
    ``next_request``, awaits the engine, records the answer and steps the environment, all on the loop
    that also runs vLLM's front end.  Groups are admitted in order, ``args.concurrent_groups`` at a time,
    and written with the worker's ``flush``.  This is the design that removes every hop between threads;
    the bench runs it beside the worker to see what that would buy.
    """
    worker = make_worker(engine, engine, args, seed_start)
    temperature, top_p = worker.sampling.temperature, worker.sampling.top_p
    turns: list[Turn] = []

    async def episode(chain: Episode) -> None:
        while not chain.done:
            request = worker.next_request(chain)
            if request is None:
                return
            seed = worker.streams.turn_seed(chain.place, len(chain.turns))
            turn = Turn(chain.group_id, chain.episode_id, request, seed)
            turns.append(turn)
            output = await engine.sample_one(request, None, temperature, top_p, seed)
            turn.token_ids = list(output.token_ids)
            turn.generated_tokens = len(turn.token_ids)
            answer = chain.record_generation(request.prompt_token_ids, output.token_ids, output.logprobs)
            chain.apply_step(chain.env.step(answer))

    async def every() -> None:
        slots = asyncio.Semaphore(args.concurrent_groups)

        async def group() -> None:
            async with slots:
                started = worker.new_group(None)
                await asyncio.gather(*(episode(e) for e in started.episodes))
            worker.finished.append(started)
            if len(worker.finished) >= args.groups_per_batch:
                worker.flush()

        await asyncio.gather(*(group() for _ in range(args.groups)))
        worker.flush()

    cpu, started = time.process_time(), time.perf_counter()
    engine.call(every())
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return Measurement(seconds, len(turns), sum(t.generated_tokens for t in turns), 0.0, cpu), turns


def cold_prefix_cache(engine: SyncSampler) -> None:
    """Empty vLLM's prefix cache (on by default), so an arm replaying another's prompts does not find them cached."""
    engine.call(engine.engine._engine().reset_prefix_cache())


def replay_bare(engine: SyncSampler, turns: list[Turn], args: argparse.Namespace) -> tuple[Measurement, int]:
    """The recorded turns into ``AsyncLLM.generate``, episode by episode, groups admitted as the worker admits
    them; returns the measurement and how many turns generated other tokens than the producer's."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine.engine._engine()
    groups: dict[str, dict[str, list[Turn]]] = {}
    for turn in turns:
        groups.setdefault(turn.group_id, {}).setdefault(turn.episode_id, []).append(turn)
    differing = 0
    generated = 0

    async def one(turn: Turn) -> None:
        nonlocal differing, generated
        params = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=engine.new_token_budget(turn.request),
                                logprobs=0, seed=request_seed(turn.seed, 0), stop_token_ids=[engine.eos_token_id], detokenize=False)
        final = None
        prompt = TokensPrompt(prompt_token_ids=list(turn.request.prompt_token_ids))
        async for out in llm.generate(prompt, params, f"bare-{uuid.uuid4().hex[:12]}"):
            final = out
        assert final is not None
        tokens = list(final.outputs[0].token_ids)
        generated += len(tokens)
        differing += tokens != turn.token_ids

    async def episode(chain: list[Turn]) -> None:
        for index, turn in enumerate(chain):
            if index and args.step_delay_s:
                await asyncio.sleep(args.step_delay_s)
            await one(turn)

    async def every() -> float:
        slots = asyncio.Semaphore(args.concurrent_groups)

        async def group(episodes: dict[str, list[Turn]]) -> None:
            async with slots:
                await asyncio.gather(*(episode(chain) for chain in episodes.values()))

        started = time.perf_counter()
        await asyncio.gather(*(group(episodes) for episodes in groups.values()))
        return time.perf_counter() - started

    cpu = time.process_time()
    seconds = engine.call(every())
    return Measurement(seconds, len(turns), generated, cpu_s=time.process_time() - cpu), differing


def table(rows: list[tuple[str, Measurement, Measurement]]) -> str:
    return rounds_table(rows, "bare AsyncLLM", [
        ("requests", lambda m: str(m.requests)), ("generated tokens", lambda m: str(m.generated_tokens)),
        ("requests/s", lambda m: f"{m.requests_per_s():.1f}"), ("tokens/s", lambda m: f"{m.tokens_per_s():.0f}"),
        ("process CPU s", lambda m: f"{m.cpu_s:.2f}"),
    ])


def parse_args() -> argparse.Namespace:
    parser = workload_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--step-delay-s", type=float, default=0.0, help="environment step delay, in both arms")
    parser.add_argument("--loop-tasks", action="store_true",
                        help="also run every round's groups as tasks on the engine's loop (run_loop_tasks), each "
                             "against the bare replay of its own requests")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import __version__ as vllm_version

    from producers.samplers.engine import VLLMEngine

    model_path = resolve_model(ModelConfig(base_model=args.model))
    load = LoadAverage()  # the engine's start, the warm-up and the rounds
    started = time.perf_counter()
    engine = SyncSampler(lambda: VLLMEngine(model_path, SamplerConfig(max_model_len=args.max_model_len, seed=0)))
    engine_s = time.perf_counter() - started
    try:
        started = time.perf_counter()  # warm-up at full concurrency: vLLM's first batches are slow on a CPU
        warm = argparse.Namespace(**{**vars(args), "groups": args.concurrent_groups})
        replay_bare(engine, run_producer(engine, warm, seed_start=10_000_000)[1], warm)
        warm_s = time.perf_counter() - started
        rows, producers, bares, differing = [], [], [], 0
        loop_rows: list[tuple[str, Measurement, Measurement]] = []
        for index in range(args.rounds):
            arms = [run_producer, run_loop_tasks] if args.loop_tasks else [run_producer]
            measured = {}
            for arm in arms if index % 2 == 0 else arms[::-1]:  # with --loop-tasks, alternately first
                cold_prefix_cache(engine)  # each arm computes its own prompts: none finds another's cached
                run, turns = arm(engine, args, seed_start=index * args.groups)
                cold_prefix_cache(engine)
                measured[arm] = run, *replay_bare(engine, turns, args)  # the very requests just sent
            producer, bare, differ = measured[run_producer]
            rows.append((str(index + 1), producer, bare))
            producers.append(producer)
            bares.append(bare)
            differing += differ
            line = f"round {index + 1}/{args.rounds}: producer {producer.seconds:.2f} s, bare {bare.seconds:.2f} s"
            if args.loop_tasks:  # the same seeds, so the same levels, as tasks on the engine's loop
                tasks, tasks_bare, _ = measured[run_loop_tasks]
                loop_rows.append((str(index + 1), tasks, tasks_bare))
                line += f"; loop tasks {tasks.seconds:.2f} s, bare {tasks_bare.seconds:.2f} s"
            print(line, flush=True)
    finally:
        load.stop()
        engine.close()
    producer, bare = total(producers), total(bares)
    print(f"machine: {os.cpu_count()} CPU cores ({platform.machine()}), {load}; vllm {vllm_version} (AsyncLLM), "
          f"model {model_path}")
    print(f"engine start {engine_s:.1f} s, warm-up {warm_s:.1f} s")
    print(f"env {args.env} (step delay {args.step_delay_s} s), {args.groups} groups x {args.group_size} per round, "
          f"concurrent_groups {args.concurrent_groups}, max_new_tokens {args.max_new_tokens}, temperature 1.0, "
          f"{args.rounds} rounds")
    print()
    print(table([*rows, ("all", producer, bare)]))
    print()
    print(f"turns whose bare tokens differ from the producer's (same seeds): {differing} of {producer.requests}")
    print(f"ratio producer/bare over all rounds: requests/s {producer.requests_per_s() / bare.requests_per_s():.2f}, "
          f"tokens/s {producer.tokens_per_s() / bare.tokens_per_s():.2f}")
    ratios = [p.tokens_per_s() / b.tokens_per_s() for _, p, b in rows]
    print(f"median per-round tokens/s ratio: {statistics.median(ratios):.2f} (min {min(ratios):.2f}, "
          f"max {max(ratios):.2f})")
    print(f"spread of the per-round ratios: {spread(ratios)}")
    print(f"producer wall time with a request out: {producer.generate_s / producer.seconds:.0%}")
    extra = (producer.cpu_s - bare.cpu_s) / producer.requests
    print(f"this process's CPU: producer {producer.cpu_s:.2f} s, bare {bare.cpu_s:.2f} s; the producer's own work "
          f"{extra * 1000:.2f} ms of CPU a turn, against {producer.seconds - bare.seconds:.2f} s more wall in all")
    if loop_rows:
        tasks, tasks_bare = total([r[1] for r in loop_rows]), total([r[2] for r in loop_rows])
        tasks_ratios = [p.tokens_per_s() / b.tokens_per_s() for _, p, b in loop_rows]
        print()
        print(f"episodes as tasks on the engine's loop: ratio over all rounds "
              f"{tasks.tokens_per_s() / tasks_bare.tokens_per_s():.2f}, per round {spread(tasks_ratios)}; its own work "
              f"{(tasks.cpu_s - tasks_bare.cpu_s) / tasks.requests * 1000:.2f} ms of CPU a turn")


if __name__ == "__main__":  # vLLM may spawn processes that re-import this module
    main()
