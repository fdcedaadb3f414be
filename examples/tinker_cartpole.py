"""CartPole through the Tinker API: a researcher's loop that runs on a laptop against ``rlpipe serve``.

It imports only the ``tinker`` SDK, numpy and transformers' tokenizer, as a
script outside rlpipe would.  The environment (Gym's CartPole-v0 physics) is
stepped here, client-side; the server only trains and samples:

1. supervised warm start: ``cross_entropy`` on demonstrations recorded from a
   scripted controller on training seeds (prompt tokens weight 0, answer weight 1);
2. on-policy RL: each step samples ``group_size`` episodes from each of ``groups``
   start states with ``save_weights_and_get_sampling_client``, scores each
   episode by its return minus its group's mean (the group baseline), and takes
   one ``importance_sampling`` step with the sampled tokens' logprobs as ``q``;
3. held-out evaluation: the base model, the warm start and the last weights on unseen seeds,
   mean return with a 95% interval.

  rlpipe serve                                 # prints the base URL and the base model path
  TINKER_API_KEY=tml-me python examples/tinker_cartpole.py --base-url http://127.0.0.1:8000 \\
      --base-model <the path serve printed>
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time

import numpy as np
import tinker
from tinker import types
from transformers import AutoTokenizer

ACTIONS = ("left", "right")


# ---- the environment (client-side) -------------------------------------------------------------------------------


class CartPole:
    """Gym's CartPole-v0: Euler steps, +1 per step until |angle| > 12 degrees or |x| > 2.4, 200 steps at most."""

    def __init__(self, seed: int, max_steps: int) -> None:
        self.state = np.random.default_rng(seed).uniform(-0.05, 0.05, 4)
        self.max_steps, self.steps, self.done = max_steps, 0, False

    def step(self, action: int) -> float:
        x, x_dot, theta, theta_dot = self.state
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + 0.05 * theta_dot**2 * sin) / 1.1
        theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos**2 / 1.1))
        x_acc = temp - 0.05 * theta_acc * cos / 1.1
        self.state = np.array([x + 0.02 * x_dot, x_dot + 0.02 * x_acc, theta + 0.02 * theta_dot,
                               theta_dot + 0.02 * theta_acc])
        self.steps += 1
        fell = abs(self.state[0]) > 2.4 or abs(self.state[2]) > 12 * 2 * math.pi / 360
        self.done = fell or self.steps >= self.max_steps
        return 1.0

    def prompt(self) -> str:
        x, x_dot, theta, theta_dot = self.state
        return (f"CartPole. Cart {x:+.2f} speed {x_dot:+.2f}; pole angle {theta:+.3f} rad, turning {theta_dot:+.2f}. "
                "Push left or right?\nAnswer:")

    def expert(self) -> int:
        x, x_dot, theta, theta_dot = self.state
        return 1 if theta + 0.5 * theta_dot + 0.02 * x + 0.1 * x_dot > 0 else 0


def parse_action(text: str) -> int | None:
    words = text.strip().lower().split()
    return ACTIONS.index(words[0]) if words and words[0] in ACTIONS else None


# ---- the loop ------------------------------------------------------------------------------------------------------


