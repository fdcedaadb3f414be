"""Fixtures the sampler tests share (the tiny model, adapters and the vLLM engine are in tests/fixtures/vllm.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from producers.samplers import AdapterHandle
from producers.samplers.hf_sampler import TransformersSampler
from schemas.config import SamplerConfig
from tests.producers.samplers.reference import Reference


@pytest.fixture(scope="module")
def reference(tiny_trained_dir: Path) -> Reference:
    return Reference(tiny_trained_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_trained_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_trained_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    """Chat prompts of three CartPole states (what the producer would send)."""
    from producers.envs.registry import make_env

    env = make_env("cartpole")
    out = []
    for seed in range(3):
        messages = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": env.reset(seed)}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


@pytest.fixture(scope="module")
def hf_sampler(tiny_trained_dir: Path) -> TransformersSampler:
    return TransformersSampler(str(tiny_trained_dir), SamplerConfig(max_model_len=1024))


@pytest.fixture(scope="module")
def learner_policy(tiny_trained_dir: Path, lora_adapters: tuple[AdapterHandle, ...]) -> Any:
    """The learner's policy holding adapter v1 (the same LoRA shape as the fixture adapters)."""
    from consumers.policy import LoraPolicy
    from schemas.config import LearnerConfig

    policy = LoraPolicy(str(tiny_trained_dir), LearnerConfig(device="cpu", lora_rank=8, lora_alpha=16.0))
    policy.load_adapter_folder(lora_adapters[0].path)
    return policy
