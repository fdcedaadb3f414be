"""learner.max_step_kl: a step that moves the policy too far is shrunk along its direction until within bound."""

from __future__ import annotations

import math

import pytest
import torch

from consumers.batching import micro_batches
from consumers.policy import LoraPolicy
from consumers.trust_region import answer_kl, probe_batches
from schemas.config import LearnerConfig


def rows(count: int, length: int = 40, answer: int = 5, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(10, 1000, (length,), generator=generator).tolist() for _ in range(count)]
    masks = [[0] * (length - answer) + [1] * answer for _ in range(count)]
    return tokens, masks


def step_batches(count: int = 12) -> list:
    tokens, masks = rows(count)
    advantages = [1.0 if i % 2 else -1.0 for i in range(count)]
    return micro_batches(tokens, masks, [[0.0] * len(t) for t in tokens], advantages, 200)


def test_the_probe_rows_are_spread_evenly_over_the_step_and_capped():
    batches = step_batches(12)
    assert len(batches) > 1  # several micro-batches, so the spread crosses their boundaries
    probes = probe_batches(batches, 4)
    picked = [row for probe in probes for row in probe.tokens_BT.tolist()]
    every = [row for batch in batches for row in batch.tokens_BT.tolist()]
    assert picked == [every[i] for i in (0, 3, 6, 9)]
    assert sum(p.num_sequences for p in probe_batches(batches, 100)) == 12  # never more rows than the step has
    assert sum(p.num_sequences for p in probe_batches(step_batches(15), 4)) == 4  # never more than asked for


def test_answer_kl_is_summed_over_an_answers_positions_and_averaged_over_answers():
    before = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1], [1.0, 1e-12]]))
    after = torch.log(torch.tensor([[0.8, 0.2], [0.9, 0.1], [1.0, 1e-12]]))
    expected = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)  # only the first position moved
    assert answer_kl(before, after, answers=2) == pytest.approx(expected / 2, rel=1e-5)
    assert answer_kl(before, before, answers=2) == pytest.approx(0.0, abs=1e-7)


def trained(tiny_model_dir: str, **settings) -> tuple[LoraPolicy, dict[str, torch.Tensor]]:
    policy = LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4, seed=3, loss="cross_entropy", **settings))
    start = {name: p.detach().clone() for name, p in policy.lora_parameters().items()}
    batches = step_batches()
    policy.trust_result = policy.train_step(batches, normaliser=12.0).trust
    return policy, start


def test_a_step_beyond_the_bound_is_shrunk_along_its_direction_into_it(tiny_model_dir):
    free, start = trained(tiny_model_dir, learning_rate=0.05, max_step_kl=50.0)  # a bound it does not reach
    full = free.trust_result
    assert full.step_scale == 1.0 and full.step_kl == full.full_step_kl
    bound = full.full_step_kl / 20
    assert full.full_step_kl > 0.01  # the unbounded step moves the answers' distributions a lot
    shrunk, start_again = trained(tiny_model_dir, learning_rate=0.05, max_step_kl=bound)
    result = shrunk.trust_result
    assert result.full_step_kl == pytest.approx(full.full_step_kl, rel=1e-4)  # the same step, measured the same
    assert result.step_kl <= bound < result.full_step_kl
    assert result.step_scale < 1.0
    free_params, shrunk_params = free.lora_parameters(), shrunk.lora_parameters()
    for name, p in shrunk_params.items():
        assert torch.equal(start[name], start_again[name])
        torch.testing.assert_close(p.detach() - start[name], result.step_scale * (free_params[name].detach() - start[name]),
                                   rtol=1e-4, atol=1e-7)  # fmt: skip


def test_a_small_step_is_kept_whole_and_off_means_no_measurement(tiny_model_dir):
    small, _ = trained(tiny_model_dir, learning_rate=1e-5, max_step_kl=0.05)
    assert small.trust_result.step_scale == 1.0 and small.trust_result.step_kl <= 0.05
    off, _ = trained(tiny_model_dir, learning_rate=1e-5)
    assert off.trust_result is None
