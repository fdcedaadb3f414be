"""Learner overhead: the ``Learner`` over a replay of stored batches against a bare peft training loop.

Three arms train on the same steps (the same rows, advantages, micro-batches and loss) in one process,
interleaved step by step (the order rotating) so a shared machine's load falls on all of them alike:

- learner: ``consumers.learner.Learner`` fed by ``ReplaySource`` from a file:// store: per step it reads
  and conforms a Parquet batch, filters stale rows, forms group advantages and micro-batches, trains
  (``LoraPolicy``: output head at generated positions only, loss statistics, LR schedule), publishes an
  adapter version (``--publish-every``) and writes a checkpoint (``--checkpoint-every``).
- bare (head at generated): a plain peft loop over the prepared micro-batches: the same forward as the
  learner (hidden states, then the output head only where a generated token is predicted), the same loss
  written directly in torch, AdamW and gradient clipping; nothing else.  learner / this = the overhead of
  the pipeline around the arithmetic.
- bare (full logits): the same loop with the usual ``model(input_ids).logits`` over every position.

Both bare loops start from the same seed as the learner, so after the same steps their adapters must
agree with the learner's: the run fails (exit status 1) when an adapter differs by more than
``SAME_WORK_TOLERANCE`` or the learner's did not move, since then the arms did not do the same work.

Tokens are every token of every row (prompt and answer, no padding), as the learner's ``tokens`` metric.
Rows imitate per-turn prompts (``--prompt-tokens`` random tokens) with short answers (``--answer-tokens``),
sampler logprobs from the base model (so importance ratios start at 1).

Reported per arm: tokens/s over the measured steps, the median seconds per step; then learner/bare as the
ratio of tokens/s and the spread of the per-block ratios (median, mean +- standard error, range): one run's
ratio moves by several hundredths on a shared machine, and the spread says by how much.

With ``--toggle-writes`` the same learner publishes and checkpoints in every other block only, reported as a
second learner row ("learner (no writes)"): what the writes cost the training path, beside what the rest of
the learner costs, on the same batches as the bare loops.

Run: .venv/bin/python bench/learner_overhead.py [--steps 20] [--rows 8] [--prompt-tokens 128]
     [--answer-tokens 8] [--loss importance_sampling] [--publish-every 1] [--checkpoint-every 1] [--threads N]
     [--block-steps 1] [--toggle-writes]

With ``--block-steps K`` every arm runs K steps per turn, the learner in one call of its loop: there a step's
publish and checkpoint are written in the background while the next step trains (``consumers.step_writer``),
and the block's time includes waiting for the last step's writes.  With 1, every learner step waits for its own.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import load_text
from bench.options import non_negative_int, positive_int
from bench.stats import spread
from consumers.advantages import compute_advantages, training_weights
from consumers.batching import micro_batches
from consumers.checkpoint import CheckpointStore
from consumers.learner import Learner
from consumers.losses import TokenBatch
from consumers.policy import LoraPolicy, seed_everything
from consumers.sources import ReplaySource
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from schemas.config import LearnerConfig
from schemas.trajectory import NO_ADAPTER_SHA

SOURCE_RUN, LEARNER_RUN = "bench-src", "bench"
NO_WRITES = "learner (no writes)"
GROUP_SIZE = 4
SAME_WORK_TOLERANCE = 1e-6  # max |difference| of a bare loop's adapter from the learner's (they agree bitwise)
DAY = datetime(2026, 1, 1, tzinfo=UTC)


# ---- data -------------------------------------------------------------------------------------------------------


def base_logprobs(model: torch.nn.Module, tokens_R: list[list[int]], answer_tokens: int) -> list[list[float]]:
    """The base model's logprob of each answer token (0 on the prompt): what a sampler would have recorded."""
    with torch.no_grad():
        logits_RTV = model(input_ids=torch.tensor(tokens_R)).logits.float()
    logp_RT = torch.log_softmax(logits_RTV[:, :-1], -1).gather(-1, torch.tensor(tokens_R)[:, 1:, None])[..., 0]
    prompt = len(tokens_R[0]) - answer_tokens
    return [[0.0] * prompt + row[prompt - 1:].tolist() for row in logp_RT]


