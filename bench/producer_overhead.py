"""Producer overhead: the rollout worker on vLLM against bare ``vllm.LLM.generate`` on the same prompts.

Both arms run in one process on one engine, one after the other, round by round:

- producer: ``RolloutWorker`` with a real environment (chat bookkeeping, environment steps in threads,
  row building) sampling through ``VLLMSampler``; finished batches go to an in-memory sink, so no store
  or broker time is counted.  A recording wrapper keeps every ``generate`` call the worker made: its
  prompts (token ids), each request's token budget, and the batch they travelled in.
- bare: the same calls replayed straight into ``vllm.LLM.generate``: the same prompts, the same number
  of requests per call, the same ``max_tokens`` and the same ``SamplingParams`` the sampler builds
  (raw logprob of each sampled token, stop on eos), with nothing around them.

Reported per arm: requests/s (one request = one model turn of one episode), generated tokens/s, and the
ratio producer/bare (1.0 = no overhead).  Sampling is stochastic, so the arms generate different but
equally distributed tokens; tokens/s is the like-for-like figure.  Other load on the machine moves single
rounds a lot, so there are several short rounds (producer, then the bare replay of its calls) and the
median of the per-round ratios is the headline; the producer's share of wall time spent inside ``generate`` is a second, load-robust view.

Run: .venv/bin/python bench/producer_overhead.py [--env sokoban] [--groups 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import LoadAverage
from bench.options import positive_int
from producers.envs.registry import make_env
from producers.rollout import FixedAdapter, RolloutWorker
from producers.samplers.base import AdapterHandle, SampleOutput, Sampler, SampleRequest
from producers.tiny_model import resolve_model
from schemas.config import ModelConfig, ProducerConfig, SamplerConfig


@dataclass
class RecordedCall:
    """One batched ``generate`` call as the worker made it."""

    requests: list[SampleRequest]
    generated_tokens: int


class RecordingSampler(Sampler):
    """Passes calls to the real sampler and records each one (prompts, budgets, batch)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.eos_token_id, self.max_model_len = inner.eos_token_id, inner.max_model_len
        self.calls: list[RecordedCall] = []

    def generate(self, requests, adapter=None, temperature=1.0, top_p=1.0, seed=None):  # type: ignore[no-untyped-def]
        outputs: list[SampleOutput] = self.inner.generate(requests, adapter, temperature, top_p, seed)
        self.calls.append(RecordedCall(list(requests), sum(len(o.token_ids) for o in outputs)))
        return outputs

    def load_adapter(self, handle: AdapterHandle) -> None:
        self.inner.load_adapter(handle)

    def unload_adapter(self, handle: AdapterHandle) -> None:
        self.inner.unload_adapter(handle)

    def close(self) -> None:
        pass


@dataclass
class MemorySink:
    """Keeps committed rows in memory (no store, no broker)."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def commit(self, rows: list[dict[str, Any]], batch_id: str) -> None:
        self.rows += rows


@dataclass
class Measurement:
    seconds: float
    calls: int  # batched generate calls
    requests: int
    generated_tokens: int
    generate_s: float = 0.0  # producer only: time inside sampler.generate

    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


def run_producer(sampler: Any, args: argparse.Namespace, seed_start: int) -> tuple[Measurement, RecordingSampler, int]:
    """The worker for ``args.groups`` groups; returns its measurement, the recorded calls and the episodes."""
    recorder = RecordingSampler(sampler)
    cfg = ProducerConfig(
        producer_id="bench", group_size=args.group_size, groups_per_batch=args.groups_per_batch,
        concurrent_groups=args.concurrent_groups, max_groups=args.groups, seed_start=seed_start,
        batch_timeout_s=3600, env_workers=args.env_workers,
    )
    sampling = SamplerConfig(max_new_tokens=args.max_new_tokens, max_model_len=args.max_model_len, seed=seed_start)
    tokenizer = sampler._engine().get_tokenizer()
    worker = RolloutWorker(
        run_id="bench", producer_id="bench", env_name=args.env, make_env=lambda: make_env(args.env),
        tokenizer=tokenizer, sampler=recorder, adapters=FixedAdapter(), sink=MemorySink(), producer=cfg,
        sampling=sampling,
    )
    started = time.perf_counter()
    worker.run()
    seconds = time.perf_counter() - started
    requests = sum(len(c.requests) for c in recorder.calls)
    generated = sum(c.generated_tokens for c in recorder.calls)
    measurement = Measurement(seconds, len(recorder.calls), requests, generated, worker.stats.generate_s)
    return measurement, recorder, worker.stats.samples


def replay_bare(sampler: Any, calls: list[RecordedCall], temperature: float) -> Measurement:
    """The recorded calls straight into ``vllm.LLM.generate``, batched as recorded, with the sampler's params."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = sampler._engine()
    batches = [
        (
            [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in call.requests],
            [
                SamplingParams(n=1, temperature=temperature, top_p=1.0, max_tokens=sampler.new_token_budget(r),
                               logprobs=0, stop_token_ids=[sampler.eos_token_id], detokenize=False)
                for r in call.requests
            ],
        )
        for call in calls
    ]
    generated = 0
    started = time.perf_counter()
    for prompts, params in batches:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        generated += sum(len(out.outputs[0].token_ids) for out in outputs)
    seconds = time.perf_counter() - started
    return Measurement(seconds, len(batches), sum(len(c.requests) for c in calls), generated)


