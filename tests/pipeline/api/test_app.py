"""The gateway's HTTP API with an in-memory store and a recording publisher (no engine behind it)."""

import json
import math
import uuid

import pytest
from fastapi.testclient import TestClient
from tinker import types
from tinker._compat import model_dump
from tinker.proto.request_conv import forward_backward_request_to_proto

from pipeline.api.app import create_app
from pipeline.api.checkpoints import weights_key, write_record
from pipeline.api.gateway import Gateway, ServedModel
from pipeline.api.tenants import TenantLimits, Tenants
from pipeline.api.wire import parse_tinker_path
from pipeline.io.store import ObjectStore
from schemas.api import result_path
from tests.pipeline.api.conftest import gateway_client

ALICE, BOB = {"X-API-Key": "tml-alice"}, {"X-API-Key": "tml-bob"}


def _session(api, headers=ALICE) -> str:
    answer = api.post("/api/v1/create_session", headers=headers,
                      json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"})
    assert answer.status_code == 200, answer.text
    return answer.json()["session_id"]


def _create(api, session, headers=ALICE, base="/models/base/tiny"):
    return api.post("/api/v1/create_model", headers=headers, json={
        "session_id": session, "model_seq_id": 0, "base_model": base, "lora_config": {"rank": 4},
        "optimizer_config": {"type": "adamw"}, "type": "create_model"})


def test_start_up_calls_and_keys(api):
    assert api.get("/api/v1/healthz").json() == {"status": "ok"}
    assert api.post("/api/v1/client/config", headers=ALICE, json={"sdk_version": "0.38.0"}).json() == {
        "pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": True,
        "fwdbwd_max_chunk_bytes_count": 4 * TenantLimits().max_call_tokens}  # the SDK counts 4 bytes a token
    assert api.post("/api/v1/client/config", json={}).status_code == 401
    refused = api.post("/api/v1/client/config", headers={"X-API-Key": "secret"}, json={})
    assert refused.status_code == 401 and "tml-" in refused.json()["error"]
    models = api.get("/api/v1/get_server_capabilities", headers=ALICE).json()["supported_models"]
    assert [m["model_name"] for m in models] == ["/models/base/tiny"]
    assert api.post("/api/v1/telemetry", headers=ALICE, json={}).json() == {"status": "accepted"}


def test_create_model_is_logged_idempotent_and_tenant_scoped(api):
    session = _session(api)
    first, again = _create(api, session).json(), _create(api, session).json()
    assert first == again == {"request_id": f"{session}.train.0.create", "model_id": f"{session}:train:0"}
    (key, event), _ = api.published
    assert key == f"{session}:train:0" and event.payload.op == "create_model" and event.payload.tenant.startswith("t-")
    assert api.store.exists(event.payload.body_path)
    info = api.post("/api/v1/get_info", headers=ALICE, json={"model_id": f"{session}:train:0"}).json()
    assert info["model_data"]["tokenizer_id"] == "/models/base/tiny" and info["lora_rank"] == 4
    # another tenant sees nothing of it
    assert api.post("/api/v1/get_info", headers=BOB, json={"model_id": f"{session}:train:0"}).status_code == 404
    assert _create(api, session, headers=BOB).status_code == 404
    bad = _create(api, session, base="/models/other")
    assert bad.status_code == 400 and "/models/base/tiny" in bad.json()["error"]
    assert bad.json()["category"] == "user"


def test_calls_and_futures(api):
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})
    fb = types.ForwardBackwardRequest(types.ForwardBackwardInput([datum], "cross_entropy"), model_id, seq_id=1)
    body = forward_backward_request_to_proto(fb).SerializeToString()
    headers = {**ALICE, "Content-Type": "application/x-protobuf"}
    request_id = api.post("/api/v1/forward_backward", headers=headers, content=body).json()["request_id"]
    assert request_id == f"{session}.train.0.1"
    optim = {"model_id": model_id, "seq_id": 2, "type": "optim_step", "adam_params": {"learning_rate": 1e-3}}
    assert api.post("/api/v1/optim_step", headers=ALICE, json=optim).json()["request_id"] == f"{session}.train.0.2"
    reused = api.post("/api/v1/optim_step", headers=ALICE, json={**optim, "adam_params": {"learning_rate": 1.0}})
    assert reused.status_code == 400 and "seq_id 2" in reused.json()["error"]

    poll = {"request_id": request_id, "allow_metadata_only": True}
    assert api.post("/api/v1/retrieve_future", headers=ALICE, json=poll).json()["type"] == "try_again"
    api.store.put_create(result_path(session, request_id, "pb"), b"\x08\x01")
    answer = api.post("/api/v1/retrieve_future", headers=ALICE, json=poll)
    assert answer.headers["content-type"] == "application/x-protobuf" and answer.content == b"\x08\x01"
    assert api.post("/api/v1/retrieve_future", headers=BOB, json=poll).status_code == 404
    error = {"error": "unknown loss", "category": "user"}
    api.store.put_create(result_path(session, f"{session}.train.0.2", "json"), json.dumps(error).encode())
    assert api.post("/api/v1/retrieve_future", headers=ALICE,
                    json={"request_id": f"{session}.train.0.2"}).json() == error


def test_heartbeat_finish_and_load_paths(api):
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    beat = {"session_id": session, "type": "session_heartbeat"}
    assert api.post("/api/v1/session_heartbeat", headers=ALICE, json=beat).status_code == 200
    bob_session = _session(api, BOB)
    stolen = api.post("/api/v1/load_weights", headers=BOB, json={
        "session_id": bob_session, "model_seq_id": 0, "path": f"tinker://{model_id}/weights/w1", "optimizer": True})
    assert stolen.status_code == 404
    saved = parse_tinker_path(f"tinker://{model_id}/weights/w1")
    api.store.put(weights_key(saved), b"saved by save_state")
    write_record(api.store, saved, 19)  # as the trainer's save_weights leaves them
    own = api.post("/api/v1/load_weights", headers=ALICE, json={
        "session_id": session, "model_seq_id": 1, "path": f"tinker://{model_id}/weights/w1", "optimizer": True})
    assert own.json() == {"request_id": f"{session}.train.1.create", "model_id": f"{session}:train:1"}
    assert api.post(f"/api/v1/sessions/{session}/finish", headers=ALICE, json={"reason": {"type": "success"}}).is_success
    assert api.post("/api/v1/session_heartbeat", headers=ALICE, json=beat).status_code == 410
    listed = api.get(f"/api/v1/training_runs/{model_id}/checkpoints", headers=ALICE).json()["checkpoints"]
    assert [(c["tinker_path"], c["expires_at"]) for c in listed] == [(str(saved), None)]


