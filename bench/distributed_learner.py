"""Tokens/s of the distributed training engine on 1 and 2 processes, and the bf16 logprob gap.

Each arm launches ``tests/consumers/distributed_worker.py`` under torchrun (gloo
on the CPU) on the same synthetic batches (``--steps`` optimizer steps of
``--per-batch`` sequences of up to ``--length`` tokens, cross-entropy, LoRA r=4
on q_proj and v_proj, one checkpoint at the end) and reads rank 0's report:
tokens/s = all tokens of all batches / wall time of the training loop.  Arms:
1 process x 1 thread, 1 process x 2 threads, 2 processes x 1 thread (replicated
base weights), 2 processes x 1 thread with FSDP2-sharded base weights.

On a machine with 2 CPU cores the cores bound every arm: two processes cannot be
faster than one process using both cores; they pay for the gradient all-reduce
(and, sharded, for gathering every layer's weights twice per step).  The numbers
show the overhead of the distributed path, not its scaling; scaling needs one
accelerator per rank.

The logprob gap: the tiny model's logprobs of the same batches under float32 and
under bfloat16 base weights (LoRA and the head in float32 either way), the
difference a bf16 trainer sees against a float32 sampler (or the reverse).

Run: .venv/bin/python bench/distributed_learner.py [--model tiny|PATH] [--steps 6] [--per-batch 8] [--length 128]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import LoadAverage
from bench.options import model_folder, positive_int

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "consumers" / "distributed_worker.py"

ARMS = {  # name -> (processes, threads per process, extra worker arguments)
    "1 process x 1 thread": (1, 1, ()),
    "1 process x 2 threads": (1, 2, ()),
    "2 processes x 1 thread": (2, 1, ()),
    "2 processes x 1 thread, sharded": (2, 1, ("--shard",)),
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_arm(model: str, processes: int, threads: int, extra: tuple[str, ...], args: argparse.Namespace) -> dict:
    """One torchrun launch; rank 0's report."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                   "--master-port", str(free_port()), str(WORKER), "--model", model, "--out", out,
                   "--steps", str(args.steps), "--per-batch", str(args.per_batch), "--length", str(args.length),
                   "--threads", str(threads), "--every", str(args.steps), *extra]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        if done.returncode:
            raise SystemExit(f"arm failed: {done.stderr[-2000:]}")
        return json.loads((Path(out) / "rank0.json").read_text())


def logprob_gap(model: str, args: argparse.Namespace) -> tuple[float, float, int]:
    """(mean, max) |logprob(float32 base) - logprob(bfloat16 base)| over every target token, and the token count."""
    import torch

    from consumers.engine import TrainingEngine
    from tests.consumers.distributed_worker import LORA, make_batches

    logprobs = {}
    for dtype in ("float32", "bfloat16"):
        engine = TrainingEngine(model, device="cpu", dtype=dtype)
        engine.create_adapter("policy", **LORA)
        batches = make_batches(args.steps, args.per_batch, engine.input_vocab - 24, args.length)
        logprobs[dtype] = torch.cat([row for b in batches
                                     for row in engine.forward("policy", b.datums, b.loss).logprobs])
    gap = (logprobs["float32"] - logprobs["bfloat16"]).abs()
    return float(gap.mean()), float(gap.max()), gap.numel()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=model_folder, default="tiny", help="'tiny' (built if needed) or a model folder")
    parser.add_argument("--steps", type=positive_int, default=6)
    parser.add_argument("--per-batch", type=positive_int, default=8)
    parser.add_argument("--length", type=positive_int, default=128)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    model = args.model
    if model == "tiny":
        from producers.tiny_model import build_tiny_model

        model = str(build_tiny_model())
    print(f"model {args.model}, {args.steps} steps x {args.per_batch} sequences of up to {args.length} tokens, "
          f"{os.cpu_count()} CPU cores")
    print("| arm | tokens/s | s/step | peak RSS rank 0 (MiB) |\n| --- | ---: | ---: | ---: |")
    with LoadAverage() as load:
        for name, (processes, threads, extra) in ARMS.items():
            report = run_arm(model, processes, threads, extra, args)
            print(f"| {name} | {report['tokens'] / report['seconds']:,.0f} | {report['seconds'] / args.steps:.3f} | "
                  f"{report['peak_rss'] / 2**20:,.0f} |", flush=True)
    print(load)
    mean, most, count = logprob_gap(model, args)
    print(f"logprob gap float32 vs bfloat16 base weights over {count} tokens: mean {mean:.4f}, max {most:.4f} nats")


if __name__ == "__main__":
    main()
