"""Samplers: token-in/token-out, logprobs of the sampling distribution equal to a teacher-forced forward pass.

The reference (``tests/producers/samplers/reference.py``) is computed independently of both samplers: one
forward pass of the whole (prompt + generated) sequence through transformers (plus peft for an adapter).  The
learner's own forward pass (``LoraPolicy.generated_logprobs``) must agree with what each sampler records, at
any temperature.  Loading and refusing adapters is in test_adapter_loading.py.
Fixtures (tiny model, adapters, the shared vLLM engine) are in tests/fixtures/vllm.py and this folder's conftest.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from producers.samplers import AdapterHandle, SampleOutput, SampleRequest, make_sampler, request_seed, sampler_for_run
from producers.samplers.engine import SampleParams
from producers.samplers.hf_sampler import TransformersSampler, _sample, sampling_logprobs
from schemas.config import RunConfig, SamplerConfig
from tests.producers.samplers.reference import LEARNER_TOL, LOGPROB_TOL, check_contract, learner_gap, max_gap

# ---- plain pieces -------------------------------------------------------------------


def test_request_validation_names_the_fix() -> None:
    with pytest.raises(ValueError, match="empty"):
        SampleRequest([], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SampleRequest([1], 0)
    with pytest.raises(ValueError, match="positive"):
        AdapterHandle(version=1, lora_int_id=0, name="v1", path="/x", sha256="")
    with pytest.raises(ValueError, match="logprobs"):
        SampleOutput([1, 2], [0.0], "stop")


def test_handle_for_version_uses_new_name_and_id_per_version() -> None:
    h3 = AdapterHandle.for_version(3, "/a", "s")
    assert (h3.name, h3.lora_int_id, h3.version) == ("v3", 3, 3)
    with pytest.raises(FileNotFoundError, match="pull the adapter"):
        h3.check_folder()


def test_request_seeds_differ_across_requests_and_calls() -> None:
    seeds = {request_seed(s, i) for s in range(3) for i in range(50)}
    assert len(seeds) == 150  # seed+index would collide: (0, 1) and (1, 0)
    assert request_seed(None, 5) is None
    assert request_seed(7, 2) == request_seed(7, 2)


def test_make_sampler_rejects_unknown_backend(tiny_trained_dir: Path) -> None:
    with pytest.raises(ValueError, match="choose 'vllm' or 'transformers'"):
        make_sampler("tgi", str(tiny_trained_dir))


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1} (0.5 < 0.7 <= 0.8), renormalised to 5/8, 3/8
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    generator = torch.Generator().manual_seed(0)
    draws = [_sample(logits, 1.0, 0.7, generator) for _ in range(4000)]
    assert set(draws) == {0, 1}
    assert abs(draws.count(0) / 4000 - 5 / 8) < 0.03
    assert _sample(logits, 0.0, 1.0, generator) == 0


def test_top_k_cuts_to_the_k_most_likely_before_top_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs)[None]
    top_3 = sampling_logprobs(logits, 1.0, 1.0, top_k=3)[0].exp()
    assert torch.allclose(top_3, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # renormalised after the cut 0.526, 0.316, 0.158: top_p 0.8 then keeps the first two (0.526 < 0.8 <= 0.842)
    both = sampling_logprobs(logits, 1.0, 0.8, top_k=3)[0].exp()
    assert torch.allclose(both, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    assert torch.equal(sampling_logprobs(logits, 1.0, 1.0, top_k=0), sampling_logprobs(logits, 1.0, 1.0, top_k=4))
    assert torch.equal(sampling_logprobs(logits, 1.0, 1.0, top_k=1)[0].exp(), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="top_k"):
        SampleParams(4, top_k=-1)


# ---- transformers backend (fast) ------------------------------------------------


def test_transformers_logprobs_match_teacher_forced(hf_sampler, reference, prompts, lora_adapters) -> None:
    v1 = lora_adapters[0]
    for adapter in (None, v1):
        outs = hf_sampler.generate([SampleRequest(p, 12) for p in prompts], adapter, seed=0)
        for prompt, out in zip(prompts, outs, strict=True):
            check_contract(out, 12, hf_sampler.eos_token_id)
            assert max_gap(reference, adapter, prompt, out) < LOGPROB_TOL


def test_transformers_stops_on_eos_and_keeps_it(hf_sampler, prompts, tokenizer) -> None:
    outs = hf_sampler.generate([SampleRequest(p, 16) for p in prompts], None, temperature=0.0)
    assert hf_sampler.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert all(o.finish_reason == "stop" for o in outs), [tokenizer.decode(o.token_ids) for o in outs]  # the fixture model learned to close its answer
    for out in outs:
        check_contract(out, 16, hf_sampler.eos_token_id)
        assert tokenizer.decode(out.token_ids).endswith("</answer><|im_end|>")


def test_transformers_length_limit(hf_sampler, prompts, lora_adapters) -> None:
    out = hf_sampler.generate([SampleRequest(prompts[0], 3)], lora_adapters[0], seed=1)[0]
    assert len(out.token_ids) <= 3
    check_contract(out, 3, hf_sampler.eos_token_id)


def test_transformers_greedy_is_argmax(hf_sampler, reference, prompts) -> None:
    out = hf_sampler.generate([SampleRequest(prompts[1], 1)], None, temperature=0.0)[0]
    assert out.token_ids == [reference.greedy_next(None, prompts[1])]


def test_transformers_logprobs_are_the_sampling_distributions(hf_sampler, reference, prompts, lora_adapters) -> None:
    """Logprobs of softmax(logits / T) renormalised over the nucleus: the distribution the token was drawn from."""
    out = hf_sampler.generate([SampleRequest(prompts[0], 8)], lora_adapters[0], temperature=0.5, top_p=0.9, seed=3)[0]
    assert max_gap(reference, lora_adapters[0], prompts[0], out, temperature=0.5, top_p=0.9) < LOGPROB_TOL
    assert max_gap(reference, lora_adapters[0], prompts[0], out) > 1e-3  # not the temperature-1 policy's


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_learner_reproduces_transformers_logprobs(hf_sampler, learner_policy, prompts, lora_adapters,
                                                  temperature) -> None:
    outs = hf_sampler.generate([SampleRequest(p, 12) for p in prompts], lora_adapters[0], temperature, seed=7)
    assert learner_gap(learner_policy, prompts, outs, temperature) < LEARNER_TOL


def test_transformers_seeds_reproduce_and_group_members_differ(hf_sampler, prompts, lora_adapters) -> None:
    group = [SampleRequest(prompts[0], 10)] * 4
    first = hf_sampler.generate(group, lora_adapters[0], seed=11)
    again = hf_sampler.generate(group, lora_adapters[0], seed=11)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids) for o in first}) > 1  # same prompt, different streams


def test_run_sampler_loads_the_base_weights_in_model_dtype(tiny_trained_dir, prompts) -> None:
    from schemas.config import ModelConfig, RunConfig

    config = RunConfig(model=ModelConfig(dtype="bfloat16"),
                       sampler=SamplerConfig(backend="transformers", max_model_len=1024, engine="blocking"))
    sampler = sampler_for_run(config, str(tiny_trained_dir))
    assert {p.dtype for p in sampler._base.parameters()} == {torch.bfloat16}
    assert not sampler.concurrent_requests  # sampler.engine "blocking": whole calls
    out = sampler.generate([SampleRequest(prompts[0], 4)], seed=0)[0]
    assert len(out.logprobs) == len(out.token_ids) and all(lp <= 0.0 for lp in out.logprobs)


def test_run_sampler_on_the_async_engine_takes_each_turn_as_its_own_request(tiny_trained_dir, prompts) -> None:
    from schemas.config import ModelConfig, RunConfig

    config = RunConfig(model=ModelConfig(dtype="bfloat16"),
                       sampler=SamplerConfig(backend="transformers", max_model_len=1024))
    sampler = sampler_for_run(config, str(tiny_trained_dir))
    try:
        assert sampler.concurrent_requests  # the default engine: the rollout worker sends every episode's turn alone
        assert {p.dtype for p in sampler.engine.sampler._base.parameters()} == {torch.bfloat16}
        request = SampleRequest(prompts[0], 4)
        alone = sampler.submit(request, temperature=0.9, seed=3).result(timeout=300)
        assert alone.token_ids == sampler.generate([request], temperature=0.9, seed=3)[0].token_ids
    finally:
        sampler.close()


def test_prompt_that_does_not_fit_is_refused(hf_sampler) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        hf_sampler.generate([SampleRequest([5] * 1024, 4)])


def test_generation_stops_at_every_eos_id_of_the_models_generation_config(tiny_trained_dir, prompts, tmp_path) -> None:
    """vLLM stops at the eos ids of the model's generation_config.json as well as the tokenizer's eos (Qwen2.5
    and Llama 3 instruct models list two or three); the transformers sampler, and the engine on it, must too."""
    import json
    import shutil

    greedy = TransformersSampler(str(tiny_trained_dir)).generate([SampleRequest(prompts[0], 12)], temperature=0.0)[0]
    extra = greedy.token_ids[2]  # a token the model produces third, greedily
    assert extra != greedy.token_ids[-1] or greedy.finish_reason == "length"
    model = shutil.copytree(tiny_trained_dir, tmp_path / "model")
    settings = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**settings, "eos_token_id": [settings["eos_token_id"],
                                                                                           extra]}))
    expected = greedy.token_ids[:greedy.token_ids.index(extra) + 1]
    out = TransformersSampler(str(model)).generate([SampleRequest(prompts[0], 12)], temperature=0.0)[0]
    assert (out.token_ids, out.finish_reason) == (expected, "stop")
    engine = sampler_for_run(RunConfig(sampler=SamplerConfig(backend="transformers", max_model_len=1024)), str(model))
    try:
        out = engine.generate([SampleRequest(prompts[0], 12)], temperature=0.0)[0]
        assert (out.token_ids, out.finish_reason) == (expected, "stop")
        # stop ids given explicitly are the whole rule, as in vLLM (ignore_eos)
        explicit = engine.sample(prompts[0], None, SampleParams(12, temperature=0.0, stop_token_ids=(2,)))
        assert explicit.sequences[0].token_ids[:len(expected)] == expected
        assert len(explicit.sequences[0].token_ids) > len(expected)
    finally:
        engine.close()


def test_a_request_also_stops_at_its_extra_stop_ids(hf_sampler, tiny_trained_dir, prompts) -> None:
    """A request's ``extra_stop_ids`` (a chat template's turn-closing token) end it as well as eos, on that request
    alone; the engine (behind the producer's ``submit``) honours them too, keeping eos."""
    greedy = hf_sampler.generate([SampleRequest(prompts[0], 12)], temperature=0.0)[0]
    extra = greedy.token_ids[2]
    expected = greedy.token_ids[:greedy.token_ids.index(extra) + 1]
    cut, whole = hf_sampler.generate([SampleRequest(prompts[0], 12, extra_stop_ids=(extra,)),
                                      SampleRequest(prompts[0], 12)], temperature=0.0)
    assert (cut.token_ids, cut.finish_reason) == (expected, "stop")
    assert whole.token_ids == greedy.token_ids
    unused = next(t for t in range(3, 100) if t not in greedy.token_ids)
    assert hf_sampler.generate([SampleRequest(prompts[0], 12, extra_stop_ids=(unused,))],
                               temperature=0.0)[0].token_ids == greedy.token_ids  # eos still stops it
    engine = sampler_for_run(RunConfig(sampler=SamplerConfig(backend="transformers", max_model_len=1024)),
                             str(tiny_trained_dir))
    try:
        out = engine.submit(SampleRequest(prompts[0], 12, extra_stop_ids=(extra,)), temperature=0.0).result()
        assert (out.token_ids, out.finish_reason) == (expected, "stop")
        kept = engine.submit(SampleRequest(prompts[0], 12, extra_stop_ids=(unused,)), temperature=0.0).result()
        assert kept.token_ids == greedy.token_ids
    finally:
        engine.close()


# ---- vLLM (one engine per session) ------------------------------------------------


@pytest.mark.vllm
def test_vllm_logprobs_match_teacher_forced_with_lora(vllm_sampler, reference, prompts, lora_adapters) -> None:
    v1 = lora_adapters[0]
    started = time.monotonic()
    outs = vllm_sampler.generate([SampleRequest(p, 12) for p in prompts], v1, seed=0)
    print(f"\nvLLM first batch with a LoRA: {time.monotonic() - started:.1f} s")
    for prompt, out in zip(prompts, outs, strict=True):
        check_contract(out, 12, vllm_sampler.eos_token_id)
        assert max_gap(reference, v1, prompt, out) < LOGPROB_TOL


@pytest.mark.vllm
def test_vllm_base_model_stops_on_eos_and_keeps_it(vllm_sampler, reference, prompts, tokenizer) -> None:
    outs = vllm_sampler.generate([SampleRequest(p, 16) for p in prompts], None, temperature=0.0)
    assert vllm_sampler.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "stop"
        check_contract(out, 16, vllm_sampler.eos_token_id)
        assert max_gap(reference, None, prompt, out) < LOGPROB_TOL


@pytest.mark.vllm
def test_vllm_and_transformers_agree_greedily(vllm_sampler, hf_sampler, prompts, lora_adapters) -> None:
    requests = [SampleRequest(p, 8) for p in prompts]
    from_vllm = vllm_sampler.generate(requests, lora_adapters[0], temperature=0.0)
    from_hf = hf_sampler.generate(requests, lora_adapters[0], temperature=0.0)
    for a, b in zip(from_vllm, from_hf, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < LOGPROB_TOL


@pytest.mark.vllm
def test_vllm_logprobs_are_the_sampling_distributions(vllm_sampler, reference, prompts, lora_adapters) -> None:
    out = vllm_sampler.generate([SampleRequest(prompts[0], 8)], lora_adapters[0], temperature=0.5, top_p=0.9, seed=3)
    assert max_gap(reference, lora_adapters[0], prompts[0], out[0], temperature=0.5, top_p=0.9) < LOGPROB_TOL
    assert max_gap(reference, lora_adapters[0], prompts[0], out[0]) > 1e-3  # not the temperature-1 policy's


@pytest.mark.vllm
@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_learner_reproduces_vllm_logprobs(vllm_sampler, learner_policy, prompts, lora_adapters, temperature) -> None:
    outs = vllm_sampler.generate([SampleRequest(p, 12) for p in prompts], lora_adapters[0], temperature, seed=7)
    assert learner_gap(learner_policy, prompts, outs, temperature) < LEARNER_TOL


@pytest.mark.vllm
def test_vllm_new_adapter_version_is_served(vllm_sampler, reference, prompts, lora_adapters) -> None:
    """v2 under a new name and id: its outputs follow v2's weights, not a cached v1."""
    v1, v2 = lora_adapters
    vllm_sampler.load_adapter(v2)
    assert v2.lora_int_id in vllm_sampler.loaded_adapter_ids()
    request = [SampleRequest(prompts[1], 8)]
    out_v1 = vllm_sampler.generate(request, v1, seed=4)[0]
    out_v2 = vllm_sampler.generate(request, v2, seed=4)[0]
    assert max_gap(reference, v2, prompts[1], out_v2) < LOGPROB_TOL
    # the same tokens under v1's weights score differently: v2 really is different weights
    assert max_gap(reference, v1, prompts[1], out_v2) > 1e-2
    assert (out_v1.token_ids, out_v1.logprobs) != (out_v2.token_ids, out_v2.logprobs)
    vllm_sampler.unload_adapter(v2)
    assert v2.lora_int_id not in vllm_sampler.loaded_adapter_ids()


@pytest.mark.vllm
def test_vllm_seeds_reproduce_and_group_members_differ(vllm_sampler, prompts, lora_adapters) -> None:
    group = [SampleRequest(prompts[0], 10)] * 4
    first = vllm_sampler.generate(group, lora_adapters[0], seed=11)
    again = vllm_sampler.generate(group, lora_adapters[0], seed=11)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]  # on the CPU too (see the sampler)
    assert len({tuple(o.token_ids) for o in first}) > 1


@pytest.mark.vllm
def test_vllm_length_limit_and_id_reuse_refused(vllm_sampler, prompts, lora_adapters) -> None:
    out = vllm_sampler.generate([SampleRequest(prompts[0], 3)], lora_adapters[0], seed=2)[0]
    check_contract(out, 3, vllm_sampler.eos_token_id)
    clash = AdapterHandle(version=7, lora_int_id=lora_adapters[0].lora_int_id, name="v7", path=lora_adapters[1].path,
                          sha256="")
    with pytest.raises(ValueError, match="new id"):
        vllm_sampler.generate([SampleRequest(prompts[0], 2)], clash)
