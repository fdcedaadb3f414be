"""vLLM's request outputs as a ``SampleResult``: the K most likely tokens of each position from what vLLM gives
(its top K and the chosen token besides), built off the event loop the engine's calls share.  Hand-built outputs,
no engine: runs on any machine with vLLM installed."""

from __future__ import annotations

import asyncio
import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from tinker.proto.response_conv import deserialize_sample_response

pytest.importorskip("vllm")
from vllm.logprobs import Logprob

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


def vllm_positions(n: int, k: int, seed: int) -> list[dict[int, Logprob]]:
    """``n`` positions as vLLM gives them: the chosen token first (its own rank), then the top k in rank order;
    logprobs on a coarse grid (ties), float32-exact, some cut to -inf after the first; the chosen token is among
    the top k at about half the positions."""
    rng = np.random.default_rng(seed)
    positions = []
    for _ in range(n):
        ids = rng.choice(150_000, k + 1, replace=False).tolist()
        values = np.sort(np.round(rng.normal(-4.0, 3.0, k + 1) * 2) / 2).astype(np.float32)[::-1].tolist()
        cut = 1 + int(rng.integers(0, k + 1))  # the entries from here on a top-k or top-p cut removed
        values[cut:] = [-math.inf] * (k + 1 - cut)
        chosen = int(rng.integers(0, k)) if rng.random() < 0.5 else k  # index k: outside the top k
        entries = [(ids[chosen], values[chosen], chosen + 1)] + [(ids[j], values[j], j + 1) for j in range(k)]
        positions.append(position(*entries))
    return positions


@pytest.mark.parametrize("k", [1, 3, 20])
def test_the_rows_are_the_reference_rows_cell_for_cell(k: int) -> None:
    """Every row in its own row and columns, every value as vLLM gave it, ties broken by vLLM's rank, cut tokens
    left out: the same rows as sorting each position's (token, logprob) tuples, and the same on the wire."""
    positions = vllm_positions(500, k, seed=k)
    rows = top_rows(positions, k)
    assert rows.ids_NK.shape == (500, k)
    assert list(rows) == tuple_rows(positions, k)
    prompt = SimpleNamespace(outputs=OUTPUT.outputs, prompt_logprobs=[None, *positions])
    topk_prompt = sample_parts([prompt], [0] * 501, SampleParams(3, topk_prompt_logprobs=k), stops=())[2]
    decoded = deserialize_sample_response(encode_sample_response(SampleResult([], None, topk_prompt), topk_prompt=k))
    assert decoded.topk_prompt_logprobs == [None, *tuple_rows(positions, k)]
