"""The training engine on a torchrun group (gloo on the CPU): the same adapter as one process, sharded or not.

Each test launches ``tests/consumers/distributed_worker.py`` under
``python -m torch.distributed.run`` and compares what rank 0 wrote with the
plain ``TrainingEngine`` trained in this process on the same batches.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from consumers.distributed import DistributedEngine, Topology, load_checkpoint, save_checkpoint, share
from consumers.engine import TrainingEngine
from consumers.engine_data import EngineError
from tests.consumers.distributed_worker import ADAM, LORA, OTHER_LORA, make_batches

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("distributed_worker.py")
STEPS = 5
TOLERANCE = 1e-5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int, model: str, out: Path, *args: str, restarts: int = 0, env: dict[str, str] | None = None,
             check_reports: bool = True) -> dict[int, dict]:
    """Run the worker on ``nproc`` ranks; each rank's report (``rank<r>.json``) by rank."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), "--max-restarts", str(restarts),
               str(WORKER), "--model", model, "--out", str(out), *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)} if check_reports else {}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def train_in_one_process(model: str, dtype: str = "auto", lora: dict | None = None, per_batch: int = 6
                         ) -> dict[str, torch.Tensor]:
    """The adapter after the worker's batches, trained by the ordinary engine in one process."""
    engine = TrainingEngine(model, device="cpu", dtype=dtype)
    engine.create_adapter("policy", **(lora or LORA))
    initial = engine.weights("policy")
    for batch in make_batches(STEPS, per_batch, vocab=engine.input_vocab - 24):
        engine.forward_backward("policy", batch.datums, batch.loss, batch.loss_args)
        engine.optim_step("policy", ADAM)
    weights = engine.weights("policy")
    assert max_difference(weights, initial) > 1e-3  # training moved the adapter, so equality says something
    return weights


@pytest.fixture(scope="module")
def one_process(tiny_model_dir) -> dict[str, torch.Tensor]:
    return train_in_one_process(tiny_model_dir)


def test_share_gives_every_rank_a_contiguous_part_and_covers_all():
    parts = [share(7, Topology(rank, 3)) for rank in range(3)]
    assert parts == [(0, 3), (3, 5), (5, 7)]
    assert share(1, Topology(1, 2)) == (1, 1)  # a rank may get nothing


def test_checkpoint_round_trip_restores_weights_and_optimizer(tiny_model_dir, tmp_path):
    """DCP save then load into a fresh engine: the next step is the same as the saved engine's."""
    engines = [DistributedEngine(tiny_model_dir, Topology(), device="cpu") for _ in range(2)]
    batches = make_batches(2, vocab=engines[0].input_vocab - 24)
    engines[0].create_adapter("policy", **LORA)
    engines[0].forward_backward("policy", batches[0].datums, batches[0].loss, batches[0].loss_args)
    engines[0].optim_step("policy", ADAM)
    save_checkpoint(engines[0], "policy", tmp_path / "step-1", {"batch_ids": ["batch-000"]})
    assert sorted(p.suffix for p in (tmp_path / "step-1").iterdir()) == [".json", ".safetensors"]
    assert load_checkpoint(engines[1], "policy", tmp_path / "step-1") == {"batch_ids": ["batch-000"]}
    for engine in engines:
        engine.forward_backward("policy", batches[1].datums, batches[1].loss, batches[1].loss_args)
        engine.optim_step("policy", ADAM)
    assert max_difference(engines[0].weights("policy"), engines[1].weights("policy")) == 0.0
    damaged = next((tmp_path / "step-1").glob("*.safetensors"))
    blob = bytearray(damaged.read_bytes())
    blob[-5] ^= 0x40  # one bit of a tensor's data: safetensors itself would load it
    damaged.write_bytes(bytes(blob))
    with pytest.raises(EngineError, match=f"checkpoint file .*{damaged.name} is damaged"):
        load_checkpoint(DistributedEngine(tiny_model_dir, Topology(), device="cpu"), "policy", tmp_path / "step-1")


