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


class _Recording(ScriptedSampler):
    """Answers like ScriptedSampler and keeps every prompt's text."""

    def __init__(self, tokenizer, answer: str) -> None:
        super().__init__(tokenizer, answer)
        self.prompts: list[str] = []

    def generate(self, requests, adapter=None, temperature=1.0, top_p=1.0, seed=None):
        self.prompts += [self.tokenizer.decode(r.prompt_token_ids) for r in requests]
        return super().generate(requests, adapter, temperature, top_p, seed)


def _questions(split: str) -> set[str]:
    from producers.envs.text2sql import TextToSQL

    return {task.question for task in TextToSQL(split=split).tasks}


def test_held_out_text2sql_episodes_ask_only_test_questions(tmp_path: Path, tiny_model_dir: str, monkeypatch) -> None:
    """A run trains on the train split; its held-out seeds index the same task list, so evaluation must play the test
    split (otherwise seeds from eval_seed_offset replay training tasks)."""
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    store = ObjectStore((tmp_path / "store").as_uri())
    config = RunConfig(run_id="ev", env={"name": "text2sql"})
    sampler = _Recording(AutoTokenizer.from_pretrained(tiny_model_dir), "<answer>SELECT 1</answer>")
    train, test = _questions("train"), _questions("test")
    result = evaluate_version(config, store, tiny_model_dir, version=0, episodes=len(test), sampler=sampler)
    asked = {q for q in train | test if any(f"Question: {q}" in p for p in sampler.prompts)}
    assert result.episodes == len(test) and asked == test  # every test question once, no training question


def test_held_out_baselines_play_the_test_split_too(monkeypatch) -> None:
    import producers.envs.evaluate as env_evaluate
    from producers.envs.registry import make_env
    from producers.evaluation import baseline_result

    seen: list[dict] = []
    real = env_evaluate.evaluate

    def spy(name, policy, episodes, seed_start=0, overrides=None):
        seen.append(dict(overrides or {}))
        return real(name, policy, episodes, seed_start, overrides)

    monkeypatch.setattr(env_evaluate, "evaluate", spy)
    baseline_result(RunConfig(run_id="ev", env={"name": "text2sql"}), "heuristic", 3)
    played = {task.question for task in make_env("text2sql", seen[0]).tasks}
    assert played == _questions("test")


class RetriedCreateStore(ObjectStore):
    """A gs:// create whose answer was lost: the client retries it, and the retry reports ``FileExistsError`` for
    the object the first attempt wrote."""

    def put_create(self, key: str, data: bytes) -> str:
        super().put_create(key, data)
        raise FileExistsError(f"{self.url(key)} already exists")


def test_a_retried_create_of_a_result_that_landed_is_stored_not_failed(tmp_path: Path) -> None:
    from producers.evaluation import save_result
    from producers.offline.evaluation import store_eval_result
    from schemas.evaluation import EvalResult, eval_from_bytes

    store = RetriedCreateStore((tmp_path / "store").as_uri())
    for save, version in ((save_result, 1), (store_eval_result, 2)):
        result = EvalResult.from_episodes(run_id="ev", env="cartpole", version=version, seed_start=1000,
                                          returns=[1.0, 2.0], successes=[True, False])
        assert eval_from_bytes(store.get(save(store, result))) == result


class _SpoilsSecondEpisode(ScriptedSampler):
    """The second episode of the first call gets a NaN logprob: the worker drops its group (seed offset + 1)."""

    def generate(self, requests, adapter=None, temperature=1.0, top_p=1.0, seed=None):
        outputs = super().generate(requests, adapter, temperature, top_p, seed)
        if len(self.calls) == 1 and len(outputs) > 1:
            outputs[1].logprobs[0] = float("nan")
        return outputs


def test_a_held_out_seed_that_wrote_no_episode_is_refused_not_shifted(tmp_path: Path, tiny_model_dir: str,
                                                                     monkeypatch) -> None:
    """Episode i of a result is seed seed_start + i: with seed offset + 1 dropped, the returns of the seeds after it
    would be stored under the wrong seeds (and paired comparisons would pair different episodes)."""
    import pytest

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    store = ObjectStore((tmp_path / "store").as_uri())
    config = RunConfig(run_id="ev", env={"name": "cartpole", "overrides": {"max_turns": 1, "max_actions_total": 1}})
    sampler = _SpoilsSecondEpisode(AutoTokenizer.from_pretrained(tiny_model_dir))
    first = config.env.eval_seed_offset
    with pytest.raises(ValueError, match=rf"2 of 3 held-out episodes.*seed {first + 1}\b"):
        evaluate_version(config, store, tiny_model_dir, version=0, episodes=3, sampler=sampler)


