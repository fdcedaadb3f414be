"""What running a micro-batch's shared prefix once saves the learner, measured side by side.

Per-turn rows of a long-horizon environment all start with the same system prompt
(CartPole's is 129 of about 230 tokens with the tiny model's chat template), and a
group's samples start with the same prompt.  ``consumers.logprobs.position_logprobs``
runs the columns every row of a micro-batch shares once and lets every row's rest
attend to their keys and values.  This bench trains the same steps twice, alternating step by step (the order rotating,
so the machine's load falls on both arms alike), each step of both arms from the same
weights and AdamW state:

- **shared**: ``LoraPolicy.train_step`` as the learner runs it;
- **plain**: the same with sharing switched off (every row through the whole body).

Rows: CartPole demonstrations recorded as the producer would sample them (the
environment's own prompts through the chat template, per-turn rows), or another
environment with ``--env``.  Their sampler logprobs are the base model's, so importance
ratios start at 1 and every step trains (with logprobs of 0 every ratio would fall below
``learner.ratio_mask_low``: every token masked, loss and gradient 0 in both arms, and the
check below would compare nothing).  The run fails (exit status 1) when a step's
gradient norm is 0 or the arms' losses or gradient norms differ by more than
``TOLERANCE`` (the same arithmetic in another order agrees to float rounding); it prints
tokens/s and tokens per CPU second per arm and their ratio.

    python bench/shared_prefix.py                      # CartPole, 8 steps of 512 rows
    python bench/shared_prefix.py --rows 256 --steps 4 --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import LoadAverage
from bench.options import positive_int
from consumers import logprobs as logprobs_module
from consumers.batching import micro_batches
from consumers.logprobs import shared_prefix_length
from consumers.policy import LoraPolicy
from consumers.token_batch import TokenBatch
from producers.demonstrations import demonstration_episode
from producers.envs.registry import env_names
from producers.episode import ChatFormat
from producers.rows import episode_rows
from schemas.config import LearnerConfig

ARMS = ("shared", "plain")
TOLERANCE = 1e-4  # relative difference of a step's loss or gradient norm between the arms


def demonstration_rows(model_dir: str, env: str, rows: int) -> list[dict]:
    """At least ``rows`` per-turn rows of ``env`` (the heuristic with half its turns random)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = ChatFormat.from_tokenizer(tokenizer)
    out: list[dict] = []
    seed = 0
    while len(out) < rows:
        episode = demonstration_episode(env, {"history_turns": 0}, tokenizer, chat, seed, 0.5, f"g{seed}")
        out += episode_rows(episode, run_id="bench", batch_id="bench", producer_id="bench", env_name=env,
                            created_at=datetime.now(UTC), with_text=False)
        seed += 1
    return out[:rows]


def with_base_logprobs(policy: LoraPolicy, batches: list[TokenBatch]) -> list[TokenBatch]:
    """``batches`` with the untrained policy's (the base model's) logprob of every generated token as the
    sampler's: what a sampler of the base model records, so every importance ratio starts at 1."""
    with torch.no_grad():
        return [dataclasses.replace(b, sampler_logprobs_BT=policy.generated_logprobs(b.tokens_BT, b.loss_mask_BT))
                for b in batches]


@dataclass
class Measured:
    """Per arm: each measured step's seconds and CPU seconds, and every step's result (the warm-up first)."""

    tokens: int
    times: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in ARMS})
    cpu: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in ARMS})
    results: dict[str, list[Any]] = field(default_factory=lambda: {name: [] for name in ARMS})


def measure(args: argparse.Namespace, model_dir: str, log: Callable[[str], None]) -> Measured:
    """Step 0 warms both arms up, then ``args.steps`` measured steps each, alternating (the order rotating)."""
    rows = demonstration_rows(model_dir, args.env, args.rows)
    config = LearnerConfig(device="cpu", lora_rank=8, lora_alpha=16, learning_rate=1e-3, seed=0)
    arms = {name: LoraPolicy(model_dir, config) for name in ARMS}
    advantages = [float(i % 5) - 2.0 for i in range(len(rows))]
    batches = with_base_logprobs(arms["plain"], micro_batches(
        [r["tokens"] for r in rows], [r["loss_mask"] for r in rows], [[0.0] * len(r["tokens"]) for r in rows],
        advantages, args.micro_batch_tokens))
    measured = Measured(tokens=sum(len(r["tokens"]) for r in rows))
    shared = [shared_prefix_length(b.tokens_BT, int((b.loss_mask_BT[:, 1:] > 0).nonzero()[:, 1].min()))
              for b in batches]
    log(f"{args.env}: {len(rows)} rows, {measured.tokens:,} tokens, {len(batches)} micro-batches; shared prefix "
        f"per micro-batch {min(shared)}-{max(shared)} tokens; mean row {measured.tokens / len(rows):.0f} tokens; "
        f"{args.threads} threads")
    minimum = logprobs_module.MIN_SHARED_PREFIX
    try:
        for step in range(args.steps + 1):
            same_start(arms["shared"], arms["plain"])  # each step compared from the same weights and AdamW state
            for name in (list(arms) if step % 2 == 0 else list(reversed(arms))):
                logprobs_module.MIN_SHARED_PREFIX = minimum if name == "shared" else 10**9
                started, started_cpu = time.perf_counter(), time.process_time()
                measured.results[name].append(arms[name].train_step(batches, normaliser=float(len(rows))))
                if step:
                    measured.times[name].append(time.perf_counter() - started)
                    measured.cpu[name].append(time.process_time() - started_cpu)
            if step:
                log(f"step {step}: shared {measured.times['shared'][-1]:.2f} s ({measured.cpu['shared'][-1]:.2f} s "
                    f"of CPU), plain {measured.times['plain'][-1]:.2f} s ({measured.cpu['plain'][-1]:.2f} s of CPU)")
    finally:
        logprobs_module.MIN_SHARED_PREFIX = minimum
    return measured


