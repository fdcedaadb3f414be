"""``rlpipe replay --train`` under torchrun: rank 0 runs the learner, rank 1 follows; the adapter one process reaches.

The group is launched as ``python -m torch.distributed.run --nproc-per-node 2``
running ``rlpipe replay --train`` (gloo on the CPU) and compared with
``replay_train`` in this process on the same stored batches.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from consumers.checkpoint import CheckpointStore
from consumers.distributed import Topology
from consumers.distributed_learner import _batch_tensors, _batches_from, launched_by_torchrun
from consumers.losses import TokenBatch
from consumers.service import replay_train
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from schemas.config import RunConfig
from tests.consumers.test_distributed import free_port
from tests.consumers.test_learner import RUN, write_batches

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tiny_tokenizer):
    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say L or R."}], tokenize=True, add_generation_prompt=True, return_dict=False)
    good = tiny_tokenizer.encode("L", add_special_tokens=False)[0]
    bad = tiny_tokenizer.encode("R", add_special_tokens=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)  # the sampler's logprobs
    return {"prompt": list(prompt), "good": good, "bad": bad, "logp": logp, "model_dir": tiny_model_dir}


def run_config(model_dir: str, root: Path, run_id: str) -> dict:
    return {"run_id": run_id, "model": {"base_model": model_dir}, "store": {"root": root.as_uri()},
            "learner": {"lora_rank": 4, "lora_alpha": 8, "learning_rate": 2e-3, "batch_rows": 16,
                        "micro_batch_tokens": 64, "publish_every": 1, "checkpoint_every": 1, "max_staleness": 1000,
                        "torch_threads": 1, "device": "cpu"}}


def latest_adapter(store: ObjectStore, run_id: str, cache: Path) -> dict[str, torch.Tensor]:
    registry = AdapterRegistry(store, run_id)
    return load_file(str(registry.pull(registry.latest().version, cache) / "adapter_model.safetensors"))


def test_micro_batches_survive_the_broadcast_encoding():
    batch = TokenBatch(torch.tensor([[1, 2, 3]]), torch.tensor([[0.0, 1.0, 1.0]]), torch.zeros(1, 3),
                       torch.tensor([0.5]), torch.ones(1), temperatures_B=torch.tensor([0.7]))
    present, tensors = _batch_tensors([batch, batch])
    assert len(tensors) == 12  # six of the eight fields, twice
    again = _batches_from(present, tensors)
    assert len(again) == 2 and again[1].token_weights_BT is None
    assert torch.equal(again[0].temperatures_B, batch.temperatures_B) and torch.equal(again[1].tokens_BT,
                                                                                       batch.tokens_BT)


def test_one_process_is_not_a_torchrun_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not launched_by_torchrun() and Topology().is_main
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launched_by_torchrun()


def replay_on_two_ranks(config_file: Path) -> str:
    """``rlpipe replay --train`` of ``RUN`` on a torchrun group of 2; its log.  A failed group fails the test with
    each rank's output apart (``failed_ranks``)."""
    done = torchrun_replay(config_file)
    if done.returncode != 0:  # pytest.fail prints the whole message; an assertion's would be cut in its middle
        pytest.fail(f"torchrun exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n{failed_ranks(done.stderr)}",
                    pytrace=False)
    return done.stdout + done.stderr


def torchrun_replay(config_file: Path) -> subprocess.CompletedProcess[str]:
    cli = shlex.join([sys.executable, "-c", "from pipeline.cli.main import main; main()", "replay", "--run", RUN,
                      "--train", "--config", str(config_file)])  # one argument: torchrun would read --run itself
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "--no-python", "sh", "-c", cli]
    # PYTHONFAULTHANDLER: a rank killed by a signal (an abort) prints every thread's Python stack
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})


def failed_ranks(stderr: str, chars: int = 8000) -> str:
    """The end of each rank's stderr apart: a follower's traceback (when rank 0 died first) would push rank 0's
    out of one tail.  Unprefixed lines (an abort's, faulthandler's) go with rank 0's until torchrun's own report."""
    lines: dict[str, list[str]] = {}
    source = "[rank0]"
    for line in stderr.splitlines():
        if line.startswith("Extension modules:"):  # faulthandler's list of loaded modules, after the stacks
            continue
        if "elastic/multiprocessing/api.py" in line:
            source = "torchrun"
        prefixed = line.startswith("[rank") and "]:" in line[:12]
        lines.setdefault(line.split(":", 1)[0] if prefixed else source, []).append(line)
    return "\n".join(f"--- stderr of {name}\n" + "\n".join(kept)[-(chars if name != "torchrun" else 1500):]
                     for name, kept in sorted(lines.items()))


