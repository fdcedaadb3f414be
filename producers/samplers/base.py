"""The sampler contract: token ids in, token ids and their logprobs out.

The rollout worker hands a sampler prompts as token ids and gets back exactly
the generated token ids (the stop token included when generation stopped on
it) with one logprob per generated token.  Nothing is re-tokenized on the way,
so the learner trains on the very sequence the sampler produced.

Logprobs: each is the log-probability of the token under the distribution it
was drawn from: ``log softmax(logits / temperature)``, renormalised over the
top-p nucleus when ``top_p`` < 1 (vLLM's ``logprobs_mode="processed_logprobs"``).
The rows record that temperature and top-p, and the learner divides its logits
by the same temperature, so the importance ratio compares the sampling
distribution with the current policy's at that temperature and starts at 1.
Greedy decoding (temperature 0) draws from no distribution: its logprobs are the
temperature-1 ones, and the importance-ratio losses refuse such rows.
"""

from __future__ import annotations

import abc
import hashlib
import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal, Self

from producers.samplers.topk import TopKRows

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SampleRequest:
    """One prompt to continue (worker -> sampler).

    ``extra_stop_ids`` end the request as well as the model's eos ids: a chat template's turn-closing token
    where it is not eos (``<|im_end|>`` of a ChatML base model), so a turn does not run on into a user turn of
    the model's own.
    """

    prompt_token_ids: list[int]
    max_new_tokens: int
    extra_stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("SampleRequest.prompt_token_ids is empty; render the prompt with the chat template first")
        if self.max_new_tokens < 1:
            raise ValueError(f"SampleRequest.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class SampleOutput:
    """What the sampler generated for one request (sampler -> worker).

    ``token_ids`` ends with the stop token when ``finish_reason`` is "stop";
    ``logprobs[i]`` belongs to ``token_ids[i]`` (of the sampling distribution, see the module doc);
    ``topk_logprobs[i]``, when asked for, are the most likely tokens of the distribution ``token_ids[i]`` was
    drawn from, with their logprobs (the tokens it could be drawn from only: a top-k or top-p cut leaves fewer);
    rows given as lists of (token, logprob) are kept as ``TopKRows`` (topk.py), as the engines build them.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    topk_logprobs: TopKRows | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} logprobs")
        if self.topk_logprobs is not None and not isinstance(self.topk_logprobs, TopKRows):
            object.__setattr__(self, "topk_logprobs", TopKRows.from_rows(self.topk_logprobs))
        if self.topk_logprobs is not None and len(self.topk_logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.topk_logprobs)} rows of top-k logprobs")


@dataclass(frozen=True)
class AdapterHandle:
    """A LoRA adapter version pulled into a local folder, as the sampler serves it.

    ``lora_int_id`` and ``name`` must be new for every version: vLLM may serve a
    stale cached adapter when a name or id is reused.  ``run`` names the run the
    version belongs to when one engine serves several runs (the sampling engine
    keys adapters by run and version and gives each its own LoRA id).
    """

    version: int
    lora_int_id: int
    name: str
    path: str
    sha256: str
    run: str = ""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"AdapterHandle.lora_int_id must be a positive integer, got {self.lora_int_id}")
        if not self.name:
            raise ValueError("AdapterHandle.name is empty; use f'v{version}'")

    @classmethod
    def for_version(cls, version: int, path: str, sha256: str) -> AdapterHandle:
        """The handle with the conventional name ``v<version>`` and id ``version`` (versions start at 1)."""
        return cls(version=version, lora_int_id=version, name=f"v{version}", path=path, sha256=sha256)

    def check_folder(self) -> None:
        """Fail fast, naming the fix, when the adapter folder is not a local PEFT adapter."""
        if not os.path.isfile(os.path.join(self.path, "adapter_config.json")):
            raise FileNotFoundError(
                f"adapter {self.name}: no adapter_config.json in {self.path}; pull the adapter into a local folder first"
            )


def request_seed(seed: int | None, index: int) -> int | None:
    """The seed of request ``index`` in a call seeded with ``seed`` (None = unseeded).

    Hashing (seed, index) rather than adding gives unrelated streams to every
    request and every call, so two requests for the same prompt (a GRPO group)
    still differ, and calls seeded 0 and 1 do not share streams.  63 bits, so a
    long run's millions of draws do not meet by chance (31 bits would, by the
    birthday bound); torch's and vLLM's generators take any such seed.
    """
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


class Sampler(abc.ABC):
    """A policy that continues token-id prompts, optionally through a LoRA adapter."""

    eos_token_id: int
    max_model_len: int

    @abc.abstractmethod
    def generate(
        self,
        requests: list[SampleRequest],
        adapter: AdapterHandle | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[SampleOutput]:
        """One output per request, in order; generation stops at ``eos_token_id`` (or another eos id of the
        model's ``generation_config.json``, as vLLM does), at the request's ``extra_stop_ids`` or at
        ``max_new_tokens``.

        ``adapter`` None samples the base model; an adapter not loaded yet is loaded
        first.  ``temperature`` 0 is greedy.  With ``seed`` set, request i samples
        from its own stream ``request_seed(seed, i)``, so a call is reproducible.
        """

    #: True when ``submit`` starts a request that runs beside others (an engine serving a running batch); a
    #: sampler that only decodes whole calls leaves it False, and callers batch their requests into ``generate``.
    concurrent_requests: bool = False

    def submit(
        self,
        request: SampleRequest,
        adapter: AdapterHandle | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> Future[SampleOutput]:
        """Start one request and return at once; its output (or error) arrives in the future.

        Drawn from ``request_seed(seed, 0)``, as request 0 of ``generate`` with that seed.  Only a sampler whose
        ``concurrent_requests`` is True has it.
        """
        raise NotImplementedError(
            f"{type(self).__name__} decodes whole calls; call generate() (concurrent_requests is False)"
        )

    @abc.abstractmethod
    def load_adapter(self, handle: AdapterHandle) -> None:
        """Make ``handle`` ready to serve (errors surface here, not mid-batch)."""

    @abc.abstractmethod
    def unload_adapter(self, handle: AdapterHandle) -> None:
        """Free ``handle``'s slot; later requests for it load it again."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine (processes, memory)."""

    def check_requests(self, requests: list[SampleRequest]) -> None:
        """Refuse prompts that cannot fit the context with a message naming the fix."""
        for index, request in enumerate(requests):
            if len(request.prompt_token_ids) >= self.max_model_len:
                raise ValueError(
                    f"request {index}: prompt of {len(request.prompt_token_ids)} tokens does not fit "
                    f"max_model_len {self.max_model_len}; shorten the prompt (fewer history turns) "
                    "or raise sampler.max_model_len"
                )

    def new_token_budget(self, request: SampleRequest) -> int:
        """``max_new_tokens``, cut so prompt plus output fit ``max_model_len`` (then finish_reason is "length")."""
        return min(request.max_new_tokens, self.max_model_len - len(request.prompt_token_ids))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
