"""Samplers: token-id prompts in, generated token ids with their logprobs out (vLLM or plain transformers)."""

from __future__ import annotations

from typing import Any

from producers.samplers.base import AdapterHandle, SampleOutput, Sampler, SampleRequest, request_seed
from schemas.config import SamplerConfig

__all__ = ["AdapterHandle", "SampleOutput", "SampleRequest", "Sampler", "make_sampler", "request_seed"]


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
