"""The async producer-overhead bench's own parts, on the transformers engine (no vLLM needed)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.producer_overhead_async import run_loop_tasks
from producers.samplers.hf_engine import TransformersEngine
from producers.samplers.sync import SyncSampler
from schemas.config import SamplerConfig


@pytest.fixture(scope="module")
def engine(tiny_trained_dir: Path) -> Iterator[SyncSampler]:
    sampler = SyncSampler(lambda: TransformersEngine(str(tiny_trained_dir), SamplerConfig(max_model_len=1024)))
    yield sampler
    sampler.close()


def test_episodes_as_loop_tasks_play_every_group_and_record_every_turn(engine, tiny_trained_dir):
    from transformers import AutoTokenizer

    args = argparse.Namespace(
        env="sokoban", groups=3, group_size=2, concurrent_groups=2, groups_per_batch=2, env_workers=1,
        max_new_tokens=8, max_model_len=1024, step_delay_s=0.0,
        tokenizer=AutoTokenizer.from_pretrained(tiny_trained_dir),
    )
    measurement, turns = run_loop_tasks(engine, args, seed_start=5)
    episodes = {t.episode_id for t in turns}
    assert len({t.group_id for t in turns}) == 3 and len(episodes) == 6  # every episode of every group took turns
    assert measurement.requests == len(turns) and measurement.generated_tokens == sum(t.generated_tokens for t in turns)
    assert all(0 < t.generated_tokens <= 8 and t.token_ids for t in turns)
    assert len({t.seed for t in turns}) == len(turns)  # a fresh stream every turn, as the worker draws them
    assert measurement.seconds > 0 and measurement.cpu_s > 0
