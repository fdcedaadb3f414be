"""What a gateway keeps of sessions' ends: an end stands, a live session is read again, the memory is bounded;
and what a sampler keeps of whether a session's client is there (ended or lapsed: gone), read again each check_s."""

import json
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from pipeline.api.lifecycle import end_key, heartbeat_key, record_end
from pipeline.api.liveness import ClientPresence, SessionLiveness
from pipeline.io.store import ObjectStore


def test_an_end_seen_stands_and_only_the_latest_sessions_are_kept():
    store = ObjectStore(f"memory://live-{uuid.uuid4().hex}")
    liveness = SessionLiveness(store, live_check_s=60.0, session_expiry_s=86400.0, cached_sessions=2)
    assert liveness.ended("sess-a") is None  # no end recorded: live, and taken as live for a minute
    record_end(store, "sess-a", "finished: success")
    assert liveness.ended("sess-a") is None  # (another gateway's end is seen after live_check_s)
    liveness.note("sess-a", "finished: success", math.inf)
    liveness.note("sess-a", None, 0.0)  # a live note after the end (a heartbeat on its way) changes nothing
    assert liveness.ended("sess-a") == "finished: success"
    liveness.note("sess-b", None, math.inf)
    liveness.note("sess-c", None, math.inf)  # 3 noted, 2 kept: sess-a is dropped, then read from the store again
    assert list(liveness._seen) == ["sess-b", "sess-c"]
    assert liveness.ended("sess-a") == "finished: success"


class Clock:
    """A monotonic clock the test moves (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat(store: ObjectStore, session: str, at: float) -> None:
    """A heartbeat record as a gateway writes it, ``at`` on the gateway's wall clock."""
    store.put(heartbeat_key(session), json.dumps({"time": at}).encode())


def test_a_client_is_gone_once_its_session_ended_or_its_heartbeats_lapsed_and_a_lapse_can_end():
    store = ObjectStore(f"memory://presence-{uuid.uuid4().hex}")
    clock = Clock()
    presence = ClientPresence(store, check_s=60.0, cached_sessions=2, timeout_s=300.0, clock=clock)
    beat(store, "sess-a", time.time())
    assert presence.gone("sess-a") is None
    record_end(store, "sess-a", "finished: success")
    assert presence.gone("sess-a") is None  # what was read stands for check_s (60 s here)
    presence.check_s = 0.0
    assert presence.gone("sess-a") == "ended (finished: success)"
    beat(store, "sess-b", time.time())
    assert presence.gone("sess-b") is None  # first seen: its heartbeat record counts from now
    clock.now += 300.0
    assert presence.gone("sess-b") is None  # unchanged for 300 s: not past the timeout yet
    clock.now += 1.0
    assert presence.gone("sess-b") == "sent no heartbeat for 301 s"  # 1 s past the timeout: its client is gone
    beat(store, "sess-b", time.time())  # a laptop that slept beats again: there again
    assert presence.gone("sess-b") is None
    clock.now += 299.0
    assert presence.gone("sess-b") is None  # counted from the new record, as this sampler first saw it
    assert presence.gone("sess-none") is None  # no heartbeat yet: nothing to lapse from
    clock.now += 3600.0
    assert presence.gone("sess-none") is None
    assert list(presence._seen) == ["sess-b", "sess-none"]  # 2 kept


def test_a_lapse_is_measured_on_the_samplers_own_clock_not_against_the_gateways():
    """The heartbeat record holds the gateway's wall-clock time; a sampler whose clock runs 301 s ahead must not
    take a client beating every 10 s as gone.  Only a record that stays unchanged past the timeout, as this
    process sees it, is a lapse."""
    store = ObjectStore(f"memory://presence-{uuid.uuid4().hex}")
    presence = ClientPresence(store, check_s=0.0, cached_sessions=2, timeout_s=300.0)
    beat(store, "sess-a", time.time() - 301.0)  # written just now by a gateway whose clock is 301 s behind
    assert presence.gone("sess-a") is None
    beat(store, "sess-a", time.time() + 3600.0)  # or an hour ahead
    assert presence.gone("sess-a") is None


