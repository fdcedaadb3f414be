"""How many warm-start steps the tiny model needs before it reads CartPole's state: the demo's warm start, in process.

The demo's warm start (preset ``demo-warmstart``) trains cross-entropy on weighted
demonstrations of a noisy teacher that pushes the heuristic's way with probability
``1 - noise / 2`` (0.62 at the demo's noise 0.76).  A warm start that has copied
the teacher favours the heuristic's push in (nearly) every state, by about that
probability; one that has not is the base model's coin flip, and online RL then
has to discover the feature by itself.  This bench records the same weighted rows
(``producers.demonstrations``, the same prompts through the chat template), trains a
fresh LoRA adapter on them with the warm-start preset's settings in steps of
``--rows`` rows, and every ``--every`` steps scores both answers of held-out
states by teacher forcing and prints

- ``p(heuristic)``: the mean probability of the heuristic's answer, the two answers
  renormalised (the teacher's is ``1 - noise / 2``);
- ``favour``: the share of states in which the heuristic's answer is the likelier.

With ``--api`` the same rows train through the training engine as the Tinker API
does (``consumers.engine``: LoRA alpha 32 on the same modules, a loss summed over
tokens, AdamW with the SDK's ``AdamParams``: beta2 0.95, eps 1e-12 unless given).

    python bench/warm_start.py                      # the tiny model init-tiny built, 150 steps of 128 rows
    python bench/warm_start.py --learning-rate 5e-3 --steps 60
    python bench/warm_start.py --seed 6 --steps 100   # rlpipe demo --seed 6's episodes, LoRA start and order
    python bench/warm_start.py --api --beta2 0.999 --eps 1e-8 --steps 100
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import LoadAverage
from bench.options import non_negative_int, positive_int
from consumers.batching import micro_batches
from consumers.policy import LoraPolicy
from pipeline.config import load_preset
from pipeline.models import resolve_base_model
from producers.demonstrations import demonstration_episode, weighted_rows
from producers.episode import ChatFormat
from producers.rows import episode_rows
from schemas.config import LearnerConfig, ModelConfig


def recorded_pairs(model_dir: str, episodes: range, noise: float) -> list[tuple[dict, dict]]:
    """The weighted rows of ``episodes``, as (left, right) pairs of one turn; the heavier one is the heuristic's."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = ChatFormat.from_tokenizer(tokenizer)
    pairs: list[tuple[dict, dict]] = []
    for seed in episodes:
        teacher: list[dict[str, float]] = []
        episode = demonstration_episode("cartpole", {"history_turns": 0}, tokenizer, chat, seed, noise, f"g{seed}",
                                        teacher=teacher)
        plain = episode_rows(episode, run_id="bench", batch_id="bench", producer_id="bench", env_name="cartpole",
                             created_at=datetime.now(UTC), with_text=False)
        rows = weighted_rows(plain, teacher, tokenizer, chat)
        pairs += list(zip(rows[::2], rows[1::2], strict=True))
    return pairs


def score(policy: LoraPolicy, pairs: list[tuple[dict, dict]]) -> tuple[float, float]:
    """Mean p(heuristic's answer) with the two answers renormalised, and the share of states favouring it."""
    flat = [row for pair in pairs for row in pair]
    totals: list[float] = []
    for batch in micro_batches([r["tokens"] for r in flat], [r["loss_mask"] for r in flat],
                               [[0.0] * len(r["tokens"]) for r in flat], [0.0] * len(flat), 16_384):
        with torch.no_grad():
            totals += policy.generated_logprobs(batch.tokens_BT, batch.loss_mask_BT).sum(-1).tolist()
    return _chosen(totals, pairs)


class ApiTrainer:
    """The warm start through ``TrainingEngine``, as the Tinker API's trainer runs ``forward_backward`` and
    ``optim_step`` (weights per token, the loss summed), scored from the engine's own forward."""

    def __init__(self, model_dir: str, rank: int, alpha: float, learning_rate: float, beta2: float | None,
                 eps: float | None, seed: int = 0) -> None:
        from consumers.api.ops import LORA_ALPHA
        from consumers.engine import AdamParams, TrainingEngine

        defaults = AdamParams()
        self.adam = AdamParams(learning_rate=learning_rate, beta2=defaults.beta2 if beta2 is None else beta2,
                               eps=defaults.eps if eps is None else eps)
        self.alpha = alpha or LORA_ALPHA
        self.engine = TrainingEngine(model_dir, device="cpu")
        self.engine.create_adapter("warm", rank, self.alpha, LearnerConfig().target_modules, seed=seed)

    @staticmethod
    def datum(row: dict, weight: float):
        from consumers.engine_data import Datum

        mask = [float(m) for m in row["loss_mask"]]
        return Datum.from_sequence(row["tokens"], mask, weights=[m * weight for m in mask])

    def train_step(self, rows: list[dict]) -> None:
        self.engine.forward_backward("warm", [self.datum(r, r["weight"]) for r in rows], "cross_entropy")
        self.engine.optim_step("warm", self.adam)

    def answer_logprobs(self, rows: list[dict]) -> list[float]:
        data = [self.datum(r, 1.0) for r in rows]
        out = self.engine.forward("warm", data, "cross_entropy")
        return [float((lp * d.weights).sum()) for lp, d in zip(out.logprobs, data, strict=True)]


