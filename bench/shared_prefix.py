"""What running a micro-batch's shared prefix once saves the learner, measured side by side.

Per-turn rows of a long-horizon environment all start with the same system prompt
(CartPole's is 129 of about 230 tokens with the tiny model's chat template), and a
group's samples start with the same prompt.  ``consumers.policy.position_logprobs``
runs the columns every row of a micro-batch shares once and lets every row's rest
attend to their keys and values.  This bench trains the same steps twice from the
same seed, alternating step by step (the order rotating, so the machine's load falls
on both arms alike):

- **shared**: ``LoraPolicy.train_step`` as the learner runs it;
- **plain**: the same with sharing switched off (every row through the whole body).

Rows: CartPole demonstrations recorded as the producer would sample them (the
environment's own prompts through the chat template, per-turn rows), or another
environment with ``--env``.  It checks that both arms' losses and gradient norms
agree at every step (the same arithmetic in another order: within 1e-4 relative),
and prints tokens/s and tokens per CPU second per arm and their ratio.

    python bench/shared_prefix.py                      # CartPole, 8 steps of 512 rows
    python bench/shared_prefix.py --rows 256 --steps 4 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from transformers import AutoTokenizer

from consumers import policy as policy_module
from consumers.batching import micro_batches
from consumers.policy import LoraPolicy, shared_prefix_length
from producers.demonstrations import demonstration_episode
from producers.episode import ChatFormat
from producers.rows import episode_rows
from schemas.config import LearnerConfig


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="cartpole")
    parser.add_argument("--rows", type=int, default=512, help="rows per optimizer step")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per arm")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="a model folder (default: build the tiny model, untrained)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from producers.tiny_model import build_tiny_model

            model_dir = str(build_tiny_model(Path(tmp) / "model", pretrain=False))  # weights do not change speed
        rows = demonstration_rows(model_dir, args.env, args.rows)
        advantages = [float(i % 5) - 2.0 for i in range(len(rows))]
        batches = micro_batches([r["tokens"] for r in rows], [r["loss_mask"] for r in rows],
                                [[0.0] * len(r["tokens"]) for r in rows], advantages, args.micro_batch_tokens)
        tokens = sum(len(r["tokens"]) for r in rows)
        shared = [shared_prefix_length(b.tokens_BT, int((b.loss_mask_BT[:, 1:] > 0).nonzero()[:, 1].min()))
                  for b in batches]
        print(f"{args.env}: {len(rows)} rows, {tokens:,} tokens, {len(batches)} micro-batches; shared prefix "
              f"per micro-batch {min(shared)}-{max(shared)} tokens; mean row {tokens / len(rows):.0f} tokens; "
              f"{args.threads} threads; load average {os.getloadavg()[0]:.2f}", flush=True)
        config = LearnerConfig(device="cpu", lora_rank=8, lora_alpha=16, learning_rate=1e-3, seed=0)
        arms = {"shared": LoraPolicy(model_dir, config), "plain": LoraPolicy(model_dir, config)}
        minimum = policy_module.MIN_SHARED_PREFIX
        times: dict[str, list[float]] = {name: [] for name in arms}
        cpu: dict[str, list[float]] = {name: [] for name in arms}
        results: dict[str, list] = {name: [] for name in arms}
        for step in range(args.steps + 1):  # step 0 warms up both arms
            for name in (list(arms) if step % 2 == 0 else list(reversed(arms))):
                policy_module.MIN_SHARED_PREFIX = minimum if name == "shared" else 10**9
                started, started_cpu = time.perf_counter(), time.process_time()
                results[name].append(arms[name].train_step(batches, normaliser=float(len(rows))))
                if step:
                    times[name].append(time.perf_counter() - started)
                    cpu[name].append(time.process_time() - started_cpu)
            if step:
                print(f"step {step}: shared {times['shared'][-1]:.2f} s ({cpu['shared'][-1]:.2f} s of CPU), "
                      f"plain {times['plain'][-1]:.2f} s ({cpu['plain'][-1]:.2f} s of CPU)", flush=True)
        policy_module.MIN_SHARED_PREFIX = minimum
        # the same arithmetic in another order: losses and gradient norms agree to float rounding (the adapters
        # drift further apart, as Adam turns rounding in near-zero gradients into steps of the learning rate)
        differences = [max(abs(a.loss - b.loss) / max(abs(b.loss), 1e-12),
                           abs(a.grad_norm - b.grad_norm) / max(b.grad_norm, 1e-12))
                       for a, b in zip(results["shared"], results["plain"], strict=True)]
        print(f"loss and gradient norm of every step: max relative difference {max(differences):.2e}")
        per_s = {name: tokens * len(t) / sum(t) for name, t in times.items()}
        per_cpu_s = {name: tokens * len(t) / sum(t) for name, t in cpu.items()}
        ratios = [p / s for s, p in zip(times["shared"], times["plain"], strict=True)]
        print("| arm | tokens/s | tokens per CPU second | median s/step |\n| --- | ---: | ---: | ---: |")
        for name in arms:
            print(f"| {name} | {per_s[name]:,.0f} | {per_cpu_s[name]:,.0f} | {statistics.median(times[name]):.2f} |")
        print(f"shared / plain: x{per_s['shared'] / per_s['plain']:.2f} tokens/s "
              f"(median per-step ratio x{statistics.median(ratios):.2f}), "
              f"x{per_cpu_s['shared'] / per_cpu_s['plain']:.2f} tokens per CPU second; "
              f"load average {os.getloadavg()[0]:.2f}")
        if max(differences) > 1e-4:
            raise SystemExit("the arms' steps differ: sharing the prefix changed the arithmetic")


if __name__ == "__main__":
    main()
