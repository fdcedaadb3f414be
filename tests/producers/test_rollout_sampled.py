"""The rollout worker on the real transformers sampler: multi-turn rows hold exactly what the sampler drew.

Checked against an independent teacher-forced forward pass (``Reference``): every
token the loss mask marks carries the logprob, at the row's temperature, of the
adapter version the row names, while two versions serve overlapping groups; the
tokens the mask leaves out (prompt, observations, chat-template tokens between
turns) carry none.  Turns stop on the stop token (kept and trained) or are cut
by ``max_new_tokens`` (no stop token; the template closes the turn, masked 0).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from producers.envs.registry import make_env
from producers.rollout import FixedAdapter, RolloutWorker
from producers.samplers.base import AdapterHandle
from producers.samplers.hf_sampler import TransformersSampler
from schemas.config import ProducerConfig, SamplerConfig
from schemas.trajectory import TrajectoryRecord
from tests.producers.samplers.reference import LOGPROB_TOL, Reference

TEMPERATURE = 0.8


class SwitchingAdapters:
    """Version 1 for the first group admitted, version 2 (published meanwhile) for every later one."""

    def __init__(self, first: AdapterHandle, second: AdapterHandle) -> None:
        self.handles, self.admitted = (first, second), 0

    def current(self) -> AdapterHandle:
        self.admitted += 1
        return self.handles[min(self.admitted, 2) - 1]

    def newest_published(self) -> int:
        return 2

    def refresh(self) -> None:
        pass


class ListSink:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def commit(self, rows: list[dict], batch_id: str) -> None:
        self.rows += rows


def masked_runs(row: TrajectoryRecord) -> list[list[int]]:
    """The stretches of tokens the loss mask marks, in order: one per turn."""
    runs: list[list[int]] = []
    for i, (token, mask) in enumerate(zip(row.tokens, row.loss_mask, strict=True)):
        if mask and (i == 0 or not row.loss_mask[i - 1]):
            runs.append([])
        if mask:
            runs[-1].append(token)
    return runs


def test_multi_turn_rows_hold_the_sampled_tokens_and_their_logprobs_per_adapter_version(
        tiny_trained_dir: Path, lora_adapters: tuple[AdapterHandle, ...]) -> None:
    lora_adapters = tuple(dataclasses.replace(h, sha256=f"{h.version}" * 64) for h in lora_adapters)  # as rows hold
    sampler = TransformersSampler(str(tiny_trained_dir), SamplerConfig(max_model_len=1024))
    sink = ListSink()
    worker = RolloutWorker(
        run_id="run1", producer_id="prod-1", env_name="sokoban",
        make_env=lambda: make_env("sokoban", {"max_turns": 3}), tokenizer=sampler_tokenizer(tiny_trained_dir),
        sampler=sampler, adapters=SwitchingAdapters(*lora_adapters), sink=sink,
        producer=ProducerConfig(producer_id="prod-1", group_size=2, groups_per_batch=2, concurrent_groups=2,
                                max_groups=2, max_staleness=2),
        sampling=SamplerConfig(max_new_tokens=8, temperature=TEMPERATURE, max_model_len=1024), incarnation=0,
    )
    worker.run()
    rows = [TrajectoryRecord.model_validate(r) for r in sink.rows]
    assert sorted(r.policy_version for r in rows) == [1, 1, 2, 2]  # both groups were out at once, one per version
    reference, handles = Reference(tiny_trained_dir), {h.version: h for h in lora_adapters}
    eos = sampler.eos_token_id
    stopped = cut = 0
    for row in rows:
        adapter = handles[row.policy_version]
        assert row.adapter_sha256 == adapter.sha256 and row.temperature == TEMPERATURE
        runs = masked_runs(row)
        assert len(runs) == row.num_turns == len(row.turn_rewards)
        stopped += sum(run[-1] == eos for run in runs)
        cut += sum(run[-1] != eos and len(run) == 8 for run in runs)
        expected = reference.logprobs(adapter, row.tokens[:1], row.tokens[1:], TEMPERATURE)
        for i, mask in enumerate(row.loss_mask):
            if mask:
                assert row.logprobs[i] == pytest.approx(expected[i - 1], abs=LOGPROB_TOL), (row.turn, i)
            else:
                assert row.logprobs[i] == 0.0
    assert stopped and cut  # both endings of a turn were exercised


def sampler_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def base_chatml_model(model_dir: Path, folder: Path) -> Path:
    """The tiny model as a ChatML base model (Qwen2.5 base): eos ``<|endoftext|>`` in the tokenizer, the model's
    config and its generation config, while the template still closes turns with ``<|im_end|>``."""
    import json
    import shutil

    model = shutil.copytree(model_dir, folder)
    endoftext = sampler_tokenizer(model).convert_tokens_to_ids("<|endoftext|>")
    for name, key, value in (("tokenizer_config.json", "eos_token", "<|endoftext|>"),
                             ("config.json", "eos_token_id", endoftext),
                             ("generation_config.json", "eos_token_id", endoftext)):
        settings = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps({**settings, key: value}))
    return model


def test_a_base_models_turns_stop_at_the_templates_closing_token(tiny_trained_dir: Path, tmp_path: Path) -> None:
    """Each turn ends at ``<|im_end|>`` (kept once, trained) rather than running on into a user turn of the
    model's own until its eos or ``max_new_tokens``."""
    model = base_chatml_model(tiny_trained_dir, tmp_path / "base")
    sampler = TransformersSampler(str(model), SamplerConfig(max_model_len=1024))
    tokenizer = sampler_tokenizer(model)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert sampler.eos_token_id != im_end and im_end not in sampler.stop_token_ids
    sink = ListSink()
    worker = RolloutWorker(
        run_id="run1", producer_id="prod-1", env_name="sokoban",
        make_env=lambda: make_env("sokoban", {"max_turns": 3}), tokenizer=tokenizer, sampler=sampler,
        adapters=FixedAdapter(), sink=sink,
        producer=ProducerConfig(producer_id="prod-1", group_size=2, groups_per_batch=1, max_groups=1),
        sampling=SamplerConfig(max_new_tokens=24, temperature=TEMPERATURE, max_model_len=1024), incarnation=0,
    )
    worker.run()
    rows = [TrajectoryRecord.model_validate(r) for r in sink.rows]
    stopped = 0
    for row in rows:
        for run in masked_runs(row):
            assert im_end not in run[:-1], tokenizer.decode(run)  # no turn runs past its closing token
            stopped += run[-1] == im_end
        assert not any(a == b == im_end for a, b in zip(row.tokens, row.tokens[1:], strict=False))  # closed once
    assert stopped
