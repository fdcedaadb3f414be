"""The sampler role of the Tinker-compatible API: translating a call and refusing what it cannot serve.

The protobuf answer the SDK decodes is in test_api_encoding.py; sample calls read from the log (sessions,
versions, retries) in test_api_sampler_log.py.
"""

from __future__ import annotations

import pytest
from tinker import types

from pipeline.api.samplers import check_sample_request
from pipeline.io.store import ObjectStore
from producers.api_sampler import sampling_params
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
    rows_only = last_two.model_copy(update={"prompt_logprobs": False})  # the last N needs it, as in the SDK
    with pytest.raises(ApiError, match=r"^prompt_logprobs_last_n=2: it needs prompt_logprobs=True"):
        check_sample_request(rows_only)


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
    # 2**20 entries (8 MiB on the wire) at most: their rows are built and encoded while the sampler's calls wait
    at_the_cap = sample_request(None, num_samples=1024, max_tokens=64, topk_sample_logprobs=16)  # 1,048,576
    check_sample_request(at_the_cap)
    assert sampling_params(at_the_cap, 4096)[0].topk_sample_logprobs == 16
    over = sample_request(None, num_samples=1024, max_tokens=52, topk_sample_logprobs=MAX_TOPK_LOGPROBS)
    with pytest.raises(ApiError, match=r"^topk_sample_logprobs=20 for 1024 samples of up to 52 tokens is 1,064,960 "):
        check_sample_request(over)


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


def test_a_session_check_interval_over_a_minute_is_refused_before_the_engine_loads(capsys):
    """A lapse is noticed up to one check interval after SESSION_TIMEOUT_S (300 s); more than MAX_SESSION_CHECK_S
    (60 s) would keep a gone client's calls sampling minutes longer.  The flag and the worker refuse it alike."""
    from producers.api_sampler import MAX_SESSION_CHECK_S, SamplerWorker, main

    required = ["--base-model", "/m", "--store", "file:///s", "--bootstrap", "h:1"]
    for value in ("-1", f"{MAX_SESSION_CHECK_S + 1:g}", "nan"):
        with pytest.raises(SystemExit) as info:
            main([*required, "--session-check-s", value])
        assert info.value.code == 2
        assert f"--session-check-s must be from 0 to {MAX_SESSION_CHECK_S:g}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"session_check_s must be from 0 to {MAX_SESSION_CHECK_S:g}"):
        SamplerWorker(ObjectStore("memory://check-s"), None, "/m", None, str, session_check_s=MAX_SESSION_CHECK_S + 1)


def test_a_temperature_the_engine_would_not_sample_at_is_refused():
    """vLLM samples at 0.01 below it: the samples and their logprobs would be of another temperature than the call's."""
    for temperature in (0.005, float("nan"), -0.5):
        request = sample_request(None)
        request = request.model_copy(update={"sampling_params": request.sampling_params.model_copy(
            update={"temperature": temperature})})
        with pytest.raises(ApiError, match="temperature"):
            sampling_params(request, 64)