def score_api(trainer: ApiTrainer, pairs: list[tuple[dict, dict]]) -> tuple[float, float]:
    """``score`` through the engine."""
    totals = trainer.answer_logprobs([row for pair in pairs for row in pair])
    return _chosen(totals, pairs)


def _chosen(totals: list[float], pairs: list[tuple[dict, dict]]) -> tuple[float, float]:
    chosen = []
    for i, (left, right) in enumerate(pairs):
        heuristic = 0 if left["weight"] > right["weight"] else 1
        chosen.append(float(torch.softmax(torch.tensor(totals[2 * i: 2 * i + 2]), 0)[heuristic]))
    return sum(chosen) / len(chosen), sum(p > 0.5 for p in chosen) / len(chosen)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=150)
    parser.add_argument("--rows", type=positive_int, default=128, help="rows per optimizer step (the preset's batch_rows)")
    parser.add_argument("--learning-rate", type=float, default=None, help="default: the preset's")
    parser.add_argument("--noise", type=float, default=0.76, help="the teacher's share of random answers")
    parser.add_argument("--every", type=positive_int, default=25, help="steps between evaluations")
    parser.add_argument("--held-out", type=positive_int, default=192, help="held-out states scored")
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="LoRA initialisation, row order and demonstration episodes (seed*1000 on, as rlpipe demo "
                             "--seed records them); the held-out states stay the same")
    parser.add_argument("--model", default=None, help="a model folder (default: the cached tiny model)")
    parser.add_argument("--api", action="store_true", help="train through the training engine as the Tinker API does")
    parser.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default: the preset's; --api: 32)")
    parser.add_argument("--beta2", type=float, default=None, help="--api: Adam's beta2 (default: the SDK's)")
    parser.add_argument("--eps", type=float, default=None, help="--api: Adam's eps (default: the SDK's)")
    args = parser.parse_args(argv)
    if not 0.0 < args.noise < 1.0:
        parser.error("--noise must be strictly between 0 and 1 (the heuristic's answer must be the heavier)")
    return args


def main() -> None:
    args = parse_args()
    load = LoadAverage()
    torch.set_num_threads(args.threads)
    model_dir = args.model or resolve_base_model(ModelConfig())  # the tiny model `rlpipe model init-tiny` built
    preset = load_preset("demo-warmstart")["learner"]
    settings = {key: preset[key] for key in ("lora_rank", "lora_alpha", "learning_rate")}
    if args.learning_rate is not None:
        settings["learning_rate"] = args.learning_rate
    if args.alpha is not None:
        settings["lora_alpha"] = args.alpha
    train: list[dict] = []
    seed = first = args.seed * 1000
    while len(train) < args.steps * args.rows:
        train += [row for pair in recorded_pairs(model_dir, range(seed, seed + 20), args.noise) for row in pair]
        seed += 20
    random.Random(args.seed).shuffle(train)
    held = recorded_pairs(model_dir, range(1_000_000, 1_000_100), args.noise)  # the demo's held-out seeds
    held = random.Random(1).sample(held, min(args.held_out, len(held)))
    if args.api:
        trainer = ApiTrainer(model_dir, settings["lora_rank"], args.alpha or 0.0, settings["learning_rate"],
                             args.beta2, args.eps, args.seed)
        settings.update(lora_alpha=trainer.alpha, beta2=trainer.adam.beta2, eps=trainer.adam.eps, path="api")
        measure = lambda: score_api(trainer, held)  # noqa: E731
    else:
        if args.eps is not None or args.beta2 is not None:
            raise SystemExit("--beta2 and --eps are for --api (the learner's AdamW keeps torch's: 0.999, 1e-8)")
        policy = LoraPolicy(model_dir, LearnerConfig(device="cpu", loss="cross_entropy", seed=args.seed, **settings))
        measure = lambda: score(policy, held)  # noqa: E731
    print(f"{len(train):,} training rows from episodes {first}-{seed - 1} (noise {args.noise:g}: the teacher's "
          f"p(heuristic) {1 - args.noise / 2:.2f}), {len(held)} held-out states; {settings}; seed {args.seed}; "
          f"{args.threads} threads", flush=True)
    started = time.monotonic()
    print("step 0: p(heuristic) {:.3f}  favour {:.2f}".format(*measure()), flush=True)
    for step in range(1, args.steps + 1):
        chunk = train[(step - 1) * args.rows: step * args.rows]
        if args.api:
            trainer.train_step(chunk)
        else:
            batches = micro_batches([r["tokens"] for r in chunk], [r["loss_mask"] for r in chunk],
                                    [r["logprobs"] for r in chunk], [0.0] * len(chunk), 8192,
                                    [r["weight"] for r in chunk])
            policy.train_step(batches, normaliser=float(len(chunk)))
        if step % args.every == 0 or step == args.steps:
            p_heuristic, favour = measure()
            print(f"step {step} ({time.monotonic() - started:.0f} s): p(heuristic) {p_heuristic:.3f}  "
                  f"favour {favour:.2f}", flush=True)
    print(load)


if __name__ == "__main__":
    main()