def _stored(seed_start: int, episodes: int, env: str = "cartpole"):
    from schemas.evaluation import EvalResult

    return EvalResult.from_episodes(run_id="ev", env=env, version=1, seed_start=seed_start,
                                    returns=[1.0] * episodes, successes=[True] * episodes)


def test_the_held_out_reach_counts_a_result_that_starts_before_the_first_seed() -> None:
    """Seeds 98..103 run 4 seeds into the held-out ones from 100: 100..103 were played, so the reach is 4; a result
    of another environment counts for nothing."""
    from producers.evaluation import held_out_played, held_out_ranges

    results = [_stored(98, 6), _stored(100, 10, env="sokoban")]
    assert held_out_ranges(results, "cartpole", 100) == [(100, 103)]
    assert held_out_played(results, "cartpole", 100) == 4
    assert held_out_played([_stored(90, 10)], "cartpole", 100) == 0  # 90..99: all before the first seed


def test_the_held_out_ranges_are_the_seeds_played_with_their_gaps() -> None:
    """100..103, 102..105 and 110..111 (a result stored with a raised offset): two ranges, 100..105 and 110..111,
    and the reach is one past the last seed played, 112 - 100 = 12."""
    from producers.evaluation import held_out_played, held_out_ranges

    results = [_stored(110, 2), _stored(100, 4), _stored(102, 4)]
    assert held_out_ranges(results, "cartpole", 100) == [(100, 105), (110, 111)]
    assert held_out_played(results, "cartpole", 100) == 12


def test_the_validation_skip_covers_each_stored_start_plus_the_validation_count() -> None:
    """Stored 100..103 and 110..111 (a raised offset), validation of 5: the held-out evaluations that started at
    100 and 110 play 100..104 and 110..114 with 5 episodes, so 115 - 100 = 15 seeds are left alone; with 1 episode the seeds
    played decide (112 - 100 = 12); with nothing stored the validation's own 5 from the first seed."""
    from producers.evaluation import validation_reach

    results = [_stored(110, 2), _stored(100, 4), _stored(90, 5), _stored(100, 3, env="sokoban")]
    assert validation_reach(results, "cartpole", 100, 5) == 15
    assert validation_reach(results, "cartpole", 100, 1) == 12
    assert validation_reach([], "cartpole", 100, 5) == 5
    assert validation_reach([_stored(98, 1)], "cartpole", 100, 5) == 5  # 98..102 at 5 episodes: within 100..104


def test_the_validated_ranges_are_those_a_held_out_evaluation_would_reach() -> None:
    """Validations on 104..105 and 108..111 (and sokoban's 100..109): 8 held-out episodes from 100 (100..107) reach
    104..105 only; 10 reach 108..109 too, cut at the last seed they play; 4 reach none."""
    from producers.evaluation import validated_ranges
    from schemas.evaluation import ValidationPlayed

    played = [ValidationPlayed(run_id="ev", env=env, seed_start=start, episodes=n)
              for env, start, n in (("cartpole", 108, 4), ("cartpole", 104, 2), ("sokoban", 100, 10))]
    assert validated_ranges(played, "cartpole", 100, 8) == [(104, 105)]
    assert validated_ranges(played, "cartpole", 100, 10) == [(104, 105), (108, 109)]
    assert validated_ranges(played, "cartpole", 100, 4) == []


def test_an_unreadable_records_refusal_words_its_fix_from_the_error() -> None:
    """A record a newer rlpipe wrote is to be read after an upgrade, never deleted; a damaged one is to be deleted
    from where the refusal says."""
    from producers.evaluation import unreadable_refusal
    from schemas.versions import NewerSchemaError

    newer = NewerSchemaError("runs/r/eval/validations/x.json has schema version 2.0, newer than this rlpipe reads "
                             "(1.1); upgrade rlpipe")
    damaged = ValueError("runs/r/eval/validations/y.json unreadable: not JSON")
    upgrade = unreadable_refusal(newer, "the seeds it played", "episodes might replay them", "gs://b")
    delete = unreadable_refusal(damaged, "the seeds it played", "episodes might replay them", "gs://b")
    assert upgrade.startswith("runs/r/eval/validations/x.json") and "upgrade rlpipe to read the seeds" in upgrade
    assert "delete" not in upgrade, upgrade
    assert delete == ("runs/r/eval/validations/y.json unreadable: not JSON: the seeds it played are unknown, so "
                      "episodes might replay them; delete it from gs://b")
