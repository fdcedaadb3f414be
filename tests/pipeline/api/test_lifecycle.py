"""Session ends (finished or expired) and the snapshots they free, on an in-memory store."""

import json
import time
import uuid

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.api.checkpoints import (
    UNNAMED_VERSIONS,
    NotFound,
    checkpoint_prefix,
    name_sampler_version,
    set_ttl,
    sweep_base_model,
)
from pipeline.api.gateway import Gateway, NotFoundError, ServedModel, SessionEndedError
from pipeline.api.lifecycle import (
    END_GRACE_S,
    OPEN_SESSIONS,
    SESSION_FILES_KEPT_S,
    SNAPSHOTS,
    end_key,
    files_deleted,
    free_session_files,
    heartbeat_key,
    index_existing_sessions,
    mark_snapshots,
    session_end,
    sweep_sessions,
    sweep_snapshots,
    sweep_unnamed_versions,
)
from pipeline.api.samplers import VERSION_USERS, write_sampler
from pipeline.api.wire import TinkerPath
from pipeline.io.registry import AdapterNotFoundError, AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.timefmt import utc_text
from schemas.api import model_run_name

BASE, DAY, LATER = "/models/base/tiny", 86400.0, END_GRACE_S + 1


@pytest.fixture
def store() -> ObjectStore:
    return ObjectStore(f"memory://life-{uuid.uuid4().hex}")


def gateway_on(store: ObjectStore) -> Gateway:
    return Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE), ServedModel("/other", "/other")],
                   live_check_s=0.0)


@pytest.fixture
def gateway(store) -> Gateway:
    return gateway_on(store)


def beat(store: ObjectStore, session: str, ago: float) -> None:
    """The session's last heartbeat, ``ago`` seconds ago (as a gateway writes it)."""
    store.put(f"sessions/{session}/heartbeat.json", json.dumps({"time": time.time() - ago}).encode())


def snapshot(store: ObjectStore, tmp_path, session: str, model_id: str, seq: int, path: str | None = None,
             record: bool = True) -> int:
    """What the trainer does for save_weights_and_get_sampling_client (with ``path``: for a named save, then a
    create_sampling_client on it; without ``record``: killed before the sampling session was written)."""
    folder = tmp_path / uuid.uuid4().hex
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "peft_type": "LORA"}))
    save_file({"lora_A": np.full((2, 2), seq, dtype=np.float32)}, str(folder / "adapter_model.safetensors"))
    run = model_id.replace(":", ".")
    if path is None:
        mark_snapshots(store, model_id)
    version = AdapterRegistry(store, run).publish(folder, BASE, 0, seq,
                                                  ends_with_session=None if path else session).version
    if record:
        write_sampler(store, "t-alice", session, seq, BASE, path, run, version)
    return version


def test_a_session_ends_when_finished_or_after_a_day_without_a_heartbeat_and_the_first_end_stands(gateway, store):
    finished, silent, live = (gateway.create_session("t-alice", [], {}) for _ in range(3))
    gateway.finish("t-alice", finished, "errored")
    gateway.finish("t-alice", finished, "success")  # a second finish keeps the first reason
    assert session_end(store, finished)[0] == "finished: errored"
    beat(store, silent, DAY + 5)
    last_beat = json.loads(store.get(heartbeat_key(silent)))["time"]
    assert session_end(store, silent, record=False)[0] == f"expired: no heartbeat since {utc_text(last_beat)}"
    assert not store.exists(end_key(silent))  # a reader that only looks records nothing
    why, at = session_end(store, silent)
    assert store.exists(end_key(silent)) and why.startswith("expired") and abs(at - (time.time() - 5)) < 2
    assert session_end(store, live) is None


def test_a_heartbeat_on_its_way_when_the_session_ended_does_not_bring_it_back(gateway, store):
    """Gateway B read the session live for a heartbeat, gateway A recorded the finish, then B wrote the heartbeat."""
    session = gateway.create_session("t-alice", [], {})
    gateway.finish("t-alice", session, "success")
    beat(store, session, 0)  # B's late write
    for other in (gateway, gateway_on(store)):
        with pytest.raises(SessionEndedError, match="finished: success"):
            other.create_sampling_session("t-alice", session, 0, BASE, None)
    # the same for an expiry: whoever sees it first records it, and a later heartbeat is refused
    lapsed = gateway.create_session("t-alice", [], {})
    beat(store, lapsed, DAY + 5)
    with pytest.raises(SessionEndedError, match=f"session {lapsed} has ended \\(expired: no heartbeat since"):
        gateway_on(store).heartbeat("t-alice", lapsed)
    beat(store, lapsed, 0)  # a heartbeat that was on its way
    with pytest.raises(SessionEndedError, match="create a new ServiceClient"):
        gateway_on(store).create_sampling_session("t-alice", lapsed, 0, BASE, None)