def test_two_ranks_end_with_the_adapter_of_one_process(tiny_model_dir, one_process, tmp_path):
    """Only rank 0 has the batches (as only it reads the event log); rank 1 receives them."""
    reports = torchrun(2, tiny_model_dir, tmp_path, "--broadcast")
    assert max_difference(load_file(str(tmp_path / "adapter.safetensors")), one_process) < TOLERANCE
    assert reports[0]["base_bytes"] == reports[1]["base_bytes"]  # replicated base weights


@pytest.mark.parametrize("per_batch, max_batch_tokens", [(1, 32768), (3, 12)])
def test_ranks_with_uneven_shares_leave_the_adapter_of_one_process(tiny_model_dir, tmp_path, per_batch,
                                                                   max_batch_tokens):
    """Sharded ranks with uneven shares: one row a step (rank 1 has none) or three rows in micro-batches of at
    most 12 tokens (rank 0 runs more passes than rank 1).  Idle passes keep the ranks' gathers paired, and the
    summed gradients are one process's on all the rows, divided by the step's normaliser, not a rank's share."""
    reports = torchrun(2, tiny_model_dir, tmp_path, "--shard", "--per-batch", str(per_batch), "--max-batch-tokens",
                       str(max_batch_tokens))
    assert reports[0]["state_sha256"] == reports[1]["state_sha256"]  # weights, AdamW state, RNG: alike on every rank
    single = train_in_one_process(tiny_model_dir, per_batch=per_batch)
    assert max_difference(load_file(str(tmp_path / "adapter.safetensors")), single) < TOLERANCE


def test_an_optim_step_without_gradients_on_any_rank_leaves_the_adapter_as_one_process_does(
        tiny_model_dir, one_process, tmp_path):
    """One process's AdamW skips a step on no gradients; the ranks must too, not step on zeros (Adam's momentum
    would move every weight)."""
    torchrun(2, tiny_model_dir, tmp_path, "--empty-steps", "2")
    assert max_difference(load_file(str(tmp_path / "adapter.safetensors")), one_process) < TOLERANCE


def test_a_broadcast_batch_reaches_every_rank_with_every_per_token_input(tiny_model_dir, tmp_path):
    """gspo's sequence_ratio_mask included: without it the other ranks refuse the batch and rank 0 waits alone."""
    out = tmp_path / "broadcast"
    torchrun(2, tiny_model_dir, out, "--only-broadcast", check_reports=False)
    sent, received = (json.loads((out / f"datums{rank}.json").read_text()) for rank in (0, 1))
    assert received == sent and received["sequence_ratio_mask"] == [0.0, 1.0, 1.0]


def test_bf16_base_weights_shard_in_bf16_and_train_float32_lora_like_one_bf16_process(tiny_model_dir, tmp_path):
    reports = torchrun(2, tiny_model_dir, tmp_path, "--shard", "--dtype", "bfloat16")
    adapter = load_file(str(tmp_path / "adapter.safetensors"))
    assert {t.dtype for t in adapter.values()} == {torch.float32}
    assert max_difference(adapter, train_in_one_process(tiny_model_dir, "bfloat16")) < TOLERANCE
    base = TrainingEngine(tiny_model_dir, device="cpu").base
    total, embedding = sum(p.numel() for p in base.parameters()), base.get_input_embeddings().weight.numel()
    bf16_share = ((total - embedding) / 2 + embedding) * 2  # half of the sharded values, all of the tied embedding
    assert bf16_share <= reports[0]["base_bytes"] < bf16_share + 64 * 1024  # plus padding


