"""One rank of a torchrun group whose rank 0 is idle longer than a collective may wait, then trains one step.

Run as ``python -m torch.distributed.run --nproc-per-node 2 tests/consumers/distributed_idle_worker.py --model DIR
--out DIR --timeout-s T --idle-s I --keep-alive-s K``.  The process group is made with a collective timeout of ``T``
seconds (production's are 30 minutes under gloo, 10 under nccl); rank 0's learner waits ``I`` seconds (as one
waiting for rows does) before its step, with ``distributed_learner.KEEP_ALIVE_S`` set to ``K``.  Every rank writes
``rank<r>.json`` with the steps it trained and a digest of its adapter.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--idle-s", type=float, required=True)
    parser.add_argument("--keep-alive-s", type=float, required=True)
    args = parser.parse_args()
    import os

    import torch
    import torch.distributed as dist

    from consumers import distributed_learner
    from consumers.distributed import Topology, _attempt_store
    from schemas.config import RunConfig
    from tests.consumers.distributed_policy_worker import policy_batches

    torch.set_num_threads(1)
    distributed_learner.KEEP_ALIVE_S = args.keep_alive_s
    topology = Topology(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo", store=_attempt_store(topology), rank=topology.rank,
                            world_size=topology.world_size, timeout=timedelta(seconds=args.timeout_s))
    config = RunConfig.model_validate({"run_id": "idle", "model": {"base_model": args.model},
                                       "learner": {"lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-2,
                                                   "device": "cpu", "seed": 0}})
    seen: dict = {"steps": 0}  # this rank's policy and the steps it trained

    def lead(policy: distributed_learner.DistributedPolicy) -> None:
        seen["policy"] = policy
        time.sleep(args.idle_s)  # a learner waiting for rows: no command for the followers meanwhile
        policy.train_step(policy_batches(4), normaliser=3.0)
        seen["steps"] += 1

    follow = distributed_learner.DistributedPolicy.follow

    def counted_follow(policy: distributed_learner.DistributedPolicy, on_step=None) -> int:  # type: ignore[no-untyped-def]
        seen["policy"] = policy
        seen["steps"] = follow(policy, on_step)
        return seen["steps"]

    distributed_learner.DistributedPolicy.follow = counted_follow  # type: ignore[method-assign]
    distributed_learner.run_on_group(config, lead)
    policy = seen["policy"]
    digest = hashlib.sha256()
    for name, tensor in sorted(policy.adapter_tensors().items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    (Path(args.out) / f"rank{topology.rank}.json").write_text(json.dumps({"steps": seen["steps"],
                                                                          "adapter": digest.hexdigest()}))


if __name__ == "__main__":
    main()
