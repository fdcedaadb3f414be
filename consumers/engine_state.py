"""A training-engine state's format and the pieces of ``TrainingEngine`` that read it or set a process up for it:
the state blob (safetensors, its metadata as JSON), its adapter tensors, Adam state and RNG checked before use, the
RNG swapped around an adapter's operation, and the undo of an optimizer step that fails part-way."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from consumers.engine_data import EngineError
from consumers.policy import load_optimizer_tensors

STATE_FORMAT = "rlpipe.engine.state/1"


def read_state(state: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and metadata of a ``save_state`` blob; anything else is refused in one line."""
    try:
        header_len = int.from_bytes(state[:8], "little")
        header = json.loads(state[8 : 8 + header_len])
        meta = json.loads(header["__metadata__"]["rlpipe"])
        tensors = load_safetensors(state)
    except (ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"not a training-engine state ({type(exc).__name__}); pass bytes from save_state") from None
    if meta.get("format") != STATE_FORMAT:
        raise EngineError(f"state format {meta.get('format')!r} is not {STATE_FORMAT!r}")
    return tensors, meta


def checked_adapter_tensors(params: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor],
                            meta: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The state's adapter weights and accumulated gradients by PEFT key; ``EngineError`` unless they are the
    tensors of ``params`` (the same names, in order, and shapes)."""
    weights = {key[len("adapter."):]: t for key, t in tensors.items() if key.startswith("adapter.")}
    matches = meta.get("param_names") == list(params) and all(
        tuple(weights[key].shape) == tuple(p.shape) for key, p in params.items() if key in weights)
    if not matches or set(weights) != set(params):
        raise EngineError("state's adapter tensors do not match this base model's layers; "
                          "load it into an engine on the same base model")
    gradients = {key[len("gradient."):]: t for key, t in tensors.items() if key.startswith("gradient.")}
    if not all(key in params and tuple(t.shape) == tuple(params[key].shape) for key, t in gradients.items()):
        raise EngineError("state's gradients do not match its adapter's tensors; it is damaged")
    return weights, gradients


def checked_rng(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state's RNG state (empty when it has none); ``EngineError`` when torch refuses it."""
    rng = {key[len("rng."):]: t for key, t in tensors.items() if key.startswith("rng.")}
    if rng:
        try:
            with swapped_rng(None):  # torch's own check of each generator state; the process's is put back
                restore_rng(rng)
        except (KeyError, RuntimeError, TypeError) as exc:
            raise EngineError(f"state's RNG is damaged ({type(exc).__name__}: {exc}); save it again") from None
    return rng


def checked_optimizer(params: list[torch.nn.Parameter], tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                      device: torch.device) -> tuple[torch.optim.AdamW, int]:
    """A new AdamW over ``params`` holding the state's Adam state, and the state's step count; ``EngineError`` if
    that state is damaged (malformed, or moments of another shape than their parameter)."""
    saved = {key[len("optimizer."):]: t for key, t in tensors.items() if key.startswith("optimizer.")}
    optimizer = torch.optim.AdamW(params, lr=0.0)
    try:
        load_optimizer_tensors(optimizer, saved, meta["param_groups"], device)
        step = int(meta["step"])
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise EngineError(f"state's optimizer is damaged ({type(exc).__name__}: {exc}); load it without the "
                          "optimizer, or save it again") from None
    for p in params:
        moments = optimizer.state.get(p, {})
        if any(tuple(moments[slot].shape) != tuple(p.shape) for slot in ("exp_avg", "exp_avg_sq")
               if slot in moments):
            raise EngineError("state's optimizer moments do not match its adapter's tensors; it is damaged: "
                              "load it without the optimizer, or save it again")
    return optimizer, step


def step_undo(params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """What puts ``params`` (weights and gradients) and ``optimizer`` (moments, step counts, hyper-parameters) back
    as they are now: for an optimizer step that fails part-way (clipping and AdamW change them in place, tensor by
    tensor).  The copies stay on the device: about four adapters' worth (weights, gradients and Adam's two moments)
    while the step runs, which is why only a caller that answers the failure to a client asks for them."""
    weights = {key: p.detach().clone() for key, p in params.items()}
    gradients = {key: None if p.grad is None else p.grad.detach().clone() for key, p in params.items()}
    state = {p: {slot: value.clone() if torch.is_tensor(value) else value for slot, value in slots.items()}
             for p, slots in optimizer.state.items()}
    groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]

    def undo() -> None:
        with torch.no_grad():
            for key, p in params.items():
                p.copy_(weights[key])
                p.grad = gradients[key]
        optimizer.state.clear()
        optimizer.state.update(state)
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            group.update(saved)

    return undo


@contextlib.contextmanager
def swapped_rng(state: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """Run the block with RNG ``state`` (None = as it is) and give the process its own state back afterwards."""
    saved = capture_rng()
    if state:
        restore_rng(state)
    try:
        yield
    finally:
        restore_rng(saved)


def capture_rng() -> dict[str, torch.Tensor]:
    rng = {"cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


def restore_rng(rng: dict[str, torch.Tensor]) -> None:
    torch.random.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
