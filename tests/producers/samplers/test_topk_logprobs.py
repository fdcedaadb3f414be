"""Top-k logprobs of the sampling engines: the K most likely tokens at each prompt position and each sampled one.

Prompt rows are of the model's own distribution (temperature 1, as prompt logprobs), sampled rows of the
distribution each token was drawn from (as sampled-token logprobs): checked here against a float32 reference
model's full ``log_softmax``.  The vLLM test shares the session's engine (tests/fixtures/vllm.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from producers.samplers.engine import SampleParams, SampleResult
from producers.samplers.hf_engine import TransformersEngine
from producers.samplers.hf_sampler import Continuation, rows_by_request, sampling_logprobs, top_tokens
from producers.samplers.sync import SyncSampler
from schemas.config import SamplerConfig
from tests.producers.samplers.test_engine import SAME_TOL, reference_model

K = 5


@pytest.fixture(scope="module")
def engine(tiny_trained_dir: Path) -> Iterator[SyncSampler]:
    sampler = SyncSampler(lambda: TransformersEngine(str(tiny_trained_dir), SamplerConfig(max_model_len=1024)))
    yield sampler
    sampler.close()


def reference_logprobs(model_dir: Path, adapter, tokens: list[int]) -> torch.Tensor:
    """The reference model's temperature-1 logprobs after each of ``tokens`` (row p predicts token p + 1)."""
    with torch.no_grad():
        return torch.log_softmax(reference_model(model_dir, adapter)(torch.tensor([tokens])).logits[0].float(), -1)


def assert_top(row: list[tuple[int, float]], logprobs_V: torch.Tensor, k: int) -> None:
    """``row`` is the ``k`` most likely tokens of ``logprobs_V``, most likely first, with its values."""
    assert len(row) == k
    ids = [token for token, _ in row]
    values = torch.tensor([value for _, value in row])
    assert ids[0] == int(torch.argmax(logprobs_V))  # top-1 is the argmax
    assert torch.all(values[:-1] >= values[1:])  # most likely first
    assert float(torch.max(torch.abs(values - logprobs_V[ids]))) < SAME_TOL  # the full log_softmax's values
    assert float(values[-1]) >= float(torch.topk(logprobs_V, k).values[-1]) - SAME_TOL  # no likelier token left out


@pytest.mark.parametrize("adapter_index", [0, None])
def test_topk_prompt_logprobs_are_the_k_most_likely_tokens_of_the_models_own_distribution(
        engine, prompts, lora_adapters, tiny_trained_dir, adapter_index) -> None:
    adapter = None if adapter_index is None else lora_adapters[adapter_index]
    prompt = prompts[0]
    result = engine.sample(prompt, adapter, SampleParams(2, temperature=0.5, topk_prompt_logprobs=K))
    assert result.prompt_logprobs is None  # only the top-k rows were asked for
    rows = result.topk_prompt_logprobs
    assert rows is not None and len(rows) == len(prompt) and rows[0] is None  # position 0: nothing predicts it
    logprobs_TV = reference_logprobs(tiny_trained_dir, adapter, prompt)
    for p in range(1, len(prompt)):
        assert_top(rows[p], logprobs_TV[p - 1], K)  # temperature 1 whatever the call samples at
    both = engine.sample(prompt, adapter, SampleParams(2, prompt_logprobs=True, topk_prompt_logprobs=1))
    assert both.prompt_logprobs is not None and both.topk_prompt_logprobs is not None
    for p in range(1, len(prompt)):
        assert both.prompt_logprobs[p] <= both.topk_prompt_logprobs[p][0][1] + SAME_TOL
    assert all(s.topk_logprobs is None for s in result.sequences + both.sequences)  # not asked for


