"""What a request creating a session or a training client, or stepping its optimizer, may ask for: the checks the gateway and
the trainer both run.

The gateway records a training client (and counts it against its tenant) before the trainer makes it, so every
creation the trainer would refuse is refused by the gateway first, with the same one-line error: the trainer
checks again what it reads from the log.  Sequence numbers (``model_seq_id`` too, which a ``load_weights`` making a
new training client also sends) are the gateway's alone to check (``pipeline.api.wire.check_seq``): the trainer
only sees calls the gateway numbered and logged.
"""

from __future__ import annotations

import json
from typing import Any

from tinker import types

from schemas.adam import adam_params_problem
from schemas.api import ApiError
from schemas.names import echoed

MAX_METADATA_BYTES = 64 << 10  # a session's tags, or a session's or training client's user_metadata, as JSON

MAX_LORA_RANK = 512  # the largest LoRA rank vLLM serves (its max_lora_rank slots)
LORA_SEEDS = range(-(2**63), 2**64)  # the seeds torch.manual_seed takes (a new adapter's initialisation)


def check_lora_seed(seed: int | None) -> None:
    """Refuse a ``lora_config.seed`` the trainer cannot initialise an adapter from."""
    if seed is not None and seed not in LORA_SEEDS:
        raise ApiError(f"lora_config.seed={echoed(seed)}: use a seed from {LORA_SEEDS.start} to "
                       f"{LORA_SEEDS.stop - 1}, or none (the model id seeds it)")


def check_create_model(request: types.CreateModelRequest) -> types.LoraConfig:
    """The LoRA config of a ``create_model`` the trainer can make, or ``ApiError`` naming the fix; the gateway and
    the trainer both check, so that no training client is recorded for one the trainer would refuse."""
    lora = request.lora_config
    if lora is None:
        raise ApiError("create_model needs a lora_config (rlpipe trains LoRA adapters); send its rank")
    if not 1 <= lora.rank <= MAX_LORA_RANK:
        raise ApiError(f"lora_config.rank={echoed(lora.rank)}: use a rank of at least 1 and at most {MAX_LORA_RANK} "
                       "(the largest vLLM serves)")
    if request.optimizer_config.type != "adamw":
        raise ApiError(f"optimizer {echoed(request.optimizer_config.type)} is not served; use adamw (the default)")
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise ApiError("lora_config trains no module of this base model; set train_attn, train_mlp or train_unembed")
    check_lora_seed(lora.seed)
    return lora


def check_optim_params(params: types.OptimParams) -> None:
    """Refuse an ``optim_step`` the trainer would refuse: an optimizer not served, or Adam parameters out of the
    engine's ranges (``schemas.adam``), with the same one-line error."""
    if not isinstance(params, types.AdamParams):
        raise ApiError(f"optimizer {params.type!r} is not supported; use AdamParams")
    problem = adam_params_problem(**params.model_dump())
    if problem is not None:
        raise ApiError(problem)


def check_metadata(field: str, value: Any) -> None:
    """Refuse metadata over ``MAX_METADATA_BYTES`` (kept in records every listing reads and a gateway caches)."""
    size = len(json.dumps(value).encode())
    if size > MAX_METADATA_BYTES:
        raise ApiError(f"{field} of {size} bytes (as JSON): keep it within {MAX_METADATA_BYTES} bytes; store "
                       "larger data elsewhere and put its address in it")
