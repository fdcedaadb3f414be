"""Tinker API overhead: ``forward_backward`` + ``optim_step`` through the API against the same calls made directly.

The arms train the same model configuration on the same data: batches of ``--sequences`` datums of
``--tokens`` tokens (the SDK's own ``tinker.types.Datum``: a prompt chunk and a completion chunk, weights
or advantages on the completion), one ``forward_backward`` and one ``optim_step`` per step.

- direct: the training calls of ``consumers.api.ops`` on a ``TrainingEngine`` in this process (the
  translation of the SDK's types included, no transport): the speed the API is measured against.
- engine: the engine's own methods, the datums translated by ``consumers.api.translate``: direct /
  engine is the cost of the API layer around the engine (request and result types, checks).
- sdk: the same through the ``tinker`` SDK and ``rlpipe serve`` (added with the gateway: ``ARMS["sdk"]``).

The arms take turns batch by batch (the order rotating), so a shared machine's load falls on all
alike; the first ``--warmup`` batches are not timed.  Reported per arm: tokens/s
(every input token of every datum over the timed steps) and the median seconds per step; with two arms,
the ratio sdk/direct (goal: at least 0.9).

Run: .venv/bin/python bench/tinker_overhead.py [--steps 3] [--sequences 64] [--tokens 256]
     [--loss cross_entropy] [--device auto] [--threads N] [--model DIR] [--arms direct,engine]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from consumers.api import ops
from consumers.api.translate import engine_datums, engine_loss_args
from consumers.engine import AdamParams, TrainingEngine

ADAM = types.AdamParams(learning_rate=1e-4)
LORA = types.LoraConfig(rank=16, seed=0)


@dataclass
class Arm:
    name: str
    tokens: int = 0
    seconds: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Every input token of every timed batch over the time of those steps."""
        return self.tokens / sum(self.seconds) if self.seconds else float("nan")


def make_batches(count: int, sequences: int, tokens: int, loss: str, vocab: int, seed: int = 0
                 ) -> list[list[types.Datum]]:
    """``count`` batches of datums: half prompt, half completion; sampler logprobs near a uniform model's."""
    rng = random.Random(seed)
    batches = []
    for _ in range(count):
        data = []
        for _ in range(sequences):
            sequence = [rng.randrange(vocab) for _ in range(tokens + 1)]
            prompt = tokens // 2
            chunks = [types.EncodedTextChunk(tokens=sequence[:prompt]),
                      types.EncodedTextChunk(tokens=sequence[prompt:tokens])]
            inputs: dict[str, list] = {"target_tokens": sequence[1:]}
            if loss == "cross_entropy":
                inputs["weights"] = [0.0] * prompt + [1.0] * (tokens - prompt)
            else:
                inputs["logprobs"] = [rng.uniform(-7.3, -6.6) for _ in range(tokens)]
                inputs["advantages"] = [0.0] * prompt + [rng.choice((-1.0, 1.0)) for _ in range(tokens - prompt)]
            data.append(types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs=inputs))
        batches.append(data)
    return batches


Step = Callable[[list[types.Datum]], None]  # one forward_backward + optim_step on one batch


def new_model(model_dir: str, args: argparse.Namespace) -> tuple[TrainingEngine, str]:
    engine = TrainingEngine(model_dir, device=args.device)
    model_id = "bench:train:0"
    ops.create_model(engine, model_id, types.CreateModelRequest(
        session_id="bench", model_seq_id=0, base_model=model_dir, lora_config=LORA))
    return engine, model_id


def direct_arm(model_dir: str, args: argparse.Namespace) -> Step:
    """forward_backward + optim_step called directly on a training engine through ``consumers.api.ops``."""
    engine, model_id = new_model(model_dir, args)

    def step(data: list[types.Datum]) -> None:
        request = types.ForwardBackwardRequest(types.ForwardBackwardInput(data, args.loss), model_id)
        ops.forward_backward(engine, model_id, request, forward_only=False)
        ops.optim_step(engine, model_id, types.OptimStepRequest(adam_params=ADAM, model_id=model_id))
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    return step


def engine_arm(model_dir: str, args: argparse.Namespace) -> Step:
    """The same steps on the engine's own methods (the datums' translation is timed here too, it is cheap)."""
    engine, model_id = new_model(model_dir, args)
    name, loss_args = ops.adapter_name(model_id), engine_loss_args(args.loss, None)
    adam = AdamParams(learning_rate=ADAM.learning_rate, beta1=ADAM.beta1, beta2=ADAM.beta2, eps=ADAM.eps)

    def step(data: list[types.Datum]) -> None:
        engine.forward_backward(name, engine_datums(data), args.loss, loss_args)
        engine.optim_step(name, adam)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    return step


ARMS: dict[str, Callable[[str, argparse.Namespace], Step]] = {"direct": direct_arm, "engine": engine_arm}


def measure(model_dir: str, batches: list[list[types.Datum]], args: argparse.Namespace) -> list[Arm]:
    """Every arm on every batch, interleaved batch by batch (the order rotating) so load falls on all alike."""
    names = args.arms.split(",")
    steps = {name: ARMS[name](model_dir, args) for name in names}
    arms = {name: Arm(name) for name in names}
    for index, data in enumerate(batches):
        for name in names[index % len(names):] + names[: index % len(names)]:
            start = time.perf_counter()
            steps[name](data)
            if index >= args.warmup:
                arms[name].seconds.append(time.perf_counter() - start)
                arms[name].tokens += sum(datum.model_input.length for datum in data)
    return list(arms.values())


def report(arms: list[Arm], args: argparse.Namespace) -> str:
    lines = [f"tinker overhead: {args.sequences} sequences x {args.tokens} tokens, loss {args.loss}, "
             f"{args.steps} timed steps after {args.warmup} warm-up; torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, {platform.machine()}, device {args.device}"]
    for arm in arms:
        lines.append(f"  {arm.name:8s} {arm.tokens_per_s:12,.0f} tokens/s   median {statistics.median(arm.seconds):.3f} s/step")
    by_name = {arm.name: arm for arm in arms}
    if "engine" in by_name and "direct" in by_name:
        lines.append(f"  direct/engine: {by_name['direct'].tokens_per_s / by_name['engine'].tokens_per_s:.3f}")
    if "sdk" in by_name and "direct" in by_name:
        lines.append(f"  sdk/direct: {by_name['sdk'].tokens_per_s / by_name['direct'].tokens_per_s:.3f} (goal >= 0.9)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per arm")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--sequences", type=int, default=64, help="datums per forward_backward")
    parser.add_argument("--tokens", type=int, default=256, help="input tokens per datum")
    parser.add_argument("--loss", default="cross_entropy", help="any loss the API serves")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--model", default=None, help="a model folder (default: build the tiny model, untrained)")
    parser.add_argument("--arms", default="direct", help=f"comma-separated, of {', '.join(ARMS)}")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from producers.tiny_model import build_tiny_model  # bench code may use both sides

            model_dir = str(build_tiny_model(Path(tmp) / "model", pretrain=False))  # weights do not change speed
        batches = make_batches(args.warmup + args.steps, args.sequences, args.tokens, args.loss, vocab=1000)
        arms = measure(model_dir, batches, args)
    print(report(arms, args))


if __name__ == "__main__":
    main()
