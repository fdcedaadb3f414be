"""Checkpoints through the gateway: time to live, external weights and their signed download URLs."""

import json
import time
from urllib.parse import parse_qs, quote, urlsplit

import pytest

from pipeline.api import checkpoints, downloads
from pipeline.api.gateway import ServedModel
from pipeline.api.wire import parse_tinker_path
from tests.pipeline.api.conftest import gateway_client
from tests.pipeline.api.test_app import ALICE, BOB, _create, _session

FILES = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"tensors" * 100}


def _model(api) -> str:
    return _create(api, _session(api)).json()["model_id"]


def _saved_state(api, model_id: str, name: str = "w1"):
    path = parse_tinker_path(f"tinker://{model_id}/weights/{name}")
    api.store.put(checkpoints.weights_key(path), b"saved by save_state")
    checkpoints.write_record(api.store, path, 19, request_id="r")  # as the trainer's save_weights leaves them
    return path


def _external(api, model_id: str, name: str = "final"):
    path = parse_tinker_path(f"tinker://{model_id}/external_weights/{name}")
    checkpoints.write_external(api.store, path, FILES, None, request_id="r")
    return path


def _listed(api, model_id: str, headers=ALICE) -> dict[str, dict]:
    answer = api.get(f"/api/v1/training_runs/{model_id}/checkpoints", headers=headers)
    assert answer.status_code == 200, answer.text
    return {c["checkpoint_id"]: c for c in answer.json()["checkpoints"]}


def _ttl(api, model_id: str, checkpoint_id: str, ttl, headers=ALICE):
    return api.put(f"/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id}/ttl", headers=headers,
                   json={"ttl_seconds": ttl})


def test_a_ttl_is_set_in_range_shown_and_removed_and_only_by_its_owner(api):
    model_id = _model(api)
    _saved_state(api, model_id)
    for bad, says in ((60, "between 3600"), (10**12, "ten years"), ("soon", "whole number")):
        refused = _ttl(api, model_id, "weights/w1", bad)
        assert refused.status_code == 400 and says in refused.json()["error"], refused.text
    assert _listed(api, model_id)["weights/w1"]["expires_at"] is None
    before = time.time()
    assert _ttl(api, model_id, "weights/w1", 7200).status_code == 200
    assert before + 7200 <= _listed(api, model_id)["weights/w1"]["expires_at"] <= time.time() + 7200
    assert _ttl(api, model_id, "weights/w1", None).status_code == 200  # None removes it
    assert _listed(api, model_id)["weights/w1"]["expires_at"] is None
    assert _ttl(api, model_id, "weights/w1", 7200, headers=BOB).status_code == 404
    assert _ttl(api, model_id, "weights/other", 7200).status_code == 404
    assert _ttl(api, model_id, "elsewhere/w1", 7200).status_code == 400


def test_an_expired_checkpoint_is_not_listed_loaded_or_downloaded(api):
    model_id = _model(api)
    state, external = _saved_state(api, model_id), _external(api, model_id)
    urls = api.get(f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/final/external_weights_urls",
                   headers=ALICE).json()["urls"]
    for path in (state, external):
        key = checkpoints.record_key(path)
        record = json.loads(api.store.get(key))
        api.store.put(key, json.dumps({**record, "expires_at": time.time() - 1}).encode())  # its time is over
    refused = api.post("/api/v1/load_weights", headers=ALICE, json={
        "session_id": model_id.split(":")[0], "model_seq_id": 1, "path": str(state), "optimizer": True})
    assert refused.status_code == 400 and "expired" in refused.json()["error"]
    assert _listed(api, model_id) == {}
    assert api.get(urls["adapter_config.json"]).status_code == 404
    info = api.post("/api/v1/weights_info", headers=ALICE, json={"tinker_path": str(state)})
    assert info.status_code == 404 and "expired" in info.json()["error"]
    assert _ttl(api, model_id, "weights/w1", 7200).status_code == 404  # too late to extend