def test_a_gateway_takes_a_session_it_saw_live_as_live_for_live_check_s(store, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("pipeline.api.liveness.time.monotonic", lambda: clock[0])
    gateway = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], live_check_s=1.0)
    session = gateway.create_session("t-alice", [], {})
    gateway.check_live(session)
    gateway_on(store).finish("t-alice", session, "success")  # on another gateway
    clock[0] += 0.5
    gateway.check_live(session)  # within the second: still taken as live
    clock[0] += 0.6
    with pytest.raises(SessionEndedError):
        gateway.check_live(session)


def test_snapshots_are_retired_a_grace_after_their_session_ends_and_named_weights_are_kept(gateway, store, tmp_path):
    session = gateway.create_session("t-alice", [], {})
    model_id = gateway.register_model("t-alice", session, 0, BASE, 4, {}, None)
    other_model = gateway.register_model("t-alice", session, 1, "/other", 4, {}, None)
    versions = [snapshot(store, tmp_path, session, model_id, seq) for seq in (1, 2)]
    versions.append(snapshot(store, tmp_path, session, model_id, 3, record=False))  # its sampling session unwritten
    named = snapshot(store, tmp_path, session, model_id, 4, path=f"tinker://{model_id}/sampler_weights/keep")
    theirs = snapshot(store, tmp_path, session, other_model, 5)  # another base model's trainer sweeps that one
    live = gateway.create_session("t-alice", [], {})
    live_model = gateway.register_model("t-alice", live, 0, BASE, 4, {}, None)
    live_version = snapshot(store, tmp_path, live, live_model, 1)
    cache: dict[str, str | None] = {}
    assert sweep_snapshots(store, BASE, cache) == 0  # both sessions live
    gateway.finish("t-alice", session, "success")
    assert sweep_snapshots(store, BASE, cache) == 0  # within the grace after the end
    assert sweep_snapshots(store, BASE, cache, now=time.time() + LATER) == 3
    registry = AdapterRegistry(store, model_id.replace(":", "."))
    for version in versions:
        with pytest.raises(AdapterNotFoundError, match="the session that made it ended"):
            registry.pull(version, tmp_path / "cache")
    assert registry.pull(named, tmp_path / "cache").is_dir()  # a named save is a checkpoint: not a snapshot
    assert AdapterRegistry(store, other_model.replace(":", ".")).pull(theirs, tmp_path / "cache").is_dir()
    assert AdapterRegistry(store, live_model.replace(":", ".")).pull(live_version, tmp_path / "cache").is_dir()
    assert sorted(key.rsplit("/", 1)[-1] for key in store.list(SNAPSHOTS)) == sorted(
        m.replace(":", ".") for m in (other_model, live_model))  # done with: out of the index
    assert sweep_snapshots(store, "/other", {}, now=time.time() + LATER) == 1
    # the live session goes silent for a day: it has ended without anyone saying so
    beat(store, live, DAY)
    assert sweep_snapshots(store, BASE, cache, now=time.time() + END_GRACE_S / 2) == 0  # within the grace
    assert sweep_snapshots(store, BASE, cache, now=time.time() + LATER) == 1
    assert store.list(SNAPSHOTS) == []


