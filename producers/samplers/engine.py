"""The sampling engine: one engine per base model, each request its own task, any number of adapters.

``SamplingEngine.sample(prompt_token_ids, adapter, params)`` is a coroutine; every
call is one request that joins the running batch as soon as it is submitted
(vLLM's ``AsyncLLM``: continuous batching), so a short request never waits for a
long one and no request waits for the slowest of a fixed batch.  Requests name
their adapter (``AdapterHandle``: a new LoRA name and id per version, see base.py);
the engine keeps up to ``max_loras`` of them loaded and serves the base model for
``adapter=None``.  The callers are the producer's episodes (one task per episode)
and, later, the Tinker-compatible gateway (``asample``), so the request carries
what both need: ``num_samples``, ``max_tokens``, temperature and top-p, a seed,
stop token ids and prompt logprobs on request.

Conventions, the same on every backend:

- sample ``j`` of a seeded request draws from ``request_seed(seed, first_stream + j)``,
  so ``sample(p, params(seed=s, num_samples=n))`` draws what ``Sampler.generate([p] * n, seed=s)``
  draws, and the result does not depend on what else runs at the same time;
- logprobs of generated tokens are of the distribution they were drawn from
  (``processed_logprobs``, base.py); prompt logprobs are the model's own
  (temperature 1, no top-p), ``None`` at position 0, one per prompt token;
- top-k logprobs (``topk_prompt_logprobs``, ``topk_sample_logprobs`` = K) are the K most likely
  tokens at each position, most likely first, with their logprobs of the same distributions: the
  model's own for the prompt (``None`` at position 0), the one each token was drawn from for the
  samples, so a top-k or top-p cut leaves only the tokens it keeps (fewer than K where it keeps fewer);
- ``stop_token_ids`` None stops at eos and at the eos ids of the model's
  ``generation_config.json`` (vLLM adds those), and at ``extra_stop_token_ids``;
  ``()`` never stops before ``max_tokens``; a tuple of ids stops at exactly those (add eos to keep it).  A sequence that
  stopped ends with its stop token, ``finish_reason`` "stop"; else "length";
- an adapter is (``run``, ``version``) of its handle; the vLLM engine gives each
  its own LoRA id (never reused), so runs with overlapping version numbers share
  one engine, and refuses a known (run, version) with other weights.

``TransformersEngine`` (hf_engine.py) puts the plain transformers sampler behind the same
coroutine (compatible calls that wait together decoded as one capped batch in a worker
thread, the groups of them taking turns, and within a group the calls' owners: it is the
reference, not the fast path).  ``SyncSampler`` (sync.py) runs an engine on its own event loop
in a thread and is a ``Sampler``, so thread-based callers keep calling
``generate`` while their requests join the same batch.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import json
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

from producers.samplers.base import AdapterHandle, SampleOutput, request_seed
from producers.samplers.reaper import EngineReaper, engine_processes, started_children
from producers.samplers.topk import TopKRows
from producers.samplers.vllm_outputs import sample_parts
from producers.samplers.vllm_sampler import check_vllm_can_load, refusal_named, refused_adapter
from schemas.api import MAX_TOPK_LOGPROBS
from schemas.config import RunConfig, SamplerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleParams:
    """How to continue one prompt (see the module doc for seeds, stops and logprobs)."""

    max_tokens: int
    num_samples: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut; k >= 1: the k most likely tokens only (applied before top_p, as in vLLM)
    seed: int | None = None
    first_stream: int = 0
    stop_token_ids: tuple[int, ...] | None = None
    extra_stop_token_ids: tuple[int, ...] = ()  # with stop_token_ids None: ids that stop besides the eos ids
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0  # K >= 1: the K most likely tokens at each prompt position (see the module doc)
    topk_sample_logprobs: int = 0  # K >= 1: the K most likely tokens at each sampled position

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SampleParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.num_samples < 1:
            raise ValueError(f"SampleParams.num_samples must be >= 1, got {self.num_samples}")
        if self.temperature < 0.0:
            raise ValueError(f"SampleParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SampleParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SampleParams.top_k must be 0 (no cut) or at least 1, got {self.top_k}")
        for field in ("topk_prompt_logprobs", "topk_sample_logprobs"):
            if getattr(self, field) < 0:
                raise ValueError(f"SampleParams.{field} must be 0 (none) or at least 1, got {getattr(self, field)}")
        if self.first_stream < 0:
            raise ValueError(f"SampleParams.first_stream must be >= 0, got {self.first_stream}")
        if self.stop_token_ids is not None and self.extra_stop_token_ids:
            raise ValueError("SampleParams.extra_stop_token_ids add to the eos ids; with stop_token_ids given (the "
                             "whole stop rule) put them in stop_token_ids instead")

    def seeds(self) -> list[int | None]:
        """The seed of every sample (None each when unseeded)."""
        return [request_seed(self.seed, self.first_stream + j) for j in range(self.num_samples)]


@dataclass(frozen=True)
class SampleResult:
    """``num_samples`` sequences for one prompt, and its prompt logprobs and top-k prompt logprobs when asked for
    (rows given as lists of (token, logprob) are kept as ``TopKRows``, as ``SampleOutput`` keeps them)."""

    sequences: list[SampleOutput]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: TopKRows | None = None  # one row per prompt token, None at position 0

    def __post_init__(self) -> None:
        if self.topk_prompt_logprobs is not None and not isinstance(self.topk_prompt_logprobs, TopKRows):
            object.__setattr__(self, "topk_prompt_logprobs", TopKRows.from_rows(self.topk_prompt_logprobs))


class SamplingEngine(abc.ABC):
    """An engine that serves concurrent ``sample`` requests on one base model and many adapters."""

    eos_token_id: int
    max_model_len: int
    vocab_size: int | None = None  # the model's input vocabulary: prompt ids outside it are refused

    @abc.abstractmethod
    async def sample(
        self, prompt_token_ids: list[int], adapter: AdapterHandle | None, params: SampleParams,
        *, owner: str | None = None,
    ) -> SampleResult:
        """Continue ``prompt_token_ids`` ``params.num_samples`` times with ``adapter`` (None = the base model).

        ``owner`` names who the call is for (the API's tenant; None: nobody in particular). It never changes
        what is drawn, only the order an engine that queues calls serves them in: the transformers engine
        takes turns between owners whose calls would share a batch, so one owner's many calls do not hold
        another's behind them all.  vLLM, which takes every request into its running batch, ignores it.

        A request that fails (an adapter that cannot be loaded, a prompt that does
        not fit) raises in its own caller only; the others keep running.
        """

    @abc.abstractmethod
    async def load_adapter(self, handle: AdapterHandle) -> None:
        """Make ``handle`` ready to serve now, so a bad adapter fails here rather than in a request."""

    @abc.abstractmethod
    async def unload_adapter(self, handle: AdapterHandle) -> None:
        """Free ``handle``'s slot; a later request for it loads it again."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine (processes, memory)."""

    @staticmethod
    def refuse_other_weights(known: AdapterHandle | None, handle: AdapterHandle) -> None:
        """Refuse ``handle`` when its (run, version) already serves other weights (``known``: the handle it
        serves, None when it serves nothing): an engine never serves two sets of weights under one version."""
        if known is not None and (known.path, known.sha256) != (handle.path, handle.sha256):
            raise ValueError(
                f"adapter {handle.run or '-'}/v{handle.version} already serves {known.path} (sha {known.sha256}); "
                "give every adapter version a new version number"
            )

    def token_budget(self, prompt_token_ids: list[int], params: SampleParams) -> int:
        """``max_tokens`` cut so prompt plus output fit ``max_model_len``; refuses a prompt that cannot fit."""
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty; render the prompt with the chat template first")
        if self.vocab_size is not None:
            low, high = min(prompt_token_ids), max(prompt_token_ids)
            if low < 0 or high >= self.vocab_size:
                raise ValueError(f"the prompt holds id {low if low < 0 else high}, outside the model's vocabulary "
                                 f"[0, {self.vocab_size}); encode it with the model's tokenizer")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens does not fit max_model_len {self.max_model_len}; "
                "shorten the prompt (fewer history turns) or raise sampler.max_model_len"
            )
        return min(params.max_tokens, self.max_model_len - len(prompt_token_ids))

    def stop_ids(self, params: SampleParams) -> tuple[int, ...]:
        """The token ids that end a sequence for ``params`` (eos and the extra ids unless told otherwise)."""
        if params.stop_token_ids is None:
            return tuple(dict.fromkeys((self.eos_token_id, *params.extra_stop_token_ids)))
        return tuple(params.stop_token_ids)


