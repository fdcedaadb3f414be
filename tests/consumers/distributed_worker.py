"""One rank of a torchrun group in the distributed-engine tests and benchmark: trains synthetic batches.

Run as ``python -m torch.distributed.run --nproc-per-node N tests/consumers/distributed_worker.py --model DIR --out DIR``.
Rank 0 writes the final adapter (``adapter.safetensors``); every rank writes
``rank<r>.json`` (its peak resident memory during training, tokens, seconds, the sha256 of its
adapter's saved state: weights, AdamW state and RNG).
``--die-after K`` makes rank 1 SIGKILL itself after step K on the group's first
attempt (torchrun's TORCHELASTIC_RESTART_COUNT is 0), so a restart can be tested.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from safetensors.torch import save_file

from consumers.distributed import (
    Batch,
    DistributedEngine,
    broadcast_batch,
    init_distributed,
    leave_group,
    train_batches,
)
from consumers.engine import AdamParams
from consumers.engine_data import PER_TOKEN, Datum

ADAM = AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.99, eps=1e-8)
LORA = dict(rank=4, alpha=8, target_modules=("q_proj", "v_proj"), seed=3)
OTHER_LORA = dict(rank=2, alpha=4, target_modules=("q_proj", "o_proj"), seed=5)  # --second-adapter


def make_batches(steps: int, per_batch: int = 6, vocab: int = 1000, length: int = 12) -> list[Batch]:
    """``steps`` batches of ``per_batch`` sequences of 5..``length`` tokens, loss on the second half with weights."""
    rng = random.Random(7)
    batches = []
    for step in range(steps):
        datums = []
        for _ in range(per_batch):
            n = rng.randint(5, length)
            sequence = [rng.randrange(vocab) for _ in range(n + 1)]
            weights = [0.0] * (n // 2) + [rng.uniform(0.5, 1.5) for _ in range(n - n // 2)]
            datums.append(Datum(sequence[:-1], sequence[1:], weights=weights))
        batches.append(Batch(f"batch-{step:03d}", datums, loss_args={"normaliser": float(per_batch)}))
    return batches


def rss_bytes(field: str = "VmHWM") -> int:
    """``VmHWM`` (peak resident memory since ``reset_peak_rss``) or ``VmRSS`` (now) of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def local_bytes(param) -> int:
    """Bytes of ``param`` held by this rank (its shard, for an FSDP2 DTensor)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.numel() * local.element_size()


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--per-batch", type=int, default=6)
    parser.add_argument("--length", type=int, default=12)
    parser.add_argument("--shard", action="store_true")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--die-after", type=int, default=-1)
    parser.add_argument("--every", type=int, default=1, help="checkpoint every this many steps")
    parser.add_argument("--broadcast", action="store_true",
                        help="only rank 0 makes the batches; the others receive them (broadcast_batch)")
    parser.add_argument("--only-broadcast", action="store_true",
                        help="broadcast one gspo batch and write what each rank received (datums.json)")
    parser.add_argument("--empty-steps", type=int, default=0,
                        help="then take this many optim_steps with no forward_backward before them")
    parser.add_argument("--dropout", type=float, default=0.0, help="the adapter's LoRA dropout")
    parser.add_argument("--max-batch-tokens", type=int, default=32768, help="the engine's micro-batch size")
    parser.add_argument("--stale-listing", action="store_true",
                        help="rank 1 lists no checkpoint (a shared folder whose listing it has cached)")
    parser.add_argument("--second-adapter", action="store_true",
                        help="then train adapter 'other' (created after sharding) on the same batches")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    topology = init_distributed("cpu")
    if args.only_broadcast:
        gspo = Batch("gspo", [Datum([1, 2, 3], [2, 3, 4], logprobs=[-1.0] * 3, advantages=[1.0, 1.0, 1.0],
                                    sequence_ratio_mask=[0.0, 1.0, 1.0])], "gspo")
        got = broadcast_batch(gspo if topology.is_main else None, topology).datums[0]
        fields = ("tokens", "target_tokens", *PER_TOKEN)
        (out / f"datums{topology.rank}.json").write_text(json.dumps(
            {name: None if getattr(got, name) is None else torch.as_tensor(getattr(got, name)).tolist()
             for name in fields}))
        leave_group()  # no rank leaves while another still receives
        return
    bare_rss = rss_bytes("VmRSS")  # before the model: what the peak is measured above
    engine = DistributedEngine(args.model, topology, device="cpu", dtype=args.dtype, shard=args.shard,
                               gradient_checkpointing=args.gradient_checkpointing, max_batch_tokens=args.max_batch_tokens)
    engine.create_adapter("policy", **LORA, dropout=args.dropout)
    batches = make_batches(args.steps, args.per_batch, engine.input_vocab - 24, args.length)
    if args.broadcast:  # as the learner: rank 0 reads the log, the others follow
        made = batches if topology.is_main else [None] * len(batches)
        batches = [broadcast_batch(batch, topology) for batch in made]

    def after_step(index: int) -> None:
        if index == args.die_after and topology.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)

    if args.stale_listing and topology.rank == 1:
        import consumers.distributed

        consumers.distributed.latest_checkpoint = lambda root: None
    reset_peak_rss()
    start_rss = rss_bytes("VmRSS")
    started = time.perf_counter()
    trained = train_batches(engine, "policy", batches, ADAM, out / "checkpoints", out / "batches.log",
                            every=args.every, after_step=after_step)
    seconds = time.perf_counter() - started
    tokens = sum(len(d) for b in batches for d in b.datums)
    base_bytes = sum(local_bytes(p) for p in engine.base.parameters() if not p.requires_grad)
    (out / f"rank{topology.rank}.json").write_text(json.dumps(
        {"peak_rss": rss_bytes(), "start_rss": start_rss, "bare_rss": bare_rss, "seconds": seconds, "tokens": tokens, "trained": trained,
         "base_bytes": base_bytes, "state_sha256": hashlib.sha256(engine.save_state("policy")).hexdigest()}))
    for _ in range(args.empty_steps):
        engine.optim_step("policy", ADAM)
    if args.second_adapter:
        engine.create_adapter("other", **OTHER_LORA)
        for batch in batches:
            engine.forward_backward("other", batch.datums, batch.loss, batch.loss_args)
            engine.optim_step("other", ADAM)
    if topology.is_main:
        save_file(engine.weights("policy"), str(out / "adapter.safetensors"))
        if args.second_adapter:
            save_file(engine.weights("other"), str(out / "other.safetensors"))
    leave_group()


if __name__ == "__main__":
    main()
