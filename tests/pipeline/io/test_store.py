"""ObjectStore on file://, memory:// and gs:// (the real emulator): create-only, digests, keys, listing."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from pipeline.devstack.gcs_emulator import FakeGCSServer, ensure_bucket
from pipeline.devstack.process import free_port
from pipeline.io.store import ChecksumError, InvalidKeyError, ObjectStore, StoreURLError, raised_by_store, validate_key
from schemas.config import StoreConfig

PAYLOAD = b"\x00rlpipe\xffbytes" * 100


def test_round_trip_returns_the_bytes_and_their_sha256(any_store: ObjectStore) -> None:
    digest = any_store.put_create("runs/r/a.bin", PAYLOAD)
    assert digest == hashlib.sha256(PAYLOAD).hexdigest()
    assert any_store.get("runs/r/a.bin") == PAYLOAD
    assert any_store.get("runs/r/a.bin", sha256=digest) == PAYLOAD
    with any_store.open_input("runs/r/a.bin") as handle:
        assert handle.read(7) == PAYLOAD[:7]


def test_create_only_refuses_an_existing_object_and_keeps_it(any_store: ObjectStore) -> None:
    any_store.put_create("x/obj", b"first")
    with pytest.raises(FileExistsError, match="already exists"):
        any_store.put_create("x/obj", b"second")
    assert any_store.get("x/obj") == b"first"


def test_create_once_accepts_our_own_bytes_and_refuses_others(memory_store: ObjectStore) -> None:
    memory_store.put_create("x/obj", b"first")
    assert memory_store.put_create_once("x/obj", b"first") == hashlib.sha256(b"first").hexdigest()
    with pytest.raises(FileExistsError, match="already exists"):
        memory_store.put_create_once("x/obj", b"second")
    assert memory_store.get("x/obj") == b"first"


def test_overwrite_replaces(any_store: ObjectStore) -> None:
    any_store.put("m/state.json", b"1")
    any_store.put("m/state.json", b"2")
    assert any_store.get("m/state.json") == b"2"


def test_flipped_byte_is_detected(any_store: ObjectStore) -> None:
    digest = any_store.put_create("b/data", PAYLOAD)
    flipped = bytearray(PAYLOAD)
    flipped[17] ^= 0x01
    any_store.put("b/data", bytes(flipped))  # someone tampers with the object in place
    with pytest.raises(ChecksumError, match=r"checksum mismatch for .*b/data.*expected sha256 " + digest):
        any_store.get("b/data", sha256=digest)


def test_racing_creates_have_exactly_one_winner(any_store: ObjectStore) -> None:
    winners: list[int] = []
    barrier = threading.Barrier(8)

    def create(i: int) -> None:
        barrier.wait()
        try:
            any_store.put_create("race/obj", str(i).encode())
            winners.append(i)
        except FileExistsError:
            pass

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(winners) == 1
    assert any_store.get("race/obj") == str(winners[0]).encode()


def test_list_exists_delete(any_store: ObjectStore) -> None:
    for key in ("runs/a/x.parquet", "runs/a/sub/y.json", "runs/b/z"):
        any_store.put_create(key, b"-")
    assert any_store.list("runs") == ["runs/a", "runs/b"]
    assert any_store.list("runs/a", recursive=True) == ["runs/a/sub/y.json", "runs/a/x.parquet"]
    assert any_store.list("nothing/here") == []
    assert any_store.exists("runs/a/x.parquet") and any_store.exists("runs/a")
    assert not any_store.exists("runs/c")
    any_store.delete("runs/a/x.parquet")
    assert not any_store.exists("runs/a/x.parquet")
    any_store.delete("runs/a", recursive=True)
    assert any_store.list("runs", recursive=True) == ["runs/b/z"]
    with pytest.raises(FileNotFoundError, match="nothing to delete"):
        any_store.delete("runs/a/x.parquet")
    any_store.delete("runs/a/x.parquet", missing_ok=True)


def test_missing_object_names_its_url(any_store: ObjectStore) -> None:
    with pytest.raises(FileNotFoundError, match=r"no object at .*/prefix/nope|no object at .*store/nope"):
        any_store.get("nope")


@pytest.mark.parametrize("key", ["../escape", "a/../../b", "/etc/passwd", "a\\b", "", "a//b", "./a", "gs://b/k", "C:x"])
def test_keys_escaping_the_root_are_refused(file_store: ObjectStore, key: str) -> None:
    with pytest.raises(InvalidKeyError, match=r"not allowed|empty"):
        file_store.put_create(key, b"x")
    assert not os.path.exists(os.path.join(os.path.dirname(file_store.path()), "escape"))


def test_validate_key_normalises_prefixes() -> None:
    assert validate_key("runs/a/", allow_root=True) == "runs/a"
    assert validate_key("", allow_root=True) == ""
    with pytest.raises(InvalidKeyError):
        validate_key("runs/a/")


def test_local_lost_race_leaves_no_temporary_file(file_store: ObjectStore) -> None:
    file_store.put_create("d/obj", b"a")
    with pytest.raises(FileExistsError):
        file_store.put_create("d/obj", b"b")
    assert os.listdir(os.path.dirname(file_store.path("d/obj"))) == ["obj"]


def test_plain_local_path_and_url(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = ObjectStore(str(tmp_path))
    store.put_create("k", b"v")
    assert store.is_local
    assert store.url("k") == (tmp_path / "k").as_uri()
    assert (tmp_path / "k").read_bytes() == b"v"


def test_gs_urls_and_from_config(gcs_emulator: FakeGCSServer) -> None:
    ensure_bucket(gcs_emulator.endpoint_url, "cfg-bucket")
    ensure_bucket(gcs_emulator.endpoint_url, "cfg-bucket")  # idempotent
    store = ObjectStore.from_config(StoreConfig(root="gs://cfg-bucket/p/", gcs_endpoint=gcs_emulator.endpoint_url))
    store.put_create("k", b"v")
    assert store.url("k") == "gs://cfg-bucket/p/k"
    assert store.path("k") == "cfg-bucket/p/k"
    assert store.filesystem.cat_file("cfg-bucket/p/k") == b"v"


@pytest.mark.parametrize(
    ("root", "endpoint", "message"),
    [
        ("", None, "empty"),
        ("bogus://x", None, "cannot open store root"),
        ("gs://", "http://127.0.0.1:1", "names no bucket"),
        ("gs://Bad_Bucket", "http://127.0.0.1:1", "not a valid GCS bucket"),
        ("memory://x", "http://127.0.0.1:1", "not gs://"),
        ("gs://bucket", "ftp://host", "must start with http"),
    ],
)
def test_bad_roots_are_refused_with_a_clear_error(root: str, endpoint: str | None, message: str) -> None:
    with pytest.raises(StoreURLError, match=message):
        ObjectStore(root, gcs_endpoint=endpoint)


def test_emulator_stops_and_frees_its_port() -> None:
    server = FakeGCSServer().start()
    url = server.endpoint_url
    ensure_bucket(url, "tmp-bucket")
    assert server.running
    server.stop()
    assert not server.running
    server.stop()  # twice is fine
    with pytest.raises(Exception, match="cannot reach"):
        ensure_bucket(url, "other")


def test_missing_google_credentials_are_one_line_but_a_bug_is_not_hidden(monkeypatch):
    import gcsfs
    from google.auth.exceptions import DefaultCredentialsError

    def no_credentials(**kwargs):
        raise DefaultCredentialsError("Your default credentials were not found")

    monkeypatch.setattr(gcsfs, "GCSFileSystem", no_credentials)
    with pytest.raises(StoreURLError, match="no Google credentials for gs://"):
        ObjectStore("gs://bucket/prefix")

    def broken(**kwargs):
        raise TypeError("unexpected keyword argument 'token'")

    monkeypatch.setattr(gcsfs, "GCSFileSystem", broken)
    with pytest.raises(TypeError, match="unexpected keyword"):
        ObjectStore("gs://bucket/prefix")


def test_create_many_writes_every_object_create_only(any_store: ObjectStore) -> None:
    files = {"c/one.bin": PAYLOAD, "c/two.json": b"{}", "d/three": b"3"}
    digests = any_store.put_create_many(files)
    assert digests == {key: hashlib.sha256(data).hexdigest() for key, data in files.items()}
    assert {key: any_store.get(key) for key in files} == files
    assert any_store.put_create_many({"c/one.bin": PAYLOAD}) == {"c/one.bin": digests["c/one.bin"]}  # our own bytes
    with pytest.raises(FileExistsError, match="already exists"):
        any_store.put_create_many({"c/new": b"n", "c/two.json": b"other"})
    assert any_store.get("c/two.json") == b"{}"


def test_create_many_refuses_a_bad_key_before_writing_anything(file_store: ObjectStore) -> None:
    with pytest.raises(InvalidKeyError):
        file_store.put_create_many({"e/good": b"g", "../escape": b"x"})
    assert not file_store.exists("e/good")


def test_create_many_makes_each_folder_durable_once(file_store: ObjectStore, fsyncs: list[str]) -> None:
    """Every file's bytes are fsynced before it is linked, and each folder's new names with one fsync of
    the folder: three files in one new folder and one in another cost 4 + 2 fsyncs, not 8, and the root
    that holds both new folders one more."""
    file_store.put_create("old", b"o")
    fsyncs.clear()
    file_store.put_create_many({"f/a": b"a", "f/b": b"b", "f/c": b"c", "g/d": b"d"})
    assert fsyncs == ["file"] * 4 + ["folder"] * 3  # the folders after every file's bytes
    assert sorted(os.listdir(os.path.dirname(file_store.path("f/a")))) == ["a", "b", "c"]  # no temporary left


@pytest.fixture
def synced_folders(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The path of every folder ``os.fsync`` synced during the test, in order."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fsynced folders through /proc")
@pytest.mark.parametrize("many", [False, True], ids=["put_create", "put_create_many"])
def test_a_create_in_new_folders_makes_each_new_folders_name_durable(
    file_store: ObjectStore, synced_folders: list[str], many: bool
) -> None:
    """A new folder's name lives in its parent: a crash of the machine would drop the folder, and the
    object in it, unless the parent of every folder the write created is fsynced too."""
    file_store.put_create("runs/r/old.json", b"{}")
    synced_folders.clear()
    key = "runs/r/checkpoints/step-000001-a/state.json"
    if many:
        file_store.put_create_many({key: b"{}"})
    else:
        file_store.put_create(key, b"{}")
    for folder in ("runs/r/checkpoints/step-000001-a", "runs/r/checkpoints", "runs/r"):
        assert file_store.path(folder) in synced_folders
    assert file_store.path("runs") not in synced_folders  # it existed: its names did not change


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fsynced folders through /proc")
@pytest.mark.parametrize("many", [False, True], ids=["put_create_once", "put_create_many"])
def test_accepting_our_own_bytes_makes_their_name_durable(
    file_store: ObjectStore, synced_folders: list[str], many: bool
) -> None:
    """An attempt that linked the file and died before syncing its folder left a name a crash of the machine
    may drop: the create that accepts those bytes as its own syncs the folder before it returns."""
    path = file_store.path("f/a")
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as handle:  # linked, never synced
        handle.write(PAYLOAD)
    if many:
        file_store.put_create_many({"f/a": PAYLOAD})
    else:
        file_store.put_create_once("f/a", PAYLOAD)
    assert file_store.path("f") in synced_folders


@pytest.mark.parametrize("scheme", ["ftp", "https", "webhdfs"])
def test_a_root_without_an_atomic_create_only_write_is_refused_before_connecting(scheme: str) -> None:
    """Every commit (a manifest, a batch, a lease epoch) is a create-only write; these filesystems can only check,
    then write, which two processes can both pass, the second silently replacing the first's commit."""
    root = f"{scheme}://127.0.0.1:{free_port()}/rlpipe"  # nothing listens there: refused before any connection
    with pytest.raises(StoreURLError, match=f"{scheme}:// has no atomic create-only write.*use file:///path"):
        ObjectStore(root)