@pytest.mark.parametrize("dies", ["before the reason", "after the reason"])
def test_a_sweep_cut_short_is_finished_by_the_next(gateway, store, tmp_path, monkeypatch, dies):
    session = gateway.create_session("t-alice", [], {})
    model_id = gateway.register_model("t-alice", session, 0, BASE, 4, {}, None)
    first, second = (snapshot(store, tmp_path, session, model_id, seq) for seq in (1, 2))
    gateway.finish("t-alice", session, "interrupted")
    registry = AdapterRegistry(store, model_id.replace(":", "."))
    put, delete = store.put, store.delete

    def put_or_die(key, data):
        if key.endswith("v000002/retired.json") and dies == "before the reason":
            raise OSError("the store went away")
        return put(key, data)

    def delete_or_die(key, **options):
        if "v000002/" in key:
            raise OSError("the store went away")
        return delete(key, **options)

    monkeypatch.setattr(store, "put", put_or_die)
    monkeypatch.setattr(store, "delete", delete_or_die)
    sweep_snapshots(store, BASE, {}, now=time.time() + LATER)  # logged, not raised: the calls go on
    assert store.list(SNAPSHOTS) != []  # still indexed
    monkeypatch.setattr(store, "put", put)
    monkeypatch.setattr(store, "delete", delete)
    assert sweep_snapshots(store, BASE, {}, now=time.time() + LATER) == 1  # the one left
    for version in (first, second):
        with pytest.raises(AdapterNotFoundError, match="the session that made it ended"):
            registry.pull(version, tmp_path / "cache")
    assert store.list(SNAPSHOTS) == []


def test_damaged_records_never_revive_a_session_nor_end_a_live_one_nor_fail_its_calls(gateway, store):
    finished = gateway.create_session("t-alice", [], {})
    gateway.finish("t-alice", finished, "success")
    store.put(end_key(finished), b"{not json")  # an end that cannot be read is still an end
    with pytest.raises(SessionEndedError, match="has ended"):
        gateway_on(store).create_sampling_session("t-alice", finished, 0, BASE, None)
    store.put(end_key(finished), b'{"time": 5}')  # (no reason)
    with pytest.raises(SessionEndedError, match="has ended"):
        gateway_on(store).create_sampling_session("t-alice", finished, 0, BASE, None)
    for damaged in (b'{"ended": false}', b'{"time": null}', b'{"time": "soon"}', b"[]", b"{not json"):
        live = gateway.create_session("t-alice", [], {})
        store.put(f"sessions/{live}/heartbeat.json", damaged)
        assert session_end(store, live) is None, damaged  # no time to expire from: taken as live
        assert not store.exists(end_key(live))
        gateway_on(store).create_sampling_session("t-alice", live, 0, BASE, None)


def test_one_clients_damaged_records_do_not_stop_the_sweep_of_the_others(gateway, store, tmp_path):
    sessions = [gateway.create_session("t-alice", [], {}) for _ in range(3)]
    models = [gateway.register_model("t-alice", s, 0, BASE, 4, {}, None) for s in sessions]
    versions = [snapshot(store, tmp_path, s, m, 1) for s, m in zip(sessions, models, strict=True)]
    for session in sessions:
        gateway.finish("t-alice", session, "success")
    # the first client's manifest is damaged (copied from elsewhere), the second's end record unreadable
    run = models[0].replace(":", ".")
    store.put(f"runs/{run}/adapters/v000001/manifest.json", b"{}")
    store.put(end_key(sessions[1]), b"{not json")
    assert sweep_snapshots(store, BASE, {}, now=time.time() + LATER) == 2  # the two that can be read
    for model_id, version in zip(models[1:], versions[1:], strict=True):
        with pytest.raises(AdapterNotFoundError, match="the session that made it ended"):
            AdapterRegistry(store, model_id.replace(":", ".")).pull(version, tmp_path / "cache")
    assert [key.rsplit("/", 1)[-1] for key in store.list(SNAPSHOTS)] == [run]  # kept, for another look


def test_a_snapshot_committed_while_the_sweep_removed_its_clients_entry_is_indexed_again(gateway, store, tmp_path,
                                                                                         monkeypatch):
    """Two trainers of one base model: B indexes and publishes a snapshot while A's sweep, which listed the
    versions before B's commit, removes the index entry."""
    session = gateway.create_session("t-alice", [], {})
    model_id = gateway.register_model("t-alice", session, 0, BASE, 4, {}, None)
    snapshot(store, tmp_path, session, model_id, 1)
    gateway.finish("t-alice", session, "success")
    delete = store.delete

    def b_commits_meanwhile(key, **options):
        delete(key, **options)
        if key.startswith(SNAPSHOTS):
            snapshot(store, tmp_path, session, model_id, 2)  # B: index (again), then its version
            delete(key, **options)  # ... but A's delete of the entry lands after B's mark

    monkeypatch.setattr(store, "delete", b_commits_meanwhile)
    assert sweep_snapshots(store, BASE, {}, now=time.time() + LATER) == 1
    monkeypatch.setattr(store, "delete", delete)
    assert store.list(SNAPSHOTS) != []  # put back: the new version is seen by the next sweep
    assert sweep_snapshots(store, BASE, {}, now=time.time() + LATER) == 1
    assert store.list(SNAPSHOTS) == []