def test_an_announced_result_wakes_the_held_poll_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    import pipeline.api.app

    # the store is re-read only every 30 s here, so an answer within 10 s came from the signal, however loaded
    monkeypatch.setattr(pipeline.api.app, "RECHECK_S", 30.0)

    from pipeline.api.results import ResultSignals

    store = ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/models/base/tiny", "/models/base/tiny")])
    signals = ResultSignals()
    api = TestClient(create_app(gateway, Tenants(), poll_hold_s=20.0, signals=signals))
    session = gateway.create_session(gateway_tenant := Tenants().tenant_of("tml-alice"), [], {})
    model_id = gateway.register_model(gateway_tenant, session, 0, "/models/base/tiny", 4, {}, None)
    request_id = gateway.submit(gateway_tenant, "create_model", model_id, None, b"{}")

    def announce() -> None:
        time.sleep(0.3)
        store.put_create(result_path(session, request_id, "json"), b'{"model_id": "x"}')
        signals.notify(request_id)

    threading.Thread(target=announce).start()
    started = time.monotonic()
    answer = api.post("/api/v1/retrieve_future", headers=ALICE, json={"request_id": request_id})
    assert answer.json() == {"model_id": "x"} and time.monotonic() - started < 10.0  # not the 30 s re-check


# ---- sampling ---------------------------------------------------------------------------------------------------
def _sampling_session(api, session, headers=ALICE, **source):
    return api.post("/api/v1/create_sampling_session", headers=headers, json={
        "session_id": session, "sampling_session_seq_id": 0, "type": "create_sampling_session", **source})


def _asample(api, sampling_session_id, seq_id=0, headers=ALICE, num_samples=2):
    return api.post("/api/v1/asample", headers=headers, json={
        "num_samples": num_samples, "prompt": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 5, "stop": ["\n"], "temperature": 1.0, "top_k": -1, "top_p": 1.0},
        "sampling_session_id": sampling_session_id, "seq_id": seq_id, "prompt_logprobs": False,
        "topk_prompt_logprobs": 0, "topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0, "type": "sample"})


def test_sampling_session_on_the_base_model_and_asample(api):
    session = _session(api)
    created = _sampling_session(api, session, base_model="/models/base/tiny")
    assert created.status_code == 200, created.text
    sampler_id = created.json()["sampling_session_id"]
    assert sampler_id == f"{session}:sample:0"
    assert api.get(f"/api/v1/samplers/{sampler_id}", headers=ALICE).json() == {
        "sampler_id": sampler_id, "base_model": "/models/base/tiny", "model_path": None}
    assert api.get(f"/api/v1/samplers/{sampler_id}", headers=BOB).status_code == 404
    future = _asample(api, sampler_id).json()
    assert future["request_id"] == f"{session}.sample.0.1"
    assert future["sample_sequence_ids"] == [f"{session}.sample.0.1.0", f"{session}.sample.0.1.1"]
    key, event = api.published[-1]
    assert key == sampler_id and event.payload.op == "sample" and event.payload.base_model == "/models/base/tiny"
    assert _asample(api, sampler_id).json() == future  # a resent call is the same request
    assert _asample(api, sampler_id, headers=BOB).json()["category"] == "user"


def test_sampling_session_from_a_sampler_path_is_tenant_scoped(api):
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    path = f"tinker://{model_id}/sampler_weights/s1"
    missing = _sampling_session(api, session, model_path=path)
    assert missing.status_code == 400 and "list_checkpoints" in missing.json()["error"]
    api.store.put(f"runs/{session}.train.0/sampler_weights/s1.json",
                  json.dumps({"name": "s1", "tinker_path": path, "time": 0.0, "version": 3}).encode())
    sampler_id = _sampling_session(api, session, model_path=path).json()["sampling_session_id"]
    record = json.loads(api.store.get(f"sessions/{session}/samplers/0.json"))
    assert (record["run"], record["version"], record["model_path"]) == (f"{session}.train.0", 3, path)
    assert api.get(f"/api/v1/samplers/{sampler_id}", headers=ALICE).json()["model_path"] == path
    other = _session(api, BOB)
    assert _sampling_session(api, other, headers=BOB, model_path=path).status_code == 404
    training = _sampling_session(api, session, model_path=f"tinker://{model_id}/weights/s1")
    assert training.status_code == 400 and "sampler_weights" in training.json()["error"]


def test_a_sampler_path_given_with_its_base_model_is_sampled_and_another_base_model_is_refused(api):
    """``create_sampling_client(model_path=..., base_model=...)`` (the cookbook's evaluations pass both) sends both:
    the path's weights are sampled when the base model is theirs, and a base model they were not trained on is a
    400 naming both, not a session sampling weights that mean nothing on it."""
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    path = f"tinker://{model_id}/sampler_weights/s1"
    api.store.put(f"runs/{session}.train.0/sampler_weights/s1.json",
                  json.dumps({"name": "s1", "tinker_path": path, "time": 0.0, "version": 3}).encode())
    both = _sampling_session(api, session, model_path=path, base_model="/models/base/tiny")
    assert both.status_code == 200, both.text
    record = json.loads(api.store.get(f"sessions/{session}/samplers/0.json"))
    assert (record["model_path"], record["version"], record["base_model"]) == (path, 3, "/models/base/tiny")
    other = api.post("/api/v1/create_sampling_session", headers=ALICE, json={
        "session_id": session, "sampling_session_seq_id": 1, "model_path": path, "base_model": "/models/other",
        "type": "create_sampling_session"})
    assert other.status_code == 400 and "/models/other" in other.json()["error"], other.text
    assert "/models/base/tiny" in other.json()["error"]
    assert api.get(f"/api/v1/samplers/{session}:sample:1", headers=ALICE).status_code == 404


def test_a_full_sampler_queue_answers_429_until_results_arrive(api):
    api.app.state.gateway.samples.max_places = 1
    session = _session(api)
    sampler_id = _sampling_session(api, session, base_model="/models/base/tiny").json()["sampling_session_id"]
    first = _asample(api, sampler_id, seq_id=0).json()["request_id"]
    busy = _asample(api, sampler_id, seq_id=1)
    assert busy.status_code == 429 and "retry" in busy.json()["error"]
    api.store.put(result_path(session, first, "pb"), b"")
    assert api.post("/api/v1/retrieve_future", headers=ALICE, json={"request_id": first}).status_code == 200
    assert _asample(api, sampler_id, seq_id=1).status_code == 200


def test_unnamed_save_for_sampler_is_accepted(api):
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    answer = api.post("/api/v1/save_weights_for_sampler", headers=ALICE, json={
        "model_id": model_id, "sampling_session_seq_id": 1, "kind": "snapshot", "seq_id": 1,
        "type": "save_weights_for_sampler"})
    assert answer.status_code == 200 and answer.json()["request_id"] == f"{session}.train.0.1"


def test_a_checkpoint_delete_cut_short_can_be_done_again_and_leaves_nothing(monkeypatch):
    from pipeline.api.checkpoints import checkpoint_prefix
    from schemas.api import model_run_name

    store = ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/models/base/tiny", "/models/base/tiny")])
    session = gateway.create_session("tml-alice", [], {})
    model_id = gateway.register_model("tml-alice", session, 0, "/models/base/tiny", 4, {}, None)
    prefix = checkpoint_prefix(model_run_name(model_id), "weights")
    store.put(f"{prefix}/w1.safetensors", b"weights")  # as the trainer's save_weights leaves them
    store.put(f"{prefix}/w1.json", json.dumps({"name": "w1", "tinker_path": f"tinker://{model_id}/weights/w1",
                                                "time": 1.0}).encode())
    delete, calls = store.delete, []

    def dies_after_one(key, **options):
        calls.append(key)
        if len(calls) > 1:
            raise KeyboardInterrupt("killed")
        return delete(key, **options)

    monkeypatch.setattr(store, "delete", dies_after_one)
    with pytest.raises(KeyboardInterrupt):
        gateway.delete_checkpoint("tml-alice", model_id, "weights/w1")
    monkeypatch.undo()
    gateway.delete_checkpoint("tml-alice", model_id, "weights/w1")  # the user tries again
    assert store.list(prefix) == [] and gateway.checkpoints("tml-alice", model_id) == []


def test_a_numbered_call_refused_here_is_still_logged_as_failing(api):
    """The SDK numbered it before sending: the trainer answers that seq_id with the error instead of waiting."""
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    bad_name = api.post("/api/v1/save_weights", headers=ALICE,
                        json={"model_id": model_id, "seq_id": 1, "path": "a/b", "type": "save_weights"})
    assert bad_name.status_code == 400 and "checkpoint name" in bad_name.json()["error"]
    nan = types.OptimStepRequest(adam_params=types.AdamParams(learning_rate=math.nan), model_id=model_id, seq_id=2)
    refused_nan = api.post("/api/v1/optim_step", headers=ALICE, json=model_dump(  # as the SDK's resource dumps it
        nan, exclude_unset=False, exclude_none=True, mode="json"))
    error = refused_nan.json()["error"]
    assert refused_nan.status_code == 400 and refused_nan.json()["category"] == "user", error
    assert "adam_params.learning_rate must be a finite number" in error and "learning-rate schedule" in error
    assert "send what the tinker SDK sends" not in error
    logged = [event.payload for _, event in api.published if event.payload.refused is not None]
    assert [(p.op, p.seq_id) for p in logged] == [("save_weights", 1), ("optim_step", 2)]
    assert "checkpoint name" in logged[0].refused and api.store.exists(logged[0].body_path)
    # another tenant's model, a body naming no seq_id, or a seq_id taken: nothing is logged
    api.post("/api/v1/save_weights", headers=BOB, json={"model_id": model_id, "seq_id": 3, "path": "a/b"})
    api.post("/api/v1/save_weights", headers=ALICE, json={"model_id": model_id, "path": "a/b"})
    again = api.post("/api/v1/save_weights", headers=ALICE, json={"model_id": model_id, "seq_id": 1, "path": "c/d"})
    assert again.status_code == 400
    assert len([e for _, e in api.published if e.payload.refused is not None]) == 2


def test_a_forward_backward_with_a_not_finite_loss_fn_config_is_a_400_logged_as_refused(api):
    """NaN and infinity arrive in the SDK's protobuf as they are: the gateway answers 400 in one line naming the key
    (the trainer's words) and logs the call as refused for its seq_id.  The SDK sends no JSON forward_backward; a
    JSON one is refused in one line too, whatever its loss_fn_config holds."""
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})
    fb = types.ForwardBackwardRequest(types.ForwardBackwardInput([datum], "dro", {"beta": math.nan}), model_id, 1)
    refused = api.post("/api/v1/forward_backward", headers={**ALICE, "Content-Type": "application/x-protobuf"},
                       content=forward_backward_request_to_proto(fb).SerializeToString())
    line = "loss_fn_config beta=nan is not a finite number; check the code that computes it"
    assert refused.status_code == 400 and refused.json() == {"error": line, "category": "user"}, refused.text
    logged = [event.payload for _, event in api.published if event.payload.refused is not None]
    assert [(p.op, p.seq_id, p.refused) for p in logged] == [("forward_backward", 1, line)]
    for beta in ("NaN", "null"):
        as_json = api.post("/api/v1/forward_backward", headers={**ALICE, "Content-Type": "application/json"},
                           content=f'{{"model_id": "{model_id}", "seq_id": 2, "forward_backward_input": {{"data": [], '
                                   f'"loss_fn": "dro", "loss_fn_config": {{"beta": {beta}}}}}}}'.encode())
        assert as_json.status_code == 400 and as_json.json()["category"] == "user"
        assert "protobuf" in as_json.json()["error"] and "\n" not in as_json.json()["error"]