def test_a_failure_is_the_stores_only_when_it_came_out_of_the_stores_code() -> None:
    """``raised_by_store``: through the store's methods or its fsspec filesystem, or raised ``from`` such a
    failure; an OSError raised elsewhere (a model id the hub does not know) is not the store's."""
    store = ObjectStore("memory://raised-by-store")
    failures = []
    for fails in (lambda: store.get("absent"), lambda: store.filesystem.cat_file("/raised-by-store/absent")):
        with pytest.raises(OSError) as caught:
            fails()
        failures.append(caught.value)
    assert [raised_by_store(exc) for exc in failures] == [True, True]
    try:
        raise OSError("typo/model is not a valid model identifier")
    except OSError as exc:
        elsewhere = exc
    assert not raised_by_store(elsewhere)
    try:
        raise OSError("could not store the batch") from failures[0]
    except OSError as exc:
        wrapped = exc
    assert raised_by_store(wrapped)


def test_read_json_records_keeps_the_error_of_each_file_it_could_not_read(tmp_path) -> None:
    """A damaged record and one a newer rlpipe wrote are both unreadable, but only the second is readable after an
    upgrade: their errors come back as raised (each naming its key), so a caller can say which to do."""
    from pipeline.io.store import read_json_records
    from schemas.evaluation import ValidationPlayed, validation_from_bytes, validation_to_bytes
    from schemas.versions import NewerSchemaError

    store = ObjectStore(tmp_path.as_uri())
    played = ValidationPlayed(run_id="r", env="cartpole", seed_start=8, episodes=4)
    store.put("runs/r/validation/good.json", validation_to_bytes(played))
    store.put("runs/r/validation/damaged.json", b"{not json")
    store.put("runs/r/validation/newer.json", validation_to_bytes(played).replace(b'"1.0"', b'"2.0"'))
    records, unreadable = read_json_records(store, "runs/r/validation",
                                            lambda data, key: validation_from_bytes(data, where=key))
    assert records == [played]
    by_key = {str(error).split(" ")[0]: error for error in unreadable}
    assert set(by_key) == {"runs/r/validation/damaged.json", "runs/r/validation/newer.json"}, unreadable
    assert isinstance(by_key["runs/r/validation/newer.json"], NewerSchemaError)
    assert not isinstance(by_key["runs/r/validation/damaged.json"], NewerSchemaError)