def write_batches(archive: TrajectoryArchive, model: torch.nn.Module, args: argparse.Namespace,
                  n_steps: int, vocab_size: int) -> None:
    """One Parquet batch per optimizer step: ``args.rows`` rows in groups of four, rewards 0/1 at random."""
    rng = np.random.default_rng(0)
    length = args.prompt_tokens + args.answer_tokens
    for step in range(n_steps):
        batch_id = f"b{step:05d}"
        tokens_R = rng.integers(10, vocab_size, size=(args.rows, length)).tolist()
        logprobs_R = base_logprobs(model, tokens_R, args.answer_tokens)
        rewards_R = rng.integers(0, 2, size=args.rows).astype(float)
        rows = [dict(
            run_id=SOURCE_RUN, batch_id=batch_id, episode_id=f"{batch_id}-{r}", group_id=f"{batch_id}-g{r // GROUP_SIZE}",
            env="bench", env_seed=r // GROUP_SIZE, producer_id="bench", policy_version=0, adapter_sha256=NO_ADAPTER_SHA,
            tokens=tokens_R[r], loss_mask=[0] * args.prompt_tokens + [1] * args.answer_tokens, logprobs=logprobs_R[r],
            turn_rewards=[rewards_R[r]], reward=rewards_R[r], num_turns=1, success=bool(rewards_R[r]), terminated=True,
            truncated=False, created_at=DAY,
        ) for r in range(args.rows)]
        archive.write_batch(SOURCE_RUN, rows, batch_id=batch_id, created=DAY)


def step_micro_batches(table: pa.Table, cfg: LearnerConfig) -> tuple[list[TokenBatch], float, int]:
    """The micro-batches the learner builds for one step's rows (same functions), their normaliser and tokens."""
    cols = table.to_pydict()
    advantages_R = compute_advantages(
        cfg.advantage, np.asarray(cols["reward"], dtype=np.float64), cols["group_id"],
        returns_to_go_R=cols["return_to_go"], turns_R=cols["turn"], normalize_std=cfg.normalize_advantage_std)
    weights_R = training_weights(cfg, advantages_R, cols.get("weight"))
    batches = micro_batches(cols["tokens"], cols["loss_mask"], cols["logprobs"], advantages_R,
                            cfg.micro_batch_tokens, weights_R)
    return batches, float(table.num_rows), sum(len(t) for t in cols["tokens"])


# ---- the bare loop ---------------------------------------------------------------------------------------------


def loss_of(cfg: LearnerConfig, logp_BT: torch.Tensor, batch: TokenBatch, normaliser: float) -> torch.Tensor:
    """The learner's loss written out: truncated importance sampling or cross-entropy (``consumers.losses``).

    IS: -(1/N) sum_bt k_t m_t w_b min(r_t, cap) A_b exp(logp_t - sg(logp_t)), r_t = exp(logp_t - q_t),
    k_t = [low <= r_t <= high]; CE: -(1/N) sum_bt m_t w_b logp_t.
    """
    mask_BT = batch.loss_mask_BT * batch.weights_B[:, None]
    if cfg.loss == "cross_entropy":
        return -(mask_BT * logp_BT).sum() / normaliser
    ratio_BT = torch.exp(logp_BT.detach() - batch.sampler_logprobs_BT)
    kept_BT = (ratio_BT >= cfg.ratio_mask_low) & (ratio_BT <= cfg.ratio_mask_high)
    coef_BT = ratio_BT.clamp(max=cfg.is_cap) * kept_BT * mask_BT * batch.advantages_B[:, None]
    return -(coef_BT * torch.exp(logp_BT - logp_BT.detach())).sum() / normaliser


