"""Engine activity: what the API's engines record about their busy time, and how it is read back.

A recorder buffers one record per executed call and writes them as one JSON-lines
object per flush under ``engines/<kind>-<engine id>/activity/``; nothing is written
while a call records, and whatever is buffered is written at close.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from pipeline.api.activity import (
    ActivityRecorder,
    EngineActivity,
    activity_prefix,
    engines,
    read_activity,
    sweep_activity,
)
from pipeline.io.store import ObjectStore
from schemas.names import InvalidNameError

T0 = 1_700_000_000.0


def _store() -> ObjectStore:
    return ObjectStore(f"memory://activity-{uuid.uuid4().hex}")


def _record(recorder: ActivityRecorder, session: str, start: float, end: float, op: str = "forward_backward",
            tokens: int = 10) -> None:
    recorder.record(session, "tenant-a", op, T0 + start, T0 + end, tokens)


def test_records_are_written_as_json_lines_once_per_flush_and_at_close() -> None:
    store = _store()
    recorder = ActivityRecorder(store, "trainer", "host-1", flush_every_s=3600.0, flush_every_calls=3)
    _record(recorder, "s1", 0.0, 1.0)
    _record(recorder, "s2", 1.0, 2.5)
    assert store.list(activity_prefix("trainer", "host-1")) == []  # recording does no I/O
    _record(recorder, "s1", 3.0, 4.0)  # the third call fills a batch: written off the caller's thread
    deadline = time.monotonic() + 5.0
    while not store.list(activity_prefix("trainer", "host-1")) and time.monotonic() < deadline:
        time.sleep(0.01)
    _record(recorder, "s2", 5.0, 6.0, op="optim_step", tokens=0)
    recorder.close()
    keys = store.list(activity_prefix("trainer", "host-1"))
    assert len(keys) == 2 and all(key.endswith(".jsonl") for key in keys)
    first = [json.loads(line) for line in store.get(keys[0]).decode().splitlines()]
    assert [r["session"] for r in first] == ["s1", "s2", "s1"]
    assert first[1] == {"engine": "trainer-host-1", "kind": "trainer", "session": "s2", "tenant": "tenant-a",
                        "op": "forward_backward", "start": T0 + 1.0, "end": T0 + 2.5, "tokens": 10}


def test_a_recorder_flushes_by_time() -> None:
    store = _store()
    recorder = ActivityRecorder(store, "sampler", "s-0", flush_every_s=0.05, flush_every_calls=1000)
    _record(recorder, "s1", 0.0, 1.0, op="sample")
    deadline = time.monotonic() + 5.0
    while not store.list(activity_prefix("sampler", "s-0")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(store.list(activity_prefix("sampler", "s-0"))) == 1
    recorder.close()
    assert len(store.list(activity_prefix("sampler", "s-0"))) == 1  # nothing left to write


def test_reading_back_every_engine_within_a_window() -> None:
    store = _store()
    trainer = ActivityRecorder(store, "trainer", "t", flush_every_s=3600.0, flush_every_calls=2)
    sampler = ActivityRecorder(store, "sampler", "s", flush_every_s=3600.0)
    for start in (0.0, 10.0, 20.0, 30.0):
        _record(trainer, "s1", start, start + 2.0)
    _record(sampler, "s2", 5.0, 6.0, op="sample")
    trainer.close()
    sampler.close()
    everything = read_activity(store)
    assert sorted((a.engine, a.session, a.start - T0) for a in everything) == [
        ("sampler-s", "s2", 5.0), ("trainer-t", "s1", 0.0), ("trainer-t", "s1", 10.0), ("trainer-t", "s1", 20.0),
        ("trainer-t", "s1", 30.0)]
    window = read_activity(store, since=T0 + 11.0, until=T0 + 21.0)  # records that overlap [11, 21]
    assert sorted(a.start - T0 for a in window) == [10.0, 20.0]
    assert all(isinstance(a, EngineActivity) and a.seconds == 2.0 for a in window)


def test_names_that_become_paths_are_checked() -> None:
    with pytest.raises(InvalidNameError):
        ActivityRecorder(_store(), "trainer", "../escape")
    with pytest.raises(ValueError, match="kind"):
        ActivityRecorder(_store(), "learner", "t")
    with pytest.raises(ValueError, match="flush_every_s"):
        ActivityRecorder(_store(), "trainer", "t", flush_every_s=0.0)


def test_a_stored_line_that_is_not_a_record_is_skipped() -> None:
    store = _store()
    store.put(f"{activity_prefix('trainer', 't')}/0-0-ab.jsonl",
              b'{"nonsense": 1}\nnot json\n' + json.dumps(
                  {"engine": "trainer-t", "kind": "trainer", "session": "s1", "tenant": None, "op": "optim_step",
                   "start": T0, "end": T0 + 1.0, "tokens": 0}).encode())
    assert [a.session for a in read_activity(store)] == ["s1"]


def test_records_older_than_the_kept_days_are_deleted_and_an_engine_left_with_none_is_gone() -> None:
    store = _store()
    old_engine = ActivityRecorder(store, "trainer", "gone", flush_every_s=3600.0)
    current = ActivityRecorder(store, "sampler", "s", flush_every_s=3600.0)
    _record(old_engine, "s1", 0.0, 1.0)  # a process that ended long ago
    for start in (0.0, 50.0, 100.0, 150.0):  # two objects: [0, 51] and [100, 151]
        _record(current, "s2", start, start + 1.0, op="sample")
        if start in (50.0, 150.0):
            current.flush()
    old_engine.close()
    current.close()
    assert len(engines(store)) == 2
    # keep what ends within 60 s of T0 + 151: the object ending at T0 + 151 only
    assert sweep_activity(store, now=T0 + 151.0, kept_s=60.0) == 2
    assert sorted(a.start - T0 for a in read_activity(store)) == [100.0, 150.0]
    assert engines(store) == ["sampler-s"]
    assert sweep_activity(store, now=T0 + 151.0, kept_s=60.0) == 0