def test_external_weights_download_by_signed_urls_that_need_no_key_and_are_checked(api):
    model_id = _model(api)
    path = _external(api, model_id)
    listed = _listed(api, model_id)["external_weights/final"]
    assert listed["checkpoint_type"] == "external" and listed["tinker_path"] == str(path)
    assert listed["size_bytes"] == sum(map(len, FILES.values()))
    route = f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/final/external_weights_urls"
    answer = api.get(route, headers=ALICE).json()
    assert sorted(answer["urls"]) == sorted(FILES) and answer["expires"]
    for file, url in answer["urls"].items():
        assert url.startswith("http://testserver/")  # on the gateway the client called
        got = api.get(url)  # no API key
        assert got.status_code == 200 and got.content == FILES[file]
    assert api.get(route, headers=BOB).status_code == 404  # another tenant gets no URLs
    url = answer["urls"]["adapter_config.json"]
    query = parse_qs(urlsplit(url).query)
    forged = url.replace(query["signature"][0], "0" * 64)
    assert api.get(forged).status_code == 403 and "signature" in api.get(forged).json()["error"]
    other_file = url.replace("adapter_config.json", "adapter_model.safetensors")  # a signature names its file
    assert api.get(other_file).status_code == 403
    later = int(query["expires"][0]) + 1
    with pytest.raises(downloads.UrlRefused, match="expired"):
        downloads.check_download(api.store, model_id, "final", "adapter_config.json", int(query["expires"][0]),
                                 query["signature"][0], query["v"][0], query["p"][0], now=later)
    api.store.put(checkpoints.external_file_key(path, "adapter_config.json"), b'{"r": 8}')  # corrupted in the store
    corrupt = api.get(url)
    assert corrupt.status_code == 500 and "checksum" in corrupt.json()["error"]
    state_urls = api.get(route.replace("external_weights/final", "weights/w1"), headers=ALICE)
    assert state_urls.status_code == 400 and "not external weights" in state_urls.json()["error"]


def test_deleting_external_weights_removes_their_files_then_their_record(api):
    model_id = _model(api)
    path = _external(api, model_id)
    assert api.delete(f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/final",
                      headers=ALICE).status_code == 204
    assert api.store.list(f"runs/{path.run}", recursive=True) == []
    assert api.delete(f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/final",
                      headers=ALICE).status_code == 404


def test_save_weights_external_is_logged_and_what_the_trainer_would_refuse_is_refused_here(api):
    model_id = _model(api)
    body = {"model_id": model_id, "path": "final", "seq_id": 1, "type": "save_weights_external"}
    accepted = api.post("/api/v1/save_weights_external", headers=ALICE, json={**body, "ttl_seconds": 7200})
    assert accepted.status_code == 200 and accepted.json()["request_id"].endswith(".1")
    for seq, extra, says in ((2, {"ttl_seconds": 5}, "between 3600"),
                             (3, {"age_encryption_recipients": ["age1xyz"]}, "age encryption"),
                             (4, {"path": "a/b"}, "checkpoint name")):
        refused = api.post("/api/v1/save_weights_external", headers=ALICE, json={**body, "seq_id": seq, **extra})
        assert refused.status_code == 400 and says in refused.json()["error"], refused.text
    logged = [(e.payload.op, e.payload.seq_id, e.payload.refused is None) for _, e in api.published
              if e.payload.op == "save_weights_external"]
    assert logged == [("save_weights_external", 1, True), ("save_weights_external", 2, False),
                      ("save_weights_external", 3, False), ("save_weights_external", 4, False)]
    too_short = api.post("/api/v1/save_weights", headers=ALICE, json={
        "model_id": model_id, "path": "w", "seq_id": 5, "ttl_seconds": 60, "type": "save_weights"})
    assert too_short.status_code == 400 and "between 3600" in too_short.json()["error"]


