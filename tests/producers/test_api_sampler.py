"""The sampler role of the Tinker-compatible API: translating a call, and the protobuf answer the SDK decodes.

Sample calls read from the log (sessions, versions, retries) are in test_api_sampler_log.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response

from pipeline.api.samplers import check_sample_request
from producers.api_sampler import cut_at_stop_strings, encode_sample_response, only_last, sampling_params
from producers.samplers.base import SampleOutput
from producers.samplers.engine import SampleResult
from schemas.api import MAX_TOPK_LOGPROBS, MAX_TOPK_SAMPLE_CELLS, ApiError
from tests.producers.api_sampling import sample_request


def test_the_four_stop_forms_and_refusals():
    assert sampling_params(sample_request(None), 64)[0].stop_token_ids is None  # eos
    assert sampling_params(sample_request([]), 64)[0].stop_token_ids == ()  # never before max_tokens
    assert sampling_params(sample_request([3, 9]), 64)[0].stop_token_ids == (3, 9)
    params, strings = sampling_params(sample_request("\n\nUser:"), 64)
    assert (params.stop_token_ids, strings) == (None, ["\n\nUser:"])
    assert sampling_params(sample_request(["a", "b"]), 64)[1] == ["a", "b"]
    assert sampling_params(sample_request(None, top_k=5), 64)[0].top_k == 5
    assert sampling_params(sample_request(None, top_k=-1), 64)[0].top_k == 0  # the SDK's "no cut"
    with pytest.raises(ApiError, match="top_k"):
        sampling_params(sample_request(None, top_k=-3), 64)
    with pytest.raises(ApiError, match="prompt_alt_tokens and target_prompt_logprobs are not served"):
        sampling_params(sample_request(None, prompt_alt_tokens_k=2), 64)
    with pytest.raises(ApiError, match=r"record_stability_info \(StableReinforce\) is not served"):
        sampling_params(sample_request(None, record_stability_info=True), 64)
    assert sampling_params(sample_request(None, prompt_logprobs=True, prompt_logprobs_last_n=2), 64)[0].prompt_logprobs
    for last_n, given in ((2, False), (0, True), (3, True)):  # the prompt has 3 tokens: at most 2 are scored
        with pytest.raises(ApiError, match="prompt_logprobs_last_n"):
            sampling_params(sample_request(None, prompt_logprobs=given, prompt_logprobs_last_n=last_n), 64)


def test_a_prompt_of_image_chunks_or_past_the_context_is_refused_in_the_sdks_terms():
    image = types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)
    mixed = sample_request(None).model_copy(update={"prompt": types.ModelInput(
        chunks=[types.EncodedTextChunk(tokens=[5, 6]), image])})
    with pytest.raises(ApiError, match=r"^prompt chunk of kind 'image' is not supported; send token chunks"):
        sampling_params(mixed, 64)
    with pytest.raises(ApiError, match=r"prompt of 3 tokens does not fit this server's context of 3 tokens "
                                       r"\(max_context_length in get_server_capabilities\); shorten it"):
        sampling_params(sample_request(None), 3)


def test_max_tokens_none_is_up_to_the_context_and_zero_is_refused():
    request = sample_request(None)
    assert sampling_params(request, 64)[0].max_tokens == 4
    unbounded = request.model_copy(update={"sampling_params": request.sampling_params.model_copy(
        update={"max_tokens": None})})
    assert sampling_params(unbounded, 64)[0].max_tokens == 64
    for bad in (0, -5):
        zero = request.model_copy(update={"sampling_params": request.sampling_params.model_copy(
            update={"max_tokens": bad})})
        with pytest.raises(ApiError, match="max_tokens"):
            sampling_params(zero, 64)


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


def test_topk_logprob_counts_reach_the_engine_and_are_bounded():
    params = sampling_params(sample_request(None, topk_prompt_logprobs=5, topk_sample_logprobs=3), 64)[0]
    assert (params.topk_prompt_logprobs, params.topk_sample_logprobs) == (5, 3)
    assert not params.prompt_logprobs  # the top-k rows need no plain prompt logprobs
    limit = sampling_params(sample_request(None, topk_prompt_logprobs=MAX_TOPK_LOGPROBS), 64)[0]
    assert limit.topk_prompt_logprobs == MAX_TOPK_LOGPROBS
    for field in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        for bad in (MAX_TOPK_LOGPROBS + 1, -1):
            with pytest.raises(ApiError, match=rf"^{field}={bad}: ask for 0 to {MAX_TOPK_LOGPROBS} "):
                sampling_params(sample_request(None, **{field: bad}), 64)
    last_two = sample_request(None, prompt_logprobs=True, prompt_logprobs_last_n=2, topk_prompt_logprobs=2)
    assert sampling_params(last_two, 64)[0].topk_prompt_logprobs == 2


def test_sampled_top_k_rows_are_bounded_by_the_call_s_whole_answer():
    # K is bounded per position, but 1,024 samples of a long max_tokens at K=20 would still answer ~20x plain logprobs
    cells = 1024 * 256 * MAX_TOPK_LOGPROBS
    assert cells > MAX_TOPK_SAMPLE_CELLS
    big = sample_request(None, num_samples=1024, max_tokens=256, topk_sample_logprobs=MAX_TOPK_LOGPROBS)
    message = rf"^topk_sample_logprobs={MAX_TOPK_LOGPROBS} for 1024 samples of up to 256 tokens is {cells:,} rows"
    with pytest.raises(ApiError, match=message):
        check_sample_request(big)  # the gateway refuses it at submit
    with pytest.raises(ApiError, match=message):
        sampling_params(big, 4096)
    unbounded = sample_request(None, num_samples=1024, max_tokens=None, topk_sample_logprobs=MAX_TOPK_LOGPROBS)
    check_sample_request(unbounded)  # max_tokens left to the sampler: its context decides
    with pytest.raises(ApiError, match=rf"^topk_sample_logprobs={MAX_TOPK_LOGPROBS} for 1024 samples of up to 4096 "):
        sampling_params(unbounded, 4096)
    assert sampling_params(big.model_copy(update={"topk_sample_logprobs": 0}), 4096)[0].num_samples == 1024
    fits = sample_request(None, num_samples=64, max_tokens=256, topk_sample_logprobs=MAX_TOPK_LOGPROBS)
    assert sampling_params(fits, 4096)[0].topk_sample_logprobs == MAX_TOPK_LOGPROBS


def test_prompt_logprobs_last_n_blanks_the_earlier_top_k_rows_too():
    rows = [None, [(3, -0.5)], [(4, -0.25)], [(5, -1.0)]]
    assert only_last(rows, 2) == [None, None, [(4, -0.25)], [(5, -1.0)]]
    assert only_last(rows, None) == rows and only_last(None, 2) is None


def test_the_batch_cap_option_reaches_the_engines_config_and_is_refused_in_one_line(capsys):
    from producers.api_sampler import main, sampler_config

    assert sampler_config("transformers", None, 8).max_batch_sequences == 8
    assert sampler_config("transformers").max_batch_sequences is None  # the engine's default (16)
    assert sampler_config("vllm", 64).max_lora_rank == 64
    required = ["--base-model", "/m", "--store", "file:///s", "--bootstrap", "h:1"]
    for extra, message in ((["--backend", "vllm", "--max-batch-sequences", "8"], "the transformers backend's"),
                           (["--max-batch-sequences", "0"], "must be from 1 to 4096, got 0")):
        with pytest.raises(SystemExit) as info:
            main([*required, *extra])  # refused before the engine loads
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_temperature_the_engine_would_not_sample_at_is_refused():
    """vLLM samples at 0.01 below it: the samples and their logprobs would be of another temperature than the call's."""
    for temperature in (0.005, float("nan"), -0.5):
        request = sample_request(None)
        request = request.model_copy(update={"sampling_params": request.sampling_params.model_copy(
            update={"temperature": temperature})})
        with pytest.raises(ApiError, match="temperature"):
            sampling_params(request, 64)


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
