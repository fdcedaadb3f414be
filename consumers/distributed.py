"""The training engine on several processes: torchrun, torch.distributed data parallelism, FSDP2 sharding.

``DistributedEngine`` is the ``TrainingEngine`` run by every process of a
torchrun group (gloo on CPUs, nccl on GPUs).  Every rank makes the same calls
with the same arguments; inside each call:

  data parallel   a call's datums are split into one contiguous share per rank;
                  each rank runs its share, and ``optim_step`` first SUMS the
                  LoRA gradients over the ranks (all-reduce).  The losses are sums
                  over tokens divided by a normaliser, so the step equals one
                  process training on the whole request (up to float summation order;
                  without LoRA dropout, whose masks each rank draws from its own stream).
  random numbers  each rank draws its share's dropout masks from its own stream, seeded
                  by one draw from the adapter's RNG, which stays the same on every rank
                  (``_rank_stream``): a restarted group draws what an uninterrupted one does.
  results         loss and statistics are reduced, every datum's logprobs are
                  gathered: every rank returns what one process would.
  sharding        ``shard=True`` shards the frozen base weights over the ranks with
                  FSDP2 (``fully_shard`` per decoder layer and on the decoder body);
                  a layer's weights are gathered for its forward and backward only.
                  The LoRA weights and their AdamW state stay replicated (they are
                  megabytes; ``ignored_params``), so save/load/export are unchanged.
                  The output head stays whole too (the head-only forward reads its
                  weight directly; when tied, the embedding with it).  Sharded ranks must run the same number
                  of forwards, so a rank with fewer micro-batches runs zero-weight ones.
  precision       base weights in ``dtype`` (bf16 halves them), LoRA weights and
                  AdamW state in float32, logprobs in float32 (``consumers.policy``).
  checkpointing   ``gradient_checkpointing=True`` recomputes each decoder layer's
                  activations in the backward pass instead of keeping them.

Rank 0 is the only rank that talks to the event log and the registry (``is_main``);
the others follow its calls, and receive the batches it read (``broadcast_batch``).  Checkpoints go through
torch.distributed.checkpoint, nothing pickled (``consumers.distributed_checkpoint``).
``train_batches`` is the exactly-once loop over a fixed sequence of batches: a
checkpoint after every ``every`` steps, committed by renaming its folder, records
the ids of the batches trained so far; a restarted group (torchrun
``--max-restarts``) resumes from the last committed one (as rank 0 lists the folder, which
every rank must share), and rank 0 rewrites the
batch log from it, so every batch is trained, and logged, exactly once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from consumers.distributed_checkpoint import (
    CHECKPOINT_META,
    STEP_PREFIX,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_folder,
    step_of,
)
from consumers.engine import AdamParams, ForwardResult, StepInfo, TrainingEngine
from consumers.engine_data import PER_TOKEN, Datum, EngineError, micro_batch_slices
from consumers.engine_state import capture_rng, restore_rng
from consumers.losses import LossStats


@dataclass(frozen=True)
class Topology:
    """This process's place in the group (torchrun's RANK, WORLD_SIZE, LOCAL_RANK)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that reads and writes the event log, the registry and the batch log."""
        return self.rank == 0


def leave_group() -> None:
    """Every rank, once its work is done: wait for the others, then close the process group.

    A rank that exits with the group open can abort in its exit ("terminate called without an
    active exception", SIGABRT) while another still receives its last message, and torchrun then
    reports a finished group as failed.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def init_distributed(device: str = "auto") -> Topology:
    """Join the torchrun group (nccl on CUDA, gloo otherwise); outside torchrun, a group of one without a backend."""
    if "WORLD_SIZE" not in os.environ:
        return Topology()
    topology = Topology(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    use_cuda = device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(topology.local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", store=_attempt_store(topology),
                                rank=topology.rank, world_size=topology.world_size)
    return topology


def _attempt_store(topology: Topology) -> dist.Store:
    """torchrun's store, with keys prefixed by the restart count.

    A group restarted by torchrun (``--max-restarts``) reuses the store of the
    attempt before; without the prefix the new ranks read the dead ranks'
    addresses and the gloo connection fails.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), topology.world_size,
                          is_master=topology.is_main and not agent_store)
    return dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def comm_device() -> torch.device:
    """Where the tensors of a collective live: the rank's GPU under nccl (which refuses CPU tensors), else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def share(count: int, topology: Topology) -> tuple[int, int]:
    """[start, stop) of this rank's contiguous share of ``count`` items (the first ranks take one more)."""
    base, extra = divmod(count, topology.world_size)
    start = topology.rank * base + min(topology.rank, extra)
    return start, start + base + (1 if topology.rank < extra else 0)


class DistributedEngine(TrainingEngine):
    """A ``TrainingEngine`` for one rank of a torchrun group (module docstring); every rank makes the same calls."""

    def __init__(
        self, base_model: str, topology: Topology, device: str = "auto", dtype: str = "auto",
        max_batch_tokens: int = 32768, shard: bool = False, gradient_checkpointing: bool = False,
    ) -> None:
        use_cuda = device != "cpu" and torch.cuda.is_available()
        rank_device = f"cuda:{topology.local_rank}" if use_cuda else "cpu"
        super().__init__(base_model, device=rank_device, dtype=dtype, max_batch_tokens=max_batch_tokens)
        self.topology = topology
        self.shard = shard and topology.world_size > 1
        self._sharded = False
        if gradient_checkpointing:
            self.base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    @property
    def distributed(self) -> bool:
        return self.topology.world_size > 1

    # ---- the operations that differ --------------------------------------------------------
    def optim_step(self, name: str, adam: AdamParams, undo: bool = False) -> StepInfo:
        """Sum the ranks' accumulated gradients, then the one-process step (clip, AdamW, zero).

        ``undo`` is refused: the undo point would be taken after the sum, so a step restored and sent again would
        sum the gradients twice.  A group that fails a step resumes from its checkpoint (``train_batches``)."""
        if undo:
            raise EngineError("a DistributedEngine step cannot be undone (its gradients are summed over the ranks "
                              "first); call optim_step without undo and resume a failed group from its checkpoint")
        if self.distributed:
            with self._lock:
                self._all_reduce_gradients(list(self._get(name).params.values()))
        return super().optim_step(name, adam)

    # ---- phases ------------------------------------------------------------------------------
    def _new_adapter(self, lora: Any, seed: int) -> Any:
        """The engine's adapter (the same seed gives the same weights on every rank); the first one triggers sharding."""
        adapter = super()._new_adapter(lora, seed)
        if self.shard and not self._sharded:
            self._shard_base()
        return adapter

    def _shard_base(self) -> None:
        """FSDP2 over the frozen base weights: each decoder layer, then the body (embeddings, final norm)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.topology.world_size,))
        ignored = {p for p in self.model.parameters() if p.requires_grad}  # LoRA: replicated, gradients all-reduced
        head = self.base.get_output_embeddings()
        if head is not None and head.weight is self.base.get_input_embeddings().weight:
            ignored.add(head.weight)  # tied head: read directly by the head-only forward, so kept whole
        for param in ignored:  # own copies: a loaded weight may be a view of the mapped checkpoint file, which
            param.data = param.data.clone()  # stays resident (all of it) while any view of it is alive
        body = self.base.model
        for layer in body.layers:
            fully_shard(layer, mesh=mesh, ignored_params=ignored)
        fully_shard(body, mesh=mesh, ignored_params=ignored)
        self._sharded = True

    def reshard(self) -> None:
        """Drop every gathered base weight on this rank (a no-op unsharded).

        A sharded forward gathers a module's weights only where they are resharded, and the body's stay gathered
        after a forward without gradients, so two ranks' gathers pair up only if their modules start a pass in
        the same state.  Some calls reshard on one rank alone (peft's ``set_adapter`` and ``load_state_dict``
        on rank 0, for a snapshot or a loaded folder); a rank calls this before a pass that the others run too.
        """
        if not self._sharded:
            return
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def held_fraction(self) -> float:
        """The share of the base model's weights this rank holds: 1 replicated, about 1/N sharded over N ranks."""
        from torch.distributed.tensor import DTensor

        held = total = 0
        for param in self.base.parameters():
            if param.requires_grad:
                continue
            total += param.numel()
            held += param.to_local().numel() if isinstance(param, DTensor) else param.numel()
        return held / total if total else 1.0

    def _run(self, datums: Sequence[Datum], loss: str, loss_fn: Callable[..., Any], backward: bool) -> ForwardResult:
        """This rank's share of the request, zero-weight passes to keep sharded ranks in step, results combined."""
        if not self.distributed:
            return super()._run(datums, loss, loss_fn, backward)
        start, stop = share(len(datums), self.topology)
        local = list(datums[start:stop])
        self.reshard()  # every rank's modules as the others' (rank 0 alone may have resharded: an export)
        idle = self._idle_count(local) if self._sharded else 0  # agreed before any sharded forward gathers
        with self._rank_stream():
            result = super()._run(local, loss, loss_fn, backward) if local else ForwardResult(0.0, [], LossStats())
            for _ in range(idle):
                super()._run([_idle_datum()], loss, loss_fn, backward)  # adds exactly zero to the gradients
        return self._combine(result, datums, start)

    def _idle_count(self, local: Sequence[Datum]) -> int:
        """How many zero-weight passes this rank runs after its ``local`` share to run as many as the rank with the
        most: each pass of a sharded body gathers every layer from all ranks, so the passes must pair up, and this
        count is agreed before any of them (a collective between two ranks' gathers would pair with a gather)."""
        passes = len(micro_batch_slices(local, self.max_batch_tokens)) if local else 0
        most = torch.tensor([passes], device=comm_device())
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most) - passes

    @contextlib.contextmanager
    def _rank_stream(self) -> Iterator[None]:
        """Run the block on this rank's own random numbers (its share's dropout masks), seeded by one draw from the
        adapter's RNG, which the block then leaves as that draw left it.

        The adapter's RNG (swapped in by the caller) is thus the same on every rank after every call, as it starts
        (one seed), so the one state a checkpoint keeps is every rank's and a restarted group draws what an
        uninterrupted one does; and no two ranks draw the same masks for different rows.
        """
        draw = int(torch.randint(0, 2**62, (1,)))  # the same on every rank: the adapter's RNG is the group's
        group_rng = capture_rng()
        torch.manual_seed(int.from_bytes(hashlib.sha256(f"{draw}:{self.topology.rank}".encode()).digest()[:8],
                                         "little") >> 1)
        try:
            yield
        finally:
            restore_rng(group_rng)

    def _combine(self, local: ForwardResult, datums: Sequence[Datum], start: int) -> ForwardResult:
        """Every rank's loss and statistics reduced, every datum's logprobs gathered (rows are disjoint: a sum)."""
        stats = _all_reduce_stats(local.stats)
        device = comm_device()
        loss = torch.tensor([local.loss], dtype=torch.float64, device=device)
        dist.all_reduce(loss)
        width = max(len(d) for d in datums)
        logprobs_BT = torch.zeros((len(datums), width), dtype=torch.float32, device=device)
        for offset, row in enumerate(local.logprobs):
            logprobs_BT[start + offset, : row.numel()] = row.to(device)
        dist.all_reduce(logprobs_BT)
        logprobs_BT = logprobs_BT.cpu()
        return ForwardResult(float(loss), [logprobs_BT[b, : len(d)].clone() for b, d in enumerate(datums)], stats)

    def _all_reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """SUM every LoRA gradient over the ranks in one flat buffer (a rank without one contributes zeros).

        A parameter with a gradient on no rank keeps none, as in one process: AdamW skips it (a zero
        gradient would still move it by its momentum and weight decay).
        """
        held = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=comm_device())
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        params = [p for p, anywhere in zip(params, held.tolist(), strict=True) if anywhere]
        if not params:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _idle_datum() -> Datum:
    """One token with zero weight and zero advantage: its loss and gradients are exactly zero for every loss."""
    return Datum([0], [0], weights=[0.0], logprobs=[0.0], advantages=[0.0], mask=[0.0])