def warm_up(sampler: Any, args: argparse.Namespace) -> float:
    """One producer run at full concurrency: vLLM's first batches are far slower than the rest on a CPU."""
    started = time.perf_counter()
    warm = argparse.Namespace(**{**vars(args), "groups": args.concurrent_groups})
    _, recorder, _ = run_producer(sampler, warm, seed_start=10_000_000)
    replay_bare(sampler, recorder.calls, temperature=1.0)
    return time.perf_counter() - started


Column = tuple[str, Callable[[Any], str]]  # header, the cell of one arm's measurement


def rounds_table(rows: list[tuple[str, Any, Any]], bare_name: str, columns: list[Column]) -> str:
    """Markdown: per round (and "all") the producer's row, then the bare arm's; ``columns`` after wall s,
    and the producer's tokens/s ratio to the bare arm's."""
    headers = ["round", "arm", "wall s", *(header for header, _ in columns), "tokens/s ratio"]
    lines = ["| " + " | ".join(headers) + " |", "| --- | --- |" + " ---: |" * (len(headers) - 2)]
    for name, producer, bare in rows:
        for arm, m in (("producer", producer), (bare_name, bare)):
            ratio = f"{producer.tokens_per_s() / bare.tokens_per_s():.2f}" if arm == "producer" else ""
            cells = [name, arm, f"{m.seconds:.2f}", *(cell(m) for _, cell in columns), ratio]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: list[tuple[str, Measurement, Measurement]]) -> str:
    return rounds_table(rows, "bare vLLM", [
        ("calls", lambda m: str(m.calls)), ("requests", lambda m: str(m.requests)),
        ("generated tokens", lambda m: str(m.generated_tokens)), ("requests/s", lambda m: f"{m.requests_per_s():.1f}"),
        ("tokens/s", lambda m: f"{m.tokens_per_s():.0f}"),
    ])


def total(measurements: list[Any]) -> Any:
    """The measurements' sum, field by field (a dataclass of numbers)."""
    return type(measurements[0])(**{f.name: sum(getattr(m, f.name) for m in measurements)
                                    for f in fields(measurements[0])})


def workload_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The producer's workload, the same in this bench and ``producer_overhead_async.py``."""
    parser.add_argument("--env", default="sokoban", help="environment (whole-episode rows for sokoban)")
    parser.add_argument("--model", default="tiny", help="'tiny' (the locally built model) or a local path")
    parser.add_argument("--groups", type=positive_int, default=32, help="groups per round")
    parser.add_argument("--group-size", type=positive_int, default=4)
    parser.add_argument("--concurrent-groups", type=positive_int, default=8)
    parser.add_argument("--groups-per-batch", type=positive_int, default=4)
    parser.add_argument("--env-workers", type=positive_int, default=4)
    parser.add_argument("--max-new-tokens", type=positive_int, default=32)
    parser.add_argument("--max-model-len", type=positive_int, default=2048)
    parser.add_argument("--rounds", type=positive_int, default=5, help="rounds of producer then bare replay")
    return parser


def parse_args() -> argparse.Namespace:
    return workload_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args()


def main() -> None:
    args = parse_args()
    from vllm import __version__ as vllm_version

    from producers.samplers.vllm_sampler import VLLMSampler

    model_path = resolve_model(ModelConfig(base_model=args.model))
    started = time.perf_counter()
    sampler = VLLMSampler(model_path, SamplerConfig(max_model_len=args.max_model_len, seed=0))
    engine_s = time.perf_counter() - started
    try:
        with LoadAverage() as load:  # the warm-up and the rounds
            warm_s = warm_up(sampler, args)
            rows, producers, bares, episodes = [], [], [], 0
            for index in range(args.rounds):
                sampler._llm.reset_prefix_cache()  # each arm computes its own prompts: none finds the other's cached
                producer, recorder, done = run_producer(sampler, args, seed_start=index * args.groups)
                sampler._llm.reset_prefix_cache()
                bare = replay_bare(sampler, recorder.calls, temperature=1.0)  # the very calls just made
                rows.append((str(index + 1), producer, bare))
                producers.append(producer)
                bares.append(bare)
                episodes += done
    finally:
        sampler.close()
    producer, bare = total(producers), total(bares)
    print(f"machine: {os.cpu_count()} CPU cores ({platform.machine()}), {load}; vllm {vllm_version}, "
          f"model {model_path}")
    print(f"engine start {engine_s:.1f} s, warm-up {warm_s:.1f} s")
    print(f"env {args.env}, {args.groups} groups x {args.group_size} per round, concurrent_groups "
          f"{args.concurrent_groups}, max_new_tokens {args.max_new_tokens}, temperature 1.0, {args.rounds} rounds")
    print()
    print(table([*rows, ("all", producer, bare)]))
    print()
    print(f"producer: {episodes / producer.seconds:.2f} episodes/s, {producer.requests_per_s():.1f} requests/s, "
          f"{producer.tokens_per_s():.0f} generated tokens/s")
    print(f"bare vLLM: {bare.requests_per_s():.1f} requests/s, {bare.tokens_per_s():.0f} generated tokens/s")
    print(f"ratio producer/bare over all rounds: requests/s {producer.requests_per_s() / bare.requests_per_s():.2f}, "
          f"tokens/s {producer.tokens_per_s() / bare.tokens_per_s():.2f}")
    ratios = [p.tokens_per_s() / b.tokens_per_s() for _, p, b in rows]
    print(f"median per-round tokens/s ratio: {statistics.median(ratios):.2f} (min {min(ratios):.2f}, "
          f"max {max(ratios):.2f})")
    print(f"producer wall time inside sampler.generate: {producer.generate_s / producer.seconds:.0%}")


if __name__ == "__main__":  # vLLM may spawn processes that re-import this module
    main()
