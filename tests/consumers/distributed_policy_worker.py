"""One rank of a torchrun group training one learner step through ``DistributedPolicy`` with sharded base weights.

Run as ``python -m torch.distributed.run --nproc-per-node 2 tests/consumers/distributed_policy_worker.py --model DIR
--out DIR [--prefix N] [--kl]``.  Rank 0 trains (``train_step``) and writes the adapter (``adapter.safetensors``);
rank 1 follows.  ``policy_batches`` is also what the test trains in one process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from consumers.batching import pad_rows
from consumers.losses import TokenBatch
from schemas.config import LearnerConfig


def policy_batches(prefix: int) -> list[TokenBatch]:
    """Two micro-batches: rank 0's two rows start with the same ``prefix`` tokens, rank 1's one row shares none."""
    head = list(range(10, 10 + prefix))
    shared = pad_rows([head + [60, 61], head + [70, 71]], [[0] * prefix + [1, 1]] * 2,
                      [[0.0] * prefix + [-1.0, -1.0]] * 2, [1.0, -1.0])
    alone = pad_rows([[5, 6, 7, 8]], [[0, 0, 1, 1]], [[0.0, 0.0, -1.0, -1.0]], [0.5])
    return [shared, alone]


def learner_config(kl: bool) -> LearnerConfig:
    return LearnerConfig(lora_rank=4, lora_alpha=8, learning_rate=1e-2, device="cpu", seed=0,
                         kl_coef=0.1 if kl else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prefix", type=int, default=40)
    parser.add_argument("--kl", action="store_true", help="a KL penalty: the reference's forward runs too")
    args = parser.parse_args()
    import torch
    from safetensors.torch import save_file

    from consumers.distributed import DistributedEngine, init_distributed, leave_group
    from consumers.distributed_learner import DistributedPolicy

    torch.set_num_threads(1)
    topology = init_distributed("cpu")
    engine = DistributedEngine(args.model, topology, device="cpu", shard=True)
    policy = DistributedPolicy(engine, "run", learner_config(args.kl))
    with engine.holding("run"):
        if topology.is_main:
            policy.train_step(policy_batches(args.prefix), normaliser=3.0)
            policy.release()
            save_file({k: v.contiguous() for k, v in policy.adapter_tensors().items()},
                      str(Path(args.out) / "adapter.safetensors"))
        else:
            policy.follow()
    leave_group()


if __name__ == "__main__":
    main()