# ---- what an ended session leaves behind ------------------------------------------------------------------------
def session_with_files(gateway: Gateway, store: ObjectStore) -> tuple[str, str, list[str], list[str]]:
    """A session with a training client, one call, its result and a fold (deleted after its end), and its records,
    a checkpoint and a sampling session (kept): (session, request id, keys to delete, keys to keep)."""
    session = gateway.create_session("t-alice", [], {})
    model_id = gateway.register_model("t-alice", session, 0, BASE, 4, {}, None)
    request_id = gateway.submit("t-alice", "optim_step", model_id, 1, b"{}")
    prefix = f"sessions/{session}"
    deleted = [*store.list(f"{prefix}/requests"), f"{prefix}/results/{request_id}.json",
               f"{prefix}/models/0.fold.json", f"{prefix}/models/0.fold.0123456789abcdef.safetensors"]
    for key in deleted[1:]:
        store.put(key, b"{}")
    write_sampler(store, "t-alice", session, 1, BASE, None, None, None)
    checkpoint = f"{checkpoint_prefix(model_run_name(model_id), 'weights')}/mine.safetensors"
    store.put(checkpoint, b"weights")
    kept = [f"{prefix}/session.json", f"{prefix}/models/0.json", checkpoint, *store.list(f"{prefix}/samplers")]
    assert len(deleted) == 4 and len(kept) == 4 and all(store.exists(key) for key in deleted + kept)
    return session, request_id, deleted, kept


def test_an_ended_sessions_calls_results_and_folds_are_deleted_a_day_after_its_end_its_records_kept(gateway, store):
    finished, finished_call, finished_files, finished_kept = session_with_files(gateway, store)
    silent, silent_call, silent_files, silent_kept = session_with_files(gateway, store)
    live, _, live_files, live_kept = session_with_files(gateway, store)
    gateway.finish("t-alice", finished, "success")
    beat(store, silent, 2 * DAY + 60)  # expired a day and a minute ago, and nobody has looked since
    assert sweep_sessions(store) == 1
    assert session_end(store, silent)[0].startswith("expired")  # the sweep recorded the expiry it saw
    assert not any(store.exists(key) for key in silent_files) and all(store.exists(key) for key in silent_kept)
    assert all(store.exists(key) for key in finished_files + live_files)  # a day after the end, not before
    with pytest.raises(NotFoundError, match=f"session {silent}, which ended .* its calls' bodies and results were deleted "
                                            r"on \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \("):
        gateway.result("t-alice", silent_call)
    assert gateway.result("t-alice", finished_call) == (b"{}", "json")
    assert sweep_sessions(store, now=time.time() + SESSION_FILES_KEPT_S + 1) == 1
    assert not any(store.exists(key) for key in finished_files) and all(store.exists(key) for key in finished_kept)
    assert all(store.exists(key) for key in live_files + live_kept)
    assert [key.rsplit("/", 1)[-1] for key in store.list(OPEN_SESSIONS)] == [live]
    assert files_deleted(store, finished) is not None and files_deleted(store, live) is None


def test_an_expired_sessions_sampling_sessions_leave_its_tenants_count_when_it_is_swept(gateway, store):
    """A session that expired was never finished: the sweep that deletes its files removes its sampling sessions
    from its tenant's count too (``pipeline.api.quotas``), and leaves a live session's."""
    from pipeline.api.quotas import SAMPLERS

    silent, live = gateway.create_session("t-alice", [], {}), gateway.create_session("t-alice", [], {})
    for session in (silent, live):
        for seq in range(2):
            gateway.create_sampling_session("t-alice", session, seq, BASE, None)
    beat(store, silent, 2 * DAY + 60)
    assert sweep_sessions(store) == 1
    left = sorted(key.rsplit("/", 1)[-1] for key in store.list(f"{SAMPLERS}/t-alice"))
    assert left == [f"{live}.sample.0", f"{live}.sample.1"]