def test_a_url_one_gateway_signed_is_honoured_by_another_on_the_store(api, monkeypatch):
    model_id = _model(api)
    _external(api, model_id)
    winner = b"k" * 32  # another gateway makes the key between this one's read and its create
    get = api.store.get

    def key_made_meanwhile(key, sha256=None):
        if key == downloads.SIGNING_KEY and not api.store.exists(key):
            api.store.put_create(key, winner)
            raise FileNotFoundError(key)
        return get(key, sha256)

    monkeypatch.setattr(api.store, "get", key_made_meanwhile)
    url = api.get(f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/final/external_weights_urls",
                  headers=ALICE).json()["urls"]["adapter_config.json"]
    monkeypatch.undo()
    assert downloads.signing_key(api.store) == winner
    other = gateway_client(api.store)
    assert other.get(url).content == FILES["adapter_config.json"]


def test_a_published_checkpoint_is_every_tenants_to_read_and_only_its_owners_to_change(api):
    model_id = _model(api)
    state = _saved_state(api, model_id)
    _external(api, model_id)
    sampler = parse_tinker_path(f"tinker://{model_id}/sampler_weights/s1")
    checkpoints.write_record(api.store, sampler, None, version=1)  # as the trainer's save_weights_for_sampler
    bob_session = _session(api, BOB)
    route = f"/api/v1/training_runs/{model_id}/checkpoints"

    def bob_reads() -> list[int]:
        return [
            api.post("/api/v1/weights_info", headers=BOB, json={"tinker_path": str(state)}).status_code,
            api.post("/api/v1/load_weights", headers=BOB, json={
                "session_id": bob_session, "model_seq_id": 0, "path": str(state), "optimizer": False}).status_code,
            api.post("/api/v1/create_sampling_session", headers=BOB, json={
                "session_id": bob_session, "sampling_session_seq_id": 0, "model_path": str(sampler)}).status_code,
            api.get(f"{route}/external_weights/final/external_weights_urls", headers=BOB).status_code,
        ]

    assert bob_reads() == [404, 404, 404, 404]
    for checkpoint_id in ("weights/w1", "sampler_weights/s1", "external_weights/final"):
        for _ in range(2):  # publishing twice is harmless
            assert api.post(f"{route}/{checkpoint_id}/publish", headers=ALICE).status_code == 200
    assert all(c["public"] for c in _listed(api, model_id).values())
    assert bob_reads() == [200, 200, 200, 200]
    loaded = json.loads(api.store.get(f"sessions/{bob_session}/models/0.json"))
    assert loaded["base_model"] == "/models/base/tiny" and loaded["lora_rank"] == 4  # Alice's model's
    for method, path in (("POST", f"{route}/weights/w1/publish"), ("DELETE", f"{route}/weights/w1/publish"),
                         ("PUT", f"{route}/weights/w1/ttl"), ("DELETE", f"{route}/weights/w1")):
        assert api.request(method, path, headers=BOB, json={"ttl_seconds": 7200}).status_code == 404, (method, path)
    assert _listed(api, model_id)["weights/w1"]["expires_at"] is None
    for checkpoint_id in ("weights/w1", "sampler_weights/s1", "external_weights/final"):
        assert api.delete(f"{route}/{checkpoint_id}/publish", headers=ALICE).status_code == 200
    assert not any(c["public"] for c in _listed(api, model_id).values())
    assert bob_reads() == [404, 404, 404, 404]
    assert api.post(f"{route}/weights/never/publish", headers=ALICE).status_code == 404


@pytest.fixture
def file_api(tmp_path):
    """The app on a file:// store, where a name's folder and another name's record can meet."""
    from pipeline.io.store import ObjectStore

    return gateway_client(ObjectStore(f"file://{tmp_path}/store"))


