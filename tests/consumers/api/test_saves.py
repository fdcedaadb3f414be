"""Saved training states: a load restores exactly the bytes its save wrote, or refuses the state."""

from __future__ import annotations

import json

import pytest
from tinker import types

from consumers.api import saves
from pipeline.api import checkpoints
from pipeline.api.wire import parse_tinker_path
from pipeline.io.store import ObjectStore
from schemas.api import ApiError, ApiRequestAccepted

TENANT, SESSION, BASE = "alice", "s1", "/models/tiny"
MODEL_ID = f"{SESSION}:train:0"
STATE = b"weights and AdamW state, as save_state wrote them"


class StateEngine:
    """Just enough of a training engine for a save and a load: one model, its state bytes, what it loaded."""

    def __init__(self) -> None:
        self.loaded: list[bytes] = []

    def adapters(self) -> list[str]:
        return [f"{SESSION}.train.0"]

    def save_state(self, name: str, with_gradients: bool = False) -> bytes:
        return STATE

    def load_state(self, name: str, state: bytes, with_optimizer: bool) -> None:
        self.loaded.append(state)


def _call(op: str, seq_id: int) -> ApiRequestAccepted:
    return ApiRequestAccepted(request_id=f"r{seq_id}", tenant=TENANT, session_id=SESSION, op=op, model_id=MODEL_ID,
                              seq_id=seq_id, base_model=BASE, body_path=f"bodies/r{seq_id}", body_sha256="0" * 64)


def _save_then_load(store: ObjectStore, engine: StateEngine, damage: bytes | None) -> None:
    store.put(f"sessions/{SESSION}/session.json", json.dumps({"tenant": TENANT}).encode())
    saves.save_weights(store, engine, MODEL_ID, _call("save_weights", 1),  # type: ignore[arg-type]
                       types.SaveWeightsRequest(model_id=MODEL_ID, path="w", seq_id=1))
    if damage is not None:
        store.put(checkpoints.weights_key(parse_tinker_path(f"tinker://{MODEL_ID}/weights/w")), damage)
    saves.load_weights(store, engine, MODEL_ID, _call("load_weights", 2),  # type: ignore[arg-type]
                       types.LoadWeightsRequest(model_id=MODEL_ID, path=f"tinker://{MODEL_ID}/weights/w",
                                                optimizer=False, seq_id=2), replaying=False)


def test_a_saved_state_loads_as_saved() -> None:
    engine = StateEngine()
    _save_then_load(ObjectStore("memory://saves-intact"), engine, damage=None)
    assert engine.loaded == [STATE]


def test_a_saved_state_whose_bytes_changed_since_its_save_is_refused_and_not_loaded() -> None:
    engine = StateEngine()
    damaged = STATE.replace(b"AdamW", b"Adam!")  # one flipped byte: a parser would still read it
    with pytest.raises(ApiError, match="do not match the sha256 its save recorded"):
        _save_then_load(ObjectStore("memory://saves-damaged"), engine, damage=damaged)
    assert engine.loaded == []
