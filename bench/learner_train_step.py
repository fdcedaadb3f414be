"""The learner's training step alone against the bare peft loop's, on the same batches, in one process.

``LoraPolicy.train_step`` (head at generated positions, loss statistics, detached entropy, LR schedule)
and ``BareLoop.step`` from ``bench/learner_overhead.py`` (head at generated positions, the same loss
written directly in torch) take turns, five steps each per round, the order alternating; printed: the
median seconds per step of each and the spread of the per-round ratios (bare s / learner s).  Nothing
around the step (reading, advantages, publishing) is timed: this says whether the arithmetic itself
costs the learner anything.

Run: .venv/bin/python bench/learner_train_step.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import LoadAverage
from bench.learner_overhead import BareLoop, step_micro_batches, write_batches
from bench.options import positive_int
from bench.stats import spread
from consumers.policy import LoraPolicy
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.store import ObjectStore
from producers.tiny_model import build_tiny_model
from schemas.config import LearnerConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=20, help="rounds of five steps per arm")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    with LoadAverage() as load, tempfile.TemporaryDirectory(prefix="rlpipe-bench-") as tmp:
        model = str(build_tiny_model(Path(tmp) / "model", pretrain=False))
        cfg = LearnerConfig(batch_rows=8, device="cpu", torch_threads=1, learning_rate=1e-3, seed=0,
                            max_staleness=1000)
        archive = TrajectoryArchive(ObjectStore((Path(tmp) / "store").as_uri()))
        shape = argparse.Namespace(rows=8, prompt_tokens=128, answer_tokens=8)
        policy, bare = LoraPolicy(model, cfg), BareLoop(model, cfg, True)
        write_batches(archive, policy.model.get_base_model(), shape, 4, policy.model.config.vocab_size)
        steps = [step_micro_batches(archive.read_batch(c.key), cfg)[:2] for c in archive.commits("bench-src")]
        arms = {"learner train_step": lambda i: policy.train_step(*steps[i % 4]),
                "bare step": lambda i: bare.step(*steps[i % 4])}
        for arm in arms.values():  # untimed: first calls (allocations, kernels' first runs) cost more
            arm(0)
        times: dict[str, list[float]] = {name: [] for name in arms}
        for round_ in range(args.rounds):
            for name in (list(arms) if round_ % 2 else list(arms)[::-1]):
                started = time.perf_counter()
                for i in range(5):
                    arms[name](i)
                times[name].append((time.perf_counter() - started) / 5)
    ratios = [b / a for a, b in zip(times["learner train_step"], times["bare step"], strict=True)]
    print(f"tiny model, CPU, torch {torch.__version__}, 1 thread; 8 rows/step of 128+8 tokens; one untimed step of "
          f"each arm, then {args.rounds} rounds of 5 steps each; {load}")
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values) * 1e3:.1f} ms/step")
    print(f"bare / learner per round: {spread(ratios)}")


if __name__ == "__main__":
    main()