def test_a_load_into_a_training_client_of_what_is_no_training_state_path_is_a_400_logged_as_refused(api):
    """load_state(path) names a path the trainer would refuse whatever was saved meanwhile (no tinker:// path, or not a
    weights/ path): answered 400 at once, and logged as refused so the client's later calls go on."""
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    for seq, path, says in ((1, "file:///etc/passwd", "is not a checkpoint path"),
                            (2, f"tinker://{model_id}/sampler_weights/s1", "is not a training state")):
        refused = api.post("/api/v1/load_weights", headers=ALICE, json={
            "model_id": model_id, "seq_id": seq, "path": path, "optimizer": True, "type": "load_weights"})
        assert refused.status_code == 400 and says in refused.json()["error"], refused.text
    logged = [event.payload for _, event in api.published if event.payload.refused is not None]
    assert [(call.op, call.seq_id) for call in logged] == [("load_weights", 1), ("load_weights", 2)]
    later = api.post("/api/v1/load_weights", headers=ALICE, json={  # saved by an earlier call, maybe: the trainer's
        "model_id": model_id, "seq_id": 3, "path": f"tinker://{model_id}/weights/not-yet", "optimizer": True})
    assert later.status_code == 200, later.text


def test_a_load_of_what_is_no_training_state_says_the_same_into_a_client_or_as_a_new_one(api):
    """load_state into a training client and create_training_client_from_state refuse a sampler path alike."""
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    path = f"tinker://{model_id}/sampler_weights/s1"
    into = api.post("/api/v1/load_weights", headers=ALICE, json={
        "model_id": model_id, "seq_id": 1, "path": path, "optimizer": True, "type": "load_weights"})
    new = api.post("/api/v1/load_weights", headers=ALICE, json={
        "session_id": session, "model_seq_id": 1, "path": path, "optimizer": True, "type": "load_weights"})
    assert into.status_code == new.status_code == 400, (into.text, new.text)
    assert into.json()["error"] == new.json()["error"], (into.text, new.text)


