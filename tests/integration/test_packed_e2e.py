"""Packed learner acceptance against the real parts: the Tansu broker, ``rlpipe learner start``, a file:// store.

Two runs on two different environments (different prompts, answers and
learner settings) are trained packed in one learner process, each from its own
announced batches (one optimizer step per batch).  Their offline replays,
each run trained alone (``replay_train``, what ``rlpipe replay --train`` runs),
are the reference.

1. Packed through the event log (``run_packed_learner``, what ``rlpipe learner
   start -c a -c b`` runs): each run reaches its ``max_steps`` with its own
   versions 1..N, and every version equals its alone-trained version (1e-6).
2. Crash check: the packed ``rlpipe learner start`` subprocess is SIGKILLed at
   each of the learner's fault points with both runs packed, then restarted
   until both finish; every batch of every run was trained in exactly one step,
   and each run's last version equals its alone-trained one.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from consumers.service import replay_train
from consumers.sources import learner_group_id
from pipeline.config import resolve_config
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.bus import GROUP_TIMINGS_ENV, group_lag
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from schemas.config import BusConfig
from schemas.trajectory import NO_ADAPTER_SHA
from tests.integration.test_deployment import free_port, http_get
from tests.integration.test_learner_e2e import (
    FIRST_DAY,
    GROUP_TIMINGS,
    LEARNER,
    World,
    adapter_tensors,
    final_state,
    one_torch_thread,
    output_of,
    rlpipe,
    step_log,
    wait_for,
)

pytestmark = pytest.mark.integration

N_BATCHES = 6
ROWS_PER_BATCH = 4
# run -> (environment, prompt, rewarded answer, other answer, learner settings of its own)
ENVS: dict[str, tuple[str, str, str, str, dict[str, Any]]] = {
    "a": ("left-right", "Say L or R.", "L", "R", {"seed": 0}),
    "b": ("yes-no", "Answer yes or no: is the sky blue?", "yes", "no",
          {"seed": 5, "learning_rate": 1e-2, "lr_schedule": "cosine", "kl_coef": 0.05}),
}
KILL_PLAN = ("after_publish:2", "before_checkpoint:3", "after_checkpoint:2")
START_TIMEOUT_S = 300.0  # a restart waits for both runs' consumer groups to drop the killed members


def rows_for(run: str, batch_id: str, prompt: list[int], answers: tuple[int, int], logp: torch.Tensor) -> list[dict]:
    good, bad = answers
    return [dict(
        run_id=f"src-{run}", batch_id=batch_id, episode_id=f"{batch_id}-{group}-{token}",
        group_id=f"{batch_id}-g{group}", env=ENVS[run][0], env_seed=group, producer_id="p", policy_version=0,
        adapter_sha256=NO_ADAPTER_SHA, tokens=prompt + [token], loss_mask=[0] * len(prompt) + [1],
        logprobs=[0.0] * len(prompt) + [float(logp[token])], turn_rewards=[float(token == good)],
        reward=float(token == good), num_turns=1, success=token == good, terminated=True, truncated=False,
        created_at=FIRST_DAY,
    ) for group in range(2) for token in (good, bad)]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str, tiny_tokenizer: Any) -> World:
    """``src-a`` and ``src-b``: N batches each, of their own environment."""
    root = tmp_path_factory.mktemp("packed-e2e")
    store = ObjectStore((root / "store").as_uri())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    archive = TrajectoryArchive(store)
    for run, (_, question, good, bad, _) in ENVS.items():
        prompt = list(tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True, return_dict=False))
        answers = tuple(tiny_tokenizer.encode(text, add_special_tokens=False)[0] for text in (good, bad))
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        for index in range(N_BATCHES):
            batch_id = f"{run}{index:03d}"
            archive.write_batch(f"src-{run}", rows_for(run, batch_id, prompt, answers, logp), batch_id=batch_id,
                                created=FIRST_DAY)
    return World(root, store.url(""), tiny_model_dir, ())


def config_of(world: World, run: str, run_id: str, bus: BusConfig | None = None) -> Path:
    config: dict[str, Any] = {
        "run_id": run_id, "model": {"base_model": world.model_dir}, "store": {"root": world.store_url},
        "learner": {**LEARNER, "max_steps": N_BATCHES, **ENVS[run][4]},
    }
    if bus is not None:
        config["bus"] = {"bootstrap_servers": bus.bootstrap_servers, "namespace": bus.namespace,
                         "connect_timeout_s": bus.connect_timeout_s}
    path = world.root / f"{run_id}.json"
    path.write_text(json.dumps(config))
    return path


def announce(world: World, run: str, config: Path) -> None:
    """``rlpipe replay --run src-<run> --to-topic`` for the run of ``config``."""
    from click.testing import CliRunner

    from consumers.cli import replay_command

    result = CliRunner().invoke(replay_command, ["--run", f"src-{run}", "--to-topic", "--config", str(config)],
                                env={"RLPIPE_HOME": str(world.root / "home")})
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def alone(world: World) -> dict[str, dict[int, dict[str, torch.Tensor]]]:
    """Each run trained alone offline on its batches: the adapter of every version."""
    adapters = {}
    for run in ENVS:
        with one_torch_thread():
            replay_train(resolve_config(config_file=config_of(world, run, f"{run}-alone")), f"src-{run}")
        registry = AdapterRegistry(world.store, f"{run}-alone")
        assert registry.versions() == list(range(1, N_BATCHES + 1))
        adapters[run] = {v: adapter_tensors(world.store, f"{run}-alone", v, world.root / "cache")
                         for v in registry.versions()}
    return adapters


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_each_batch_trained_once(world: World, run: str, run_id: str) -> None:
    state = final_state(world.store, run_id)
    steps = step_log(world.store, run_id, state)
    assert state.step == N_BATCHES
    assert [m["step"] for m in steps] == list(range(1, N_BATCHES + 1))
    trained = sorted(batch_id for m in steps for batch_id in m["batch_ids"])
    assert trained == [f"{run}{index:03d}" for index in range(N_BATCHES)], trained  # all, none twice
    assert all(m["rows"] == ROWS_PER_BATCH for m in steps)


def test_two_packed_runs_each_reach_the_weights_they_reach_alone(
    world: World, alone: dict, bus_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from consumers.packed_service import run_packed_learner

    configs = {run: config_of(world, run, f"{run}-packed", bus_config) for run in ENVS}
    for run, config in configs.items():
        announce(world, run, config)
    monkeypatch.setenv(GROUP_TIMINGS_ENV, json.dumps(GROUP_TIMINGS))
    order: list[str] = []
    with one_torch_thread():
        run_packed_learner([resolve_config(config_file=c) for c in configs.values()],
                           on_step=lambda run_id, metrics: order.append(run_id))
    assert sorted(order) == sorted([f"{run}-packed" for run in ENVS] * N_BATCHES)
    assert order[:N_BATCHES] != [order[0]] * N_BATCHES  # both runs trained from the start, in turns
    for index, run in enumerate(ENVS):
        assert_each_batch_trained_once(world, run, f"{run}-packed")
        registry = AdapterRegistry(world.store, f"{run}-packed")
        assert registry.versions() == list(range(1, N_BATCHES + 1))
        for version in registry.versions():
            packed = adapter_tensors(world.store, f"{run}-packed", version, world.root / "cache")
            assert max_difference(packed, alone[run][version]) <= 1e-6, f"{run} v{version}"
        # the runs share the topic (a's batches, then b's): each commits just past its own last batch
        (lag,) = group_lag(bus_config, learner_group_id(f"{run}-packed"))
        assert lag.committed == N_BATCHES * (index + 1)
    assert max_difference(alone["a"][N_BATCHES], alone["b"][N_BATCHES]) > 0  # two different runs


@dataclass
class Attempt:
    plan: str
    returncode: int


def test_a_packed_learner_killed_at_each_fault_point_trains_every_batch_of_every_run_once(
    world: World, alone: dict, bus_config: BusConfig
) -> None:
    configs = {run: config_of(world, run, f"{run}-crash", bus_config) for run in ENVS}
    for run, config in configs.items():
        announce(world, run, config)
    args = ["learner", "start", *(arg for c in configs.values() for arg in ("--config", str(c)))]
    attempts = []
    for index, plan in enumerate(KILL_PLAN):
        proc = rlpipe(world, args, f"packed-crash-{index}.log", fault=plan)
        attempts.append(Attempt(plan, wait_for(proc, START_TIMEOUT_S)))
    assert all(a.returncode == -signal.SIGKILL for a in attempts), (attempts, output_of(proc))
    last = rlpipe(world, args, "packed-crash-final.log")
    assert wait_for(last, START_TIMEOUT_S) == 0, output_of(last)
    for run in ENVS:
        run_id = f"{run}-crash"
        assert_each_batch_trained_once(world, run, run_id)
        registry = AdapterRegistry(world.store, run_id)
        versions = registry.versions()
        assert versions == list(range(1, len(versions) + 1))  # dense, a step may be published twice
        assert {registry.show(v).learner_step for v in versions} == set(range(1, N_BATCHES + 1))
        for version in versions:
            step = registry.show(version).learner_step
            crashed = adapter_tensors(world.store, run_id, version, world.root / "cache")
            assert max_difference(crashed, alone[run][step]) <= 1e-6, f"{run_id} v{version} (step {step})"


# ---- 3. one packed producer and one packed learner, two environments -------------------------------------------
PIPELINE_ENVS = {"cartpole": {"history_turns": 0, "max_turns": 3, "max_actions_total": 3, "max_env_steps": 3},
                 "acrobot": {"history_turns": 0, "max_turns": 2, "max_actions_total": 2, "max_env_steps": 2}}
PIPELINE_STEPS = 3


def pipeline_config(world: World, model_dir: str, env: str, bus: BusConfig) -> Path:
    run_id = f"{env}-pipe"
    config = {
        "run_id": run_id, "model": {"base_model": model_dir}, "store": {"root": world.store_url},
        "env": {"name": env, "overrides": PIPELINE_ENVS[env]},
        "bus": {"bootstrap_servers": bus.bootstrap_servers, "namespace": bus.namespace,
                "connect_timeout_s": bus.connect_timeout_s},
        "sampler": {"backend": "transformers", "max_new_tokens": 8},
        "producer": {"group_size": 2, "groups_per_batch": 1, "concurrent_groups": 2, "batch_timeout_s": 5,
                     "heartbeat_interval_s": 1.0, "max_staleness": 2},
        "learner": {**LEARNER, "batch_rows": 4, "max_steps": PIPELINE_STEPS, "max_staleness": 2,
                    "advantage": "return_to_go"},
    }
    path = world.root / f"{run_id}.json"
    path.write_text(json.dumps(config))
    return path


def test_one_packed_producer_and_one_packed_learner_serve_two_environments(
    world: World, bus_config: BusConfig, tiny_trained_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from consumers.packed_service import run_packed_learner

    configs = [pipeline_config(world, str(tiny_trained_dir), env, bus_config) for env in PIPELINE_ENVS]
    producer = rlpipe(world, ["producer", "start", *(a for c in configs for a in ("--config", str(c)))],
                      "packed-producer.log")
    monkeypatch.setenv(GROUP_TIMINGS_ENV, json.dumps(GROUP_TIMINGS))
    port = free_port()
    scraped_loss: dict[str, list[tuple[float, float | None]]] = {}  # run -> (its step's loss, /metrics' loss{run})

    def scrape_step(run_id: str, metrics: dict) -> None:  # each step's loss is on /metrics, labelled with its run
        families = text_string_to_metric_families(http_get(port, "/metrics")[1])
        served = {tuple(s.labels.items()): s.value for f in families for s in f.samples if s.name == "rlpipe_learner_loss"}
        scraped_loss.setdefault(run_id, []).append((metrics["loss"], served.get((("run", run_id),))))

    try:
        with one_torch_thread():
            run_packed_learner([resolve_config(config_file=c, overrides=[f"learner.health_port={port}"])
                                for c in configs], on_step=scrape_step)
    finally:
        producer.send_signal(signal.SIGTERM)
    assert wait_for(producer) == 0, output_of(producer)
    assert set(scraped_loss) == {f"{env}-pipe" for env in PIPELINE_ENVS}
    for run_id, losses in scraped_loss.items():
        assert all(loss == served for loss, served in losses), (run_id, losses)
    archive = TrajectoryArchive(world.store)
    for env in PIPELINE_ENVS:
        run_id = f"{env}-pipe"
        rows = archive.scan(run_id=run_id).collect()
        assert rows.height > 0 and set(rows["env"].to_list()) == {env}  # each run its own batches, its own env
        registry = AdapterRegistry(world.store, run_id)
        assert registry.versions() == list(range(1, PIPELINE_STEPS + 1))
        # the same run trained alone on the same batches (offline replay of its store) reaches the same weights
        alone = resolve_config(config_file=pipeline_config(world, str(tiny_trained_dir), env, bus_config),
                               overrides=[f"run_id={run_id}-alone"])
        with one_torch_thread():
            replay_train(alone, run_id)
        for version in registry.versions():
            packed = adapter_tensors(world.store, run_id, version, world.root / "cache")
            replayed = adapter_tensors(world.store, f"{run_id}-alone", version, world.root / "cache")
            assert max_difference(packed, replayed) <= 1e-6, f"{run_id} v{version}"
