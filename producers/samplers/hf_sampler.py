"""The plain transformers sampler: a manual sampling loop with a KV cache, adapters through peft.

Why a second backend: it runs wherever torch runs (no vLLM wheel for the
platform, debugging, tests), and its loop is short enough to read, so it is
the reference for what vLLM should return.  Why a manual loop rather than
``model.generate``: every request needs its own random stream (reproducible
per request, different within a GRPO group) and the logprob of each sampled
token under the distribution it was drawn from, and both are one line each here.

Adapters: the base model is wrapped in one ``PeftModel`` holding every loaded
version under its own name; ``set_adapter`` picks the version for a batch and
``disable_adapter`` serves the base model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from producers.samplers.base import AdapterHandle, SampleOutput, Sampler, SampleRequest, request_seed
from producers.samplers.topk import TopKRows
from schemas.config import SamplerConfig
from schemas.names import echoed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Continuation:
    """One prompt to continue ``len(seeds)`` times (sample j from ``seeds[j]``) in ``continue_prompts``.

    ``topk_prompt`` / ``topk_sample`` >= 1 ask for that many most likely tokens at each prompt position (of the
    model's own distribution) / each sampled position (of the distribution the token was drawn from)."""

    prompt: list[int]
    max_new_tokens: int
    seeds: list[int | None]
    with_prompt_logprobs: bool = False
    topk_prompt: int = 0
    topk_sample: int = 0


@dataclass(frozen=True)
class Continued:
    """What ``continue_prompts`` made of one ``Continuation``: its samples, and its prompt's logprobs and top-k
    logprobs where asked for (None at position 0)."""

    samples: list[SampleOutput]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: TopKRows | None = None


class TransformersSampler(Sampler):
    """Samples with a transformers causal LM, one left-padded batch of up to ``max_batch`` requests at a time."""

    def __init__(
        self,
        model_path: str,
        config: SamplerConfig | None = None,
        device: str = "auto",
        dtype: str = "auto",
        max_batch: int = 16,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        config = config or SamplerConfig()
        self.config = config
        self.max_batch = max_batch
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
        self._lock = threading.Lock()  # one batch at a time: the adapter choice is model state
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id)
        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self._base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(self.device).eval()
        self.stop_token_ids = frozenset({self.eos_token_id, *generation_eos_ids(self._base.generation_config)})
        self.max_model_len = min(config.max_model_len, int(self._base.config.max_position_embeddings))
        self.vocab_size = int(self._base.get_input_embeddings().num_embeddings)
        self._peft: Any = None  # PeftModel once the first adapter is loaded
        self._handles: dict[str, AdapterHandle] = {}

    # ---- adapters ----------------------------------------------------------------
    def load_adapter(self, handle: AdapterHandle) -> None:
        """Load ``handle`` under its name; loading the same handle twice is a no-op."""
        handle.check_folder()
        with self._lock:
            self._load_locked(handle)

    def _load_locked(self, handle: AdapterHandle) -> None:
        known = self._handles.get(handle.name)
        if known == handle:
            return
        if known is not None:
            raise ValueError(f"adapter name {handle.name} already serves {known.path}; give every version a new name")
        check_adapter_folder_config(handle)  # before peft applies any of it to the base model
        import torch
        from peft import PeftModel
        from safetensors import SafetensorError

        try:
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(self._base, handle.path, adapter_name=handle.name)
            else:
                self._peft.load_adapter(handle.path, adapter_name=handle.name)
        except Exception as exc:
            # peft puts an adapter's layers into the model before it loads their weights: take them out again,
            # whatever failed (an unreadable file, memory), or the model samples with them from now on
            if self._peft is None:
                _strip_lora_layers(self._base)
            else:
                with contextlib.suppress(ValueError, KeyError):
                    self._peft.delete_adapter(handle.name)
            refused = (RuntimeError, ValueError, KeyError, SafetensorError)  # the weights themselves do not fit
            if not isinstance(exc, refused) or isinstance(exc, torch.OutOfMemoryError):
                raise
            reason = " ".join(str(exc).split())[:300]
            raise ValueError(f"peft refused adapter {handle.name} from {handle.path} ({reason}): sample only "
                             "adapters trained on this sampler's base model (model.base_model)") from exc
        self._peft.eval()
        self._handles[handle.name] = handle
        log.info("loaded adapter %s from %s", handle.name, handle.path)

    def unload_adapter(self, handle: AdapterHandle) -> None:
        """Delete ``handle``'s weights; unwrap the base model when it was the last adapter."""
        with self._lock:
            if self._handles.pop(handle.name, None) is None:
                return
            if self._handles:
                self._peft.set_adapter(next(iter(self._handles)))
                self._peft.delete_adapter(handle.name)
            else:
                self._base = self._peft.unload()  # strips the LoRA layers, leaves the base weights untouched
                self._peft = None

    @contextmanager
    def _policy(self, adapter: AdapterHandle | None) -> Iterator[Any]:
        """The model to run for ``adapter`` (None = the base model, even while adapters are loaded)."""
        if adapter is None:
            if self._peft is None:
                yield self._base
            else:
                with self._peft.disable_adapter():
                    yield self._peft
            return
        self._load_locked(adapter)
        self._peft.set_adapter(adapter.name)
        yield self._peft

    # ---- sampling ----------------------------------------------------------------
    def generate(
        self,
        requests: list[SampleRequest],
        adapter: AdapterHandle | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[SampleOutput]:
        """See ``Sampler.generate``; requests run in chunks of ``max_batch``."""
        self.check_requests(requests)
        if adapter is not None:
            adapter.check_folder()
        outputs: list[SampleOutput] = []
        with self._lock, self._policy(adapter) as model:
            for start in range(0, len(requests), self.max_batch):
                chunk = requests[start : start + self.max_batch]
                seeds = [request_seed(seed, start + i) for i in range(len(chunk))]
                outputs += self._generate_batch(model, chunk, temperature, top_p, seeds)
        return outputs

    def continue_prompt(
        self,
        prompt: list[int],
        adapter: AdapterHandle | None,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seeds: list[int | None],
        stop_ids: frozenset[int] | None = None,
        with_prompt_logprobs: bool = False,
        top_k: int = 0,
    ) -> tuple[list[SampleOutput], list[float | None] | None]:
        """One batch of ``len(seeds)`` continuations of ``prompt`` (sample j from ``seeds[j]``).

        ``stop_ids`` None stops at ``stop_token_ids``, an empty set only at ``max_new_tokens``; ``top_k`` >= 1
        keeps the k most likely tokens before the ``top_p`` cut.
        With ``with_prompt_logprobs``, also the model's own (temperature 1) logprob
        of every prompt token given the ones before it (None at position 0).
        """
        done = self.continue_prompts([Continuation(prompt, max_new_tokens, seeds, with_prompt_logprobs)], adapter,
                                     temperature, top_p, stop_ids, top_k)[0]
        return done.samples, done.prompt_logprobs

    def continue_prompts(
        self,
        calls: list[Continuation],
        adapter: AdapterHandle | None,
        temperature: float,
        top_p: float,
        stop_ids: frozenset[int] | None = None,
        top_k: int = 0,
    ) -> list[Continued]:
        """``continue_prompt`` for several prompts with the same settings, their rows decoded together, with the
        top-k logprobs each call asks for.

        Each row draws from its own seed, so a call's tokens do not depend on the others in the
        batch; its logprobs agree with the call alone within float rounding.
        """
        rows = [SampleRequest(call.prompt, call.max_new_tokens) for call in calls for _ in call.seeds]
        seeds = [seed for call in calls for seed in call.seeds]
        topk = [call.topk_sample for call in calls for _ in call.seeds]
        self.check_requests(rows)
        if adapter is not None:
            adapter.check_folder()
        outputs: list[SampleOutput] = []
        with self._lock, self._policy(adapter) as model:
            for start in range(0, len(rows), self.max_batch):
                end = start + self.max_batch
                outputs += self._generate_batch(model, rows[start:end], temperature, top_p, seeds[start:end],
                                                stop_ids, top_k, topk[start:end])
            scored = [self._prompt_logprobs(model, c.prompt, c.with_prompt_logprobs, c.topk_prompt)
                      if c.with_prompt_logprobs or c.topk_prompt else (None, None) for c in calls]
        results, taken = [], 0
        for call, (logprobs, topk_rows) in zip(calls, scored, strict=True):
            results.append(Continued(outputs[taken:taken + len(call.seeds)], logprobs, topk_rows))
            taken += len(call.seeds)
        return results

    def _prompt_logprobs(self, model: Any, prompt: list[int], plain: bool = True, topk: int = 0
                         ) -> tuple[list[float | None] | None, TopKRows | None]:
        """The model's own (temperature 1) logprob of each prompt token when ``plain``, and its ``topk`` most likely
        tokens at each position when ``topk`` >= 1; None at position 0 (nothing predicts it)."""
        import torch

        with torch.inference_mode():
            logits_TV = model(input_ids=torch.tensor([prompt], device=self.device)).logits[0].float()
        logprobs_TV = torch.log_softmax(logits_TV, dim=-1)
        # the token at position p is predicted by the logits at position p - 1
        logprobs: list[float | None] | None = None
        if plain:
            logprobs = [None] + [float(logprobs_TV[p - 1, token]) for p, token in enumerate(prompt) if p > 0]
        rows: TopKRows | None = None
        if topk:
            top = top_tokens(logprobs_TV[:-1], topk)
            rows = TopKRows.concatenate([TopKRows.blank(1, top.k), top], topk)
        return logprobs, rows

    def _generate_batch(
        self, model: Any, requests: list[SampleRequest], temperature: float, top_p: float, seeds: list[int | None],
        stop_ids: frozenset[int] | None = None, top_k: int = 0, topk_B: list[int] | None = None,
    ) -> list[SampleOutput]:
        """Decode one left-padded batch token by token until every row stopped (at a stop id or its budget).

        A row stops at ``stop_ids`` (None: ``stop_token_ids``) and at its request's ``extra_stop_ids``; a row with
        ``topk_B[b]`` >= 1 gets that many most likely tokens of each step's distribution (``top_tokens``)."""
        import torch

        stops = self.stop_token_ids if stop_ids is None else stop_ids
        stops_B = [stops | frozenset(r.extra_stop_ids) for r in requests]
        generators = [_generator(s, self.device) for s in seeds]
        budgets = [self.new_token_budget(r) for r in requests]
        input_ids_BT, attention_BT = self._left_pad(requests)
        tokens_B: list[list[int]] = [[] for _ in requests]
        logprobs_B: list[list[float]] = [[] for _ in requests]
        topk_B = topk_B or [0] * len(requests)
        widest = max(topk_B, default=0)
        tops_S: list[TopKRows] = []  # step s's rows of the whole batch, B x widest (a done request's unused)
        done_B = [False] * len(requests)
        cache = None
        step_ids_BT = input_ids_BT
        with torch.inference_mode():
            for _ in range(max(budgets)):
                positions_BT = (attention_BT.cumsum(-1) - 1).clamp(min=0)[:, -step_ids_BT.shape[1] :]
                out = model(
                    input_ids=step_ids_BT,
                    attention_mask=attention_BT,
                    position_ids=positions_BT,
                    past_key_values=cache,
                    use_cache=True,
                )
                cache = out.past_key_values
                logprobs_BV = sampling_logprobs(out.logits[:, -1, :].float(), temperature, top_p, top_k)
                next_B = [
                    _draw(logprobs_BV[b], temperature == 0.0, generators[b]) if not done_B[b] else self.pad_token_id
                    for b in range(len(requests))
                ]
                if widest:
                    tops_S.append(top_tokens(logprobs_BV, widest))
                for b, token in enumerate(next_B):
                    if done_B[b]:
                        continue
                    tokens_B[b].append(token)
                    logprobs_B[b].append(float(logprobs_BV[b, token]))
                    done_B[b] = token in stops_B[b] or len(tokens_B[b]) >= budgets[b]
                if all(done_B):
                    break
                step_ids_BT = torch.tensor(next_B, device=self.device).unsqueeze(-1)
                attention_BT = torch.cat([attention_BT, torch.ones_like(step_ids_BT)], dim=-1)
        rows_B = rows_by_request(tops_S, [len(t) for t in tokens_B], topk_B)
        return [
            SampleOutput(t, lp, "stop" if t and t[-1] in row_stops else "length", rows)
            for t, lp, row_stops, rows in zip(tokens_B, logprobs_B, stops_B, rows_B, strict=True)
        ]

    def _left_pad(self, requests: list[SampleRequest]) -> tuple[Any, Any]:
        """Prompts right-aligned (left padding), so every row's next token sits in the last column."""
        import torch

        length = max(len(r.prompt_token_ids) for r in requests)
        input_ids = torch.full((len(requests), length), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(requests), length), dtype=torch.long)
        for row, request in enumerate(requests):
            n = len(request.prompt_token_ids)
            input_ids[row, length - n :] = torch.tensor(request.prompt_token_ids)
            attention[row, length - n :] = 1
        return input_ids.to(self.device), attention.to(self.device)

    def close(self) -> None:
        """Drop the model (frees its memory once nothing else holds it)."""
        self._peft = None
        self._base = None


# What peft does on load with an adapter_config.json, beyond reading LoRA weights: an initialisation other than
# true, false or gaussian rewrites the base layers' weights (PiSSA, OLoRA, CorDA, LoftQ: W - BA, quantised
# residuals), which outlives the adapter's unload; ``layer_replication`` rebuilds the model's layers;
# ``megatron_config`` imports the module named by ``megatron_core``; ``modules_to_save`` and
# ``trainable_token_indices`` (even an empty list: the embedding is wrapped for no tokens) wrap base modules in
# peft's auxiliary wrappers, which are no tuner layers and outlive the unload.  rlpipe's learners publish none of
# these (null, peft's defaults), so an adapter that has them was written past them.
BASE_CHANGING_FIELDS = ("layer_replication", "megatron_config", "modules_to_save", "trainable_token_indices")


def check_adapter_config(config: object, what: str) -> None:
    """Refuse, in one line naming the field, an adapter config that is no plain LoRA's: another peft tuner type, an
    initialisation that changes the base model, layer replication, a Megatron module to import, or base modules
    to wrap (``modules_to_save``, ``trainable_token_indices``)."""
    if not isinstance(config, dict):
        raise ValueError(f"{what}: adapter_config.json holds {type(config).__name__}, not an object; publish the "
                         "adapter again")
    init = config.get("init_lora_weights", True)
    if config.get("peft_type") != "LORA":
        problem = f"peft_type={echoed(config.get('peft_type'))}"
    elif not (isinstance(init, bool) or init == "gaussian"):
        problem = f"init_lora_weights={echoed(init)}"
    else:
        problem = next((f"{field}={echoed(config[field])}" for field in BASE_CHANGING_FIELDS
                        if config.get(field) is not None), None)
    if problem is not None:
        raise ValueError(f"{what}: adapter_config.json sets {problem}, which peft would apply to the shared base "
                         "model on load (or which is no LoRA); serve only plain LoRA adapters as rlpipe's learners "
                         "publish them (peft_type LORA, default initialisation)")


def check_adapter_folder_config(handle: AdapterHandle) -> None:
    """``check_adapter_config`` on ``handle``'s ``adapter_config.json`` (a folder ``check_folder`` let through)."""
    config_file = os.path.join(handle.path, "adapter_config.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep to read
        raise ValueError(f"adapter {handle.name}: {config_file} is not JSON ({exc}); publish the adapter again"
                         ) from None
    check_adapter_config(config, f"adapter {handle.name}")


def _strip_lora_layers(model: Any) -> None:
    """Put every layer peft wrapped back in place of its wrapper, and drop the config peft left on ``model``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    vars(model).pop("peft_config", None)


def generation_eos_ids(generation_config: Any) -> list[int]:
    """The eos ids of a loaded model's generation config (its ``generation_config.json``, else its config's).

    vLLM stops at these as well as at the tokenizer's eos (instruct models often list their end-of-turn and
    end-of-text tokens there), so the transformers sampler does too.
    """
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def _generator(seed: int | None, device: Any) -> Any:
    import torch

    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sampling_logprobs(logits_BV: Any, temperature: float, top_p: float, top_k: int = 0) -> Any:
    """Log-probabilities of the distribution tokens are drawn from (float32), -inf outside the nucleus.

    ``softmax(logits / temperature)`` cut to the ``top_k`` most likely tokens (when
    ``top_k`` >= 1; ties at the k-th logit all stay), then to the smallest set of most
    likely tokens whose mass reaches ``top_p`` (the most likely token always stays), and
    renormalised: what vLLM computes with ``logprobs_mode="processed_logprobs"``.
    Greedy decoding (temperature 0) has no distribution: its logprobs are the
    temperature-1 ones, uncut, as vLLM reports them.
    """
    import torch

    if temperature == 0.0:
        return torch.log_softmax(logits_BV.float(), dim=-1)
    logits_BV = logits_BV.float() / temperature
    if 0 < top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[..., -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, -torch.inf)
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        outside_BV = probs_BV.cumsum(-1) - probs_BV >= top_p  # the mass before this token already reaches top_p
        logits_BV = logits_BV.scatter(-1, order_BV, sorted_BV.masked_fill(outside_BV, -torch.inf))
    return torch.log_softmax(logits_BV, dim=-1)


def top_tokens(logprobs_NV: Any, k: int) -> TopKRows:
    """Each row's ``k`` most likely tokens with their logprobs, most likely first; tokens of logprob -inf (outside a
    top-k or top-p cut: they cannot be drawn) are left out.  One ``topk`` over the rows and one copy to the host."""
    import torch

    values_NK, ids_NK = torch.topk(logprobs_NV, min(k, logprobs_NV.shape[-1]), dim=-1)
    return TopKRows.from_ranked(ids_NK.cpu().numpy(), values_NK.cpu().numpy())


def rows_by_request(tops_S: list[TopKRows], lengths_B: list[int], topk_B: list[int]) -> list[TopKRows | None]:
    """A batch's top-k rows, one ``TopKRows`` per request, from its steps' rows (step s: B x K, row b request b's).
    Request b decoded the first ``lengths_B[b]`` steps (a request that stops decodes no more), so its rows are
    those steps' row b, its first ``topk_B[b]`` columns (None where 0); the steps are stacked once, B x S x K."""
    if not tops_S:
        return [TopKRows.blank(0, k) if k else None for k in topk_B]
    ids_BSK = np.stack([top.ids_NK for top in tops_S], axis=1)
    logprobs_BSK = np.stack([top.logprobs_NK for top in tops_S], axis=1)
    return [TopKRows(ids_BSK[b, :n, :k], logprobs_BSK[b, :n, :k]) if k else None
            for b, (n, k) in enumerate(zip(lengths_B, topk_B, strict=True))]


def _draw(logprobs_V: Any, greedy: bool, generator: Any) -> int:
    """One token: the most likely when ``greedy``, else a draw from ``exp(logprobs_V)``."""
    import torch

    if greedy:
        return int(torch.argmax(logprobs_V))
    return int(torch.multinomial(logprobs_V.exp(), 1, generator=generator))


def _sample(logits_V: Any, temperature: float, top_p: float, generator: Any) -> int:
    """One token from ``softmax(logits / temperature)`` restricted to the top-p nucleus; greedy at temperature 0."""
    return _draw(sampling_logprobs(logits_V[None], temperature, top_p)[0], temperature == 0.0, generator)
