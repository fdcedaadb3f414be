"""The Tinker training calls on a ``TrainingEngine``: the SDK's request types in, its result types out.

One function per call; the engine worker runs them in ``seq_id`` order per
model.  A Tinker model is one engine adapter, named ``model_run_name(model_id)``
(``<session>.train.<n>``).  Semantics (TINKER.md sections 5, 6 and 10):

  create_model      LoRA of ``lora_config.rank`` on the modules that train_attn /
                    train_mlp / train_unembed select, alpha ``LORA_ALPHA``, initialised
                    from ``lora_config.seed`` (or from the model id, so a replay of the
                    request log initialises it the same way); no LoRA dropout
  forward_backward  the loss (a sum over tokens), per-datum ``logprobs`` of the targets
                    and ``name:reduction`` metrics (``loss:sum`` always); no dropout runs
                    (the engine zeroes the base model's), so the logprobs are a function
                    of the weights, as Tinker's are; the gradients add
                    up until ``optim_step``; ``forward_only`` leaves every state untouched
  optim_step        AdamW with this call's AdamParams (``grad_clip_norm`` 0 = no clipping),
                    then the gradients are zeroed; with no forward_backward since the last
                    step nothing changes and no step is counted (``step:max`` stays)
  save_state / load_state  weights (+ AdamW state) as one safetensors blob
  export_for_sampling      the PEFT folder a sampler loads
  unload            forget the model

Every refusal is ``ApiError(message, "user")`` and is raised before anything
changed: the request is translated and checked completely first, and the
engine itself refuses a bad request without touching its state.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors.torch import load as load_safetensors
from tinker import types

from consumers.api.translate import engine_datums, engine_loss_args, lora_target_modules
from consumers.engine import AdamParams, ForwardResult, TrainingEngine
from consumers.engine_data import AdapterShapeError, EngineError
from pipeline.api.clients import check_create_model
from pipeline.io.tensors import save_tensors as save_safetensors
from schemas.api import ApiError, model_run_name
from schemas.names import InvalidNameError

LORA_ALPHA = 32.0
LOSS_FN_OUTPUT_TYPE = "ArrayRecord"
# safetensors metadata key saying a saved state carries no optimizer (save_state(with_optimizer=False))
_WEIGHTS_ONLY_KEY = "rlpipe.api.weights_only"


def create_model(engine: TrainingEngine, model_id: str, request: types.CreateModelRequest) -> None:
    """A new LoRA adapter for ``model_id`` (see the module docstring for the modules and the seed)."""
    name = adapter_name(model_id)
    lora = check_create_model(request)
    if name in engine.adapters():
        raise ApiError(f"model {model_id!r} already exists; unload it first or create another model")
    targets = lora_target_modules(engine.base, lora)
    seed = lora.seed if lora.seed is not None else _seed_of(model_id)
    with _as_user_errors():
        engine.create_adapter(name, rank=lora.rank, alpha=LORA_ALPHA, target_modules=targets, seed=seed)


def forward_backward(
    engine: TrainingEngine, model_id: str, request: types.ForwardBackwardRequest, forward_only: bool
) -> types.ForwardBackwardOutput:
    """Loss, logprobs and metrics of the request's datums; their gradients are accumulated unless ``forward_only``."""
    name = _known_model(engine, model_id, request.model_id)
    call = request.forward_backward_input
    loss_args = engine_loss_args(call.loss_fn, call.loss_fn_config)
    datums = engine_datums(list(call.data))
    run = engine.forward if forward_only else engine.forward_backward
    with _as_user_errors():
        result = run(name, datums, call.loss_fn, loss_args)
    return types.ForwardBackwardOutput(
        loss_fn_output_type=LOSS_FN_OUTPUT_TYPE,
        loss_fn_outputs=[{"logprobs": types.TensorData.from_torch(logprobs)} for logprobs in result.logprobs],
        metrics=_metrics(result),
    )


def optim_step(engine: TrainingEngine, model_id: str, request: types.OptimStepRequest) -> types.OptimStepResponse:
    """One AdamW step with the request's hyper-parameters over the gradients accumulated since the last one."""
    name = _known_model(engine, model_id, request.model_id)
    params = request.optim_params
    if not isinstance(params, types.AdamParams):
        raise ApiError(f"optimizer {getattr(params, 'type', type(params).__name__)!r} is not served; send adam_params")
    with _as_user_errors():
        adam = AdamParams(learning_rate=params.learning_rate, beta1=params.beta1, beta2=params.beta2,
                          eps=params.eps, weight_decay=params.weight_decay, grad_clip_norm=params.grad_clip_norm)
        step = engine.optim_step(name, adam, undo=True)  # a step failing part-way changes nothing: it may be resent
    return types.OptimStepResponse(metrics={"grad_norm:mean": step.grad_norm,
                                            "learning_rate:mean": step.learning_rate, "step:max": float(step.step)})