def test_topk_sample_logprobs_of_a_greedy_call_are_the_models_own_and_start_with_the_sampled_token(
        engine, prompts, lora_adapters, tiny_trained_dir) -> None:
    prompt = prompts[1]
    result = engine.sample(prompt, lora_adapters[0], SampleParams(6, temperature=0.0, stop_token_ids=(),
                                                                  topk_sample_logprobs=K))
    sample = result.sequences[0]
    assert result.topk_prompt_logprobs is None
    assert sample.topk_logprobs is not None and len(sample.topk_logprobs) == len(sample.token_ids) == 6
    logprobs_TV = reference_logprobs(tiny_trained_dir, lora_adapters[0], prompt + sample.token_ids)
    for i, (token, logprob, row) in enumerate(zip(sample.token_ids, sample.logprobs, sample.topk_logprobs,
                                                  strict=True)):
        assert row[0][0] == token and abs(row[0][1] - logprob) < SAME_TOL  # greedy: the sampled token is top-1
        assert_top(row, logprobs_TV[len(prompt) - 1 + i], K)


def test_topk_sample_logprobs_are_of_the_distribution_drawn_from_after_the_cuts(
        engine, prompts, lora_adapters, tiny_trained_dir) -> None:
    """Temperature 0.7 and a top-k cut of 3: a row holds the 3 tokens that could be drawn (the others have
    probability 0), with the logprobs of the cut, renormalised distribution, the sampled token among them."""
    prompt = prompts[2]
    params = SampleParams(6, num_samples=3, temperature=0.7, top_k=3, seed=11, stop_token_ids=(),
                          topk_sample_logprobs=K)
    result = engine.sample(prompt, lora_adapters[1], params)
    for sample in result.sequences:
        assert sample.topk_logprobs is not None and len(sample.topk_logprobs) == len(sample.token_ids)
        with torch.no_grad():
            logits_TV = reference_model(tiny_trained_dir, lora_adapters[1])(
                torch.tensor([prompt + sample.token_ids])).logits[0].float()
        drawn_TV = sampling_logprobs(logits_TV, 0.7, 1.0, 3)
        for i, (token, logprob, row) in enumerate(zip(sample.token_ids, sample.logprobs, sample.topk_logprobs,
                                                      strict=True)):
            assert dict(row)[token] == pytest.approx(logprob, abs=SAME_TOL)
            assert_top(row, drawn_TV[len(prompt) - 1 + i], 3)


def test_one_batch_of_different_k_and_lengths_gives_each_sample_its_own_rows(hf_sampler, prompts) -> None:
    """Rows of one batch that ask for different K (0: none) and stop at different steps: each sample's rows are
    its own steps, K columns wide, as the same call decoded alone gives them; greedy, so top-1 is the token."""
    calls = [Continuation(prompts[0], 3, [1], topk_sample=2), Continuation(prompts[1], 6, [2, 3], topk_sample=K),
             Continuation(prompts[2], 4, [4])]
    together = hf_sampler.continue_prompts(calls, None, temperature=0.0, top_p=1.0, stop_ids=frozenset())
    for call, done in zip(calls, together, strict=True):
        alone = hf_sampler.continue_prompts([call], None, temperature=0.0, top_p=1.0, stop_ids=frozenset())[0]
        for sample, single in zip(done.samples, alone.samples, strict=True):
            assert len(sample.token_ids) == call.max_new_tokens and sample.token_ids == single.token_ids
            if not call.topk_sample:
                assert sample.topk_logprobs is None
                continue
            rows = sample.topk_logprobs
            assert rows is not None and rows.k == call.topk_sample and len(rows) == call.max_new_tokens
            for token, logprob, row, row_alone in zip(sample.token_ids, sample.logprobs, rows,
                                                      single.topk_logprobs, strict=True):
                assert row[0] == (token, logprob) and len(row) == call.topk_sample
                assert [t for t, _ in row] == [t for t, _ in row_alone]
                assert max(abs(a - b) for (_, a), (_, b) in zip(row, row_alone, strict=True)) < SAME_TOL


