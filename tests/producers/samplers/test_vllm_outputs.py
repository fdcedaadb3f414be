"""vLLM's request outputs as a ``SampleResult``: the K most likely tokens of each position from what vLLM gives
(its top K and the chosen token besides), built off the event loop the engine's calls share.  Hand-built outputs,
no engine: runs on any machine with vLLM installed."""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from tinker.proto.response_conv import deserialize_sample_response

pytest.importorskip("vllm")
from vllm.logprobs import (
    FlatLogprobs,
    Logprob,
    append_logprobs_for_next_position,
    create_prompt_logprobs,
    create_sample_logprobs,
)

from producers.api_encoding import encode_sample_response
from producers.samplers import engine as engine_module
from producers.samplers.engine import SampleParams, SampleResult, VLLMEngine
from producers.samplers.vllm_outputs import sample_parts, top_rows
from schemas.config import SamplerConfig


def position(*entries: tuple[int, float, int]) -> dict[int, Logprob]:
    """One position as vLLM gives it: token -> Logprob(logprob, rank), in the order given."""
    return {token: Logprob(logprob, rank, None) for token, logprob, rank in entries}


# k=2: vLLM gives the chosen token first, then its top 2 (rank 1, 2); -inf is a token a top-k/top-p cut removed
SAMPLED = [position((9, -3.0, 5), (4, -0.5, 1), (7, -1.0, 2)),  # the chosen token is not among the top 2
           position((4, -0.25, 1), (6, -2.0, 2)),  # the chosen token is the top 1: k entries only
           position((5, -0.0, 1), (8, -math.inf, 2))]  # a cut kept one token
OUTPUT = SimpleNamespace(
    outputs=[SimpleNamespace(token_ids=[9, 4, 5], logprobs=SAMPLED, finish_reason="length")],
    prompt_logprobs=[None, position((3, -2.5, 3), (1, -0.75, 1), (2, -1.5, 2)), position((4, -0.125, 1), (5, -3.5, 2))])


def test_vllm_positions_become_the_k_most_likely_rows_most_likely_first() -> None:
    params = SampleParams(3, prompt_logprobs=True, topk_prompt_logprobs=2, topk_sample_logprobs=2)
    result = SampleResult(*sample_parts([OUTPUT], [0, 3, 4], params, stops=(5,)))
    sample = result.sequences[0]
    assert (sample.token_ids, sample.logprobs, sample.finish_reason) == ([9, 4, 5], [-3.0, -0.25, -0.0], "stop")
    assert sample.topk_logprobs == [[(4, -0.5), (7, -1.0)], [(4, -0.25), (6, -2.0)], [(5, -0.0)]]
    assert result.prompt_logprobs == [None, -2.5, -0.125]
    assert result.topk_prompt_logprobs == [None, [(1, -0.75), (2, -1.5)], [(4, -0.125), (5, -3.5)]]
    one = SampleResult(*sample_parts([OUTPUT], [0, 3, 4], SampleParams(3, topk_sample_logprobs=1), stops=()))
    assert one.sequences[0].topk_logprobs == [[(4, -0.5)], [(4, -0.25)], [(5, -0.0)]]
    assert one.sequences[0].finish_reason == "length" and one.prompt_logprobs is one.topk_prompt_logprobs is None


def test_the_vllm_engine_builds_a_calls_rows_off_the_event_loop(monkeypatch) -> None:
    """A call's rows are up to MAX_TOPK_SAMPLE_CELLS Python entries: built on the loop, every other call waits."""
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM engine: its one request is answered with OUTPUT
    engine._init_state(SamplerConfig(max_model_len=64), zero_base_adapter=False)
    engine.vocab_size, engine.eos_token_id = None, 5

    async def one(prompt, lora, sampling_params):
        return OUTPUT

    built_on: list[int] = []

    def recorded(*args, **kwargs):
        built_on.append(threading.get_ident())
        return sample_parts(*args, **kwargs)

    monkeypatch.setattr(engine, "_one", one)
    monkeypatch.setattr(engine_module, "sample_parts", recorded)
    params = SampleParams(3, topk_sample_logprobs=2)
    try:
        result = asyncio.run(engine.sample([0, 3, 4], None, params))
    finally:
        engine.close()
    assert result.sequences[0].topk_logprobs == [[(4, -0.5), (7, -1.0)], [(4, -0.25), (6, -2.0)], [(5, -0.0)]]
    assert len(built_on) == 1 and built_on[0] != threading.get_ident()  # asyncio.run's loop runs on this thread


def tuple_rows(positions: list[dict[int, Logprob]], k: int) -> list:
    """The reference: each position's entries sorted (most likely first, then vLLM's rank), the first k of them,
    those of logprob -inf left out; a row of none is None."""
    rows = [[(token, entry.logprob) for token, entry in sorted(position.items(),
                                                               key=lambda item: (-item[1].logprob, item[1].rank))[:k]
             if entry.logprob > -math.inf] for position in positions]
    return [row or None for row in rows]


