"""Tinker's training inputs in the training engine's terms: datums, loss configurations, LoRA modules.

Alignment (TINKER.md section 6): position i of a datum's ``model_input`` (the
concatenation of its chunks) predicts ``loss_fn_inputs["target_tokens"][i]``,
and every loss input holds one value per input token.  The engine's ``Datum``
has exactly that layout, so a datum translates without any shift: the text
chunks are concatenated and each ``TensorData`` becomes a 1-D tensor.

Losses keep Tinker's definitions (sums over tokens, no normaliser), which the
engine's losses reproduce with these arguments:

  importance_sampling  no truncation and no ratio mask: -sum exp(lp - q) A
  ppo                  Tinker's absolute thresholds (clip_low_threshold 0.8,
                       clip_high_threshold 1.2) as the engine's epsilons, no ratio mask
  cispo                thresholds as given (default 0 and 4)
  dro                  beta (default 0.05)
  gspo                 thresholds on the sequence ratio as given (default 0.8 and 1.2,
                       ppo's), the ratio over the targets ``sequence_ratio_mask`` marks

LoRA modules: ``train_attn`` / ``train_mlp`` select the linear layers inside a
block's attention / MLP (found by their parents' names, so any Hugging Face
causal LM works), ``train_unembed`` the output head.  Modules are named by
their own name where that is unambiguous (``q_proj``) and with their parent's
otherwise (``attn.c_proj`` next to ``mlp.c_proj`` in GPT-2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from tinker import types

from consumers.engine_data import Datum
from pipeline.api.wire import not_finite_loss_config
from schemas.adam import FLOAT32_MAX
from schemas.api import ApiError
from schemas.names import echoed

LOSS_INPUTS = ("target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask")
# loss -> its loss_fn_config keys with Tinker's defaults
LOSS_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}
_OPEN_RATIO_MASK = {"ratio_mask_low": 0.0, "ratio_mask_high": math.inf}
_ATTENTION_PARTS = ("attn", "attention")
_MLP_PARTS = ("mlp", "feed_forward", "ffn", "experts")


def engine_loss_args(loss: str, config: Mapping[str, float | str] | None) -> dict[str, float]:
    """The engine's keyword arguments for Tinker loss ``loss`` with ``loss_fn_config`` ``config``."""
    if loss == "stable_reinforce":
        raise ApiError("loss_fn stable_reinforce is not served (it needs the sampler's stability records, which "
                       "rlpipe does not keep); train with another, e.g. the cookbook's rl_loop with "
                       "loss_fn=importance_sampling")
    if loss not in LOSS_CONFIG_DEFAULTS:
        raise ApiError(f"unknown loss_fn {echoed(loss)}; rlpipe serves {', '.join(LOSS_CONFIG_DEFAULTS)}")
    values = dict(LOSS_CONFIG_DEFAULTS[loss])
    for key, value in (config or {}).items():
        if key not in values:
            takes = ", ".join(LOSS_CONFIG_DEFAULTS[loss]) or "no loss_fn_config"
            raise ApiError(f"loss_fn {loss} does not take loss_fn_config {echoed(key)}; it takes {takes}")
        values[key] = _number(key, value)
    if loss == "cross_entropy":
        return {}
    if loss == "importance_sampling":
        return {"is_cap": math.inf, **_OPEN_RATIO_MASK}
    if loss == "dro":
        if values["beta"] < 0:
            raise ApiError(f"loss_fn dro needs beta >= 0, got {values['beta']}")
        return values
    low, high = values["clip_low_threshold"], values["clip_high_threshold"]
    if not 0 <= low <= high:
        raise ApiError(f"loss_fn {loss} needs 0 <= clip_low_threshold <= clip_high_threshold, got {low} and {high}")
    if loss == "ppo":
        return {"clip_low": 1.0 - low, "clip_high": high - 1.0, **_OPEN_RATIO_MASK}
    return values


def _number(key: str, value: float | str) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise ApiError(not_finite_loss_config(key, value))  # (the gateway refuses NaN and infinity so too)
    if abs(number) > FLOAT32_MAX:  # the losses compute in float32, where torch cannot hold it
        raise ApiError(f"loss_fn_config {key}={echoed(value)} is beyond float32's {FLOAT32_MAX:g}, the precision the "
                       "losses compute in; use a number within it")
    return number