def test_two_ranks_replay_train_to_the_adapter_of_one_process_and_resume_alike(setup, tmp_path):
    """3 steps, then 2 more batches and a resumed run (rank 0's checkpoint reaches rank 1): the same as one process."""
    store = ObjectStore(tmp_path.as_uri())
    rng = np.random.default_rng(21)
    write_batches(TrajectoryArchive(store), setup, STEPS, rng)
    config_file = tmp_path / "two.yaml"
    config_file.write_text(json.dumps(run_config(setup["model_dir"], tmp_path, "two")))
    one = RunConfig.model_validate(run_config(setup["model_dir"], tmp_path, "one"))

    assert "rank 1 followed 3 steps" in replay_on_two_ranks(config_file)
    assert replay_train(one, RUN).state.step == STEPS
    write_batches(TrajectoryArchive(store), setup, 2, rng, first=STEPS)
    assert "rank 1 followed 2 steps" in replay_on_two_ranks(config_file)
    assert replay_train(one, RUN).state.step == STEPS + 2

    single = latest_adapter(store, "one", tmp_path / "cache-one")
    group = latest_adapter(store, "two", tmp_path / "cache-two")
    assert AdapterRegistry(store, "two").versions() == list(range(1, STEPS + 3))  # published once each, by rank 0
    assert CheckpointStore(store, "two").latest().state.step == STEPS + 2
    assert single.keys() == group.keys()
    assert max(float(single[k].abs().max()) for k in single if "lora_B" in k) > 1e-3  # training moved the adapter
    difference = max(float((single[k] - group[k]).abs().max()) for k in single)
    print(f"largest difference from one process: {difference:.2e}")
    assert difference <= TOLERANCE


def test_two_ranks_with_dropout_stopped_and_resumed_end_with_the_weights_of_a_group_that_was_not(setup, tmp_path):
    """LoRA dropout draws masks on every rank: rank 0 from the RNG its checkpoint restores, rank 1 from a seed of its
    rank and the step (``follower_seed``).  A group stopped after 3 steps and resumed for 2 more ends bit for bit
    where a group that trained the 5 steps at once does."""
    store = ObjectStore(tmp_path.as_uri())
    rng = np.random.default_rng(29)
    write_batches(TrajectoryArchive(store), setup, STEPS, rng)
    files = {}
    for name in ("cut", "whole"):
        config = run_config(setup["model_dir"], tmp_path, name)
        config["learner"]["lora_dropout"] = 0.3
        files[name] = tmp_path / f"{name}.yaml"
        files[name].write_text(json.dumps(config))

    assert "rank 1 followed 3 steps" in replay_on_two_ranks(files["cut"])
    write_batches(TrajectoryArchive(store), setup, 2, rng, first=STEPS)
    assert "rank 1 followed 2 steps" in replay_on_two_ranks(files["cut"])  # resumed from the checkpoint of step 3
    assert "rank 1 followed 5 steps" in replay_on_two_ranks(files["whole"])

    cut = latest_adapter(store, "cut", tmp_path / "cache-cut")
    whole = latest_adapter(store, "whole", tmp_path / "cache-whole")
    assert CheckpointStore(store, "cut").latest().state.step == CheckpointStore(store, "whole").latest().state.step == 5
    assert max(float(whole[k].abs().max()) for k in whole if "lora_B" in k) > 1e-3  # training moved the adapter
    assert all(torch.equal(cut[k], whole[k]) for k in whole), max(float((cut[k] - whole[k]).abs().max()) for k in whole)


def test_two_sharded_ranks_with_a_kl_penalty_to_a_warm_start_train_as_one_process_across_a_resume(setup, tmp_path):
    """``learner.kl_coef`` under torchrun: rank 0's warm start is every rank's KL reference, after a resume too.

    ``learner.shard``: FSDP2 holds half the base weights on each rank; a rank with one micro-batch fewer runs an
    idle pass (the reference's forward too) so both gather the same layers."""
    store = ObjectStore(tmp_path.as_uri())
    rng = np.random.default_rng(23)
    write_batches(TrajectoryArchive(store), setup, 2, rng)
    assert replay_train(RunConfig.model_validate(run_config(setup["model_dir"], tmp_path, "start")), RUN).state.step == 2
    configs = {name: run_config(setup["model_dir"], tmp_path, name) for name in ("group", "one", "no-kl")}
    for name, config in configs.items():
        config["learner"].update(init_from="start", kl_coef=0.0 if name == "no-kl" else 0.5, micro_batch_tokens=96)
    configs["group"]["learner"]["shard"] = True
    config_file = tmp_path / "group.yaml"
    config_file.write_text(json.dumps(configs["group"]))

    first = " ".join(replay_on_two_ranks(config_file).split())  # the log's lines wrap at the terminal's width
    assert "sharded over 2 ranks" in first
    idle = re.search(r"rank 1 followed 2 steps, (\d+) idle passes, holding (\d+)% of the base weights", first)
    assert idle is not None and int(idle.group(1)) > 0, first[-2000:]  # an uneven share was kept in step
    assert 40 <= int(idle.group(2)) <= 60  # half of each sharded layer; the tied embedding stays whole
    write_batches(TrajectoryArchive(store), setup, 1, rng, first=2)
    assert "rank 1 followed 1 steps" in replay_on_two_ranks(config_file)  # resumed: the reference re-read from v1
    for name in ("one", "no-kl"):
        assert replay_train(RunConfig.model_validate(configs[name]), RUN).state.step == 3

    adapters = {name: latest_adapter(store, name, tmp_path / f"cache-{name}") for name in ("group", "one", "no-kl")}
    def gap(a: str, b: str) -> float:
        return max(float((adapters[a][k] - adapters[b][k]).abs().max()) for k in adapters[a])
    print(f"KL group against one process: {gap('group', 'one'):.2e}; against no KL: {gap('group', 'no-kl'):.2e}")
    assert gap("group", "one") <= TOLERANCE
    assert gap("group", "no-kl") > 100 * TOLERANCE  # the penalty changed the steps