def test_a_deletion_cut_short_is_finished_by_the_next_sweep_and_an_operator_frees_an_unindexed_session(
        gateway, store, monkeypatch):
    session, _, files, kept = session_with_files(gateway, store)
    gateway.finish("t-alice", session, "success")
    delete = store.delete

    def delete_or_die(key, **options):
        if "/results/" in key:
            raise OSError("the store went away")
        return delete(key, **options)

    monkeypatch.setattr(store, "delete", delete_or_die)
    assert sweep_sessions(store, now=time.time() + SESSION_FILES_KEPT_S + 1) == 0  # logged, not raised
    assert store.list(OPEN_SESSIONS) != []
    monkeypatch.setattr(store, "delete", delete)
    assert sweep_sessions(store, now=time.time() + SESSION_FILES_KEPT_S + 1) == 1
    assert not any(store.exists(key) for key in files) and all(store.exists(key) for key in kept)
    # a session made before the index (or whose entry was lost) is freed by name; a live one is refused
    older, _, older_files, older_kept = session_with_files(gateway, store)
    store.delete(f"{OPEN_SESSIONS}/{older}")
    with pytest.raises(ValueError, match="has not ended"):
        free_session_files(store, older)
    gateway.finish("t-alice", older, "success")
    with pytest.raises(ValueError, match="ended less than 10 minutes ago; free it from"):  # calls may be in flight
        free_session_files(store, older)
    assert free_session_files(store, older, now=time.time() + END_GRACE_S + 1) == len(older_files)
    assert not any(store.exists(key) for key in older_files) and all(store.exists(key) for key in older_kept)


# ---- named sampler weights whose name is gone --------------------------------------------------------------------
def named_save(store: ObjectStore, tmp_path, session: str, model_id: str, seq: int, name: str,
               ttl: float | None = None) -> int:
    """What the trainer does for save_weights_for_sampler(name): a registry version and its checkpoint record."""
    version = snapshot(store, tmp_path, session, model_id, seq, path=f"tinker://{model_id}/sampler_weights/{name}",
                       record=False)
    name_sampler_version(store, TinkerPath(model_id, "sampler", name), version, 1,
                         None if ttl is None else time.time() + ttl)
    return version


def test_named_sampler_weights_whose_name_was_deleted_or_expired_are_retired_once_no_live_session_samples_them(
        gateway, store, tmp_path):
    session = gateway.create_session("t-alice", [], {})
    model_id = gateway.register_model("t-alice", session, 0, BASE, 4, {}, None)
    other_model = gateway.register_model("t-alice", session, 1, "/other", 4, {}, None)
    used = named_save(store, tmp_path, session, model_id, 1, "used")
    unused = named_save(store, tmp_path, session, model_id, 2, "unused")
    kept = named_save(store, tmp_path, session, model_id, 3, "kept")
    expiring = named_save(store, tmp_path, session, model_id, 4, "expiring", ttl=3600)
    theirs = named_save(store, tmp_path, session, other_model, 5, "theirs")
    reader = gateway.create_session("t-alice", [], {})  # another session samples from "used"
    gateway.create_sampling_session("t-alice", reader, 0, None, f"tinker://{model_id}/sampler_weights/used")
    for name in ("used", "unused"):
        gateway.delete_checkpoint("t-alice", model_id, f"sampler_weights/{name}")
    gateway.delete_checkpoint("t-alice", other_model, "sampler_weights/theirs")
    later = time.time() + LATER
    assert sweep_unnamed_versions(store, BASE, {}) == 0  # within the grace after the delete
    assert sweep_unnamed_versions(store, BASE, {}, now=later) == 1  # "unused"; "used" is sampled by a live session
    registry = AdapterRegistry(store, model_run_name(model_id))
    with pytest.raises(AdapterNotFoundError, match=r"its name .* was deleted or expired"):
        registry.pull(unused, tmp_path / "cache")
    for version in (used, kept, expiring):
        assert registry.pull(version, tmp_path / "cache").is_dir()
    gateway.finish("t-alice", reader, "success")
    assert sweep_base_model(store, BASE, {}, now=time.time() + 3600 + LATER) == 1  # "expiring" has expired
    assert sweep_unnamed_versions(store, BASE, {}, now=time.time() + 3600 + 2 * LATER) == 2  # "used", "expiring"
    for version in (used, expiring):
        with pytest.raises(AdapterNotFoundError, match="was deleted or expired"):
            registry.pull(version, tmp_path / "fresh-cache")  # (a reader's cached copy stays its own)
    assert registry.pull(kept, tmp_path / "cache").is_dir()
    assert AdapterRegistry(store, model_run_name(other_model)).pull(theirs, tmp_path / "cache").is_dir()
    assert sweep_unnamed_versions(store, "/other", {}, now=later) == 1  # another base model's trainer's
    assert store.list(UNNAMED_VERSIONS) == [] and store.list(VERSION_USERS) == []


