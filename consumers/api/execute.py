"""What one API training call does: its body read from the store, its op run on the engine, its answer known.

``run_call`` executes one call (``create_model``, ``forward_backward``, ``optim_step``,
the loads and saves) on a ``TrainingEngine`` for one model, and ``answered`` and
``changes_nothing`` tell the trainer (``consumers.api.worker``), which orders the
calls and keeps the models' lifecycle, whether a call replayed after a restart runs
again.  The translation of each op's SDK types is ``consumers.api.ops``; the calls
that write or read saved weights are ``consumers.api.saves``.
"""

from __future__ import annotations

import json
from typing import Any

from tinker import types

from consumers.api import ops, saves
from consumers.api.calls import Model
from consumers.engine import TrainingEngine
from pipeline.api import lifecycle
from pipeline.api.wire import decode_forward_backward, encode_forward_backward_output, parse_body
from pipeline.io.store import ObjectStore
from schemas.api import ApiError, ApiRequestAccepted, result_path

# calls that change no adapter state: never re-executed
PURE_OPS = ("save_weights", "save_weights_for_sampler", "save_weights_external")


class FilesDeleted(Exception):
    """A call's body is gone with its ended session's files (``pipeline.api.lifecycle.sweep_sessions``)."""


def answered(store: ObjectStore, call: ApiRequestAccepted) -> str | None:
    """Whether the call has a stored result: None, "ok" or "error" (a JSON ``{"error", "category"}``)."""
    if store.exists(result_path(call.session_id, call.request_id, "pb")):
        return "ok"
    try:
        answer = json.loads(store.get(result_path(call.session_id, call.request_id, "json")))
    except FileNotFoundError:
        return None
    return "error" if isinstance(answer, dict) and "error" in answer else "ok"


def changes_nothing(store: ObjectStore, call: ApiRequestAccepted) -> bool:
    """A call that leaves the model as it was: a pure one, or a forward-only ``forward_backward``."""
    return call.op in PURE_OPS or (call.op == "forward_backward" and call.body_format == "pb"
                                   and decode_forward_backward(call_body(store, call))[1])


def call_body(store: ObjectStore, call: ApiRequestAccepted) -> bytes:
    """The call's body, checked against its digest; ``FilesDeleted`` when its session's files were deleted."""
    try:
        return store.get(call.body_path, call.body_sha256)
    except FileNotFoundError:
        if lifecycle.files_deleted(store, call.session_id) is not None:
            raise FilesDeleted(call.session_id) from None
        raise


def run_call(store: ObjectStore, engine: TrainingEngine, base_model: str, model: Model, call: ApiRequestAccepted,
             replaying: bool) -> tuple[bytes, str, int]:
    """Execute one call on the engine: the result's bytes, its format and the tokens it trained.

    ``replaying``: the call succeeded before (a restart's replay, or the call resent)."""
    saves.check_tenant(store, call.tenant, call.session_id)
    if call.refused is not None:  # refused by the gateway (the client has its 400): answered, and the next goes on
        raise ApiError(call.refused)
    if model.refused and call.op != "load_weights":  # a load replaces the whole state: the way out
        raise ApiError(model.refused, "server")
    body = call_body(store, call)
    if call.op == "create_model":
        ops.create_model(engine, model.model_id, parse_body(types.CreateModelRequest, body))
        model.loaded = True
        return _json({"type": "create_model", "model_id": model.model_id}), "json", 0
    if call.op == "load_weights":
        data = saves.load_weights(store, engine, model.model_id, call, parse_body(types.LoadWeightsRequest, body),
                                  replaying)
        model.loaded, model.has_gradients, model.refused, model.replay_failed = True, False, None, False
        model.fold_now = True  # (see TrainerWorker._fold_after_load)
        return data, "json", 0
    if not model.loaded:
        raise ApiError(f"model {model.model_id} does not exist or has been unloaded (session ended); "
                       "create a new training client")
    if call.op == "forward_backward":
        request, forward_only = decode_forward_backward(body)
        output = ops.forward_backward(engine, model.model_id, request, forward_only)
        tokens = sum(datum.model_input.length for datum in request.forward_backward_input.data)
        model.has_gradients |= not forward_only
        if model.split is not None:
            model.split.datums_before += len(request.forward_backward_input.data)
        return encode_forward_backward_output(output), "pb", tokens
    if call.op == "optim_step":
        try:
            response = ops.optim_step(engine, model.model_id, parse_body(types.OptimStepRequest, body))
        finally:  # a refusal may have discarded them (gradients that are not finite), or kept them
            model.has_gradients = engine.has_gradients(ops.adapter_name(model.model_id))
        return _json(response.model_dump(mode="json")), "json", 0
    if call.op == "save_weights":
        return saves.save_weights(store, engine, model.model_id, call,
                                  parse_body(types.SaveWeightsRequest, body)), "json", 0
    if call.op == "save_weights_for_sampler":
        return saves.save_for_sampler(store, engine, base_model, model.model_id, model.next_seq, call,
                                      parse_body(types.SaveWeightsForSamplerRequest, body)), "json", 0
    if call.op == "save_weights_external":
        return saves.save_external(store, engine, model.model_id, call,
                                   parse_body(types.SaveWeightsExternalRequest, body)), "json", 0
    raise ApiError(f"{call.op} is not a training call; send it to the sampler")


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()