@pytest.mark.slow  # two group starts: 40-70 s on 2 shared cores
def test_sharded_group_with_a_killed_rank_restarts_from_the_last_checkpoint_and_trains_each_batch_once(
    tiny_model_dir, one_process, tmp_path
):
    """FSDP2-sharded float32 base weights with gradient checkpointing; each rank holds about half of them.

    Rank 1 is SIGKILLed after step 3 (index 2), one step after the last checkpoint (every 2 steps).
    A second adapter, created after the base weights were sharded (on a layer not yet wrapped by
    LoRA), then trains on the same batches like one process too.
    """
    reports = torchrun(2, tiny_model_dir, tmp_path, "--shard", "--gradient-checkpointing", "--every", "2",
                       "--die-after", "2", "--second-adapter", restarts=1)
    logged = (tmp_path / "batches.log").read_text().split()
    assert logged == [f"batch-{step:03d}" for step in range(STEPS)]  # each once, in order
    assert max_difference(load_file(str(tmp_path / "adapter.safetensors")), one_process) < TOLERANCE
    other = train_in_one_process(tiny_model_dir, lora=OTHER_LORA)
    assert max_difference(load_file(str(tmp_path / "other.safetensors")), other) < TOLERANCE
    base = TrainingEngine(tiny_model_dir, device="cpu").base
    total, embedding = sum(p.numel() for p in base.parameters()), base.get_input_embeddings().weight.numel()
    float32_share = ((total - embedding) / 2 + embedding) * 4  # the tied embedding stays whole
    for report in reports.values():
        assert float32_share <= report["base_bytes"] < float32_share + 64 * 1024  # plus padding


def test_two_ranks_with_lora_dropout_killed_and_restarted_end_bitwise_where_an_uninterrupted_group_does(
        tiny_model_dir, tmp_path):
    """LoRA dropout draws masks on every rank; the checkpoint holds one RNG state for the group.  Rank 1 is
    SIGKILLed after step 3 and the group resumes from that step's checkpoint: the adapter must be the one a
    group that was never interrupted trains, bit for bit."""
    args = ("--dropout", "0.3", "--every", "1")
    whole_reports = torchrun(2, tiny_model_dir, tmp_path / "whole", *args)
    cut_reports = torchrun(2, tiny_model_dir, tmp_path / "cut", *args, "--die-after", "2", restarts=1)
    states = {report["state_sha256"] for reports in (whole_reports, cut_reports) for report in reports.values()}
    assert len(states) == 1  # weights, AdamW state and RNG alike on every rank, restarted or not
    assert (tmp_path / "cut" / "batches.log").read_text().split() == [f"batch-{step:03d}" for step in range(STEPS)]
    whole, cut = (load_file(str(tmp_path / name / "adapter.safetensors")) for name in ("whole", "cut"))
    assert max(float(whole[k].abs().max()) for k in whole if "lora_B" in k) > 1e-3  # training moved the adapter
    assert all(torch.equal(cut[k], whole[k]) for k in whole), max_difference(cut, whole)


