"""The API's events and the mapping of Tinker ids onto rlpipe names."""

from __future__ import annotations

import hashlib

import pytest

from schemas.api import (
    ApiRequestAccepted,
    ApiResultReady,
    model_id_for,
    model_run_name,
    request_body_path,
    result_path,
)
from schemas.events import decode_event, encode_event, make_event
from schemas.names import InvalidNameError, validate_name

SHA = hashlib.sha256(b"body").hexdigest()


def test_model_ids_map_one_to_one_onto_valid_run_names() -> None:
    names = {model_run_name(model_id_for(f"sess-{s}", "train", n)) for s in ("a1", "b2") for n in range(3)}
    assert len(names) == 6
    for name in names:
        assert validate_name(name) == name
    assert model_run_name("sess-a1:train:2") == "sess-a1.train.2"


@pytest.mark.parametrize("bad", ["", "sess", "../x:train:0", "s:train:-1", "s:train:0/..", "s:eval:0"])
def test_malformed_model_ids_are_refused(bad: str) -> None:
    with pytest.raises(InvalidNameError):
        model_run_name(bad)


def test_paths_refuse_unsafe_ids() -> None:
    assert request_body_path("s1", "r1", "pb") == "sessions/s1/requests/r1.pb"
    assert result_path("s1", "r1", "json") == "sessions/s1/results/r1.json"
    with pytest.raises(InvalidNameError):
        request_body_path("../s1", "r1", "json")
    with pytest.raises(InvalidNameError):
        result_path("s1", "a/b", "json")


def test_request_and_result_events_round_trip() -> None:
    request = ApiRequestAccepted(
        request_id="req-1",
        tenant="alice",
        session_id="sess-a1",
        op="forward_backward",
        model_id="sess-a1:train:0",
        seq_id=2,
        body_path=request_body_path("sess-a1", "req-1", "pb"),
        body_format="pb",
        body_sha256=SHA,
    )
    result = ApiResultReady(request_id="req-1", session_id="sess-a1", op="forward_backward", ok=False,
                            error="unknown loss 'x'; use one of cross_entropy, ppo", category="user")
    for payload in (request, result):
        event = decode_event(encode_event(make_event("sess-a1.train.0", payload)))
        assert event.payload == payload


def test_a_request_with_an_unsafe_tenant_is_refused() -> None:
    with pytest.raises(ValueError, match="not allowed"):
        ApiRequestAccepted(request_id="r", tenant="a/b", session_id="s", op="sample",
                           body_path="sessions/s/requests/r.json", body_sha256=SHA)