def save_state(engine: TrainingEngine, model_id: str, with_optimizer: bool = True,
               with_gradients: bool = False) -> bytes:
    """The model's weights, and unless ``with_optimizer`` is False its AdamW state, as safetensors bytes (with
    ``with_gradients`` also its accumulated gradients: a trainer's fold)."""
    name = _known_model(engine, model_id)
    state = engine.save_state(name, with_gradients=with_gradients)
    if with_optimizer:
        return state
    tensors = {key: t for key, t in load_safetensors(state).items() if not key.startswith("optimizer.")}
    return save_safetensors(tensors, metadata={**_metadata(state), _WEIGHTS_ONLY_KEY: "true"})


def load_state(engine: TrainingEngine, model_id: str, state: bytes, with_optimizer: bool,
               source: str = "this state") -> None:
    """Restore a ``save_state`` blob into ``model_id`` (created if unknown); without the optimizer, Adam restarts.
    ``source`` names the state in a refusal (its tinker:// path)."""
    name = adapter_name(model_id)
    if with_optimizer and _metadata(state).get(_WEIGHTS_ONLY_KEY) == "true":
        raise ApiError("this checkpoint holds weights only (saved without the optimizer); load it without "
                       "the optimizer (create_training_client_from_state)")
    with _as_user_errors():
        try:
            engine.load_state(name, state, with_optimizer=with_optimizer)
        except AdapterShapeError as exc:
            raise ApiError(f"{source} holds a {_shape(exc.saved)} adapter and this training client a "
                           f"{_shape(exc.current)} one; start a training client from it instead "
                           "(create_training_client_from_state)", "user") from None


def _shape(lora: dict[str, Any]) -> str:
    """An adapter's shape in the SDK's words: rank, alpha and the modules it trains."""
    return f"rank {lora['r']} (alpha {lora['lora_alpha']:g}, modules {', '.join(lora['target_modules'])})"


def export_for_sampling(engine: TrainingEngine, model_id: str, folder: Path) -> Path:
    """Write the model's PEFT folder (adapter_config.json + adapter_model.safetensors) for the adapter registry."""
    name = _known_model(engine, model_id)
    return engine.export_for_sampling(name, folder)


def unload(engine: TrainingEngine, model_id: str) -> None:
    """Forget the model: weights, optimizer state, accumulated gradients."""
    engine.delete_adapter(_known_model(engine, model_id))


def adapter_name(model_id: str) -> str:
    """The engine adapter that holds Tinker model ``model_id`` (its run name, ``<session>.train.<n>``)."""
    try:
        return model_run_name(model_id)
    except InvalidNameError as exc:
        raise ApiError(str(exc)) from None


# ---- phases --------------------------------------------------------------------------------
def _known_model(engine: TrainingEngine, model_id: str, request_model_id: str | None = None) -> str:
    """The adapter name of an existing model; a request naming another model than its route is refused."""
    if request_model_id is not None and request_model_id != model_id:
        raise ApiError(f"request is for model {request_model_id!r} but was sent to {model_id!r}; resend it")
    name = adapter_name(model_id)
    if name not in engine.adapters():
        raise ApiError(f"unknown model {model_id!r}; create it with create_model (or load_weights) first")
    return name


def _seed_of(model_id: str) -> int:
    """A seed that depends only on the model id, so every replay initialises the model identically."""
    return int.from_bytes(hashlib.sha256(model_id.encode()).digest()[:4], "little")


def _metrics(result: ForwardResult) -> dict[str, float]:
    """The engine's sums plus the ratio statistics (max/min of the importance ratios, clipped tokens)."""
    metrics = result.metrics()
    stats = result.stats
    if stats.ratio_count:
        metrics.update({"ratio_max:max": stats.ratio_max, "ratio_min:min": stats.ratio_min,
                        "ratio_sum:sum": stats.ratio_sum, "num_clipped:sum": float(stats.num_clipped)})
    return metrics


def _metadata(state: bytes) -> dict[str, str]:
    """The safetensors header's metadata of a saved state (empty if it is not one)."""
    try:
        header = json.loads(state[8 : 8 + int.from_bytes(state[:8], "little")])
        return dict(header.get("__metadata__") or {})
    except (ValueError, TypeError, AttributeError):
        return {}


@contextlib.contextmanager
def _as_user_errors() -> Iterator[None]:
    """The engine's refusals (``EngineError``: nothing was changed) reach the client as ``user`` errors.

    peft's warning about LoRA on a tied output head is silenced: the LoRA delta applies to the head
    only (the embeddings stay as they are), and the warning is about merging adapters into tied
    weights, which rlpipe never does.
    """
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            yield
    except EngineError as exc:
        raise ApiError(str(exc), "user") from None