def test_two_sharded_ranks_bound_each_step_by_its_kl_as_one_process_does(setup, tmp_path):
    """``learner.max_step_kl`` under torchrun: every rank measures the step on the same rows and shrinks it by rank 0's
    measure, so the adapter is one process's; a tight bound shrinks the steps."""
    store = ObjectStore(tmp_path.as_uri())
    write_batches(TrajectoryArchive(store), setup, 2, np.random.default_rng(24))
    configs = {name: run_config(setup["model_dir"], tmp_path, name) for name in ("group", "one", "unbounded")}
    for name, config in configs.items():
        config["learner"].update(micro_batch_tokens=96, learning_rate=2e-2)
        if name != "unbounded":
            config["learner"].update(max_step_kl=1e-4, trust_region_rows=8)
    configs["group"]["learner"]["shard"] = True
    config_file = tmp_path / "group.yaml"
    config_file.write_text(json.dumps(configs["group"]))

    assert "rank 1 followed 2 steps" in replay_on_two_ranks(config_file)
    for name in ("one", "unbounded"):
        assert replay_train(RunConfig.model_validate(configs[name]), RUN).state.step == 2
    scales = [m.metrics.get("step_scale") for m in AdapterRegistry(store, "group").list()]
    assert scales and all(scale is not None and scale < 1.0 for scale in scales), scales  # the bound shrank each step

    adapters = {name: latest_adapter(store, name, tmp_path / f"cache-{name}") for name in configs}
    def gap(a: str, b: str) -> float:
        return max(float((adapters[a][k] - adapters[b][k]).abs().max()) for k in adapters[a])
    print(f"bounded group against one process: {gap('group', 'one'):.2e}; against unbounded: "
          f"{gap('group', 'unbounded'):.2e}")
    assert gap("group", "one") <= TOLERANCE
    assert gap("group", "unbounded") > 100 * TOLERANCE


def test_learner_start_under_torchrun_refuses_packed_runs(monkeypatch):
    from typer.testing import CliRunner

    from consumers.cli import app

    monkeypatch.setenv("WORLD_SIZE", "2")
    result = CliRunner().invoke(app, ["--preset", "cartpole", "--run", "a", "--run", "b"])
    assert result.exit_code != 0 and "one torchrun learner per run" in result.output


@pytest.mark.parametrize("kl", [False, True])
def test_sharded_ranks_train_a_step_whose_rows_share_a_long_prompt_on_one_rank_only_as_one_process(
        tiny_model_dir, tmp_path, kl):
    """Rank 0's rows share a 40-token prompt, rank 1's none.  One process runs such a prompt through the body once
    and the rest of the rows after it; sharded ranks gather every layer for each pass of the body, so they must run
    as many passes, and a sharded model runs the prompt with the rows (before, the group hung)."""
    from consumers.logprobs import MIN_SHARED_PREFIX
    from consumers.policy import LoraPolicy
    from tests.consumers.distributed_policy_worker import learner_config, policy_batches

    assert MIN_SHARED_PREFIX <= 40
    worker = Path(__file__).with_name("distributed_policy_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(worker), "--model", tiny_model_dir, "--out", str(tmp_path), "--prefix", "40",
               *(["--kl"] if kl else [])]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    group = load_file(str(tmp_path / "adapter.safetensors"))
    alone = LoraPolicy(tiny_model_dir, learner_config(kl))
    alone.train_step(policy_batches(40), normaliser=3.0)
    single = alone.adapter_tensors()
    assert max(float((group[k] - single[k]).abs().max()) for k in single) < TOLERANCE


