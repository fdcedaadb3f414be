"""The journaled local S3 server under the embedded broker's log: restore, compaction, listing, restart."""

from __future__ import annotations

import hashlib
import json
import urllib.request
from pathlib import Path

import pytest

from pipeline.devstack.s3_server import (
    LocalS3Server,
    _journal_entry,
    _ordered_modification_times,
    _s3_backend,
    compact_journal,
    restore_journal,
)

ENDPOINT = "http://127.0.0.1:1"  # journaled URLs keep the old port; only the path matters


def put(key: str, body: bytes, **headers: str) -> dict:
    entry = _journal_entry(f"{ENDPOINT}/journal-test/{key}", body)
    entry["headers"].update(headers)
    return entry


def etag(body: bytes) -> str:
    return f'"{hashlib.md5(body).hexdigest()}"'


@pytest.fixture
def backend():
    """moto's S3 backend in this process, as the server process sets it up (strictly increasing times)."""
    _ordered_modification_times()
    backend = _s3_backend()
    backend.reset()
    yield backend
    backend.reset()


def test_restore_applies_writes_as_they_were_answered_and_compaction_keeps_the_result(
    backend, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.jsonl"
    entries = [
        _journal_entry(f"{ENDPOINT}/journal-test", b""),
        put("meta.json", b"v1", **{"If-None-Match": "*"}),
        put("meta.json", b"lost a create race", **{"If-None-Match": "*"}),
        put("meta.json", b"v2", **{"If-Match": etag(b"v1")}),
        put("meta.json", b"stale update", **{"If-Match": etag(b"v1")}),
        put("records/00000000000000000000.batch", b"first"),
        put("records/00000000000000000001.batch", b"second"),
        {"method": "DELETE", "url": f"{ENDPOINT}/journal-test/gone", "headers": {}, "body": ""},
    ]
    journal.write_text("".join(json.dumps(e) + "\n" for e in entries) + '{"cut short')
    assert restore_journal(journal) == 6
    bucket = backend.buckets["journal-test"]
    assert {k: bucket.keys[k].value for k in bucket.keys} == {
        "meta.json": b"v2", "records/00000000000000000000.batch": b"first",
        "records/00000000000000000001.batch": b"second"}
    order = sorted(bucket.keys, key=lambda k: bucket.keys[k].last_modified)
    assert order == ["meta.json", "records/00000000000000000000.batch", "records/00000000000000000001.batch"]

    assert compact_journal(journal, ENDPOINT) == 3
    assert len(journal.read_text().splitlines()) == 4  # the bucket and one PUT per object
    backend.reset()
    restore_journal(journal)
    bucket = backend.buckets["journal-test"]
    assert sorted(bucket.keys, key=lambda k: bucket.keys[k].last_modified) == order
    assert bucket.keys["meta.json"].value == b"v2"


def test_a_restarted_server_lists_what_it_held_in_write_order(tmp_path: Path) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    auth = {"Authorization": "AWS4-HMAC-SHA256 Credential=t/20260101/us-east-1/s3/aws4_request, "
                             "SignedHeaders=host, Signature=0"}
    with LocalS3Server(data_dir=tmp_path / "s3", bucket="restart-test") as server:
        for name in ("b", "a", "c"):
            opener.open(urllib.request.Request(f"{server.endpoint_url}/restart-test/p/{name}", data=name.encode(),
                                               method="PUT", headers=auth)).read()
    with LocalS3Server(data_dir=tmp_path / "s3", bucket="restart-test") as server:
        listing = opener.open(urllib.request.Request(
            f"{server.endpoint_url}/restart-test?list-type=2&prefix=p%2F&max-keys=2", headers=auth)).read().decode()
        rest = opener.open(urllib.request.Request(
            f"{server.endpoint_url}/restart-test?list-type=2&prefix=p%2F&continuation-token=p%2Fb",
            headers=auth)).read().decode()
    assert "<Key>p/a</Key>" in listing and "<Key>p/b</Key>" in listing and "<IsTruncated>true" in listing
    assert "<Key>p/c</Key>" in rest and "<IsTruncated>false" in rest
    # modification times to the microsecond, increasing in write order (b, a, c)
    times = dict(zip(["a", "b"], [t.split("<")[0] for t in listing.split("<LastModified>")[1:]], strict=True))
    assert times["b"] < times["a"] and "." in times["a"]


class _Object:
    """What the listing reads of moto's object."""

    def __init__(self, body: bytes) -> None:
        import datetime

        self.last_modified = datetime.datetime(2026, 1, 1, 0, 0, 0, len(body))
        self.etag, self.size = etag(body), len(body)


def test_the_listing_index_pages_in_key_order_and_follows_writes_and_deletes() -> None:
    from pipeline.devstack.s3_listing import ListingIndex, list_objects_v2

    index, store = ListingIndex(), {}
    for offset in (5, 1, 3, 2, 4):
        store[f"p/{offset:020}.batch"] = _Object(b"x" * offset)
    store["other/meta.json"] = _Object(b"m")

    def keys(query: dict) -> tuple[list[str], str]:
        body = list_objects_v2(index, store, "b", query).decode()
        token = body.split("<NextContinuationToken>")[1].split("<")[0] if "<NextContinuationToken>" in body else ""
        return [k.split("<")[0] for k in body.split("<Key>")[1:]], token

    first, token = keys({"prefix": "p/", "max-keys": "2"})
    assert first == ["p/00000000000000000001.batch", "p/00000000000000000002.batch"]
    assert token == first[-1]
    store["p/00000000000000000006.batch"] = _Object(b"y")  # appended after the first page
    del store["p/00000000000000000003.batch"]
    rest, token = keys({"prefix": "p/", "continuation-token": token})
    assert rest == [f"p/{n:020}.batch" for n in (4, 5, 6)] and token == ""
    store["p/00000000000000000000.batch"] = _Object(b"")  # inserted before the rest
    store["p/00000000000000000004.batch"] = _Object(b"z" * 9)  # written again: a new size
    body = list_objects_v2(index, store, "b", {"prefix": "p/", "start-after": "p/00000000000000000003.batch"}).decode()
    assert "p/00000000000000000000" not in body and "<Size>9</Size>" in body and "<KeyCount>3</KeyCount>" in body
    assert keys({"prefix": ""})[0][0] == "other/meta.json"
    assert keys({"prefix": "p/"})[0][0] == "p/00000000000000000000.batch"