class BareLoop:
    """peft LoRA on the base model, AdamW, clipping: an optimizer step and nothing around it."""

    def __init__(self, model_dir: str, cfg: LearnerConfig, head_at_generated_only: bool) -> None:
        self.cfg, self.head_only = cfg, head_at_generated_only
        seed_everything(cfg.seed)  # as LoraPolicy does, so the LoRA initialisation is the learner's
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")
        self.model = get_peft_model(base, lora)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)

    def logprobs(self, tokens_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        """logp of each generated token (0 elsewhere)."""
        if not self.head_only:
            logits_BTV = self.model(input_ids=tokens_BT).logits.float()
            picked_Bt = torch.log_softmax(logits_BTV[:, :-1], -1).gather(-1, tokens_BT[:, 1:, None])[..., 0]
            return torch.nn.functional.pad(picked_Bt, (1, 0)) * (mask_BT > 0)
        base = self.model.get_base_model()
        hidden_BTH = base.model(input_ids=tokens_BT).last_hidden_state
        rows_N, cols_N = (mask_BT[:, 1:] > 0).nonzero(as_tuple=True)
        logits_NV = base.lm_head(hidden_BTH[rows_N, cols_N]).float()
        logp_N = torch.log_softmax(logits_NV, -1).gather(-1, tokens_BT[rows_N, cols_N + 1, None])[:, 0]
        return torch.zeros(tokens_BT.shape).index_put((rows_N, cols_N + 1), logp_N)

    def step(self, batches: list[TokenBatch], normaliser: float) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for batch in batches:
            loss = loss_of(self.cfg, self.logprobs(batch.tokens_BT, batch.loss_mask_BT), batch, normaliser)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        return total

    def adapter(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}


# ---- timing ----------------------------------------------------------------------------------------------------


@dataclass
class Arm:
    """What one arm did in the measured blocks."""

    name: str
    blocks: dict[int, tuple[float, float]] = field(default_factory=dict)  # block start -> (s, tokens) per step
    train_s: float = 0.0  # learner only: time inside step() before publish and checkpoint, per step, summed

    def tokens_per_s(self, blocks: list[int] | None = None) -> float:
        """Tokens/s over ``blocks`` (all of this arm's by default)."""
        chosen = [self.blocks[b] for b in (self.blocks if blocks is None else blocks)]
        return sum(tokens for _, tokens in chosen) / sum(s for s, _ in chosen)

    def step_s(self) -> list[float]:
        return [s for s, _ in self.blocks.values()]


def learner_steps(learner: Learner, count: int) -> tuple[float, int, float]:
    """``count`` learner steps through one call of its loop (poll, ingest, train, publish, checkpoint, the writes
    of a step beside the next step's training, all writes done at the end): (s, tokens, train s)."""
    target = learner.state.step + count
    metrics: list[dict] = []
    started = time.perf_counter()
    learner.run(should_stop=lambda: learner.state.step >= target, on_step=metrics.append, poll_timeout_s=0.0)
    wall = time.perf_counter() - started
    assert len(metrics) == count  # the replay holds exactly the steps asked for
    return wall, sum(m["tokens"] for m in metrics), sum(m["finished_at"] - m["started_at"] for m in metrics)


def bare_steps(loop: BareLoop, prepared: list[tuple[list[TokenBatch], float, int]]) -> tuple[float, int, float]:
    started = time.perf_counter()
    for batches, normaliser, _ in prepared:
        loop.step(batches, normaliser)
    return time.perf_counter() - started, sum(tokens for _, _, tokens in prepared), 0.0


def measure(args: argparse.Namespace, model_dir: str, root: Path,
            log: Callable[[str], None]) -> tuple[list[Arm], float, dict[str, float]]:
    """Block by block (``--block-steps``), each arm once per block (the order rotating), so load changes hit
    every arm alike; each block's time counts as that many steps of its mean time.  With ``--toggle-writes``
    the learner publishes and checkpoints in every other block only (the same learner, the same batches).
    Returns the arms and ``check_same_work``'s figures at the end."""
    cfg = LearnerConfig(loss=args.loss, batch_rows=args.rows, publish_every=args.publish_every,
                        checkpoint_every=args.checkpoint_every, max_staleness=1000, device="cpu",
                        torch_threads=args.threads, learning_rate=1e-3, seed=0)
    n_steps = args.warmup_steps + args.steps
    store = ObjectStore(root.as_uri())
    archive = TrajectoryArchive(store)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    log(f"writing {n_steps} batches of {args.rows} rows to {store.url()}")
    write_batches(archive, base, args, n_steps, base.config.vocab_size)
    source = ReplaySource(archive, SOURCE_RUN)
    prepared = [step_micro_batches(archive.read_batch(c.key), cfg) for c in archive.commits(SOURCE_RUN)]  # its order
    learner = Learner(run_id=LEARNER_RUN, base_model=model_dir, config=cfg, policy=LoraPolicy(model_dir, cfg),
                      archive=archive, registry=AdapterRegistry(store, LEARNER_RUN),
                      checkpoints=CheckpointStore(store, LEARNER_RUN), source=source)
    modes = {"learner": cfg}
    if args.toggle_writes:
        modes[NO_WRITES] = cfg.model_copy(update={"publish_every": 10**6, "checkpoint_every": 10**6})
    bare = {"bare (head at generated)": BareLoop(model_dir, cfg, True),
            "bare (full logits)": BareLoop(model_dir, cfg, False)}
    block = args.block_steps
    runners: dict[str, Callable[[int], tuple[float, int, float]]] = {
        "learner": lambda i: learner_steps(learner, block)}
    for name, loop in bare.items():
        runners[name] = lambda i, loop=loop: bare_steps(loop, prepared[i:i + block])
    arms = {name: Arm(name) for name in [*modes, *bare]}
    names = list(runners)
    for turn, index in enumerate(range(0, n_steps, block)):
        mode = list(modes)[turn % len(modes)]
        learner.cfg = modes[mode]
        order = names[turn % len(names):] + names[:turn % len(names)]
        for name in order:
            wall, tokens, train_s = runners[name](index)
            if index >= args.warmup_steps:
                arm = arms[mode if name == "learner" else name]
                arm.blocks[index] = (wall / block, tokens / block)
                arm.train_s += train_s / block
        if (index + block) % 5 < block:
            log(f"step {index + block}/{n_steps}")
    learner.cfg = cfg
    moved, diffs = check_same_work(learner, bare, log)
    return list(arms.values()), moved, diffs


def check_same_work(learner: Learner, bare: dict[str, BareLoop],
                    log: Callable[[str], None]) -> tuple[float, dict[str, float]]:
    """How far the learner's ``lora_B`` moved from 0, and each bare loop's largest |difference| from the
    learner's adapter: they must end where the learner ended (same data, loss, optimizer)."""
    weights = learner.policy.adapter_tensors()
    moved = max(float(t.abs().max()) for name, t in weights.items() if "lora_B" in name)
    log(f"check: the learner's lora_B moved from 0 to max |w| {moved:.2e}")
    diffs: dict[str, float] = {}
    for name, loop in bare.items():
        diffs[name] = max(float((weights[k] - v).abs().max()) for k, v in loop.adapter().items())
        log(f"check: {name} adapter vs the learner's: max |difference| {diffs[name]:.2e}")
    return moved, diffs


def same_work_failure(moved: float, diffs: dict[str, float]) -> str | None:
    """Why the arms did not do the same work (a reason to fail the run), or None."""
    if moved == 0:
        return "the learner's lora_B did not move from 0: no step trained, so the arms compare nothing"
    apart = {name: diff for name, diff in diffs.items() if diff > SAME_WORK_TOLERANCE}
    if apart:
        named = ", ".join(f"{name} by {diff:.2e}" for name, diff in apart.items())
        return f"the bare loops' adapters differ from the learner's ({named}; at most {SAME_WORK_TOLERANCE:g})"
    return None


def report(arms: list[Arm], args: argparse.Namespace, load_before: tuple, load_after: tuple) -> str:
    learners = [arm for arm in arms if arm.name.startswith("learner")]
    bares = [arm for arm in arms if not arm.name.startswith("learner")]
    lines = [
        f"tiny model, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}; "
        f"{args.rows} rows/step of {args.prompt_tokens}+{args.answer_tokens} tokens, loss {args.loss}, publish "
        f"every {args.publish_every}, checkpoint every {args.checkpoint_every}; {args.steps} steps in blocks "
        f"of {args.block_steps} after {args.warmup_steps} warm-up"
        f"{', the learner writing in every other block' if args.toggle_writes else ''}; "
        f"{load_text(load_before[0], load_after[0])}",
        "",
        "| arm | tokens/s | median s/step | time outside training |",
        "| --- | ---: | ---: | ---: |",
    ]
    for arm in arms:
        outside = f"{1 - arm.train_s / sum(arm.step_s()):.0%}" if arm in learners else ""
        lines.append(f"| {arm.name} | {arm.tokens_per_s():,.0f} | {statistics.median(arm.step_s()):.3f} | {outside} |")
    lines += ["", "| learner / bare | tokens/s ratio | per block (bare s / learner s) |", "| --- | ---: | --- |"]
    for learner in learners:
        blocks = list(learner.blocks)
        for arm in bares:
            ratios = [arm.blocks[b][0] / learner.blocks[b][0] for b in blocks]
            lines.append(f"| {learner.name} / {arm.name} | "
                         f"{learner.tokens_per_s() / arm.tokens_per_s(blocks):.2f} | {spread(ratios, 'blocks')} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=20, help="measured optimizer steps per arm")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=2)
    parser.add_argument("--rows", type=positive_int, default=8, help="rows per optimizer step (one batch)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=128)
    parser.add_argument("--answer-tokens", type=positive_int, default=8)
    parser.add_argument("--loss", choices=["importance_sampling", "cross_entropy"], default="importance_sampling")
    parser.add_argument("--publish-every", type=positive_int, default=1)
    parser.add_argument("--checkpoint-every", type=positive_int, default=1)
    parser.add_argument("--block-steps", type=positive_int, default=1,
                        help="steps each arm runs per turn (the learner's writes overlap the next step within one)")
    parser.add_argument("--toggle-writes", action="store_true",
                        help="the learner publishes and checkpoints in every other block only: what the writes cost")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--model", default=None, help="a model folder (default: build the tiny model, untrained)")
    args = parser.parse_args(argv)
    if args.steps % args.block_steps or args.warmup_steps % args.block_steps:
        parser.error("--block-steps must divide both --steps and --warmup-steps")
    if args.toggle_writes and args.steps // args.block_steps < 2:
        parser.error("--toggle-writes needs at least two measured blocks (one with writes, one without): "
                     "--steps at least twice --block-steps")
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from producers.tiny_model import build_tiny_model  # bench code may use both sides

            model_dir = str(build_tiny_model(Path(tmp) / "model", pretrain=False))  # weights do not change speed
        arms, moved, diffs = measure(args, model_dir, Path(tmp) / "store", lambda line: print(line, flush=True))
    print()
    print(report(arms, args, load_before, os.getloadavg()))
    if failure := same_work_failure(moved, diffs):
        raise SystemExit(f"FAILED: {failure}")


if __name__ == "__main__":
    main()