def test_names_that_end_in_json_are_checkpoints_like_any_other(file_api):
    api = file_api
    model_id = _model(api)
    for name in ("a", "a.json", "a.json.json"):
        _external(api, model_id, name)
        _saved_state(api, model_id, name)
    listed = _listed(api, model_id)
    assert sorted(listed) == sorted(f"{folder}/{name}" for folder in ("weights", "external_weights")
                                    for name in ("a", "a.json", "a.json.json"))
    route = f"/api/v1/training_runs/{model_id}/checkpoints"
    for checkpoint_id in ("external_weights/a.json", "weights/a.json"):
        assert api.delete(f"{route}/{checkpoint_id}", headers=ALICE).status_code == 204
    assert sorted(_listed(api, model_id)) == ["external_weights/a", "external_weights/a.json.json", "weights/a",
                                              "weights/a.json.json"]
    urls = api.get(f"{route}/external_weights/a/external_weights_urls", headers=ALICE).json()["urls"]
    assert api.get(urls["adapter_model.safetensors"]).content == FILES["adapter_model.safetensors"]


def test_checkpoints_named_like_a_route_can_be_deleted(api):
    model_id = _model(api)
    route = f"/api/v1/training_runs/{model_id}/checkpoints"
    for name in ("ttl", "publish"):
        _saved_state(api, model_id, name)
        assert api.delete(f"{route}/weights/{name}", headers=ALICE).status_code == 204
    assert _listed(api, model_id) == {}


def test_a_read_hides_an_expired_checkpoint_and_only_the_sweep_deletes_it(api):
    """A gateway that finds a checkpoint expired hides it and deletes nothing: the trainer may be saving that name
    again at that moment.  The sweep (run by the trainer, between its calls) deletes it."""
    model_id = _model(api)
    state = _saved_state(api, model_id)
    external = _external(api, model_id)
    for path in (state, external):
        key = checkpoints.record_key(path)
        api.store.put(key, json.dumps({**json.loads(api.store.get(key)), "expires_at": time.time() - 1}).encode())
    objects = api.store.list(f"runs/{state.run}", recursive=True)
    assert _listed(api, model_id) == {}
    assert api.store.list(f"runs/{state.run}", recursive=True) == objects
    checkpoints.write_record(api.store, state, 19, request_id="again")  # saved again under the same name
    assert checkpoints.sweep_expired(api.store, model_id) == 1  # the export; the state lives again
    assert list(_listed(api, model_id)) == ["weights/w1"]
    assert api.store.list(f"runs/{state.run}", recursive=True) == sorted([checkpoints.weights_key(state),
                                                                            checkpoints.record_key(state)])


def test_a_download_url_is_refused_for_another_model_a_resaved_checkpoint_or_missing_files(api):
    model_id, other = _model(api), _model(api)
    path = _external(api, model_id)
    _external(api, other)
    route = f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/final/external_weights_urls"
    url = api.get(route, headers=ALICE).json()["urls"]["adapter_config.json"]
    assert api.get(url.replace(quote(model_id), quote(other))).status_code == 403  # a signature names its model
    api.store.delete(checkpoints.external_file_key(path, "adapter_config.json"))  # a delete cut short
    missing = api.get(url)
    assert missing.status_code == 404 and "delete it again" in missing.json()["error"]
    assert api.get(route, headers=ALICE).status_code == 404  # no URLs for files that are not there
    checkpoints.write_external(api.store, path, FILES, None, request_id="again")  # saved again under its name
    assert api.get(url).status_code == 403  # a URL is for the export it was made for
    assert api.get(api.get(route, headers=ALICE).json()["urls"]["adapter_config.json"]).status_code == 200
    truncated = api.get(url.split("&")[0])
    assert truncated.status_code == 400 and "signature" in truncated.json()["error"]


def test_the_ttl_route_refuses_what_is_not_a_ttl_in_one_line(api):
    model_id = _model(api)
    _saved_state(api, model_id)
    route = f"/api/v1/training_runs/{model_id}/checkpoints/weights/w1/ttl"
    nested = b'{"ttl_seconds": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # deeper than Python's JSON reader goes
    for body, says in ((b"not json", "JSON body"), (b"{}", "ttl_seconds"), (nested, "JSON body")):
        refused = api.put(route, headers={**ALICE, "Content-Type": "application/json"}, content=body)
        assert refused.status_code == 400 and says in refused.json()["error"], refused.text