def test_a_create_the_trainer_would_refuse_is_refused_here_and_leaves_no_training_client(api):
    """A rank or seed out of range, no lora_config, an optimizer not served, a LoRA on no module, or a new client from
    sampler weights or from no saved state, fails at the gateway:
    nothing is recorded, so list_training_runs never shows it."""
    session = _session(api)
    for rank, says in ((0, "at least 1"), (100_000, "at most 512")):
        refused = api.post("/api/v1/create_model", headers=ALICE, json={
            "session_id": session, "model_seq_id": 0, "base_model": "/models/base/tiny", "lora_config": {"rank": rank},
            "type": "create_model"})
        assert refused.status_code == 400 and says in refused.json()["error"], refused.text
    for seed in (2**64, -2**63 - 1):  # outside the seeds torch takes
        refused = api.post("/api/v1/create_model", headers=ALICE, json={
            "session_id": session, "model_seq_id": 0, "base_model": "/models/base/tiny",
            "lora_config": {"rank": 4, "seed": seed}, "type": "create_model"})
        assert refused.status_code == 400 and f"lora_config.seed={seed}: use" in refused.json()["error"], refused.text
    for change, says in (({"lora_config": None}, "needs a lora_config"),
                         ({"optimizer_config": {"type": "muon"}}, "optimizer 'muon' is not served"),
                         ({"lora_config": {"rank": 4, "train_attn": False, "train_mlp": False, "train_unembed": False}},
                          "trains no module")):
        refused = api.post("/api/v1/create_model", headers=ALICE, json={
            "session_id": session, "model_seq_id": 0, "base_model": "/models/base/tiny", "lora_config": {"rank": 4},
            "type": "create_model", **change})
        assert refused.status_code == 400 and says in refused.json()["error"], refused.text
    assert _create(api, session).status_code == 200  # model_seq_id 0 is still free
    for seq, path, says in ((1, f"tinker://{session}:train:0/sampler_weights/final", "not a training state"),
                            (2, f"tinker://{session}:train:0/weights/never-saved", "no saved weights")):
        refused = api.post("/api/v1/load_weights", headers=ALICE, json={
            "session_id": session, "model_seq_id": seq, "path": path, "optimizer": False, "type": "load_weights"})
        assert refused.status_code == 400 and says in refused.json()["error"], refused.text
    models = [key for key in api.store.list(f"sessions/{session}/models", recursive=True) if key.endswith(".json")]
    assert models == [f"sessions/{session}/models/0.json"], models


def test_checkpoint_calls_with_other_methods_answer_404_not_served_and_delete_nothing(api):
    """`.../publish` and `.../ttl` are served with the SDK's methods only; no method makes them a delete of a
    checkpoint named `final/publish`."""
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    base = f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/final"
    deleted: list[tuple] = []
    api.app.state.gateway.delete_checkpoint = lambda *args: deleted.append(args)
    for method, path in (("PUT", f"{base}/publish"), ("DELETE", f"{base}/ttl"), ("POST", f"{base}/ttl")):
        answer = api.request(method, path, headers=ALICE, json={"ttl_seconds": 7200})
        assert answer.status_code == 404 and "is not served by rlpipe" in answer.json()["error"], (method, path)
    unpublished = api.delete(f"{base}/publish", headers=ALICE)  # unpublish: there is no such checkpoint
    assert unpublished.status_code == 404 and "no checkpoint" in unpublished.json()["error"]
    assert deleted == []


def test_a_finished_session_refuses_new_calls_and_still_answers_reads(api):
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    sampler_id = _sampling_session(api, session, base_model="/models/base/tiny").json()["sampling_session_id"]
    optim = {"model_id": model_id, "seq_id": 1, "type": "optim_step", "adam_params": {"learning_rate": 1e-3}}
    before = api.post("/api/v1/optim_step", headers=ALICE, json=optim).json()["request_id"]
    other = gateway_client(api.store)  # a second gateway, which saw the session alive just now
    other.app.state.gateway.liveness.live_check_s = 0.0  # (and reads the record at every call)
    other.app.state.gateway.check_live(session)
    assert api.post(f"/api/v1/sessions/{session}/finish", headers=ALICE, json={"reason": {"type": "success"}}).is_success
    logged = len(api.published)
    refused = [
        api.post("/api/v1/optim_step", headers=ALICE, json={**optim, "seq_id": 2}),
        _create(api, session),
        _sampling_session(api, session, base_model="/models/base/tiny"),
        _asample(api, sampler_id, seq_id=1),
        api.post("/api/v1/load_weights", headers=ALICE, json={
            "session_id": session, "model_seq_id": 3, "path": f"tinker://{model_id}/weights/w", "optimizer": True}),
    ]
    for answer in refused:
        assert answer.status_code == 410 and answer.json()["category"] == "user", answer.text
        assert f"session {session} has ended (finished: success); create a new ServiceClient" in answer.json()["error"]
    assert len(api.published) == logged  # nothing was logged for them, not even as failing
    # what was accepted before is still answered, and the checkpoints stay reachable
    assert api.post("/api/v1/retrieve_future", headers=ALICE, json={"request_id": before}).json()["type"] == "try_again"
    assert api.get(f"/api/v1/training_runs/{model_id}/checkpoints", headers=ALICE).status_code == 200
    # the other gateway refuses too, once its last look at the session is older than live_check_s
    assert _asample(other, sampler_id, seq_id=1).status_code == 410
    assert _asample(api, sampler_id, seq_id=1, headers=BOB).status_code == 404  # another key: not told it ended


def test_a_sampling_session_id_is_no_training_model_id(api):
    """``<session>:sample:N`` names a sampling client: as a training client's model_id it is an unknown model (it
    once reached the record of ``<session>:train:N`` and trained an adapter no create_model made)."""
    session = _session(api)
    _create(api, session)
    alias = f"{session}:sample:0"
    for call, body in (("get_info", {"model_id": alias}),
                       ("optim_step", {"model_id": alias, "seq_id": 1, "type": "optim_step",
                                       "adam_params": {"learning_rate": 1e-3}})):
        answer = api.post(f"/api/v1/{call}", headers=ALICE, json=body)
        assert answer.status_code == 404 and f"unknown model {alias!r}" in answer.json()["error"], call
    assert api.get(f"/api/v1/training_runs/{alias}", headers=ALICE).status_code == 404
    path = f"tinker://{alias}/weights/w1"
    loaded = api.post("/api/v1/load_weights", headers=ALICE, json={
        "session_id": session, "model_seq_id": 1, "path": path, "optimizer": True})
    assert loaded.status_code in (400, 404) and loaded.json()["category"] == "user"


def test_negative_sequence_numbers_are_a_400_that_logs_and_holds_nothing(api):
    """The SDK numbers calls from 0 (samples, model_seq_id) or 1 (training calls): a negative number is a bad request,
    answered 400 naming the field, not a 500 that the SDK resends for minutes; nothing is stored or logged for it, and
    a refused sample holds none of the sampler queue's places."""
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    sampler_id = _sampling_session(api, session, base_model="/models/base/tiny").json()["sampling_session_id"]
    logged, stored = len(api.published), set(api.store.list("sessions", recursive=True))
    answers = {
        "optim_step": api.post("/api/v1/optim_step", headers=ALICE, json={
            "model_id": model_id, "seq_id": -2, "type": "optim_step", "adam_params": {"learning_rate": 1e-3}}),
        "create_model": api.post("/api/v1/create_model", headers=ALICE, json={
            "session_id": session, "model_seq_id": -1, "base_model": "/models/base/tiny", "lora_config": {"rank": 4},
            "type": "create_model"}),
        "asample": _asample(api, sampler_id, seq_id=-7),
        "asample -1": _asample(api, sampler_id, seq_id=-1),
    }
    for call, answer in answers.items():
        assert answer.status_code == 400 and answer.json()["category"] == "user", (call, answer.text)
        assert "seq_id" in answer.json()["error"], (call, answer.text)
    assert len(api.published) == logged and set(api.store.list("sessions", recursive=True)) == stored
    assert api.app.state.gateway.samples.queued() == 0