def test_a_following_rank_seeds_each_step_from_its_rank_and_the_steps_tensors_alone():
    """What a follower draws in a step (dropout masks) must not depend on what it drew before a restart."""
    from consumers.distributed_learner import follower_seed

    step = [torch.tensor([[1, 2, 3]]), torch.tensor([0.5, -1.0])]
    seed = follower_seed(1, step)
    assert seed == follower_seed(1, [t.clone() for t in step]) and 0 <= seed < 2**63
    assert seed != follower_seed(2, step)  # each rank its own masks
    assert seed != follower_seed(1, [torch.tensor([[1, 2, 4]]), step[1]])  # each step its own


def test_followers_outlast_a_rank_0_idle_for_longer_than_a_collective_may_wait(tiny_model_dir, tmp_path):
    """Rank 0's learner may wait for rows for hours while the other ranks wait in a broadcast for its next command;
    a collective gives up after the group's timeout (30 minutes under gloo, 10 under nccl), and a follower that gave
    up ended the whole group.  Here the timeout is 6 s and rank 0 idles 15 s before its step: the group must still
    train that step on both ranks alike."""
    worker = Path(__file__).with_name("distributed_idle_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(worker), "--model", tiny_model_dir, "--out", str(tmp_path),
               "--timeout-s", "6", "--idle-s", "15", "--keep-alive-s", "0.5"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [report["steps"] for report in reports] == [1, 1]
    assert reports[0]["adapter"] == reports[1]["adapter"]


def scrape(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_following_rank_serves_its_rank_labelled_metrics_on_the_learners_health_port():
    """Every pod of the learner group is scraped (prometheus.io annotations on the Job's pods), so a following rank
    answers on learner.health_port too: /readyz once it follows rank 0, /metrics with its steps labelled by rank."""
    from consumers.distributed_learner import follow_with_metrics, follower_health

    seen: dict[str, tuple[int, str]] = {}

    class TwoSteps:  # a follower's policy: two steps of rank 0, the second with one idle pass
        def follow(self, on_step):
            on_step(0)
            on_step(1)
            seen.update(readyz=scrape(health.port, "/readyz"), metrics=scrape(health.port, "/metrics"))
            return 2

    health = follower_health(0, Topology(rank=1, world_size=2, local_rank=0))
    try:
        assert health.running
        status, body = scrape(health.port, "/readyz")
        assert status == 503 and "policy" in body  # the base model still loading
        assert follow_with_metrics(TwoSteps(), health, rank=1) == 2
        assert seen["readyz"][0] == 200
        status, body = seen["metrics"]
        assert status == 200
        assert 'rlpipe_learner_follower_up{rank="1"} 1.0' in body
        assert 'rlpipe_learner_follower_steps_total{rank="1"} 2.0' in body
        assert 'rlpipe_learner_follower_idle_passes_total{rank="1"} 1.0' in body
        assert scrape(health.port, "/readyz")[0] == 503  # rank 0 stopped the group
        assert 'rlpipe_learner_follower_up{rank="1"} 0.0' in scrape(health.port, "/metrics")[1]
    finally:
        health.stop()


def test_only_the_first_process_of_a_pod_listens_on_its_health_port():
    """``--nproc-per-node N`` puts N ranks in one pod, on one network: the pod's local rank 0 serves its port."""
    from consumers.distributed_learner import follower_health

    second = follower_health(0, Topology(rank=3, world_size=4, local_rank=1))
    assert not second.running and second.port is None
    assert not follower_health(None, Topology(rank=1, world_size=2, local_rank=0)).running  # no port configured


def test_follow_reports_each_step_with_the_idle_passes_it_ran(monkeypatch):
    """``DistributedPolicy.follow`` calls ``on_step`` once per step of rank 0 (not per keep-alive or sync)."""
    import consumers.distributed_learner as module

    batch = TokenBatch(torch.tensor([[1, 2, 3]]), torch.tensor([[0.0, 1.0, 1.0]]), torch.zeros(1, 3),
                       torch.tensor([0.5]), torch.ones(1))
    present, tensors = _batch_tensors([batch])
    step = ({"command": "step", "normaliser": 1.0, "present": present}, tensors)
    commands = iter([step, ({"command": "wait"}, []), step, ({"command": "stop"}, [])])
    monkeypatch.setattr(module, "_receive_command", lambda: next(commands))
    policy = object.__new__(module.DistributedPolicy)  # no engine: the steps' training is the stub below
    policy.topology, policy.idle_passes = Topology(rank=1, world_size=2, local_rank=1), 0

    def train_share(micro_batches, normaliser):
        policy.idle_passes += 2

    monkeypatch.setattr(policy, "_train_share", train_share)
    seen: list[int] = []
    assert policy.follow(on_step=seen.append) == 2
    assert seen == [2, 2]