def same_start(source: LoraPolicy, target: LoraPolicy) -> None:
    """``target`` takes ``source``'s adapter, AdamW state and schedule (outside the timed steps).

    Two arms trained apart drift: AdamW turns float-rounding differences of near-zero gradient
    entries into steps of the learning rate's size, so after one step the arms' weights, and from
    then on their losses, differ by far more than the arithmetic of one step does.
    """
    optimizer, scalars = source.optimizer_state()
    target.load_state({name: value.clone() for name, value in source.adapter_tensors().items()},
                      {name: value.clone() for name, value in optimizer.items()}, scalars)


def relative_difference(a: Any, b: Any) -> float:
    """The larger relative difference of two steps' losses and gradient norms."""
    return max(abs(a.loss - b.loss) / max(abs(b.loss), 1e-12), abs(a.grad_norm - b.grad_norm) / max(b.grad_norm, 1e-12))


def step_failure(shared: list[Any], plain: list[Any], tolerance: float = TOLERANCE) -> str | None:
    """Why the comparison fails (a step that trained nothing, or arms that differ), or None; steps are numbered
    as the bench prints them (0 is the warm-up)."""
    for step, (a, b) in enumerate(zip(shared, plain, strict=True)):
        if a.grad_norm == 0 or b.grad_norm == 0:
            return (f"step {step} trained nothing (gradient norm 0; every token masked?), so the arms were not "
                    "compared")
        if (difference := relative_difference(a, b)) > tolerance:
            return (f"step {step}: the arms' loss or gradient norm differ by {difference:.2e} relative (at most "
                    f"{tolerance:g}): sharing the prefix changed the arithmetic")
    return None


def report(measured: Measured) -> list[str]:
    """The check's figures, the table per arm and the ratio of the arms."""
    steps = list(zip(measured.results["shared"], measured.results["plain"], strict=True))
    norms = [step.grad_norm for pair in steps for step in pair]
    per_s = {name: measured.tokens * len(t) / sum(t) for name, t in measured.times.items()}
    per_cpu_s = {name: measured.tokens * len(t) / sum(t) for name, t in measured.cpu.items()}
    ratios = [p / s for s, p in zip(measured.times["shared"], measured.times["plain"], strict=True)]
    lines = [f"loss and gradient norm of every step: max relative difference "
             f"{max(relative_difference(a, b) for a, b in steps):.2e}; gradient norms {min(norms):.3g}-{max(norms):.3g}",
             "| arm | tokens/s | tokens per CPU second | median s/step |", "| --- | ---: | ---: | ---: |"]
    for name in ARMS:
        lines.append(f"| {name} | {per_s[name]:,.0f} | {per_cpu_s[name]:,.0f} | "
                     f"{statistics.median(measured.times[name]):.2f} |")
    lines.append(f"shared / plain: x{per_s['shared'] / per_s['plain']:.2f} tokens/s "
                 f"(median per-step ratio x{statistics.median(ratios):.2f}), "
                 f"x{per_cpu_s['shared'] / per_cpu_s['plain']:.2f} tokens per CPU second")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="cartpole", choices=env_names())
    parser.add_argument("--rows", type=positive_int, default=512, help="rows per optimizer step")
    parser.add_argument("--steps", type=positive_int, default=8, help="measured steps per arm")
    parser.add_argument("--micro-batch-tokens", type=positive_int, default=8192)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--model", default=None, help="a model folder (default: build the tiny model, untrained)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp, LoadAverage() as load:
        model_dir = args.model
        if model_dir is None:
            from producers.tiny_model import build_tiny_model

            model_dir = str(build_tiny_model(Path(tmp) / "model", pretrain=False))  # weights do not change speed
        measured = measure(args, model_dir, lambda line: print(line, flush=True))
    print("\n".join(report(measured)))
    print(load)
    if failure := step_failure(measured.results["shared"], measured.results["plain"]):
        raise SystemExit(f"FAILED: {failure}")


if __name__ == "__main__":
    main()