def test_an_ended_session_is_gone_at_once_even_when_first_seen():
    store = ObjectStore(f"memory://presence-{uuid.uuid4().hex}")
    beat(store, "sess-a", time.time())
    record_end(store, "sess-a", "finished: success")
    assert ClientPresence(store, check_s=5.0, cached_sessions=2).gone("sess-a") == "ended (finished: success)"


def counted_slow_reads(store: ObjectStore, monkeypatch, key: str, delay_s: float) -> list[str]:
    """Make every ``store.get`` take ``delay_s``; the threads that read ``key``, one entry per read."""
    readers: list[str] = []
    get = store.get

    def slow(read: str) -> bytes:
        if read == key:
            readers.append(threading.current_thread().name)
        time.sleep(delay_s)
        return get(read)

    monkeypatch.setattr(store, "get", slow)
    return readers


def gone_from_threads(presence: ClientPresence, session: str, threads: int) -> list[str | None]:
    """What ``threads`` threads started together are told by ``presence.gone(session)``."""
    start = threading.Barrier(threads)

    def ask(_: int) -> str | None:
        start.wait()
        return presence.gone(session)

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(ask, range(threads)))


def test_concurrent_calls_of_a_session_read_its_records_once(monkeypatch):
    """32 calls of one session looking at once (rounds of concurrent calls) make one read of its records, not 32
    blocking the executor: first seen, they wait for the one read; after check_s, they take the last answer while
    one reads again."""
    store = ObjectStore(f"memory://presence-{uuid.uuid4().hex}")
    beat(store, "sess-a", time.time())
    record_end(store, "sess-b", "finished: success")
    clock = Clock()
    presence = ClientPresence(store, check_s=5.0, cached_sessions=4, clock=clock)
    readers = counted_slow_reads(store, monkeypatch, heartbeat_key("sess-b"), 0.2)
    assert gone_from_threads(presence, "sess-b", 32) == ["ended (finished: success)"] * 32
    assert len(readers) == 1
    readers = counted_slow_reads(store, monkeypatch, heartbeat_key("sess-a"), 0.2)
    assert gone_from_threads(presence, "sess-a", 32) == [None] * 32
    clock.now += 5.0  # the answer is old: read again, once
    assert gone_from_threads(presence, "sess-a", 32) == [None] * 32
    assert len(readers) == 2


def test_an_end_seen_is_never_replaced_by_a_read_that_started_before_it(monkeypatch):
    """A read that found no end, landing after a later read saw the end (here: the session was dropped from the
    memory meanwhile and read again), leaves the session ended."""
    store = ObjectStore(f"memory://presence-{uuid.uuid4().hex}")
    beat(store, "sess-a", time.time())
    presence = ClientPresence(store, check_s=60.0, cached_sessions=1)
    read_end, land = threading.Event(), threading.Event()
    get = store.get

    def held(key: str) -> bytes:
        try:
            return get(key)
        finally:
            if threading.current_thread().name == "early" and key == end_key("sess-a"):
                read_end.set()  # it found no end; it lands once the test says so
                land.wait(10)

    monkeypatch.setattr(store, "get", held)
    early = threading.Thread(target=presence.gone, args=("sess-a",), name="early")
    early.start()
    assert read_end.wait(10)
    presence.gone("sess-b")  # one session kept: sess-a is dropped
    record_end(store, "sess-a", "finished: success")
    assert presence.gone("sess-a") == "ended (finished: success)"
    land.set()
    early.join(10)
    assert presence.gone("sess-a") == "ended (finished: success)"


def test_a_store_that_fails_remotely_leaves_the_session_taken_as_there(monkeypatch, caplog):
    """A gs:// store's transient failure (gcsfs's HttpError, not an OSError) is an unreadable store, not a call's
    failure: the session is taken as there until the next read."""
    from gcsfs.retry import HttpError

    store = ObjectStore(f"memory://presence-{uuid.uuid4().hex}")
    store.put(heartbeat_key("sess-a"), json.dumps({"time": time.time()}).encode())

    def unavailable(key: str) -> bytes:
        raise HttpError({"code": 503, "message": "Service Unavailable"})

    monkeypatch.setattr(store, "get", unavailable)
    presence = ClientPresence(store, check_s=0.0, cached_sessions=2)
    assert presence.gone("sess-a") is None
    assert "Service Unavailable" in caplog.text and "taken as live" in caplog.text
