"""The sampler's answers on the wire: samples cut at stop strings, prompt logprobs of the last N, and the protobuf
``SampleResponse`` (with its top-k matrices) that the Tinker SDK decodes."""

from __future__ import annotations

import numpy as np
import pytest
from tinker.proto.response_conv import deserialize_sample_response

from producers.api_encoding import cut_at_stop_strings, encode_sample_response, only_last
from producers.samplers.base import SampleOutput
from producers.samplers.engine import SampleResult


def test_stop_strings_cut_after_the_token_that_completes_them():
    text = {1: "a", 2: "\n", 3: "\nU", 4: "b"}
    sample = SampleOutput(token_ids=[1, 2, 3, 4], logprobs=[-0.1, -0.2, -0.3, -0.4], finish_reason="length")
    cut = cut_at_stop_strings(sample, ["\n\nU"], lambda ids: "".join(text[i] for i in ids))
    assert (cut.token_ids, cut.logprobs, cut.finish_reason) == ([1, 2, 3], [-0.1, -0.2, -0.3], "stop")
    assert cut_at_stop_strings(sample, ["zz"], lambda ids: "x").token_ids == [1, 2, 3, 4]


def test_the_sample_response_is_what_the_sdk_decodes():
    result = SampleResult([SampleOutput([4, 2], [-1.5, -0.25], "stop"), SampleOutput([7], [-3.0], "length")],
                          [None, -2.0, -0.5])
    decoded = deserialize_sample_response(encode_sample_response(result))
    assert [s.tokens for s in decoded.sequences] == [[4, 2], [7]]
    assert [s.stop_reason for s in decoded.sequences] == ["stop", "length"]
    assert decoded.sequences[0].logprobs == [-1.5, -0.25]
    assert decoded.prompt_logprobs == [None, -2.0, -0.5]


def test_topk_logprobs_reach_the_sdks_decoder_as_its_dense_matrices():
    """N x K int32 ids and float32 logprobs, most likely first; cells a row does not fill hold 0 / -99999.0, which
    the SDK's decoder drops (a row of none is None: position 0 of the prompt)."""
    prompt_rows = [None, [(3, -0.5), (4, -2.0)], [(5, -0.25)]]
    samples = [SampleOutput([4, 2], [-1.5, -0.25], "stop", topk_logprobs=[[(4, -1.5), (9, -1.75)], [(2, -0.25)]]),
               SampleOutput([7], [-3.0], "length", topk_logprobs=[[(8, -0.125), (7, -3.0)]])]
    result = SampleResult(samples, [None, -2.0, -0.5], prompt_rows)
    decoded = deserialize_sample_response(encode_sample_response(result, topk_prompt=2, topk_sample=2))
    assert decoded.topk_prompt_logprobs == prompt_rows
    matrices = decoded.topk_prompt_logprobs_np
    assert matrices is not None and matrices.token_ids.shape == matrices.logprobs.shape == (3, 2)
    assert matrices.token_ids.dtype == np.int32 and matrices.logprobs.dtype == np.float32
    assert matrices.token_ids[0].tolist() == [0, 0] and matrices.logprobs[0].tolist() == [-99999.0, -99999.0]
    assert (matrices.token_ids[2, 1], matrices.logprobs[2, 1]) == (0, -99999.0)
    assert [s.topk_logprobs for s in decoded.sequences] == [s.topk_logprobs for s in samples]
    assert decoded.prompt_logprobs == [None, -2.0, -0.5] and decoded.sequences[1].logprobs == [-3.0]
    plain = deserialize_sample_response(encode_sample_response(SampleResult(samples, None, prompt_rows)))
    assert plain.topk_prompt_logprobs is None and all(s.topk_logprobs is None for s in plain.sequences)
    with pytest.raises(ValueError, match="3 entries"):  # never more than asked for
        encode_sample_response(SampleResult(samples, None, [[(1, -1.0), (2, -2.0), (3, -3.0)]]), topk_prompt=2)


def test_prompt_logprobs_last_n_blanks_the_earlier_top_k_rows_too():
    rows = [None, [(3, -0.5)], [(4, -0.25)], [(5, -1.0)]]
    assert only_last(rows, 2) == [None, None, [(4, -0.25)], [(5, -1.0)]]
    assert only_last(rows, None) == rows and only_last(None, 2) is None


def test_stop_strings_are_found_with_a_number_of_decodes_logarithmic_in_the_sample():
    """Every sample of a renderer's loop carries stop strings (role_colon's "\\n\\nUser:"): decoding every prefix
    costs time quadratic in its length, on the sampler's event loop that every tenant's calls share."""
    text = {token: chr(ord("a") + token % 20) for token in range(4000)} | {9000: "\n", 9001: "U"}
    calls: list[int] = []

    def decode(ids: list[int]) -> str:
        calls.append(len(ids))
        return "".join(text[i] for i in ids)

    tokens = list(range(4000))
    for stop_at in (0, 1, 2500, 3998):
        ids = tokens[:stop_at] + [9000, 9001] + tokens[stop_at + 2:]
        sample = SampleOutput(token_ids=ids, logprobs=[-float(i) for i in range(len(ids))], finish_reason="length")
        calls.clear()
        cut = cut_at_stop_strings(sample, ["\nU"], decode)
        assert (cut.token_ids, cut.logprobs, cut.finish_reason) == (ids[:stop_at + 2], sample.logprobs[:stop_at + 2],
                                                                   "stop")
        assert len(calls) <= 2 * 12 + 2 and sum(calls) <= 30 * len(ids), (stop_at, len(calls))
    calls.clear()
    sample = SampleOutput(token_ids=tokens, logprobs=[0.0] * len(tokens), finish_reason="length")
    assert cut_at_stop_strings(sample, ["\nU"], decode) is sample and len(calls) == 1


def test_topk_rows_of_every_length_are_placed_in_their_own_row_and_columns():
    """Rows of 0 to k entries and None, in any order, each land in its own row, from column 0, the rest masked."""
    rng = np.random.default_rng(7)
    k = 4
    rows: list = []
    for n in range(200):
        length = int(rng.integers(0, k + 1))
        ids = rng.choice(150_000, length, replace=False).tolist()
        rows.append(None if n % 7 == 3 else [(int(t), -float(j) - 0.5) for j, t in enumerate(ids)])
    decoded = deserialize_sample_response(encode_sample_response(SampleResult([], None, rows), topk_prompt=k))
    assert decoded.topk_prompt_logprobs == [row or None for row in rows]  # the SDK: an empty row is None
    matrices = decoded.topk_prompt_logprobs_np
    assert matrices is not None and matrices.token_ids.shape == (200, k)
    for n, row in enumerate(rows):
        filled = len(row or [])
        assert matrices.token_ids[n, :filled].tolist() == [t for t, _ in row or []]
        assert matrices.token_ids[n, filled:].tolist() == [0] * (k - filled)
        assert matrices.logprobs[n, filled:].tolist() == [-99999.0] * (k - filled)
    with pytest.raises(ValueError, match="a top-k row of 5 entries for k=4"):
        encode_sample_response(SampleResult([], None, [*rows, [(1, -1.0)] * 5]), topk_prompt=k)