class Loop:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.service = tinker.ServiceClient(base_url=args.base_url)
        self.training = self.service.create_lora_training_client(base_model=args.base_model, rank=args.rank).result()
        self.tokenizer = AutoTokenizer.from_pretrained(args.base_model)
        self.eos = self.tokenizer.eos_token_id
        self.sampled: list[int] = []  # sample calls per time step so far (seeds never repeat)

    def answer_tokens(self, action: int) -> list[int]:
        return self.tokenizer.encode(" " + ACTIONS[action], add_special_tokens=False) + [self.eos]

    def datum(self, prompt: list[int], answer: list[int], **per_token: list[float]) -> types.Datum:
        tokens = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        inputs: dict = {"target_tokens": tokens[1:], "weights": weights}
        for name, values in per_token.items():
            inputs[name] = [0.0] * (len(prompt) - 1) + values
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)

    # 1. supervised warm start
    def warm_start(self) -> None:
        demos = []
        for seed in range(self.args.demo_episodes):
            env = CartPole(10_000 + seed, self.args.max_steps)
            while not env.done:
                action = env.expert()
                demos.append((self.tokenizer.encode(env.prompt()), self.answer_tokens(action)))
                env.step(action)
        rng = np.random.default_rng(0)
        for step in range(self.args.sft_steps):
            batch = [demos[i] for i in rng.choice(len(demos), min(self.args.batch, len(demos)), replace=False)]
            out = self.training.forward_backward([self.datum(p, a) for p, a in batch], "cross_entropy").result()
            self.training.optim_step(types.AdamParams(learning_rate=self.args.sft_lr)).result()
            tokens = sum(len(a) for _, a in batch)
            print(f"sft step {step}: loss/token {out.metrics['loss:sum'] / tokens:.3f}", flush=True)

    # 2. on-policy RL with group baselines
    async def episodes(self, sampling, seeds: list[int], temperature: float) -> list[tuple[float, list]]:
        """Run one episode per seed at once; each: its return and (prompt, tokens, logprobs) of every step."""
        envs = [CartPole(seed, self.args.max_steps) for seed in seeds]
        steps: list[list] = [[] for _ in envs]
        returns = [0.0] * len(envs)
        while not all(env.done for env in envs):
            live = [i for i, env in enumerate(envs) if not env.done]
            prompts = [self.tokenizer.encode(envs[i].prompt()) for i in live]
            results = await asyncio.gather(*(  # each episode its own seed stream, so a group's episodes differ
                sampling.sample(types.ModelInput.from_ints(p), 1, types.SamplingParams(
                    max_tokens=4, temperature=temperature, seed=self.args.seed * 1_000_003 + i * 10_007 + envs[i].steps
                    + len(self.sampled)))
                for i, p in zip(live, prompts, strict=True)))
            self.sampled.append(len(live))
            for i, prompt, result in zip(live, prompts, results, strict=True):
                sequence = result.sequences[0]
                action = parse_action(self.tokenizer.decode(sequence.tokens, skip_special_tokens=True))
                steps[i].append((prompt, list(sequence.tokens), list(sequence.logprobs)))
                if action is None:  # an answer that is no action ends the episode
                    envs[i].done = True
                    continue
                returns[i] += envs[i].step(action)
        return list(zip(returns, steps, strict=True))

    def rl_step(self, step: int) -> None:
        started = time.monotonic()
        sampling = self.training.save_weights_and_get_sampling_client().result()
        seeds = [20_000 + step * self.args.groups + g for g in range(self.args.groups)]
        runs = asyncio.run(self.episodes(sampling, [s for s in seeds for _ in range(self.args.group_size)], 1.0))
        data, returns = [], [r for r, _ in runs]
        for g in range(self.args.groups):
            group = runs[g * self.args.group_size:(g + 1) * self.args.group_size]
            baseline = float(np.mean([r for r, _ in group]))
            for episode_return, steps in group:
                advantage = (episode_return - baseline) / max(1.0, self.args.max_steps / 10)
                for prompt, tokens, logprobs in steps:
                    if tokens and advantage != 0.0:
                        data.append(self.datum(prompt, tokens, logprobs=logprobs, advantages=[advantage] * len(tokens)))
        if data:
            self.training.forward_backward(data, "importance_sampling").result()
            self.training.optim_step(types.AdamParams(learning_rate=self.args.rl_lr)).result()
        print(f"rl step {step}: mean return {np.mean(returns):.1f} over {len(returns)} episodes, "
              f"{len(data)} datums ({time.monotonic() - started:.1f} s)", flush=True)

    # 3. held-out evaluation
    def evaluate(self, sampling, label: str) -> tuple[float, float]:
        seeds = list(range(90_000, 90_000 + self.args.eval_episodes))
        returns = np.array([r for r, _ in asyncio.run(self.episodes(sampling, seeds, 0.0))])
        half = 1.96 * returns.std(ddof=1) / math.sqrt(len(returns)) if len(returns) > 1 else float("nan")
        print(f"held-out {label}: return {returns.mean():.1f} +/- {half:.1f} (95%, {len(returns)} episodes)",
              flush=True)
        return float(returns.mean()), float(half)


def ratio(last: tuple[float, float], before: tuple[float, float]) -> str:
    """``x2.31 over`` (95% intervals separated) or ``x1.10 over (intervals overlap)``; ``above`` a zero return."""
    separated = last[0] - last[1] > before[0] + before[1]
    times = f"x{last[0] / before[0]:.2f} over" if before[0] > 0 else "above"
    return f"{times}{'' if separated else ' (intervals overlap)'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--base-model", required=True, help="the base model name rlpipe serve printed")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=200, help="episode length limit")
    parser.add_argument("--demo-episodes", type=int, default=8)
    parser.add_argument("--sft-steps", type=int, default=30)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rl-steps", type=int, default=20)
    parser.add_argument("--rl-lr", type=float, default=2e-4)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--eval-episodes", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.monotonic()
    loop = Loop(args)
    base = loop.evaluate(loop.service.create_sampling_client(base_model=args.base_model).result(), "base model")
    loop.warm_start()
    warm = loop.evaluate(loop.training.save_weights_and_get_sampling_client().result(), "warm start")
    for step in range(args.rl_steps):
        loop.rl_step(step)
    last = loop.evaluate(loop.training.save_weights_and_get_sampling_client().result(), "last version")
    print(f"base {base[0]:.1f}, warm start {warm[0]:.1f} -> last {last[0]:.1f} "
          f"({ratio(last, base)} the base model, {ratio(last, warm)} the warm start) "
          f"in {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
