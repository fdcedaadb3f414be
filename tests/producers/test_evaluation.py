"""evaluate_version with a scripted sampler: held-out episodes, and nothing left in the adapter cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from transformers import AutoTokenizer

from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from producers.evaluation import evaluate_version
from schemas.config import RunConfig
from tests.producers.test_rollout import ScriptedSampler


def _store_with_version_1(tmp_path: Path, monkeypatch) -> ObjectStore:
    """A store whose run ``ev`` has published one (all-zero) adapter, v1."""
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    store = ObjectStore((tmp_path / "store").as_uri())
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    save_file({"lora_A": np.zeros((2, 4), dtype=np.float32)}, str(adapter / "adapter_model.safetensors"))
    AdapterRegistry(store, "ev").publish(adapter, base_model="tiny", parent_version=0, learner_step=1)
    return store


def test_evaluating_a_version_leaves_no_cache_folder(tmp_path: Path, tiny_model_dir: str, monkeypatch) -> None:
    store = _store_with_version_1(tmp_path, monkeypatch)
    config = RunConfig(run_id="ev", env={"name": "cartpole", "overrides": {"max_turns": 2, "max_actions_total": 2}})
    sampler = ScriptedSampler(AutoTokenizer.from_pretrained(tiny_model_dir))
    result = evaluate_version(config, store, tiny_model_dir, version=1, episodes=2, sampler=sampler)
    assert result.version == 1 and result.episodes == 2 and sampler.calls
    cache = tmp_path / "home" / "adapter-cache"
    assert not cache.exists() or not any(cache.iterdir())


def test_all_held_out_episodes_are_played_at_once_unless_bounded(tmp_path: Path, tiny_model_dir: str,
                                                                 monkeypatch) -> None:
    """One generate call per turn for every episode in flight: 32 episodes are one batch of 32, not four of 8."""
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    store = ObjectStore((tmp_path / "store").as_uri())
    config = RunConfig(run_id="ev", env={"name": "cartpole", "overrides": {"max_turns": 1, "max_actions_total": 1}},
                       producer={"concurrent_groups": 1})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    every = ScriptedSampler(tokenizer)
    result = evaluate_version(config, store, tiny_model_dir, version=0, episodes=32, sampler=every)
    assert result.episodes == 32 and max(size for size, _ in every.calls) == 32
    bounded = ScriptedSampler(tokenizer)
    evaluate_version(config, store, tiny_model_dir, version=0, episodes=32, sampler=bounded, in_flight=8)
    assert max(size for size, _ in bounded.calls) == 8 and sum(size for size, _ in bounded.calls) == 32


class _StrictIds(ScriptedSampler):
    """Refuses a second adapter under a loaded id, as the vLLM sampler does."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.loaded: dict[int, object] = {}

    def load_adapter(self, handle):
        if self.loaded.get(handle.lora_int_id, handle) != handle:
            raise ValueError(f"lora_int_id {handle.lora_int_id} already serves another adapter")
        self.loaded[handle.lora_int_id] = handle

    def unload_adapter(self, handle):
        self.loaded.pop(handle.lora_int_id, None)


def test_one_version_evaluated_twice_on_one_sampler(tmp_path: Path, tiny_model_dir: str, monkeypatch) -> None:
    """``rlpipe eval --version latest --version 13`` with 13 the latest: each pass pulls its own copy."""
    store = _store_with_version_1(tmp_path, monkeypatch)
    config = RunConfig(run_id="ev", env={"name": "cartpole", "overrides": {"max_turns": 1, "max_actions_total": 1}})
    sampler = _StrictIds(AutoTokenizer.from_pretrained(tiny_model_dir))
    first = evaluate_version(config, store, tiny_model_dir, version=1, episodes=2, sampler=sampler)
    second = evaluate_version(config, store, tiny_model_dir, version=1, episodes=2, sampler=sampler)
    assert first.version == second.version == 1 and not sampler.loaded  # unloaded after each pass