def vllm_rows(n: int, k: int, rng: np.random.Generator) -> list[tuple[list[int], list[float], int]]:
    """``n`` positions as vLLM's engine core hands them over: the chosen token and its logprob first, then the top k
    in rank order, and the chosen token's rank.  Logprobs on a coarse grid (ties), float32-exact, some cut to -inf
    after the first; the chosen token is among the top k at about half the positions."""
    rows = []
    for _ in range(n):
        ids = rng.choice(150_000, k + 1, replace=False).tolist()
        values = np.sort(np.round(rng.normal(-4.0, 3.0, k + 1) * 2) / 2).astype(np.float32)[::-1].tolist()
        cut = 1 + int(rng.integers(0, k + 1))  # the entries from here on a top-k or top-p cut removed
        values[cut:] = [-math.inf] * (k + 1 - cut)
        chosen = int(rng.integers(0, k)) if rng.random() < 0.5 else k  # index k: outside the top k
        rows.append(([ids[chosen], *ids[:k]], [values[chosen], *values[:k]], chosen + 1))
    return rows


def positions_of(rows: list[tuple[list[int], list[float], int]], k: int, flat: bool, prompt: bool = False) -> Any:
    """The positions vLLM's output processor makes of ``rows``: a list of dicts, or ``FlatLogprobs`` with
    ``flat_logprobs=True`` (a prompt's start with position 0, which has none)."""
    positions = (create_prompt_logprobs if prompt else create_sample_logprobs)(flat)
    for ids, values, rank in rows:
        append_logprobs_for_next_position(positions, ids, values, itertools.repeat(None), rank, k)
    return positions


@pytest.mark.parametrize("k", [1, 3, 20])
@pytest.mark.parametrize("flat", [False, True])
def test_the_rows_are_the_reference_rows_cell_for_cell(k: int, flat: bool) -> None:
    """Every row in its own row and columns, every value as vLLM gave it, ties broken by vLLM's rank, cut tokens
    left out, each sample its own rows: the same rows as sorting each position's (token, logprob) tuples, read
    from vLLM's dicts or its flat lists, and the same on the wire."""
    rng = np.random.default_rng(k)
    samples = [vllm_rows(n, k, rng) for n in (300, 1, 57)]
    prompt = vllm_rows(200, k, rng)
    outputs = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[ids[0] for ids, _, _ in rows],
                                                        logprobs=positions_of(rows, k, flat), finish_reason=None)],
                               prompt_logprobs=positions_of(prompt, k, flat, prompt=True) if j == 0 else None)
               for j, rows in enumerate(samples)]
    prompt_ids = [0] + [ids[0] for ids, _, _ in prompt]
    params = SampleParams(3, prompt_logprobs=True, topk_prompt_logprobs=k, topk_sample_logprobs=k)
    result = SampleResult(*sample_parts(outputs, prompt_ids, params, stops=()))
    for rows, sample in zip(samples, result.sequences, strict=True):
        assert sample.topk_logprobs is not None and sample.topk_logprobs.ids_NK.shape == (len(rows), k)
        assert list(sample.topk_logprobs) == tuple_rows(positions_of(rows, k, flat=False), k)
        assert sample.logprobs == [values[0] for _, values, _ in rows]
    expected_prompt = [None, *tuple_rows(positions_of(prompt, k, flat=False), k)]
    assert result.topk_prompt_logprobs == expected_prompt
    assert result.prompt_logprobs == [None, *(values[0] for _, values, _ in prompt)]
    decoded = deserialize_sample_response(encode_sample_response(result, topk_prompt=k, topk_sample=k))
    assert decoded.topk_prompt_logprobs == expected_prompt
    assert [s.topk_logprobs for s in decoded.sequences] == [list(s.topk_logprobs) for s in result.sequences]


def test_samples_of_flat_and_dict_logprobs_together_are_refused() -> None:
    """One engine gives all of a call's samples in one layout; a mix means a caller built them by hand."""
    rng = np.random.default_rng(0)
    rows = vllm_rows(4, 2, rng)
    parts = [positions_of(rows, 2, flat=True), positions_of(rows, 2, flat=False)]
    with pytest.raises(ValueError, match="flat_logprobs") as refused:
        top_rows(parts, 2)
    assert "\n" not in str(refused.value)


def test_flat_logprobs_rows_drop_the_chosen_entry_and_break_ties_by_vllms_top_k_rank() -> None:
    """vLLM's flat layout, by hand: each position's chosen token first with its rank in the vocabulary, then the top
    K with ranks 1..K.  The chosen entry is no row entry (it is among the top K or outside them); equal logprobs
    keep vLLM's rank order."""
    positions = FlatLogprobs()
    positions.append(None)  # a prompt's position 0
    # (token ids, logprobs, ranks): the chosen token, then the top 3
    for ids, values, ranks in [([9, 4, 7, 3], [-4.0, -0.5, -0.5, -1.0], [7, 1, 2, 3]),  # chosen: vocabulary rank 7
                               ([6, 5, 6, 8], [-0.75, -0.25, -0.75, -0.75], [2, 1, 2, 3]),  # chosen: the top 2
                               ([2, 2, 1, 0], [-0.0, -0.0, -math.inf, -math.inf], [1, 1, 2, 3])]:  # a cut kept one
        positions.append_fast(ids, values, iter(ranks), [None] * len(ids))
    assert positions.ranks == [7, 1, 2, 3, 2, 1, 2, 3, 1, 1, 2, 3]
    assert top_rows([positions], 3)[0] == [None, [(4, -0.5), (7, -0.5), (3, -1.0)],
                                           [(5, -0.25), (6, -0.75), (8, -0.75)], [(2, -0.0)]]
    assert top_rows([positions], 2)[0] == [None, [(4, -0.5), (7, -0.5)], [(5, -0.25), (6, -0.75)], [(2, -0.0)]]