def test_download_urls_use_the_public_url_when_one_is_set():
    api = gateway_client(public_url="https://rl.example.org/tinker/")
    model_id = _model(api)
    _external(api, model_id)
    urls = api.get(f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/final/external_weights_urls",
                   headers=ALICE).json()["urls"]
    assert all(url.startswith("https://rl.example.org/tinker/api/v1/external_weights_files/") for url in urls.values())


def test_a_download_url_says_nothing_without_its_signature_and_a_published_ones_end_with_publication(api):
    model_id = _model(api)
    _external(api, model_id)
    route = f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/final"
    url = api.get(f"{route}/external_weights_urls", headers=ALICE).json()["urls"]["adapter_config.json"]
    forged = url.replace(parse_qs(urlsplit(url).query)["signature"][0], "0" * 64)
    answers = [api.get(forged), api.get(forged.replace("/final/", "/never-saved/")),
               api.get(forged.replace(quote(model_id), "garbage")),
               api.get(forged.replace("0" * 64, quote("é" * 64)))]  # (hmac compares str of ASCII only)
    assert [a.status_code for a in answers] == [403, 403, 403, 403]  # exists, does not, cannot: the same answer
    assert len({a.json()["error"] for a in answers}) == 1
    assert api.post(f"{route}/publish", headers=ALICE).status_code == 200
    bobs = api.get(f"{route}/external_weights_urls", headers=BOB).json()["urls"]["adapter_config.json"]
    assert api.get(bobs).status_code == 200
    assert api.delete(f"{route}/publish", headers=ALICE).status_code == 200
    taken_back = api.get(bobs)
    assert taken_back.status_code == 403 and "no longer published" in taken_back.json()["error"]
    assert api.get(url).status_code == 200  # the owner's URL is the owner's


def test_a_download_sends_the_bytes_it_checked_even_if_the_name_is_saved_again_meanwhile(file_api):
    api = file_api
    model_id = _model(api)
    path = _external(api, model_id)
    url = api.get(f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/final/external_weights_urls",
                  headers=ALICE).json()["urls"]["adapter_model.safetensors"]
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    found = downloads.check_download(api.store, model_id, "final", "adapter_model.safetensors",
                                     int(query["expires"]), query["signature"], query["v"], query["p"])
    api.store.put(checkpoints.external_file_key(path, "adapter_model.safetensors"), b"X" * len(FILES[
        "adapter_model.safetensors"]))  # the same size, other bytes
    assert b"".join(downloads.send(found)) == FILES["adapter_model.safetensors"]


def test_weights_info_refuses_a_body_that_is_not_json_in_one_line(api):
    answer = api.post("/api/v1/weights_info", headers={**ALICE, "Content-Type": "application/json"}, content=b"{")
    assert answer.status_code == 400 and "JSON" in answer.json()["error"]


def test_the_sweep_visits_only_clients_with_a_ttl_and_forgets_them_once_none_has_one(api):
    with_ttl, without = _model(api), _model(api)
    expiring = parse_tinker_path(f"tinker://{with_ttl}/weights/old")
    api.store.put(checkpoints.weights_key(expiring), b"state")
    checkpoints.write_record(api.store, expiring, 5, time.time() + 3600)
    _saved_state(api, without)
    assert api.store.list(checkpoints.EXPIRING) == [f"{checkpoints.EXPIRING}/{expiring.run}"]
    lists: list[str] = []
    listing = api.store.list
    api.store.list = lambda prefix="", recursive=False: lists.append(prefix) or listing(prefix, recursive)
    assert checkpoints.sweep_base_model(api.store, "/models/base/tiny", {}, now=time.time() + 7200) == 1
    assert not any(without.split(":")[0] in prefix for prefix in lists)  # a client without TTLs costs nothing
    assert api.store.list(checkpoints.EXPIRING) == []  # nothing of it has a TTL any more
    assert not api.store.exists(checkpoints.weights_key(expiring))
    assert _ttl(api, without, "weights/w1", 7200).status_code == 200
    assert api.store.list(checkpoints.EXPIRING) == [f"{checkpoints.EXPIRING}/{without.replace(':', '.')}"]
    assert checkpoints.sweep_base_model(api.store, "/models/other", {}, now=time.time() + 9000) == 0  # not its model
    assert api.store.list(checkpoints.EXPIRING) != []