def _all_reduce_stats(stats: LossStats) -> LossStats:
    """``LossStats.merge`` over the ranks: sums, and the extremes of the ratios."""
    names = [f.name for f in fields(LossStats) if f.name not in ("ratio_max", "ratio_min")]
    device = comm_device()
    sums = torch.tensor([float(getattr(stats, n)) for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    high = torch.tensor([stats.ratio_max, -stats.ratio_min], dtype=torch.float64, device=device)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    values = {n: (int(v) if isinstance(getattr(stats, n), int) else float(v)) for n, v in zip(names, sums.tolist(), strict=True)}
    return LossStats(**values, ratio_max=float(high[0]), ratio_min=-float(high[1]))


# ---- the exactly-once loop over a fixed sequence of batches ---------------------------------
@dataclass(frozen=True)
class Batch:
    """One optimizer step's data: an id (for the batch log), its datums, the loss and its arguments."""

    batch_id: str
    datums: list[Datum]
    loss: str = "cross_entropy"
    loss_args: dict[str, float] | None = None


def broadcast_batch(batch: Batch | None, topology: Topology) -> Batch:
    """Rank 0's ``batch`` on every rank (the others pass None): only rank 0 reads the event log.

    Sent as a JSON header (id, loss, its arguments, lengths, temperatures, which
    per-token inputs each datum has) and two flat tensors (token ids; the per-token
    inputs of ``engine_data.PER_TOKEN``): nothing is pickled.
    """
    if topology.world_size == 1:
        if batch is None:
            raise ValueError("broadcast_batch: rank 0 of a group of one must pass its batch")
        return batch
    columns = PER_TOKEN  # every per-token input a loss may need (gspo's sequence_ratio_mask too)
    if topology.is_main:
        header = json.dumps({"batch_id": batch.batch_id, "loss": batch.loss, "loss_args": batch.loss_args,
                             "lengths": [len(d) for d in batch.datums],
                             "temperatures": [d.temperature for d in batch.datums],
                             "present": [[getattr(d, c) is not None for c in columns] for d in batch.datums]})
        header_bytes = torch.tensor(list(header.encode()), dtype=torch.uint8)
        ids = torch.cat([torch.cat([d.tokens, d.target_tokens]) for d in batch.datums])
        values = torch.cat([torch.cat([getattr(d, c) if getattr(d, c) is not None else torch.zeros(len(d))
                                       for c in columns]) for d in batch.datums])
        sizes = torch.tensor([header_bytes.numel(), ids.numel(), values.numel()])
    else:
        sizes = torch.zeros(3, dtype=torch.int64)
    device = comm_device()
    sizes = sizes.to(device)
    dist.broadcast(sizes, src=0)
    if topology.is_main:
        header_bytes, ids, values = header_bytes.to(device), ids.to(device), values.to(device)
    else:
        header_bytes = torch.empty(int(sizes[0]), dtype=torch.uint8, device=device)
        ids = torch.empty(int(sizes[1]), dtype=torch.int64, device=device)
        values = torch.empty(int(sizes[2]), dtype=torch.float32, device=device)
    for tensor in (header_bytes, ids, values):
        dist.broadcast(tensor, src=0)
    if topology.is_main:
        return batch
    header_bytes, ids, values = header_bytes.cpu(), ids.cpu(), values.cpu()
    header = json.loads(bytes(header_bytes.tolist()).decode())
    datums, id_at, value_at = [], 0, 0
    for n, temperature, present in zip(header["lengths"], header["temperatures"], header["present"], strict=True):
        per_token = {c: values[value_at + i * n : value_at + (i + 1) * n] if has else None
                     for i, (c, has) in enumerate(zip(columns, present, strict=True))}
        datums.append(Datum(ids[id_at : id_at + n], ids[id_at + n : id_at + 2 * n], temperature=temperature,
                            **per_token))
        id_at, value_at = id_at + 2 * n, value_at + len(columns) * n
    return Batch(header["batch_id"], datums, header["loss"], header["loss_args"])


def train_batches(
    engine: DistributedEngine, name: str, batches: Sequence[Batch], adam: AdamParams, checkpoints: str | Path,
    batch_log: str | Path | None = None, every: int = 1, after_step: Callable[[int], None] | None = None,
) -> list[str]:
    """Train each batch once (forward_backward + optim_step), resuming from the last committed checkpoint.

    Returns the ids trained, in order, across restarts.  ``after_step(index)``
    runs after each step (fault injection in tests, progress in benchmarks).
    """
    trained = _resume(engine, name, checkpoints, batch_log)
    for index in range(len(trained), len(batches)):
        batch = batches[index]
        engine.forward_backward(name, batch.datums, batch.loss, batch.loss_args)
        engine.optim_step(name, adam)
        trained.append(batch.batch_id)
        if len(trained) % every == 0 or index == len(batches) - 1:
            _commit(engine, name, checkpoints, trained, batch_log)
        if after_step is not None:
            after_step(index)
    return trained


def _resume(engine: DistributedEngine, name: str, checkpoints: str | Path, batch_log: str | Path | None) -> list[str]:
    """The batch ids of rank 0's last committed checkpoint (loaded into ``name`` on every rank); rank 0 rewrites the
    batch log to match."""
    latest = _rank_0s_checkpoint(engine, checkpoints)
    trained = list(load_checkpoint(engine, name, latest)["batch_ids"]) if latest else []
    if batch_log is not None and engine.topology.is_main:
        Path(batch_log).write_text("".join(f"{batch_id}\n" for batch_id in trained))
    return trained


def _rank_0s_checkpoint(engine: DistributedEngine, checkpoints: str | Path) -> Path | None:
    """The newest committed checkpoint as rank 0 lists it, on every rank.

    Only rank 0 lists the folder: a rank listing it on its own may be shown an older state of a shared
    filesystem (a cached listing), resume from another step and pair its collectives with other steps'.
    """
    latest = latest_checkpoint(checkpoints) if engine.topology.is_main else None
    if not engine.distributed:
        return latest
    picked = [step_of(latest), len(latest.name) - len(STEP_PREFIX)] if latest else [-1, 0]  # (step, its digits)
    sent = torch.tensor(picked, dtype=torch.int64, device=comm_device())
    dist.broadcast(sent, src=0)
    step, digits = (int(value) for value in sent)
    if step < 0:
        return None
    folder = latest if latest is not None else step_folder(checkpoints, step, digits)  # rank 0's name, padded or not
    if not (folder / CHECKPOINT_META).is_file():
        raise EngineError(f"rank {engine.topology.rank} does not see {folder}, rank 0's newest checkpoint; "
                          "put the checkpoints in a folder every rank shares")
    return folder


def _commit(engine: DistributedEngine, name: str, checkpoints: str | Path, trained: list[str],
            batch_log: str | Path | None) -> None:
    """Checkpoint (the commit point), then rank 0 logs the batches since the previous one and prunes old folders."""
    root = Path(checkpoints)
    folder = save_checkpoint(engine, name, step_folder(root, len(trained)), {"batch_ids": trained})
    if not engine.topology.is_main:
        return
    if batch_log is not None:
        logged = Path(batch_log).read_text().split() if Path(batch_log).exists() else []
        with Path(batch_log).open("a") as log:
            log.writelines(f"{batch_id}\n" for batch_id in trained[len(logged):])
    for old in root.glob(f"{STEP_PREFIX}*"):
        if old != folder and not old.name.endswith(".partial"):
            shutil.rmtree(old, ignore_errors=True)