def test_sequence_numbers_beyond_the_sdks_are_a_400_that_records_and_logs_nothing(api):
    """The SDK's sequence numbers are int32 (its protobuf's seq_id): a larger one is a bad request naming its field,
    and no training client, sampling client or call is recorded for it (none whose create is not logged, none
    counted against its tenant)."""
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    sampler_id = _sampling_session(api, session, base_model="/models/base/tiny").json()["sampling_session_id"]
    logged, stored = len(api.published), set(api.store.list("sessions", recursive=True))
    huge = 10**30
    answers = {
        "model_seq_id": api.post("/api/v1/create_model", headers=ALICE, json={
            "session_id": session, "model_seq_id": huge, "base_model": "/models/base/tiny", "lora_config": {"rank": 4},
            "type": "create_model"}),
        "sampling_session_seq_id": api.post("/api/v1/create_sampling_session", headers=ALICE, json={
            "session_id": session, "sampling_session_seq_id": huge, "base_model": "/models/base/tiny",
            "type": "create_sampling_session"}),
        "seq_id": api.post("/api/v1/optim_step", headers=ALICE, json={
            "model_id": model_id, "seq_id": huge, "type": "optim_step", "adam_params": {"learning_rate": 1e-3}}),
        "seq_id ": _asample(api, sampler_id, seq_id=huge),
        "sampling_session_seq_id ": api.post("/api/v1/save_weights_for_sampler", headers=ALICE, json={
            "model_id": model_id, "seq_id": 1, "sampling_session_seq_id": huge, "type": "save_weights_for_sampler"}),
    }
    for field, answer in answers.items():
        assert answer.status_code == 400 and answer.json()["category"] == "user", (field, answer.text)
        assert f"{field.strip()}={huge}: " in answer.json()["error"] and "2147483647" in answer.json()["error"], (
            field, answer.text)
    refused = [event.payload for _, event in api.published[logged:]]
    assert [(call.op, call.seq_id, call.refused is not None) for call in refused] == [
        ("save_weights_for_sampler", 1, True)]  # a numbered call refused here is logged as refused, as ever
    stored_now = set(api.store.list("sessions", recursive=True)) - stored
    assert stored_now == {refused[0].body_path}, stored_now


def test_the_largest_sequence_numbers_the_sdk_sends_are_taken(api):
    """2,147,483,647 (the SDK's int32 limit) is a valid model_seq_id, sampling_session_seq_id and seq_id of a
    training or sample call; one more is refused naming the field."""
    session = _session(api)
    top = 2**31 - 1
    created = api.post("/api/v1/create_model", headers=ALICE, json={
        "session_id": session, "model_seq_id": top, "base_model": "/models/base/tiny", "lora_config": {"rank": 4},
        "type": "create_model"})
    assert created.status_code == 200, created.text
    model_id = created.json()["model_id"]
    sampling = api.post("/api/v1/create_sampling_session", headers=ALICE, json={
        "session_id": session, "sampling_session_seq_id": top, "base_model": "/models/base/tiny",
        "type": "create_sampling_session"})
    assert sampling.status_code == 200, sampling.text
    sampler_id = sampling.json()["sampling_session_id"]
    optim = {"model_id": model_id, "seq_id": top, "type": "optim_step", "adam_params": {"learning_rate": 1e-3}}
    assert api.post("/api/v1/optim_step", headers=ALICE, json=optim).status_code == 200
    sampled = _asample(api, sampler_id, seq_id=top)
    assert sampled.status_code == 200, sampled.text
    assert sampled.json()["request_id"] == f"{sampler_id.replace(':', '.')}.{top + 1}"
    beyond = _asample(api, sampler_id, seq_id=top + 1)
    assert beyond.status_code == 400 and f"seq_id={top + 1}: " in beyond.json()["error"], beyond.text


def test_a_sample_answered_but_never_polled_here_frees_its_place_in_the_queue(api):
    """The queue counts samples without a result, not samples this gateway has not answered a poll for: a client
    that died after its call, or that polls through another gateway, must not fill it for every tenant for ever."""
    gateway = api.app.state.gateway
    queue = gateway.samples
    queue.max_places, queue.recheck_s, queue.tenant_share = 2, 0.0, 1.0
    alice = _sampling_session(api, _session(api), base_model="/models/base/tiny").json()["sampling_session_id"]
    abandoned = [_asample(api, alice, seq_id=seq).json()["request_id"] for seq in range(2)]
    bob = _sampling_session(api, _session(api, BOB), headers=BOB,
                            base_model="/models/base/tiny").json()["sampling_session_id"]
    assert _asample(api, bob, headers=BOB).status_code == 429  # still running: the queue is full
    for request_id in abandoned:  # the sampler answers them; nobody polls
        api.store.put_create(result_path(request_id.split(".")[0], request_id, "pb"), b"")
    assert _asample(api, bob, headers=BOB).status_code == 200


def test_one_tenant_holds_at_most_its_share_of_the_sampler_queue(api):
    """One tenant's many sample calls (legitimate ones) cannot take every place of a base model's queue: past its
    share (half, by default) its next call is answered 429, and another tenant's call still gets a place."""
    gateway = api.app.state.gateway
    gateway.samples.max_places = 4
    alice = _sampling_session(api, _session(api), base_model="/models/base/tiny").json()["sampling_session_id"]
    assert [_asample(api, alice, seq_id=seq).status_code for seq in range(2)] == [200, 200]
    busy = _asample(api, alice, seq_id=2)
    assert busy.status_code == 429 and "2 of the 4 places" in busy.json()["error"], busy.text
    bob = _sampling_session(api, _session(api, BOB), headers=BOB,
                            base_model="/models/base/tiny").json()["sampling_session_id"]
    assert _asample(api, bob, headers=BOB).status_code == 200


def test_sampling_parameters_that_cannot_be_honoured_are_a_400_at_submit(api):
    """A temperature vLLM would raise to 0.01 (or one that is not a number), a top_p outside (0, 1], a count of samples
    below 1 or above the limit, a top_k or a stop token id that is no int32 token id, more or longer stop strings than
    the sampler searches, an empty prompt: answered 400 naming the field before anything is queued, not a future that fails (or,
    for 0 < T < 0.01, samples and logprobs of another temperature than asked for)."""
    from pipeline.api.samplers import MAX_SAMPLES_PER_CALL

    sampler_id = _sampling_session(api, _session(api), base_model="/models/base/tiny").json()["sampling_session_id"]
    logged = len(api.published)
    good = {"num_samples": 1, "prompt": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]},
            "sampling_params": {"max_tokens": 5, "temperature": 1.0, "top_k": -1, "top_p": 1.0},
            "sampling_session_id": sampler_id, "seq_id": 0, "type": "sample"}
    bad = {"temperature": (0.005, 1e-9, -1.0, math.nan, math.inf), "top_p": (0.0, 1.5, math.nan),
           "num_samples": (0, -3, MAX_SAMPLES_PER_CALL + 1), "max_tokens": (0,), "top_k": (-2, 2**31, 10**30),
           "stop": ([5, 10**30], [-1], [2**31],  # numbers a sampler's engine cannot take (vLLM's: 64 bits)
                    ["\n"] * 65, ["x" * 1025])}  # stop strings the sampler's event loop would search for minutes
    for field, values in bad.items():
        for value in values:
            body = json.loads(json.dumps(good))
            (body if field == "num_samples" else body["sampling_params"])[field] = value
            answer = api.post("/api/v1/asample", headers=ALICE, content=json.dumps(body).encode())
            assert answer.status_code == 400 and answer.json()["category"] == "user", (field, value, answer.text)
            assert field in answer.json()["error"], (field, value, answer.text)
    empty = api.post("/api/v1/asample", headers=ALICE, json={**good, "prompt": {"chunks": []}})
    assert empty.status_code == 400 and "prompt is empty" in empty.json()["error"], empty.text
    assert len(api.published) == logged
    for temperature in (0.0, 0.01, 0.7):  # greedy, and the lowest temperature sampled as asked
        body = {**good, "sampling_params": {**good["sampling_params"], "temperature": temperature}}
        assert api.post("/api/v1/asample", headers=ALICE, json=body).status_code == 200, temperature
        good["seq_id"] += 1


