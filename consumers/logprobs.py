"""Log-probabilities of a LoRA-wrapped causal model at chosen positions: the body once, the head where needed.

``position_logprobs`` runs the decoder body over a batch and the output head only at
the positions whose next-token distribution is wanted, in float32 (``head_float32``);
the columns every row starts with go through the body once (``shared_prefix_length``).
The policy (``consumers.policy``) and the training engine (``consumers.engine``) both
compute their logprobs here.
"""

from __future__ import annotations

import torch
from peft import PeftModel


def head_float32(head: torch.nn.Module, hidden_NH: torch.Tensor) -> torch.Tensor:
    """The output head in float32 at least (bf16 logits are too coarse for ratios); a LoRA-wrapped head runs as it is.

    Over bf16 weights this holds a float32 copy of the head's weight (vocabulary x
    hidden) until the backward pass: the price of float32 logprobs.  A float64
    model keeps float64.
    """
    dtype = torch.promote_types(hidden_NH.dtype, torch.float32)
    if isinstance(head, torch.nn.Linear):
        bias = None if head.bias is None else head.bias.to(dtype)
        return torch.nn.functional.linear(hidden_NH.to(dtype), head.weight.to(dtype), bias)
    return head(hidden_NH).to(dtype)


MIN_SHARED_PREFIX = 32  # tokens; a shorter common prefix is not worth a second pass through the body


def shared_prefix_length(input_ids_BT: torch.Tensor, first_needed: int) -> int:
    """How many leading columns every row of the batch shares, capped at ``first_needed`` (the first
    position whose hidden state is wanted); 0 for one row or fewer than ``MIN_SHARED_PREFIX`` columns."""
    if input_ids_BT.shape[0] < 2:
        return 0
    differs_T = (input_ids_BT != input_ids_BT[:1]).any(dim=0)
    length = int(differs_T.int().argmax()) if bool(differs_T.any()) else input_ids_BT.shape[1]
    length = min(length, first_needed)
    return length if length >= MIN_SHARED_PREFIX else 0


def _may_share(model: PeftModel) -> bool:
    """Sharing a prefix is exact unless dropout runs (it would draw one mask for every row's prefix); not with
    gradient checkpointing, which turns the cache off in training; never on a sharded body (FSDP2), whose every
    pass gathers each layer from all ranks, so that every rank must run as many passes as the others."""
    if _sharded(model.get_base_model()):
        return False
    if not model.training:
        return True
    rates = [getattr(cfg, "lora_dropout", 0.0) or 0.0 for cfg in model.peft_config.values()]
    base_config = model.get_base_model().config
    rates += [getattr(base_config, name, 0.0) or 0.0 for name in ("attention_dropout", "hidden_dropout")]
    if any(rates):
        return False
    # last: transformers answers this by walking every module
    return not getattr(model.get_base_model(), "is_gradient_checkpointing", False)


def _sharded(base: torch.nn.Module) -> bool:
    body = getattr(base, "model", None)
    if body is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False  # sharding needs a process group
    from torch.distributed.fsdp import FSDPModule

    return isinstance(body, FSDPModule)


def position_logprobs(
    model: PeftModel,
    input_ids_BT: torch.Tensor,
    rows_N: torch.Tensor,
    cols_N: torch.Tensor,
    divisors_N: torch.Tensor | None,
    autocast: bool,
) -> torch.Tensor:
    """log p(. | ``input_ids_BT[rows_N[i], :cols_N[i] + 1]``) over the vocabulary (N, V), head run at those positions only.

    The columns every row starts with (``shared_prefix_length``: a system prompt, a
    group's prompt) go through the body once, as one row, and every row's rest attends
    to their cached keys and values: the same numbers up to float rounding, and the
    prefix's share of the body's work saved (per-turn CartPole rows share 129 of about
    230 tokens).  Not while dropout runs (one mask would serve every row's prefix) or under gradient
    checkpointing (no cache in training) or on a sharded body (every rank must run as many passes).

    ``divisors_N`` (None = 1) divides each selected row of logits (sampling
    temperature, see ``logit_divisors``).  The body runs with the model's active
    LoRA adapter: peft injects its layers in place, so the base body applies them.
    """
    base = model.get_base_model()
    body, head = base.base_model, base.get_output_embeddings()  # Llama/Qwen: .model, .lm_head; GPT-2: .transformer
    device = input_ids_BT.device
    shared = shared_prefix_length(input_ids_BT, int(cols_N.min()) if len(cols_N) else 0) if _may_share(model) else 0
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        if shared:
            # the columns every row starts with (a system prompt, a group's prompt) run once, and every row's
            # rest attends to their keys and values: the same arithmetic, the prefix's share of the work saved
            cache = body(input_ids=input_ids_BT[:1, :shared], use_cache=True).past_key_values
            if cache is None or cache.get_seq_length() != shared:  # a model that would not cache: no sharing
                shared = 0
            else:
                cache.batch_repeat_interleave(input_ids_BT.shape[0])
                hidden_BTH = body(input_ids=input_ids_BT[:, shared:], past_key_values=cache,
                                  use_cache=True).last_hidden_state
        if not shared:
            hidden_BTH = body(input_ids=input_ids_BT).last_hidden_state
    logits_NV = head_float32(head, hidden_BTH[rows_N, cols_N - shared])
    if divisors_N is not None:
        logits_NV = logits_NV / divisors_N[:, None]
    return torch.log_softmax(logits_NV, dim=-1)


def selected_logprobs(
    model: PeftModel,
    input_ids_BT: torch.Tensor,
    rows_N: torch.Tensor,
    cols_N: torch.Tensor,
    targets_N: torch.Tensor,
    divisors_N: torch.Tensor | None,
    autocast: bool,
) -> torch.Tensor:
    """logp of ``targets_N[i]`` at the positions of ``position_logprobs``."""
    logprobs_NV = position_logprobs(model, input_ids_BT, rows_N, cols_N, divisors_N, autocast)
    return logprobs_NV.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1)
