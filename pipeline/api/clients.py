"""What a request creating a training or sampling client may ask for: checks shared by the gateway and the trainer.

The gateway records a training client (and counts it against its tenant) before the trainer makes it, so every
creation the trainer would refuse is refused by the gateway first, with the same one-line error: the trainer
checks again what it reads from the log.
"""

from __future__ import annotations

from tinker import types

from pipeline.api.wire import MAX_SEQ
from schemas.api import ApiError
from schemas.names import echoed

LORA_SEEDS = range(-(2**63), 2**64)  # the seeds torch.manual_seed takes (a new adapter's initialisation)


def check_lora_seed(seed: int | None) -> None:
    """Refuse a ``lora_config.seed`` the trainer cannot initialise an adapter from."""
    if seed is not None and seed not in LORA_SEEDS:
        raise ApiError(f"lora_config.seed={echoed(seed)}: use a seed from {LORA_SEEDS.start} to "
                       f"{LORA_SEEDS.stop - 1}, or none (the model id seeds it)")


def check_create_model(request: types.CreateModelRequest) -> types.LoraConfig:
    """The LoRA config of a ``create_model`` the trainer can make, or ``ApiError`` naming the fix; the gateway and
    the trainer both check, so that no training client is recorded for one the trainer would refuse (the rank is
    ``Gateway.register_model``'s to check)."""
    lora = request.lora_config
    if lora is None:
        raise ApiError("create_model needs a lora_config (rlpipe trains LoRA adapters); send its rank")
    if request.optimizer_config.type != "adamw":
        raise ApiError(f"optimizer {echoed(request.optimizer_config.type)} is not served; use adamw (the default)")
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise ApiError("lora_config trains no module of this base model; set train_attn, train_mlp or train_unembed")
    check_lora_seed(lora.seed)
    return lora


def check_sampling_seq(seq: int) -> None:
    """Refuse a ``sampling_session_seq_id`` the SDK never sends (it numbers sampling clients from 0)."""
    if not 0 <= seq <= MAX_SEQ:
        raise ApiError(f"sampling_session_seq_id={echoed(seq)}: a ServiceClient numbers its sampling clients from 0 "
                       f"(up to {MAX_SEQ}); use the tinker SDK's create_sampling_client")