def test_a_training_state_loads_only_on_the_base_model_it_was_trained_on():
    """LoRA weights mean nothing on another base model: a state of a training client of one base model, loaded into a
    client of another (load_state) or as a new client asked to be of another (create_training_client_from_state's
    base_model), is a 400 at once naming both; the load_state is logged as refused, so the client's later calls go
    on.  A state not saved yet is refused too: its training client's record says its base model."""
    tiny, other = "/models/base/tiny", "/models/base/other"
    api = gateway_client(models=[ServedModel(tiny, tiny), ServedModel(other, other)])
    session = _session(api)
    tiny_id = _create(api, session).json()["model_id"]
    other_id = api.post("/api/v1/create_model", headers=ALICE, json={
        "session_id": session, "model_seq_id": 1, "base_model": other, "lora_config": {"rank": 4},
        "type": "create_model"}).json()["model_id"]
    state = _saved_state(api, tiny_id)
    for seq, path in ((1, state), (2, f"tinker://{tiny_id}/weights/not-yet")):
        refused = api.post("/api/v1/load_weights", headers=ALICE, json={
            "model_id": other_id, "seq_id": seq, "path": str(path), "optimizer": True, "type": "load_weights"})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"] == (
            f"{path} holds LoRA weights trained on {tiny}, which mean nothing on {other}; load it into a training "
            f"client of {tiny}, or start one from it (create_training_client_from_state without base_model)")
    logged = [event.payload for _, event in api.published if event.payload.refused is not None]
    assert [(call.op, call.model_id, call.seq_id) for call in logged] == [
        ("load_weights", other_id, 1), ("load_weights", other_id, 2)]
    same = api.post("/api/v1/load_weights", headers=ALICE, json={
        "model_id": tiny_id, "seq_id": 1, "path": str(state), "optimizer": True, "type": "load_weights"})
    assert same.status_code == 200, same.text
    new = api.post("/api/v1/load_weights", headers=ALICE, json={
        "session_id": session, "model_seq_id": 2, "base_model": other, "path": str(state), "optimizer": False})
    assert new.status_code == 400 and f"trained on {tiny}, which mean nothing on {other}" in new.json()["error"]
    assert api.post("/api/v1/get_info", headers=ALICE, json={"model_id": f"{session}:train:2"}).status_code == 404
    new = api.post("/api/v1/load_weights", headers=ALICE, json={
        "session_id": session, "model_seq_id": 2, "base_model": tiny, "path": str(state), "optimizer": False})
    assert new.status_code == 200, new.text
    info = api.post("/api/v1/get_info", headers=ALICE, json={"model_id": f"{session}:train:2"}).json()
    assert info["model_name"] == tiny
    # another tenant's unpublished state is not read here (not found, by the trainer), so its base model is not told
    bob_session = _session(api, BOB)
    bob_other = api.post("/api/v1/create_model", headers=BOB, json={
        "session_id": bob_session, "model_seq_id": 0, "base_model": other, "lora_config": {"rank": 4},
        "type": "create_model"}).json()["model_id"]
    stolen = api.post("/api/v1/load_weights", headers=BOB, json={
        "model_id": bob_other, "seq_id": 1, "path": str(state), "optimizer": True, "type": "load_weights"})
    assert stolen.status_code == 200 and tiny not in stolen.text