def test_a_batchs_step_rows_become_each_requests_rows() -> None:
    """Three steps of a batch of three, 2 columns: request 0 decoded all three steps and asks for 2, request 1
    stopped after step 0 and asks for 1, request 2 asks for none."""
    step_S = [top_tokens(torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0], [0.0, 5.0, 1.0], [1.0, 1.0, 9.0]]) * s, -1),
                         2) for s in (1, 2, 3)]
    rows_B = rows_by_request(step_S, [3, 1, 2], [2, 1, 0])
    assert rows_B[2] is None and [len(rows) for rows in rows_B[:2]] == [3, 1] and rows_B[1].k == 1
    assert [[token for token, _ in row] for row in rows_B[0]] == [[0, 1]] * 3  # token 0 likeliest, then 1
    assert rows_B[0] == [step[0] for step in step_S] and rows_B[1] == [step_S[0][1][:1]]
    assert rows_by_request([], [0, 0], [4, 0]) == [[], None]  # no step decoded


def test_negative_top_k_logprob_counts_are_refused() -> None:
    for field in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        with pytest.raises(ValueError, match=field):
            SampleParams(4, **{field: -1})


@pytest.mark.vllm
def test_the_vllm_engine_gives_top_k_logprobs_of_the_same_shape_and_meaning(vllm_engine, engine, prompts,
                                                                            lora_adapters) -> None:
    """vLLM returns the chosen token besides its top K (K + 1 entries where it is not among them): the engine keeps
    the K most likely, as the transformers engine gives them."""
    prompt = prompts[0]
    greedy = SampleParams(6, temperature=0.0, stop_token_ids=(), topk_prompt_logprobs=K, topk_sample_logprobs=K)
    from_vllm, from_hf = (e.sample(prompt, lora_adapters[0], greedy) for e in (vllm_engine, engine))
    assert_same_topk(from_vllm, from_hf, tol=1e-4)
    cut = SampleParams(6, num_samples=2, temperature=0.7, top_k=3, seed=5, stop_token_ids=(), topk_sample_logprobs=K)
    for sample in vllm_engine.sample(prompt, lora_adapters[0], cut).sequences:  # vLLM's own draws: its RNG
        assert sample.topk_logprobs is not None and len(sample.topk_logprobs) == len(sample.token_ids)
        for token, logprob, row in zip(sample.token_ids, sample.logprobs, sample.topk_logprobs, strict=True):
            assert len(row) == 3 and dict(row)[token] == pytest.approx(logprob, abs=1e-6)  # what could be drawn


def assert_same_topk(a: SampleResult, b: SampleResult, tol: float) -> None:
    def same(x: list[tuple[int, float]] | None, y: list[tuple[int, float]] | None) -> None:
        assert (x is None) == (y is None)
        if x is not None and y is not None:
            assert [t for t, _ in x] == [t for t, _ in y]
            assert max(abs(p - q) for (_, p), (_, q) in zip(x, y, strict=True)) <= tol

    assert (a.topk_prompt_logprobs is None) == (b.topk_prompt_logprobs is None)
    for x, y in zip(a.topk_prompt_logprobs or [], b.topk_prompt_logprobs or [], strict=True):
        same(x, y)
    for s, t in zip(a.sequences, b.sequences, strict=True):
        assert s.token_ids == t.token_ids and s.topk_logprobs is not None and t.topk_logprobs is not None
        for x, y in zip(s.topk_logprobs, t.topk_logprobs, strict=True):
            same(x, y)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_tokens_are_each_rows_sorted_tuples_cell_for_cell(k: int) -> None:
    """The matrices ``top_tokens`` builds hold what sorting each row's (token, logprob) tuples gives: its k most
    likely tokens, in its own row, most likely first, values unchanged, the tokens a cut removed left out."""
    generator = torch.Generator().manual_seed(k)
    logits_NV = torch.randn(64, 300, generator=generator) * 3
    logprobs_NV = sampling_logprobs(logits_NV, 0.8, 0.9, 12)  # cut: some rows keep fewer than k tokens
    rows = top_tokens(logprobs_NV, k)
    expected = []
    for logprobs_V in logprobs_NV.tolist():
        ranked = sorted(enumerate(logprobs_V), key=lambda item: -item[1])[:k]
        expected.append([(token, value) for token, value in ranked if value > -math.inf] or None)
    assert rows.ids_NK.shape == (64, k) and list(rows) == expected
    assert any(len(row) < k for row in expected) or k == 1