def engine_datums(data: list[types.Datum]) -> list[Datum]:
    """Every datum of a request in the engine's layout; the error names the first bad datum."""
    datums = []
    for index, datum in enumerate(data):
        try:
            datums.append(_engine_datum(datum))
        except ApiError as exc:
            raise ApiError(f"datum {index}: {exc}") from None
    return datums


def _engine_datum(datum: types.Datum) -> Datum:
    if not isinstance(datum, types.Datum):
        raise ApiError(f"expected a tinker Datum, got {type(datum).__name__}")
    tokens: list[int] = []
    for index, chunk in enumerate(datum.model_input.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise ApiError(f"model_input chunk {index} is {getattr(chunk, 'type', type(chunk).__name__)!r}; "
                           "rlpipe's models read text only, send encoded_text chunks")
        tokens.extend(int(token) for token in chunk.tokens)
    inputs = dict(datum.loss_fn_inputs)
    unknown = sorted(set(inputs) - set(LOSS_INPUTS))
    if unknown:
        raise ApiError(f"loss_fn_inputs {echoed(unknown)} are not served; send {', '.join(LOSS_INPUTS)}")
    if "target_tokens" not in inputs:
        raise ApiError("loss_fn_inputs has no target_tokens; send one target per model_input token")
    tensors = {key: _vector(key, value, len(tokens)) for key, value in inputs.items()}
    return Datum(tokens, **tensors)


def _vector(key: str, value: types.TensorData, n: int) -> torch.Tensor:
    """One loss input as a 1-D tensor.  Its shape is checked first: a sparse CSR input (2-D, as the SDK encodes
    top-k inputs) would be densified to whatever size its shape claims."""
    if value.shape is not None and len(value.shape) != 1:
        raise ApiError(f"{key} has shape {echoed(list(value.shape))}, expected [{n}] (one value per model_input token; "
                       "2-D inputs are not served)")
    try:
        tensor = value.to_torch()
    except (AssertionError, RuntimeError, TypeError, ValueError) as exc:
        raise ApiError(f"{key} is not a readable TensorData ({type(exc).__name__}); send dense float32/int64 data"
                       ) from None
    if tensor.dim() != 1:
        raise ApiError(f"{key} has shape {list(tensor.shape)}, expected [{n}] (one value per model_input token; "
                       "2-D inputs are not served)")
    if key == "target_tokens" and tensor.is_floating_point():
        raise ApiError("target_tokens must be int64 token ids, got float32")
    return tensor


def lora_target_modules(model: torch.nn.Module, lora: types.LoraConfig) -> list[str]:
    """peft ``target_modules`` for the parts of ``model`` that ``lora`` trains (see the module docstring)."""
    output = model.get_output_embeddings()
    output_path = next((path for path, module in model.named_modules() if module is output), None)
    found: dict[str, str] = {}  # module path -> kind
    for path, module in model.named_modules():
        if ".lora_" in path or not _is_linear(module):
            continue
        path = path.removesuffix(".base_layer")  # the layer peft wrapped for an existing adapter
        parents = path.split(".")[:-1]
        if path == output_path:
            found[path] = "unembed"
        elif any(key in part.lower() for part in parents for key in _ATTENTION_PARTS):
            found[path] = "attn"
        elif any(key in part.lower() for part in parents for key in _MLP_PARTS):
            found[path] = "mlp"
    wanted = {"attn": lora.train_attn, "mlp": lora.train_mlp, "unembed": lora.train_unembed}
    kinds_of_leaf: dict[str, set[str]] = {}
    for path, kind in found.items():
        kinds_of_leaf.setdefault(path.rsplit(".", 1)[-1], set()).add(kind)
    targets = set()
    for path, kind in found.items():
        if wanted[kind]:
            leaf = path.rsplit(".", 1)[-1]
            targets.add(leaf if len(kinds_of_leaf[leaf]) == 1 else ".".join(path.split(".")[-2:]))
    if not targets:
        raise ApiError("lora_config trains no module of this base model; set train_attn, train_mlp or train_unembed")
    return sorted(targets)


def _is_linear(module: torch.nn.Module) -> bool:
    """A plain linear layer (torch's, or the Conv1D that GPT-2-style models use)."""
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