# ---- vLLM ------------------------------------------------------------------------


class VLLMEngine(SamplingEngine):
    """vLLM's ``AsyncLLM`` with LoRA: continuous batching over every request of every adapter.

    The engine belongs to the event loop that first awaits it (vLLM's output
    handler runs there); ``SyncSampler`` gives it one of its own.

    The base model through a zero adapter: vLLM 0.32's CPU LoRA kernels index the
    adapter slots with -1 for rows without an adapter, which reads the last slot,
    so a base-model request batched with adapter requests gets that adapter's
    delta added.  On a CPU (``zero_base_adapter`` None), from the first adapter load
    on, base-model requests are served through a copy of that adapter with every
    B matrix zero: the same batch, an exact zero delta, one extra LoRA slot (an
    adapter vLLM refuses leaves no copy: vLLM would refuse the copy as well).
    """

    def __init__(
        self,
        model_path: str,
        config: SamplerConfig | None = None,
        max_loras: int | None = None,
        max_lora_rank: int | None = None,
        dtype: str = "auto",
        enforce_eager: bool | None = None,
        zero_base_adapter: bool | None = None,
        max_cpu_loras: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """Start the engine (about 30 s on a CPU); ``engine_kwargs`` pass to ``AsyncEngineArgs``.

        ``max_loras`` (adapters in one batch; default the config's) should cover every
        version of every run served at once: runs x (max_staleness + 1).  ``max_cpu_loras``
        (adapters kept loaded; default ``max_loras``) should cover every version a caller
        keeps loaded, or vLLM evicts some and reads them from disk again (``lora_slots``).  On a CPU,
        chunked prefill is off: vLLM 0.32 cannot seed a request whose prefill is
        chunked there, and every request here may be seeded.
        """
        import torch

        from producers.samplers.vllm_sampler import _prepare_environment, checkpoint_dtype

        config = config or SamplerConfig()
        _prepare_environment()
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cuda = torch.cuda.is_available()
        engine_kwargs.setdefault("max_logprobs", MAX_TOPK_LOGPROBS)  # what a sample call may ask for
        if not cuda:
            engine_kwargs.setdefault("enable_chunked_prefill", False)
            engine_kwargs.setdefault("max_num_batched_tokens", max(config.max_model_len, 2048))
        self._init_state(config, not cuda if zero_base_adapter is None else zero_base_adapter, max_lora_rank)
        batch_slots, cache_slots = lora_slots(max_loras or config.max_loras, max_cpu_loras, self.zero_base_adapter)
        args = AsyncEngineArgs(
            model=model_path,
            enable_lora=True,
            max_loras=batch_slots,
            max_cpu_loras=cache_slots,
            max_lora_rank=self.max_lora_rank,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_model_len=config.max_model_len,
            dtype=checkpoint_dtype(model_path) if dtype == "auto" else dtype,
            enforce_eager=not cuda if enforce_eager is None else enforce_eager,
            seed=config.seed,
            logprobs_mode="processed_logprobs",  # of the distribution drawn from: after temperature and top-p
            **engine_kwargs,
        )
        before = started_children()
        self._llm = AsyncLLM.from_engine_args(args)
        self._reaper = EngineReaper(engine_processes(before))  # ends vLLM's processes should this one die unclosed
        self.eos_token_id = int(self._llm.get_tokenizer().eos_token_id)
        self.vocab_size = int(self._llm.model_config.get_vocab_size())

    def _init_state(self, config: SamplerConfig, zero_base_adapter: bool, max_lora_rank: int | None = None) -> None:
        """Everything but the vLLM engine itself (``_llm``)."""
        self.config = config
        self.max_lora_rank = max_lora_rank or config.max_lora_rank
        self.max_model_len = config.max_model_len
        self.zero_base_adapter = zero_base_adapter
        self._handles: dict[tuple[str, int], AdapterHandle] = {}  # (run, version) -> the handle it serves
        self._lora_ids: dict[tuple[str, int], int] = {}  # (run, version) -> its LoRA id in this engine
        self._loading: dict[tuple[str, int], asyncio.Lock] = {}
        self._next_lora_id = itertools.count(1)
        self._base: AdapterHandle | None = None  # the zero adapter, once made
        self._scratch = tempfile.mkdtemp(prefix="rlpipe-engine-")
        self._ids = itertools.count()
        self._llm: Any = None
        self._reaper: EngineReaper | None = None

    # ---- adapters ----------------------------------------------------------------
    def _lora_request(self, handle: AdapterHandle) -> Any:
        """The LoRA request of ``handle``: its own id in this engine, refused when its (run, version) changed."""
        from vllm.lora.request import LoRARequest

        key = (handle.run, handle.version)
        self.refuse_other_weights(self._handles.get(key), handle)
        lora_id = self._lora_ids.setdefault(key, next(self._next_lora_id))
        return LoRARequest(f"{handle.run + '/' if handle.run else ''}{handle.name}#{lora_id}", lora_id, handle.path)

    async def load_adapter(self, handle: AdapterHandle) -> None:
        """Load ``handle`` into the engine once (concurrent first requests wait for the same load)."""
        handle.check_folder()
        check_vllm_can_load(handle.path, self.max_lora_rank)
        request = self._lora_request(handle)
        key = (handle.run, handle.version)
        zero = None
        if self.zero_base_adapter and self._base is None and handle.run != BASE_RUN:
            # before this adapter can share a batch with a base-model row, base rows go through zeros
            self._base = zero = _zero_copy(handle, os.path.join(self._scratch, "base"))
        try:
            async with self._loading.setdefault(key, asyncio.Lock()):
                if self._handles.get(key) == handle:
                    return
                with refusal_named(handle):
                    added = await self._engine().add_lora(request)
                if not added:
                    raise refused_adapter(handle)
                self._handles[key] = handle
        except BaseException:
            if zero is not None and self._base is zero and (BASE_RUN, 0) not in self._handles:
                self._base = None  # vLLM refuses its zero copy too: the next adapter that loads makes one
                self._lora_ids.pop((BASE_RUN, 0), None)
            raise
        log.info("loaded adapter %s (LoRA id %d) from %s", request.lora_name, request.lora_int_id, handle.path)

    async def unload_adapter(self, handle: AdapterHandle) -> None:
        """Drop ``handle`` from the engine (a no-op when it is not loaded); its LoRA id is never reused."""
        key = (handle.run, handle.version)
        self._handles.pop(key, None)
        self._loading.pop(key, None)
        lora_id = self._lora_ids.pop(key, None)
        if lora_id is not None:
            await self._engine().remove_lora(lora_id)

    def lora_id(self, handle: AdapterHandle) -> int | None:
        """The LoRA id ``handle`` has in this engine (None before its first use)."""
        return self._lora_ids.get((handle.run, handle.version))

    async def loaded_adapter_ids(self) -> set[int]:
        """The LoRA ids the engine holds right now."""
        return set(await self._engine().list_loras())

    async def _base_request(self) -> Any:
        """The LoRA request base-model requests go through (None until an adapter was loaded: plain rows are safe)."""
        if self._base is None:
            return None
        if (self._base.run, self._base.version) not in self._handles:
            await self.load_adapter(self._base)
        return self._lora_request(self._base)

    # ---- sampling ----------------------------------------------------------------
    async def sample(
        self, prompt_token_ids: list[int], adapter: AdapterHandle | None, params: SampleParams,
        *, owner: str | None = None,
    ) -> SampleResult:
        """One vLLM request per sample (each with its own seed), all submitted at once; see ``SamplingEngine``
        (``owner`` is not needed: continuous batching holds no call behind another's queue)."""
        budget = self.token_budget(prompt_token_ids, params)
        if adapter is None:
            lora = await self._base_request()
        else:
            if self._handles.get((adapter.run, adapter.version)) != adapter:
                await self.load_adapter(adapter)
            lora = self._lora_request(adapter)
        outputs = await asyncio.gather(
            *(
                self._one(prompt_token_ids, lora, self._sampling_params(params, budget, seed, want_prompt=j == 0))
                for j, seed in enumerate(params.seeds())
            )
        )
        # off the loop: a call's top-k rows are up to MAX_TOPK_SAMPLE_CELLS entries (vllm_outputs.py)
        return SampleResult(*await asyncio.to_thread(sample_parts, outputs, prompt_token_ids, params,
                                                     self.stop_ids(params)))

    def _sampling_params(self, params: SampleParams, budget: int, seed: int | None, want_prompt: bool) -> Any:
        from vllm import SamplingParams

        stops = self.stop_ids(params)
        return SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=budget,
            logprobs=params.topk_sample_logprobs,  # the sampled token's, and the K most likely besides
            prompt_logprobs=(params.topk_prompt_logprobs if want_prompt and (
                params.prompt_logprobs or params.topk_prompt_logprobs) else None),
            seed=seed,
            ignore_eos=params.stop_token_ids is not None,  # then the ids given are the whole stop rule
            stop_token_ids=list(stops),
            detokenize=False,  # token-in/token-out: text is never needed here
            flat_logprobs=True,  # a few flat lists, not a Logprob object per entry (vllm_outputs.py reads both)
        )

    async def _one(self, prompt_token_ids: list[int], lora: Any, sampling_params: Any) -> Any:
        """Submit one request and wait for its final output (the engine batches it with whatever runs)."""
        from vllm.inputs import TokensPrompt

        final = None
        request_id = f"s{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        async for out in self._engine().generate(prompt, sampling_params, request_id, lora_request=lora):
            final = out
        if final is None:
            raise RuntimeError(f"vLLM returned nothing for request {request_id}")
        return final

    def close(self) -> None:
        """Shut the engine down (its engine-core and worker processes, and their memory)."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.close()
        shutil.rmtree(self._scratch, ignore_errors=True)

    def _engine(self) -> Any:
        if self._llm is None:
            raise RuntimeError("this VLLMEngine is closed; build a new one")
        return self._llm


def lora_slots(max_loras: int, max_cpu_loras: int | None, zero_base_adapter: bool) -> tuple[int, int]:
    """vLLM's ``max_loras`` (adapters in one batch) and ``max_cpu_loras`` (adapters it keeps loaded: beyond them it
    evicts the least recently used, and reads one from its folder again when a request names it), each with a
    slot for the zero adapter when base rows go through it; the cache is never smaller than a batch."""
    extra = 1 if zero_base_adapter else 0
    return max_loras + extra, max(max_loras, max_cpu_loras or 0) + extra


BASE_RUN = "#base"  # the zero adapter's run: no run name can take it (names never hold "#")


def _zero_copy(handle: AdapterHandle, folder: str) -> AdapterHandle:
    """``handle``'s adapter with every LoRA B matrix zero: it adds exactly nothing to the base model."""
    from safetensors.torch import load_file, save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(handle.path, "adapter_config.json")) as source:
        config = json.load(source)
    with open(os.path.join(folder, "adapter_config.json"), "w") as target:
        json.dump(config, target)
    tensors = load_file(os.path.join(handle.path, "adapter_model.safetensors"))
    zeroed = {name: t.zero_() if "lora_B" in name else t for name, t in tensors.items()}
    save_file(zeroed, os.path.join(folder, "adapter_model.safetensors"))
    return AdapterHandle(version=0, lora_int_id=1, name="base", path=folder, sha256="zero", run=BASE_RUN)


def make_engine(backend: str, model_path: str, config: SamplerConfig | None = None, **kwargs: Any) -> SamplingEngine:
    """The engine for ``backend`` ("vllm" or "transformers"); each backend is imported only when chosen."""
    if backend == "vllm":
        return VLLMEngine(model_path, config, **kwargs)
    if backend == "transformers":
        from producers.samplers.hf_engine import TransformersEngine

        return TransformersEngine(model_path, config, **kwargs)
    raise ValueError(f"unknown sampler backend {backend!r}; choose 'vllm' or 'transformers'")


def engine_for_run(config: RunConfig, model_path: str, **kwargs: Any) -> SamplingEngine:
    """The engine ``config`` describes: its backend and settings, base weights in ``model.dtype``."""
    return make_engine(config.sampler.backend, model_path, config.sampler, dtype=config.model.dtype, **kwargs)