def test_a_prompt_past_the_advertised_context_is_a_400_at_submit_that_holds_nothing():
    """A prompt that leaves no room to sample one token in the context get_server_capabilities advertises is answered
    400 naming the numbers, before anything is stored, queued or logged (not a future that fails later); one token
    shorter is taken."""
    api = gateway_client(models=[ServedModel("/models/base/tiny", "/models/base/tiny", max_context_length=8)])
    sampler_id = _sampling_session(api, _session(api), base_model="/models/base/tiny").json()["sampling_session_id"]
    logged = len(api.published)

    def asample(length: int, seq_id: int):
        return api.post("/api/v1/asample", headers=ALICE, json={
            "num_samples": 1, "prompt": {"chunks": [{"tokens": [5] * length, "type": "encoded_text"}]},
            "sampling_params": {"max_tokens": 1}, "sampling_session_id": sampler_id, "seq_id": seq_id,
            "prompt_logprobs": True, "type": "sample"})

    long = asample(8, 0)
    assert long.status_code == 400 and long.json()["category"] == "user", long.text
    assert "8 tokens" in long.json()["error"] and "context of 8" in long.json()["error"], long.text
    assert len(api.published) == logged and api.app.state.gateway.samples.queued() == 0
    assert asample(7, 0).status_code == 200  # seq_id 0 was not taken by the refused call


def test_a_sample_of_a_base_model_no_longer_served_is_a_400_not_a_future_that_never_ends(api):
    """A sampling client made while the gateway served a base model, sampling after it was redeployed without it:
    no sampler reads its calls any more, so the call is answered 400 naming the served models, and holds no place."""
    sampler_id = _sampling_session(api, _session(api), base_model="/models/base/tiny").json()["sampling_session_id"]
    redeployed = gateway_client(api.store, models=[ServedModel("/models/base/other", "/models/base/other")])
    answer = _asample(redeployed, sampler_id)
    assert answer.status_code == 400 and answer.json()["category"] == "user", answer.text
    assert "/models/base/tiny" in answer.json()["error"] and "/models/base/other" in answer.json()["error"]
    assert redeployed.published == [] and redeployed.app.state.gateway.samples.queued() == 0


def test_a_prompt_token_id_no_model_has_is_a_400_at_submit(api):
    """A negative id, or one past the int32 ids of the SDK's wire, is no token of any model: answered 400 naming it
    before anything is queued (an id past one model's vocabulary is its sampler's to refuse, as a user error)."""
    sampler_id = _sampling_session(api, _session(api), base_model="/models/base/tiny").json()["sampling_session_id"]
    logged = len(api.published)
    for bad in (-1, 2**31, 10**30):
        answer = api.post("/api/v1/asample", headers=ALICE, json={
            "num_samples": 1, "prompt": {"chunks": [{"tokens": [5, bad, 7], "type": "encoded_text"}]},
            "sampling_params": {"max_tokens": 1}, "sampling_session_id": sampler_id, "seq_id": 0, "type": "sample"})
        assert answer.status_code == 400 and answer.json()["category"] == "user", (bad, answer.text)
        assert f"prompt holds {bad}" in answer.json()["error"], answer.text
    assert len(api.published) == logged and api.app.state.gateway.samples.queued() == 0


def test_a_finish_with_a_body_that_is_not_the_sdks_is_a_400_and_ends_nothing(api):
    session = _session(api)
    finish = f"/api/v1/sessions/{session}/finish"
    for body in (b"not json", b"[1]", json.dumps({"reason": {"type": "x" * 1000}}).encode()):
        answer = api.post(finish, headers=ALICE, content=body)
        assert answer.status_code == 400 and answer.json()["category"] == "user", (body, answer.text)
        assert answer.json()["error"].startswith("FinishRequest: "), answer.text
    beat = {"session_id": session, "type": "session_heartbeat"}
    assert api.post("/api/v1/session_heartbeat", headers=ALICE, json=beat).status_code == 200  # still live
    assert api.post(finish, headers=ALICE, json={"reason": {"type": "errored"}, "detail": "boom"}).is_success
    assert api.post("/api/v1/session_heartbeat", headers=ALICE, json=beat).status_code == 410
    assert "finished: errored" in api.post("/api/v1/session_heartbeat", headers=ALICE, json=beat).json()["error"]


def test_a_body_over_the_limit_is_a_413_before_it_is_read_whole():
    """The gateway holds a call's body in memory: one tenant's huge body must not take the memory every tenant's calls
    share.  Declared too large (Content-Length) or found too large while read (chunked), it is refused with 413."""
    api = gateway_client(max_body_bytes=4096)
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    logged = len(api.published)
    optim = json.dumps({"model_id": model_id, "seq_id": 1, "type": "optim_step", "padding": "x" * 5000,
                        "adam_params": {"learning_rate": 1e-3}}).encode()
    declared = api.post("/api/v1/optim_step", headers=ALICE, content=optim)
    chunked = api.post("/api/v1/optim_step", headers=ALICE,
                       content=(optim[start:start + 1000] for start in range(0, len(optim), 1000)))
    for answer in (declared, chunked):
        assert answer.status_code == 413 and answer.json()["category"] == "user", answer.text
        assert "4096 bytes" in answer.json()["error"], answer.text
    assert len(api.published) == logged
    small = json.dumps({"model_id": model_id, "seq_id": 1, "type": "optim_step",
                        "adam_params": {"learning_rate": 1e-3}}).encode()
    assert api.post("/api/v1/optim_step", headers=ALICE, content=small).status_code == 200


