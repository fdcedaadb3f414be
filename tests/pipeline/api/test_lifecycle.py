"""Session ends (finished or expired) and the snapshots they free, on an in-memory store."""

import json
import time
import uuid

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.api.gateway import Gateway, ServedModel, SessionEndedError
from pipeline.api.lifecycle import SNAPSHOTS, mark_snapshots, session_end, sweep_snapshots
from pipeline.api.samplers import write_sampler
from pipeline.io.registry import AdapterNotFoundError, AdapterRegistry
from pipeline.io.store import ObjectStore

BASE, DAY = "/models/base/tiny", 86400.0


@pytest.fixture
def store() -> ObjectStore:
    return ObjectStore(f"memory://life-{uuid.uuid4().hex}")


@pytest.fixture
def gateway(store) -> Gateway:
    return Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE), ServedModel("/other", "/other")],
                   live_check_s=0.0)


def snapshot(store: ObjectStore, tmp_path, session: str, model_id: str, seq: int, path: str | None = None) -> int:
    """What the trainer does for save_weights_and_get_sampling_client (or, with ``path``, a named save followed
    by create_sampling_client on it): a registry version and a sampling session on it; the version."""
    folder = tmp_path / uuid.uuid4().hex
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))
    save_file({"lora_A": np.full((2, 2), seq, dtype=np.float32)}, str(folder / "adapter_model.safetensors"))
    run = model_id.replace(":", ".")
    if path is None:
        mark_snapshots(store, model_id)
    version = AdapterRegistry(store, run).publish(folder, BASE, 0, seq).version
    write_sampler(store, "t-alice", session, seq, BASE, path, run, version)
    return version


def test_a_session_ends_when_finished_or_after_a_day_without_a_heartbeat():
    now = 1_000_000.0
    assert session_end({"time": now - 60, "ended": False}, now) is None
    assert session_end({"time": now - 60, "ended": True, "reason": "errored"}, now) == ("finished: errored", now - 60)
    why, at = session_end({"time": now - DAY - 1, "ended": False}, now)
    assert why.startswith("expired: no heartbeat since") and at == now - 1


def test_an_expired_session_refuses_its_heartbeat_and_calls(gateway, store):
    session = gateway.create_session("t-alice", [], {})
    gateway.heartbeat("t-alice", session)  # alive
    store.put(f"sessions/{session}/heartbeat.json", json.dumps({"time": time.time() - DAY - 5, "ended": False}).encode())
    with pytest.raises(SessionEndedError, match=f"session {session} has ended \\(expired: no heartbeat since"):
        gateway.heartbeat("t-alice", session)
    with pytest.raises(SessionEndedError, match="create a new ServiceClient"):
        gateway.create_sampling_session("t-alice", session, 0, BASE, None)


def test_snapshots_are_retired_a_grace_after_their_session_ends_and_named_weights_are_kept(gateway, store, tmp_path):
    session = gateway.create_session("t-alice", [], {})
    model_id = gateway.register_model("t-alice", session, 0, BASE, 4, {}, None)
    other_model = gateway.register_model("t-alice", session, 1, "/other", 4, {}, None)
    versions = [snapshot(store, tmp_path, session, model_id, seq) for seq in (1, 2)]
    named = snapshot(store, tmp_path, session, model_id, 3, path=f"tinker://{model_id}/sampler_weights/keep")
    theirs = snapshot(store, tmp_path, session, other_model, 4)  # another base model's trainer sweeps that one
    live = gateway.create_session("t-alice", [], {})
    live_model = gateway.register_model("t-alice", live, 0, BASE, 4, {}, None)
    live_version = snapshot(store, tmp_path, live, live_model, 1)
    cache: dict[str, str | None] = {}
    assert sweep_snapshots(store, BASE, cache) == 0  # both sessions live
    gateway.finish("t-alice", session, "success")
    assert sweep_snapshots(store, BASE, cache) == 0  # within the grace after the end
    assert sweep_snapshots(store, BASE, cache, now=time.time() + 61) == 2
    registry = AdapterRegistry(store, model_id.replace(":", "."))
    for version in versions:
        with pytest.raises(AdapterNotFoundError, match="the session that made it ended"):
            registry.pull(version, tmp_path / "cache")
    assert registry.pull(named, tmp_path / "cache").is_dir()  # a named save is a checkpoint: not a snapshot
    assert AdapterRegistry(store, other_model.replace(":", ".")).pull(theirs, tmp_path / "cache").is_dir()
    assert AdapterRegistry(store, live_model.replace(":", ".")).pull(live_version, tmp_path / "cache").is_dir()
    assert sorted(key.rsplit("/", 1)[-1] for key in store.list(SNAPSHOTS)) == sorted(
        m.replace(":", ".") for m in (other_model, live_model))  # done with: out of the index
    assert sweep_snapshots(store, "/other", {}, now=time.time() + 61) == 1
    # the live session lapses for a day: it has ended without anyone saying so
    store.put(f"sessions/{live}/heartbeat.json", json.dumps({"time": time.time() - DAY, "ended": False}).encode())
    assert sweep_snapshots(store, BASE, cache, now=time.time() + 30) == 0  # expired 30 s ago: the grace
    assert sweep_snapshots(store, BASE, cache, now=time.time() + 61) == 1
    assert store.list(SNAPSHOTS) == []


def test_a_sweep_cut_short_is_finished_by_the_next(gateway, store, tmp_path, monkeypatch):
    session = gateway.create_session("t-alice", [], {})
    model_id = gateway.register_model("t-alice", session, 0, BASE, 4, {}, None)
    first, second = (snapshot(store, tmp_path, session, model_id, seq) for seq in (1, 2))
    gateway.finish("t-alice", session, "interrupted")
    retire = AdapterRegistry.retire

    def dies_on_the_second(registry, version, reason):
        if version == second:
            raise OSError("the store went away")
        retire(registry, version, reason)

    monkeypatch.setattr(AdapterRegistry, "retire", dies_on_the_second)
    with pytest.raises(OSError):
        sweep_snapshots(store, BASE, {}, now=time.time() + 61)
    assert store.list(SNAPSHOTS) != []  # still indexed
    monkeypatch.setattr(AdapterRegistry, "retire", retire)
    assert sweep_snapshots(store, BASE, {}, now=time.time() + 61) == 1  # the one left
    registry = AdapterRegistry(store, model_id.replace(":", "."))
    assert registry.retired_reason(first) and registry.retired_reason(second)