def test_a_rank_whose_listing_misses_the_newest_checkpoint_resumes_from_rank_0s(tiny_model_dir, one_process,
                                                                                tmp_path):
    """Rank 0 alone picks the checkpoint a group resumes from: a rank that listed the shared folder on its own
    could see an older one (a cached listing) and train batches the others skip, pairing their collectives
    with those of other steps."""
    torchrun(2, tiny_model_dir, tmp_path, "--steps", "3")
    reports = torchrun(2, tiny_model_dir, tmp_path, "--stale-listing")  # rank 1 lists no checkpoint
    ids = [f"batch-{step:03d}" for step in range(STEPS)]
    assert reports[0]["trained"] == reports[1]["trained"] == ids
    assert (tmp_path / "batches.log").read_text().split() == ids
    assert max_difference(load_file(str(tmp_path / "adapter.safetensors")), one_process) < TOLERANCE


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory) -> str:
    """A Qwen2-shaped model of 12 layers x 512 (about 40 M parameters, 160 MB in float32), random weights."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
                         max_position_embeddings=512)
    folder = tmp_path_factory.mktemp("wider") / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow  # a 40 M-parameter model on 1 and on 2 ranks: 60-100 s on 2 shared cores
def test_peak_memory_per_rank_with_two_sharded_ranks_is_below_one_rank(wider_model, tmp_path):
    """Peak resident memory while training (after loading), glibc returning freed tensors to the system at once."""
    malloc = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    args = ("--steps", "2", "--per-batch", "4", "--length", "64")
    one = torchrun(1, wider_model, tmp_path / "one", *args, env=malloc)[0]
    two = torchrun(2, wider_model, tmp_path / "two", "--shard", *args, env=malloc)
    mib = 2**20
    print(f"peak resident memory per rank: 1 rank {one['peak_rss'] / mib:.0f} MiB; "
          f"2 sharded ranks {two[0]['peak_rss'] / mib:.0f} and {two[1]['peak_rss'] / mib:.0f} MiB "
          f"(base weights held {one['base_bytes'] / mib:.0f} vs {two[0]['base_bytes'] / mib:.0f} MiB)")
    assert max(report["peak_rss"] for report in two.values()) < one["peak_rss"]


def test_the_latest_checkpoint_is_a_committed_step_never_one_being_written(tmp_path: Path) -> None:
    from consumers.distributed import CHECKPOINT_META, latest_checkpoint

    for name in ("step-00000002", "step-00000010", "step-00000011.partial"):  # killed while renaming step 11
        (tmp_path / name).mkdir()
        (tmp_path / name / CHECKPOINT_META).write_text("{}")
    (tmp_path / "step-00000012").mkdir()  # never committed
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000010"


def test_collectives_use_the_ranks_gpu_under_nccl_and_the_cpu_otherwise(monkeypatch) -> None:
    """nccl refuses CPU tensors: every command, statistic and batch a group sends lives on comm_device()."""
    import torch.distributed as dist

    from consumers.distributed import comm_device

    assert comm_device() == torch.device("cpu")  # no group here
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert comm_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm_device() == torch.device("cuda", 3)


def test_ranks_draw_their_own_dropout_masks_and_leave_the_groups_rng_alike() -> None:
    """Two ranks of a group, from the group's one RNG state: different numbers inside ``_rank_stream`` (each rank's
    rows get their own dropout masks), the same state after it (the one state a checkpoint keeps is every rank's)."""
    inside, after = [], []
    with torch.random.fork_rng(devices=[]):
        for rank in (0, 1, 1):
            torch.manual_seed(1234)
            with DistributedEngine._rank_stream(SimpleNamespace(topology=Topology(rank, 2))):
                inside.append(torch.rand(8))
            after.append(torch.random.get_rng_state())
    assert not torch.equal(inside[0], inside[1])
    assert torch.equal(inside[1], inside[2])  # a rank's stream follows from the group's state: a restart redraws it
    assert torch.equal(after[0], after[1]) and torch.equal(after[1], after[2])


def test_a_step_of_the_distributed_engine_cannot_be_undone(tiny_model_dir) -> None:
    """Its gradients are summed over the ranks before the undo point would be taken: a restored step would sum them
    again.  A group resumes from its checkpoint instead."""
    engine = DistributedEngine(tiny_model_dir, Topology(), device="cpu")
    engine.create_adapter("policy", **LORA)
    with pytest.raises(EngineError, match="cannot be undone"):
        engine.optim_step("policy", ADAM, undo=True)


def test_every_rank_resumes_from_rank_0s_checkpoint_folder_as_rank_0_names_it(tmp_path, monkeypatch) -> None:
    """Two ranks played in turn in one process: rank 0 lists the folder and broadcasts its pick, rank 1 receives it.
    A folder without zero padding (``step-12``) is a committed checkpoint too; a rank that does not see rank 0's pick
    (checkpoints in a folder of its own) refuses to start."""
    import torch.distributed as dist

    from consumers.distributed import CHECKPOINT_META, _rank_0s_checkpoint

    shared, private = tmp_path / "shared", tmp_path / "private"
    (shared / "step-12").mkdir(parents=True)
    (shared / "step-12" / CHECKPOINT_META).write_text("{}")
    private.mkdir()
    sent: list[torch.Tensor] = []

    def resume_point(rank: int, root: Path) -> Path | None:
        received = iter(list(sent))

        def broadcast(tensor: torch.Tensor, src: int = 0) -> None:
            sent.append(tensor.clone()) if rank == 0 else tensor.copy_(next(received))

        monkeypatch.setattr(dist, "broadcast", broadcast)
        return _rank_0s_checkpoint(SimpleNamespace(topology=Topology(rank, 2), distributed=True), root)

    assert resume_point(0, shared) == shared / "step-12"
    assert resume_point(1, shared) == shared / "step-12"
    with pytest.raises(EngineError, match=r"rank 1 does not see .*step-12, rank 0's newest checkpoint; put the"):
        resume_point(1, private)
