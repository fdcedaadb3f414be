"""Run configuration invariants: training seeds never reach the held-out evaluation seeds,
and every producer of a run plays its own seeds, derived from its id."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, resolve_config
from pipeline.devstack.launcher import producer_args
from schemas.config import PRODUCER_SLOTS, RunConfig


def assert_disjoint_training_ranges(config: RunConfig, producer_ids: list[str]) -> None:
    seen: set[int] = set()
    for producer_id in producer_ids:
        seeds = config.training_seeds(producer_id)
        assert len(seeds) >= 1000, producer_id
        assert config.producer.seed_start <= seeds.start and seeds.stop <= config.env.eval_seed_offset, producer_id
        assert not seen & set(seeds), f"{producer_id} shares seeds with another producer"
        seen |= set(seeds)


@pytest.mark.parametrize("overrides", [
    ["producer.seed_start=1000000"],                     # training starts at the evaluation seeds
    ["producer.seed_start=2000000"],                     # ... or above them
    ["env.eval_seed_offset=100"],                        # no room for a range per producer below them
])
def test_training_seeds_that_reach_the_evaluation_seeds_are_refused_in_one_line(overrides):
    with pytest.raises(ConfigError) as info:
        resolve_config(overrides=overrides)
    message = str(info.value)
    assert "env.eval_seed_offset" in message and "producer.seed_start" in message and "\n" not in message


def test_launched_producers_get_disjoint_ranges_below_the_evaluation_seeds():
    config = RunConfig(num_producers=PRODUCER_SLOTS)
    ids = []
    for index in range(config.num_producers):
        args = producer_args(config, "run.json", index)
        assert not any(a.startswith("producer.seed_start=") for a in args)  # nothing set by hand
        (producer_id,) = [a.split("=", 1)[1] for a in args if a.startswith("producer.producer_id=")]
        ids.append(producer_id)
    assert_disjoint_training_ranges(config, ids)


def test_statefulset_replicas_get_disjoint_ranges_and_other_ids_a_stable_one():
    config = RunConfig(producer={"seed_start": 5000}, env={"eval_seed_offset": 3_000_000})
    assert_disjoint_training_ranges(config, [f"rlpipe-producer-{i}" for i in range(16)])
    # No ordinal in the id (a hand-picked name, host-pid): a stable slot from a hash of the id.
    for producer_id in ["my-producer", "gpu-host-123456", "rlpipe-producer-7d9f8b6c5-x2k4q"]:
        seeds = config.training_seeds(producer_id)
        assert seeds == config.training_seeds(producer_id)
        assert seeds.start >= 5000 and seeds.stop <= 3_000_000


def test_a_sampling_temperature_vllm_would_not_use_is_refused():
    """vLLM samples at 0.01 below it, while rows would record the configured temperature and the learner divide by it."""
    with pytest.raises(ValueError, match=r"use 0 \(greedy\) or at least 0\.01"):
        RunConfig.model_validate({"run_id": "r", "sampler": {"temperature": 0.005}})
    greedy = {"run_id": "r", "sampler": {"temperature": 0.0}, "learner": {"loss": "cross_entropy"}}
    assert RunConfig.model_validate(greedy).sampler.temperature == 0.0


def test_seeds_that_an_environment_row_or_torch_cannot_hold_are_refused():
    """env.eval_seed_offset (and so the training seeds below it) and learner.seed took any integer: a seed past
    int64 failed only when a producer wrote its first batch (the env_seed column) or the learner seeded torch."""
    RunConfig.model_validate({"env": {"eval_seed_offset": 2**62}, "learner": {"seed": 2**63 - 1}})
    with pytest.raises(ValueError, match="eval_seed_offset"):
        RunConfig.model_validate({"env": {"eval_seed_offset": 2**63}})
    with pytest.raises(ValueError, match=r"learner\.seed"):
        RunConfig.model_validate({"learner": {"seed": 2**64}})


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1", "mps", "xpu:0"])
def test_a_learner_device_torch_knows_is_accepted(device):
    assert RunConfig.model_validate({"learner": {"device": device}}).learner.device == device


@pytest.mark.parametrize("device", ["cuda0", "gpu", "CUDA", "cuda:", "cuda:x", ""])
def test_a_learner_device_torch_cannot_open_is_refused_up_front(device):
    """Any text was accepted, and the learner failed in torch.device() only after the run had started."""
    with pytest.raises(ValueError, match=r"learner\.device"):
        RunConfig.model_validate({"learner": {"device": device}})


@pytest.mark.parametrize("modules", [[], [""]])
def test_lora_without_target_modules_is_refused_up_front(modules):
    """An empty learner.target_modules was accepted and peft refused it only when the learner built its adapter."""
    with pytest.raises(ValueError, match=r"learner\.target_modules"):
        RunConfig.model_validate({"learner": {"target_modules": modules}})


@pytest.mark.parametrize("advantage", ["group", "raw"])
def test_a_discount_the_advantage_never_reads_is_refused(advantage):
    """group and raw advantages read the episode's undiscounted reward: a discount below 1 would change nothing."""
    from schemas.config import LearnerConfig

    with pytest.raises(ValueError, match=r"learner\.discount") as info:
        LearnerConfig(advantage=advantage, discount=0.9)
    assert "learner.advantage=return_to_go" in str(info.value)
    for kind in ("return_to_go", "gae"):
        assert LearnerConfig(advantage=kind, discount=0.9).discount == 0.9
    assert LearnerConfig(advantage=advantage, discount=1.0).discount == 1.0


def test_the_transformers_batch_cap_is_a_sampler_setting_bounded_in_one_line():
    """``sampler.max_batch_sequences``: None (the transformers sampler's decode batch) unless set; 0 is refused."""
    assert RunConfig().sampler.max_batch_sequences is None
    assert resolve_config(overrides=["sampler.max_batch_sequences=32"]).sampler.max_batch_sequences == 32
    with pytest.raises(ConfigError) as info:
        resolve_config(overrides=["sampler.max_batch_sequences=0"])
    assert "sampler.max_batch_sequences" in str(info.value) and "\n" not in str(info.value)
