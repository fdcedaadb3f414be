"""Samplers: token-id prompts in, generated token ids with their logprobs out (vLLM or plain transformers)."""

from __future__ import annotations

from typing import Any

from producers.samplers.base import AdapterHandle, SampleOutput, Sampler, SampleRequest, request_seed
from schemas.config import RunConfig, SamplerConfig

__all__ = [
    "AdapterHandle", "SampleOutput", "SampleRequest", "Sampler", "make_sampler", "request_seed", "sampler_for_run",
]


def make_sampler(backend: str, model_path: str, config: SamplerConfig | None = None, **kwargs: Any) -> Sampler:
    """The sampler for ``backend`` ("vllm" or "transformers"); each backend is imported only when chosen."""
    config = config or SamplerConfig()
    if backend == "vllm":
        from producers.samplers.vllm_sampler import VLLMSampler

        return VLLMSampler(model_path, config, **kwargs)
    if backend == "transformers":
        from producers.samplers.hf_sampler import TransformersSampler

        return TransformersSampler(model_path, config, **kwargs)
    raise ValueError(f"unknown sampler backend {backend!r}; choose 'vllm' or 'transformers'")


def sampler_for_run(config: RunConfig, model_path: str, **kwargs: Any) -> Sampler:
    """The sampler ``config`` describes: its backend and settings, base weights in ``model.dtype``.

    ``sampler.engine`` "async" puts the sampling engine (``producers.samplers.engine``) behind the
    ``Sampler`` interface (``SyncSampler``), so every request is its own engine request.
    """
    if config.sampler.engine == "async":
        from producers.samplers.engine import engine_for_run
        from producers.samplers.sync import SyncSampler

        return SyncSampler(lambda: engine_for_run(config, model_path, **kwargs))
    return make_sampler(config.sampler.backend, model_path, config.sampler, dtype=config.model.dtype, **kwargs)