def test_a_json_body_over_its_limit_is_a_413_before_it_is_parsed(api):
    """JSON bodies are parsed with the GIL held, which stops the event loop every tenant's calls share (a sample
    call's prompt of 64 MB took seconds of it): one over ``MAX_JSON_BODY_BYTES`` is refused with 413 before it is
    parsed, and nothing is logged; a forward_backward (protobuf, which the SDK sends in chunks) keeps the larger
    limit."""
    from pipeline.api.body_limit import MAX_JSON_BODY_BYTES

    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    sampler_id = _sampling_session(api, session, base_model="/models/base/tiny").json()["sampling_session_id"]
    logged = len(api.published)
    tokens = [123456] * (MAX_JSON_BODY_BYTES // 7 + 1)  # 7 bytes each as JSON
    big = json.dumps({"num_samples": 1, "prompt": {"chunks": [{"tokens": tokens, "type": "encoded_text"}]},
                      "sampling_params": {"max_tokens": 5}, "sampling_session_id": sampler_id, "seq_id": 0,
                      "type": "sample"}).encode()
    answer = api.post("/api/v1/asample", headers=ALICE, content=big)
    assert answer.status_code == 413 and f"{MAX_JSON_BODY_BYTES} bytes" in answer.json()["error"], answer.text[:300]
    assert len(api.published) == logged
    # a few tokens (under the cap on a request's tokens) and loss inputs of many bytes: float32 each in protobuf
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:1000]),
                        loss_fn_inputs={"target_tokens": tokens[:1000], "weights": [1.0] * (MAX_JSON_BODY_BYTES // 4)})
    fb = types.ForwardBackwardRequest(types.ForwardBackwardInput([datum], "cross_entropy"), model_id, seq_id=1)
    body = forward_backward_request_to_proto(fb).SerializeToString()
    assert len(body) > MAX_JSON_BODY_BYTES
    taken = api.post("/api/v1/forward_backward", headers={**ALICE, "Content-Type": "application/x-protobuf"},
                     content=body)
    assert taken.status_code == 200, taken.text[:300]


def test_a_forward_backward_over_the_limit_is_logged_as_refused_so_later_calls_go_on():
    """The SDK numbers a call before sending it: a forward_backward refused 413 and never logged would leave a gap its
    training client's later calls wait on for ``GAP_GIVE_UP_S``.  Its model_id and seq_id are in its first bytes, so it
    is logged as refused (the trainer answers it with the same error and goes on), read no further than those."""
    api = gateway_client(max_body_bytes=4096)
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    headers = {**ALICE, "Content-Type": "application/x-protobuf"}

    def body(seq_id: int, tokens: int = 2000) -> bytes:
        datum = types.Datum(model_input=types.ModelInput.from_ints([1] * tokens),
                            loss_fn_inputs={"target_tokens": [2] * tokens})
        fb = types.ForwardBackwardRequest(types.ForwardBackwardInput([datum], "cross_entropy"), model_id, seq_id)
        return forward_backward_request_to_proto(fb).SerializeToString()

    logged = len(api.published)
    big = body(1)
    assert api.post("/api/v1/forward_backward", headers={**BOB, "Content-Type": "application/x-protobuf"},
                    content=big).status_code == 413
    assert len(api.published) == logged  # not Bob's model: no training client of his waits on it
    declared = api.post("/api/v1/forward_backward", headers=headers, content=big)
    chunked = api.post("/api/v1/forward_backward", headers=headers,
                       content=(part for part in (body(2)[:1000], body(2)[1000:])))
    for answer in (declared, chunked):
        assert answer.status_code == 413 and "4096 bytes" in answer.json()["error"], answer.text
    refused = [event.payload for _, event in api.published[logged:]]
    assert [(call.op, call.seq_id) for call in refused] == [("forward_backward", 1), ("forward_backward", 2)]
    assert all("4096 bytes" in (call.refused or "") for call in refused)
    assert all(len(api.store.get(call.body_path)) < 100 for call in refused)  # the header, not the body
    assert api.post("/api/v1/forward_backward", headers=headers, content=body(3, tokens=10)).status_code == 200


def test_metadata_over_the_limit_is_a_400_and_records_nothing(api):
    """Sessions' and training clients' metadata are kept in their records, which every listing reads and a gateway
    keeps in memory: a few megabytes each from one tenant would cost every tenant's listings and the gateway's memory."""
    from pipeline.api.clients import MAX_METADATA_BYTES

    big = "x" * MAX_METADATA_BYTES
    stored = set(api.store.list("sessions", recursive=True))
    for body in ({"tags": [], "user_metadata": {"notes": big}}, {"tags": [big], "user_metadata": {}}):
        answer = api.post("/api/v1/create_session", headers=ALICE,
                          json={**body, "sdk_version": "0.38.0", "type": "create_session"})
        assert answer.status_code == 400 and answer.json()["category"] == "user", answer.text
        assert f"{MAX_METADATA_BYTES} bytes" in answer.json()["error"], answer.text
    assert set(api.store.list("sessions", recursive=True)) == stored
    session = _session(api)
    answer = api.post("/api/v1/create_model", headers=ALICE, json={
        "session_id": session, "model_seq_id": 0, "base_model": "/models/base/tiny", "lora_config": {"rank": 4},
        "user_metadata": {"notes": big}, "type": "create_model"})
    assert answer.status_code == 400 and "user_metadata" in answer.json()["error"], answer.text
    assert not api.store.exists(f"sessions/{session}/models/0.json")
    kept = api.post("/api/v1/create_model", headers=ALICE, json={
        "session_id": session, "model_seq_id": 0, "base_model": "/models/base/tiny", "lora_config": {"rank": 4},
        "user_metadata": {"renderer_name": "role_colon"}, "type": "create_model"})
    assert kept.status_code == 200, kept.text


def test_a_full_queue_is_checked_against_the_store_by_one_call_at_a_time(api, monkeypatch):
    """On a slow store every sample call arriving during a re-check ran its own: one re-checks, the others go by
    the counts as they are."""
    import contextlib
    import threading
    import time

    from pipeline.api.sample_queue import BusyError

    gateway = api.app.state.gateway
    queue = gateway.samples
    queue.max_places, queue.recheck_s, queue.tenant_share = 2, 60.0, 1.0
    alice = _sampling_session(api, _session(api), base_model="/models/base/tiny").json()["sampling_session_id"]
    assert [_asample(api, alice, seq_id=seq).status_code for seq in range(2)] == [200, 200]
    looked: list[str] = []

    def slow_has_result(request_id: str) -> bool:
        looked.append(request_id)
        time.sleep(0.3)
        return False

    monkeypatch.setattr(queue, "_has_result", slow_has_result)
    def admit(request_id: str) -> None:
        with contextlib.suppress(BusyError):  # the queue stays full: each call is answered 429
            queue.take("/models/base/tiny", request_id, "t")

    callers = [threading.Thread(target=admit, args=(f"x.{i}",)) for i in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(looked) == 2  # the two queued calls, looked up once


def test_an_input_of_any_length_is_echoed_cut_short_in_errors(api):
    """An error repeats the client's input so it can see what was wrong, but an input of a megabyte repeated whole
    would go into every log line and answer: it is cut to ``MAX_ECHOED`` characters and "…"."""
    from schemas.names import MAX_ECHOED

    session = _session(api)
    long = "x" * 1_000_000
    sample = {"num_samples": 1, "prompt": {"chunks": [{"tokens": [1], "type": "encoded_text"}]},
              "sampling_params": {"max_tokens": 5}, "seq_id": 0, "type": "sample"}
    calls = [("/api/v1/get_info", {"model_id": long}),
             ("/api/v1/get_info", {"model_id": f"{long}:train:0"}),
             ("/api/v1/session_heartbeat", {"session_id": long}),
             ("/api/v1/create_model", {"session_id": session, "model_seq_id": 0, "base_model": long,
                                       "lora_config": {"rank": 4}}),
             ("/api/v1/weights_info", {"tinker_path": long}),
             ("/api/v1/weights_info", {"tinker_path": f"tinker://{session}:train:0/weights/{long}"}),
             ("/api/v1/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0,
                                                  "model_path": long}),
             ("/api/v1/asample", {**sample, "sampling_session_id": long}),
             ("/api/v1/asample", {**sample, "sampling_session_id": f"{session}:sample:{'9' * 100_000}"})]
    for path, body in calls:
        answer = api.post(path, headers=ALICE, json=body)
        assert 400 <= answer.status_code < 500, (path, answer.status_code)
        error = answer.json()["error"]
        assert len(error) < MAX_ECHOED + 400 and "…" in error, (path, error[:300])
    unserved = api.get("/api/v1/" + "y" * 20_000, headers=ALICE)
    assert unserved.status_code == 404 and len(unserved.json()["error"]) < MAX_ECHOED + 400, unserved.text[:300]


def test_a_tenant_at_its_session_limit_is_answered_403_naming_the_setting():
    from pipeline.api.tenants import TenantLimits

    store = ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/models/base/tiny", "/models/base/tiny")],
                      limits=TenantLimits(max_sessions=1))
    api = TestClient(create_app(gateway, Tenants(), poll_hold_s=0.05))
    _session(api)
    refused = api.post("/api/v1/create_session", headers=ALICE, json={"tags": [], "user_metadata": {},
                                                                      "sdk_version": "0.38.0", "type": "create_session"})
    assert refused.status_code == 403 and refused.json()["category"] == "user", refused.text
    assert "RLPIPE_API_MAX_SESSIONS" in refused.json()["error"]
    _session(api, BOB)


def test_adam_params_out_of_range_are_a_400_logged_as_refused_and_later_calls_go_on(api):
    """The gateway checks the Adam parameters by the training engine's own ranges (``schemas.adam``): one out of range
    or not a number is answered 400 naming it, and logged as refused, so the training client's next call runs."""
    session = _session(api)
    model_id = _create(api, session).json()["model_id"]
    cases = [('{"learning_rate": NaN}', "adam learning_rate=nan is out of range"),
             ('{"learning_rate": -0.001}', "adam learning_rate=-0.001 is out of range"),
             ('{"beta1": 1.0}', "adam beta1=1.0 is out of range"),
             ('{"beta2": Infinity}', "adam beta2=inf is out of range"),
             ('{"eps": 0.0}', "adam eps=0.0 is out of range"),
             ('{"weight_decay": -1.0}', "adam weight_decay=-1.0 is out of range"),
             ('{"learning_rate": 1e38, "beta1": 0.99}', "make a step of 1e+40, beyond float32's")]
    for seq, (params, says) in enumerate(cases, start=1):
        refused = api.post("/api/v1/optim_step", headers={**ALICE, "Content-Type": "application/json"}, content=(
            f'{{"model_id": "{model_id}", "seq_id": {seq}, "type": "optim_step", "adam_params": {params}}}'))
        assert refused.status_code == 400 and says in refused.json()["error"], (params, refused.text)
    logged = [event.payload for _, event in api.published if event.payload.refused is not None]
    assert [(call.op, call.seq_id) for call in logged] == [("optim_step", seq) for seq in range(1, len(cases) + 1)]
    later = api.post("/api/v1/optim_step", headers=ALICE, json={
        "model_id": model_id, "seq_id": len(cases) + 1, "type": "optim_step", "adam_params": {"learning_rate": 1e-3}})
    assert later.status_code == 200, later.text


def test_a_base_url_given_with_api_v1_is_answered_naming_the_fix(api):
    """The SDK adds `/api/v1` itself: a base URL copied with it doubles the prefix, and the 404 says to drop it."""
    for method, path in (("POST", "/api/v1/api/v1/client/config"), ("GET", "/api/v1/api/v1/healthz")):
        answer = api.request(method, path, headers=ALICE)
        error = answer.json()["error"]
        assert answer.status_code == 404 and "/api/v1" in error and "base URL" in error and "\n" not in error, error
    other = api.post("/api/v1/no_such_call", headers=ALICE).json()["error"]
    assert "is not served by rlpipe" in other and "base URL" not in other, other


def test_a_forward_backward_over_the_token_cap_is_a_400_naming_its_size_the_cap_and_the_setting(monkeypatch):
    """One request's datums hold at most ``max_call_tokens`` tokens (``RLPIPE_API_MAX_CALL_TOKENS``): a larger one
    would hold the trainer from every other tenant's calls.  It is answered 400 in one line and logged as refused
    for its seq_id, so the training client's next call runs; a forward (forward_only) is named as such."""
    monkeypatch.setenv("RLPIPE_API_MAX_CALL_TOKENS", "10")
    published: list = []
    gateway = Gateway(ObjectStore(f"memory://gw-{uuid.uuid4().hex}"), lambda event, key: published.append((key, event)),
                      [ServedModel("/models/base/tiny", "/models/base/tiny")], limits=TenantLimits.from_env())
    api = TestClient(create_app(gateway, Tenants(), poll_hold_s=0.05))
    model_id = _create(api, _session(api)).json()["model_id"]
    datums = [types.Datum(model_input=types.ModelInput.from_ints(list(range(1, 7))),
                          loss_fn_inputs={"target_tokens": list(range(2, 8))}) for _ in range(2)]  # 12 tokens
    headers = {**ALICE, "Content-Type": "application/x-protobuf"}
    for seq, (forward_only, op) in enumerate(((False, "forward_backward"), (True, "forward")), start=1):
        request = types.ForwardBackwardRequest(types.ForwardBackwardInput(datums, "cross_entropy"), model_id, seq)
        proto = forward_backward_request_to_proto(request)
        proto.forward_only = forward_only
        refused = api.post("/api/v1/forward_backward", headers=headers, content=proto.SerializeToString())
        adding = "" if forward_only else "gradients add up until optim_step; "  # a forward keeps no gradients
        line = (f"{op} of 12 tokens (model_input of 2 datums) is over this server's cap of 10 tokens per request; "
                f"send the batch as several smaller calls ({adding}the tinker SDK splits it so by itself), or ask "
                "the operator to raise RLPIPE_API_MAX_CALL_TOKENS")
        assert refused.status_code == 400 and refused.json() == {"error": line, "category": "user"}, refused.text
    logged = [(e.payload.seq_id, e.payload.refused is not None) for _, e in published if e.payload.op != "create_model"]
    assert logged == [(1, True), (2, True)]
    within = types.ForwardBackwardRequest(types.ForwardBackwardInput(datums[:1], "cross_entropy"), model_id, 3)
    accepted = api.post("/api/v1/forward_backward", headers=headers,
                        content=forward_backward_request_to_proto(within).SerializeToString())
    assert accepted.status_code == 200, accepted.text
