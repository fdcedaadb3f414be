"""The learner on a torchrun group: rank 0 runs the learner loop, the other ranks follow its training steps.

``rlpipe learner start`` (and ``rlpipe replay --train``) launched by
``torchrun --nproc-per-node N`` builds one ``DistributedEngine`` per rank and
the run's policy as one adapter of it (``DistributedPolicy``, the packed
learner's ``EnginePolicy`` seam).  Rank 0 is the ordinary learner: consumer
group, lease, checkpoints, publishing, all unchanged.  The other ranks never
touch the event log, the store or the registry: they wait in ``follow`` for
rank 0's commands, which are broadcast as a JSON header plus tensors (nothing
pickled):

  step   the step's micro-batches and normaliser; every rank runs the
         forward/backward of its contiguous share of the micro-batches, the
         LoRA gradients are SUMMED over the ranks, then every rank clips and
         takes the same AdamW step, so the weights stay identical everywhere
         and equal one process's step on all the micro-batches (up to float
         summation order).
  sync   rank 0's adapter weights (and AdamW state and schedule, after a
         checkpoint was loaded): a resume or a warm start on rank 0 reaches the
         followers.
  reference  rank 0's KL reference (``learner.kl_coef`` > 0 after a warm
         start, and again on a resume): every rank computes the penalty of its
         share against the same weights.  Without a warm start the reference is
         the base model on every rank.
  wait   nothing to do yet: rank 0 sends it whenever ``KEEP_ALIVE_S`` passed
         without a command (a learner waiting for rows, writing a checkpoint,
         resuming), because a follower waits for the next command in a
         collective, and a collective gives up after the group's timeout (30
         minutes under gloo, 10 under nccl), ending the whole group.
  stop   the learner finished; followers return.

A rank that fails ends the torchrun group (its agent stops the others); the
restarted group resumes from rank 0's last checkpoint exactly as one process
does (a following rank seeds each step's random numbers, such as dropout masks,
from its rank and the step's tensors: ``follower_seed``).  With ``learner.shard`` the frozen base weights are sharded over the
ranks with FSDP2 (``DistributedEngine``): every forward gathers each layer
from all ranks, so a rank whose share has fewer micro-batches runs idle passes
(a two-token row whose loss is multiplied by zero, with the reference's forward
too under a KL penalty) until every rank has run as many.  ``learner.max_step_kl``
runs on every rank: each has every micro-batch, measures the step's KL on the
same rows and halves the step on rank 0's measure, so the ranks stay equal.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from consumers.distributed import (
    DistributedEngine,
    Topology,
    _all_reduce_stats,
    comm_device,
    init_distributed,
    leave_group,
    share,
)
from consumers.engine_policy import EnginePolicy
from consumers.losses import LossStats, TokenBatch, loss_from_logprobs
from consumers.policy import StepResult
from consumers.trust_region import TrustRegion
from pipeline.health import HealthServer
from pipeline.models import resolve_base_model
from schemas.config import LearnerConfig, RunConfig

log = logging.getLogger("rlpipe.learner")

T = TypeVar("T")
BATCH_FIELDS = ("tokens_BT", "loss_mask_BT", "sampler_logprobs_BT", "advantages_B", "weights_B", "token_weights_BT",
                "temperatures_B", "token_advantages_BT")
DTYPES = {"int64": torch.int64, "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "int32": torch.int32, "bool": torch.bool}
FOLLOWER_UP = "rlpipe_learner_follower_up"  # a following rank's gauge, labelled rank="<rank>"
KEEP_ALIVE_S = 60.0  # rank 0 sends "wait" after this long without a command: well inside any collective's timeout


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a torchrun group of more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class DistributedPolicy(EnginePolicy):
    """One run's policy on a ``DistributedEngine``: rank 0 trains through it, the other ranks ``follow`` it."""

    def __init__(self, engine: DistributedEngine, name: str, config: LearnerConfig) -> None:
        super().__init__(engine, name, config.model_copy(update={"device": str(engine.device)}))
        self.topology: Topology = engine.topology
        self.idle_passes = 0  # forwards run only to keep sharded ranks in step (a share with fewer micro-batches)
        # rank 0: one command, with the collectives it starts, at a time (the keep-alive thread sends too)
        self._commands = threading.RLock()
        self._last_command = time.monotonic()
        self._keep_alive: tuple[threading.Thread, threading.Event] | None = None

    # ---- rank 0: the learner's calls, sent to the followers first ----------------------------
    def train_step(self, micro_batches: list[TokenBatch], normaliser: float) -> StepResult:
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        present, tensors = _batch_tensors(micro_batches)
        with self._commands:  # the followers run the step's collectives with rank 0: no "wait" in between
            self._send({"command": "step", "normaliser": normaliser, "present": present}, tensors)
            return self._train_share(micro_batches, normaliser)

    def load_state(self, adapter: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor],
                   scalars: dict[str, Any]) -> None:
        super().load_state(adapter, optimizer, scalars)
        self._sync(with_optimizer=True)

    def load_adapter_folder(self, folder: Any) -> None:
        super().load_adapter_folder(folder)
        self._sync(with_optimizer=False)

    def keep_reference(self) -> None:
        """The KL penalty's reference is the adapter as it is now, on every rank."""
        super().keep_reference()
        assert self.reference is not None
        self._send({"command": "reference", "names": list(self.reference)}, list(self.reference.values()))

    def keep_reference_folder(self, folder: Any) -> None:
        """A published adapter as every rank's reference; every rank's adapter is then rank 0's again."""
        super().keep_reference_folder(folder)  # loads the folder (sent), keeps it (sent), puts rank 0's weights back
        self._sync(with_optimizer=False)

    def release(self) -> None:
        """Rank 0 finished: the followers return from ``follow``."""
        self.stop_keep_alive()
        self._send({"command": "stop"}, [])

    def start_keep_alive(self, interval_s: float | None = None) -> None:
        """Rank 0: send "wait" from a thread whenever ``interval_s`` (``KEEP_ALIVE_S``) passed without a command."""
        if self._keep_alive is not None or not self.engine.distributed:
            return
        interval = KEEP_ALIVE_S if interval_s is None else interval_s
        stopped = threading.Event()
        thread = threading.Thread(target=self._keep_followers_waiting, args=(interval, stopped), daemon=True,
                                  name="rlpipe-rank0-keep-alive")
        self._keep_alive = thread, stopped
        thread.start()

    def stop_keep_alive(self) -> None:
        """Stop sending "wait" (before ``stop``, and before the group is left: nothing may follow them)."""
        if self._keep_alive is None:
            return
        thread, stopped = self._keep_alive
        stopped.set()
        thread.join()
        self._keep_alive = None

    def _keep_followers_waiting(self, interval_s: float, stopped: threading.Event) -> None:
        if self.device.type == "cuda":  # a thread's current GPU is GPU 0: collectives use the rank's own
            torch.cuda.set_device(self.device)
        while not stopped.wait(min(interval_s, 1.0) / 2):
            with self._commands:
                if not stopped.is_set() and time.monotonic() - self._last_command >= interval_s:
                    self._send({"command": "wait"}, [])

    def _send(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        with self._commands:
            _send_command(header, tensors)
            self._last_command = time.monotonic()

    def _sync(self, with_optimizer: bool) -> None:
        tensors = dict(self.adapter_tensors())
        header: dict[str, Any] = {"command": "sync", "adapter": list(tensors)}
        if with_optimizer:
            optimizer, scalars = self.optimizer_state()
            header.update(optimizer=list(optimizer), scalars=scalars)
            tensors.update({f"optimizer/{k}": v for k, v in optimizer.items()})
        self._send(header, list(tensors.values()))

    # ---- every rank ----------------------------------------------------------------------------
    def _train_share(self, micro_batches: list[TokenBatch], normaliser: float) -> StepResult:
        """This rank's share of the micro-batches, gradients and statistics summed over the ranks, one AdamW step."""
        start, stop = share(len(micro_batches), self.topology)
        self.engine.reshard()  # rank 0 alone may have resharded since the last step (a snapshot to publish)
        idle = self._idle_count(stop - start) if self.engine.shard else 0  # agreed before any sharded forward
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, stats = 0.0, LossStats()
        for batch in micro_batches[start:stop]:
            batch = batch.to(self.device)
            reference_BT = self.reference_logprobs(batch) if self.config.kl_coef > 0 else None
            logprobs_BT, entropy_BT = self.generated_logprobs_and_entropy(
                batch.tokens_BT, batch.loss_mask_BT, batch.temperatures_B,
                entropy="grad" if self.config.entropy_coef > 0 else "detached",
            )
            loss, batch_stats = loss_from_logprobs(self.config, logprobs_BT, batch, normaliser, entropy_BT=entropy_BT,
                                                   reference_logprobs_BT=reference_BT)
            loss.backward()
            total_loss += float(loss.detach())
            stats = stats.merge(batch_stats)
        self._idle_passes(idle)
        self.engine._all_reduce_gradients(self.params)
        loss_sum = torch.tensor([total_loss], dtype=torch.float64, device=comm_device())
        dist.all_reduce(loss_sum)
        stats = _all_reduce_stats(stats)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip))
        learning_rate = self.optimizer.param_groups[0]["lr"]
        trust = self._trust_region()
        previous = [p.detach().clone() for p in self.params] if trust is not None else []
        self.optimizer.step()
        self.scheduler.step()
        bounded = trust.bound(micro_batches, self.params, previous, self.device) if trust is not None else None
        return StepResult(float(loss_sum), grad_norm, learning_rate, stats, bounded)

    def _trust_region(self) -> TrustRegion | None:
        """``learner.max_step_kl`` on every rank: the same probe rows (every rank has every micro-batch) and the same
        forwards, each halving decided by rank 0's measure, so the ranks shrink the step alike and in step."""
        if self.config.max_step_kl is None:
            return None

        def rank_0s(kl: float) -> float:
            value = torch.tensor([kl], dtype=torch.float64, device=comm_device())
            dist.broadcast(value, src=0)
            return float(value)

        return TrustRegion(self.config.max_step_kl, self.config.trust_region_rows, self.answer_distributions,
                           agree=rank_0s)

    def _idle_count(self, passes: int) -> int:
        """How many passes this rank runs beyond its ``passes`` to run as many as the rank with the most: each pass
        of a sharded model gathers every layer from all ranks, so their passes must pair up."""
        most = torch.tensor([passes], device=comm_device())
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most) - passes

    def _idle_passes(self, count: int) -> None:
        """Passes on a two-token row that add exactly zero to the gradients, with the forwards of a real one: the
        reference's (with a KL penalty), then the policy's and its backward."""
        tokens_BT = torch.zeros((1, 2), dtype=torch.int64, device=self.device)
        mask_BT = torch.tensor([[0.0, 1.0]], device=self.device)
        for _ in range(count):
            if self.config.kl_coef > 0:
                self.reference_logprobs(TokenBatch(tokens_BT, mask_BT, torch.zeros((1, 2), device=self.device),
                                                   torch.zeros(1, device=self.device), torch.zeros(1, device=self.device)))
            logprobs_BT = self.generated_logprobs(tokens_BT, mask_BT)
            (logprobs_BT.sum() * 0.0).backward()
            self.idle_passes += 1

    # ---- ranks other than 0 ------------------------------------------------------------------
    def follow(self, on_step: Callable[[int], None] | None = None) -> int:
        """Run rank 0's commands until it stops; the number of steps taken.  ``on_step`` is called after each step
        with the idle passes it ran (``learner.shard``)."""
        steps = 0
        while True:
            header, tensors = _receive_command()
            if header["command"] == "stop":
                return steps
            if header["command"] == "wait":  # rank 0 is alive and has nothing for us yet
                continue
            if header["command"] == "step":
                torch.manual_seed(follower_seed(self.topology.rank, tensors))  # dropout masks a resume draws again
                idle_before = self.idle_passes
                self._train_share(_batches_from(header["present"], tensors), header["normaliser"])
                steps += 1
                if on_step is not None:
                    on_step(self.idle_passes - idle_before)
            elif header["command"] == "sync":
                self._receive_sync(header, tensors)
            elif header["command"] == "reference":
                self.reference = {name: tensor.to(self.device) for name, tensor in zip(header["names"], tensors,
                                                                                       strict=True)}
            else:
                raise ValueError(f"unknown command {header['command']!r} from rank 0; run the same rlpipe on every rank")

    def _receive_sync(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        adapter = dict(zip(header["adapter"], tensors, strict=False))
        if "optimizer" not in header:
            params = self.lora_parameters()
            with torch.no_grad():
                for name, value in adapter.items():
                    params[name].copy_(value.to(params[name].device))
            return
        optimizer = dict(zip(header["optimizer"], tensors[len(adapter):], strict=True))
        super().load_state(adapter, optimizer, header["scalars"])


def follower_seed(rank: int, tensors: list[torch.Tensor]) -> int:
    """The seed a following rank draws a step's random numbers from (dropout masks): a function of its rank and the
    step's tensors alone, so a group resumed from rank 0's checkpoint draws what it drew before (rank 0's own
    generators are in the checkpoint)."""
    digest = hashlib.sha256(str(rank).encode())
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


# ---- commands: a JSON header and a list of tensors, broadcast from rank 0 ----------------------
def _send_command(header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
    device = comm_device()  # the rank's GPU under nccl, the CPU under gloo
    tensors = [t.detach().to(device).contiguous() for t in tensors]
    header = {**header, "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]}
    encoded = torch.tensor(list(json.dumps(header).encode()), dtype=torch.uint8, device=device)
    dist.broadcast(torch.tensor([encoded.numel()], device=device), src=0)
    dist.broadcast(encoded, src=0)
    for tensor in tensors:
        dist.broadcast(tensor, src=0)


def _receive_command() -> tuple[dict[str, Any], list[torch.Tensor]]:
    device = comm_device()
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    encoded = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(encoded, src=0)
    header = json.loads(bytes(encoded.tolist()).decode())
    tensors = []
    for dtype, shape in header["tensors"]:
        tensor = torch.empty(shape, dtype=DTYPES[dtype], device=device)
        dist.broadcast(tensor, src=0)
        tensors.append(tensor)
    return header, tensors


def _batch_tensors(micro_batches: list[TokenBatch]) -> tuple[list[bool], list[torch.Tensor]]:
    """Which of ``BATCH_FIELDS`` each micro-batch has (flattened), and those tensors in that order."""
    present = [getattr(batch, name) is not None for batch in micro_batches for name in BATCH_FIELDS]
    values = [getattr(batch, name) for batch in micro_batches for name in BATCH_FIELDS]
    return present, [value for value in values if value is not None]


def _batches_from(present: list[bool], tensors: list[torch.Tensor]) -> list[TokenBatch]:
    """The micro-batches ``_batch_tensors`` described."""
    received = iter(tensors)
    values = [next(received) if has else None for has in present]
    count = len(BATCH_FIELDS)
    return [TokenBatch(**dict(zip(BATCH_FIELDS, values[i : i + count], strict=True)))
            for i in range(0, len(values), count)]


# ---- a following rank's health endpoints ---------------------------------------------------------------
def follower_health(port: int | None, topology: Topology) -> HealthServer:
    """A following rank's ``/healthz``, ``/readyz`` and ``/metrics`` on ``learner.health_port``, served from now on.

    Every pod of the group carries the same ``prometheus.io`` annotations, so every pod answers on that port: rank
    0 with the learner's series (``consumers.service``), the first process of any other pod (``LOCAL_RANK`` 0) with
    its rank's.  A pod's other processes (``--nproc-per-node`` > 1) share its network and keep theirs unserved.
    ``/readyz`` is 200 while the rank follows rank 0 (``follow_with_metrics``), else 503 naming ``policy``.
    """
    health = HealthServer(port if topology.local_rank == 0 else None).start()
    labels = {"rank": str(topology.rank)}
    health.add_readiness_check("policy", lambda: health.metric_value(FOLLOWER_UP, labels) == 1.0)
    return health


def follow_with_metrics(policy: DistributedPolicy, health: HealthServer, rank: int) -> int:
    """``policy.follow()``, counting the steps and idle passes of rank ``rank`` on ``health``; the steps taken."""
    labels = {"rank": str(rank)}
    health.inc_counter("rlpipe_learner_follower_steps", 0.0, "steps trained with rank 0", labels)
    health.inc_counter("rlpipe_learner_follower_idle_passes", 0.0,
                       "passes run only to keep sharded ranks in step (learner.shard)", labels)
    health.set_gauge(FOLLOWER_UP, 1.0, "1 while this rank follows rank 0's steps", labels)

    def stepped(idle_passes: int) -> None:
        health.inc_counter("rlpipe_learner_follower_steps", 1.0, labels=labels)
        health.inc_counter("rlpipe_learner_follower_idle_passes", float(idle_passes), labels=labels)

    steps = policy.follow(on_step=stepped)
    health.set_gauge(FOLLOWER_UP, 0.0, labels=labels)
    return steps


# ---- the learner process on a torchrun group ----------------------------------------------------------
def run_on_group(config: RunConfig, lead: Callable[[DistributedPolicy], T]) -> T | None:
    """Build this rank's engine and policy; rank 0 runs ``lead(policy)`` (the learner), the others follow it.

    Returns what ``lead`` returned on rank 0, None on the other ranks.
    """
    topology = init_distributed(config.learner.device)
    # before the slow engine load, so /healthz answers while it loads (rank 0's server starts in its learner)
    health = None if topology.is_main else follower_health(config.learner.health_port, topology)
    try:
        return _run_rank(config, topology, lead, health)
    finally:
        if health is not None:
            health.stop()


def _run_rank(config: RunConfig, topology: Topology, lead: Callable[[DistributedPolicy], T],
              health: HealthServer | None) -> T | None:
    if config.learner.torch_threads:
        torch.set_num_threads(config.learner.torch_threads)
    engine = DistributedEngine(resolve_base_model(config.model), topology, device=config.learner.device,
                               dtype=config.model.dtype, shard=config.learner.shard,
                               gradient_checkpointing=config.learner.gradient_checkpointing)
    policy = DistributedPolicy(engine, config.run_id, config.learner)
    log.info("rank %d of %d: %s%s", topology.rank, topology.world_size,
             "runs the learner" if topology.is_main else "follows rank 0's steps",
             f"; base weights sharded over {topology.world_size} ranks" if engine.shard else "")
    with engine.holding(config.run_id):
        if health is not None:  # a following rank
            steps = follow_with_metrics(policy, health, topology.rank)
            log.info("rank %d followed %d steps, %d idle passes, holding %.0f%% of the base weights", topology.rank,
                     steps, policy.idle_passes, 100 * engine.held_fraction())
            leave_group()
            return None
        policy.start_keep_alive()
        try:
            result = lead(policy)
        finally:
            policy.stop_keep_alive()  # (on an error the group ends: torchrun stops the followers)
        policy.release()
    leave_group()  # after the followers took the stop: none may be left receiving as rank 0 exits
    return result