def test_a_delete_cut_short_keeps_the_version_it_still_names(gateway, store, tmp_path, monkeypatch):
    session = gateway.create_session("t-alice", [], {})
    model_id = gateway.register_model("t-alice", session, 0, BASE, 4, {}, None)
    version = named_save(store, tmp_path, session, model_id, 1, "mine")
    delete = store.delete

    def delete_or_die(key, **options):
        if key.endswith("sampler_weights/mine.json"):
            raise OSError("the store went away")
        return delete(key, **options)

    monkeypatch.setattr(store, "delete", delete_or_die)
    with pytest.raises(OSError):
        gateway.delete_checkpoint("t-alice", model_id, "sampler_weights/mine")
    monkeypatch.setattr(store, "delete", delete)
    assert sweep_unnamed_versions(store, BASE, {}, now=time.time() + LATER) == 0  # still named: kept
    assert AdapterRegistry(store, model_run_name(model_id)).pull(version, tmp_path / "cache").is_dir()
    assert store.list(UNNAMED_VERSIONS) == []


def test_a_name_saved_again_frees_the_version_it_named_and_a_ttl_set_after_a_delete_does_not_revive_it(
        gateway, store, tmp_path):
    session = gateway.create_session("t-alice", [], {})
    model_id = gateway.register_model("t-alice", session, 0, BASE, 4, {}, None)
    first = named_save(store, tmp_path, session, model_id, 1, "latest")
    second = named_save(store, tmp_path, session, model_id, 2, "latest")  # the SDK's named saves replace the name
    assert sweep_unnamed_versions(store, BASE, {}, now=time.time() + LATER) == 1
    registry = AdapterRegistry(store, model_run_name(model_id))
    with pytest.raises(AdapterNotFoundError, match="was deleted or expired"):
        registry.pull(first, tmp_path / "cache")
    assert registry.pull(second, tmp_path / "cache").is_dir()
    # a TTL change that read the record before a delete and writes it after: the record is removed again
    path = TinkerPath(model_id, "sampler", "latest")
    record = store.get(f"{checkpoint_prefix(model_run_name(model_id), 'sampler_weights')}/latest.json")
    gateway.delete_checkpoint("t-alice", model_id, "sampler_weights/latest")
    store.put(f"{checkpoint_prefix(model_run_name(model_id), 'sampler_weights')}/latest.json", record)
    with pytest.raises(NotFound, match="deleted meanwhile"):
        set_ttl(store, path, 7200)
    assert sweep_unnamed_versions(store, BASE, {}, now=time.time() + LATER) == 1


def test_sessions_made_before_the_indexes_are_indexed_once_and_the_weights_they_sample_kept(
        gateway, tmp_path):
    store = ObjectStore(f"file://{tmp_path}/store")  # a local store: emptied index folders go too
    gateway = gateway_on(store)
    session = gateway.create_session("t-alice", [], {})
    model_id = gateway.register_model("t-alice", session, 0, BASE, 4, {}, None)
    version = named_save(store, tmp_path, session, model_id, 1, "shared")
    reader = gateway.create_session("t-alice", [], {})
    gateway.create_sampling_session("t-alice", reader, 0, None, f"tinker://{model_id}/sampler_weights/shared")
    for key in store.list("api", recursive=True):  # as a store written before the indexes existed
        store.delete(key)
    assert index_existing_sessions(store) == 2 and index_existing_sessions(store) == 0  # once per store
    assert sorted(k.rsplit("/", 1)[-1] for k in store.list(OPEN_SESSIONS)) == sorted([session, reader])
    gateway.delete_checkpoint("t-alice", model_id, "sampler_weights/shared")
    assert sweep_unnamed_versions(store, BASE, {}, now=time.time() + LATER) == 0  # the reader still samples it
    gateway.finish("t-alice", reader, "success")
    assert sweep_sessions(store, now=time.time() + SESSION_FILES_KEPT_S + 1) == 1  # the reader's files go...
    assert store.list(f"{VERSION_USERS}/{model_run_name(model_id)}/{version}") == []  # ...and its user note
    assert sweep_unnamed_versions(store, BASE, {}, now=time.time() + LATER) == 1
    assert store.list(UNNAMED_VERSIONS) == [] and store.list(VERSION_USERS) == []
