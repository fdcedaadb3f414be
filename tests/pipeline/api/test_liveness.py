"""What a gateway keeps of sessions' ends: an end stands, a live session is read again, the memory is bounded;
and what a sampler keeps of whether a session's client is there (ended or lapsed: gone), read again each check_s."""

import json
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from pipeline.api import liveness
from pipeline.api.lifecycle import heartbeat_key, record_end
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
    assert presence.gone("sess-b") is None  # counted from the read before the one that found the new record
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


def wall_clock_at(monkeypatch, now: float) -> None:
    """Stop the sampler's wall clock at ``now`` (unix seconds), so the age of a record first seen is exact."""
    monkeypatch.setattr(liveness, "time", SimpleNamespace(time=lambda: now, monotonic=time.monotonic))


def test_a_session_first_seen_long_after_its_last_beat_is_lapsed_at_once_then_counted_on_the_samplers_clock(
        monkeypatch):
    """A restarted sampler that first sees a heartbeat record an hour old (its queued calls' client long gone) takes
    it as lapsed at once: the wall-clock age is trusted only past the timeout plus CLOCK_ALLOWANCE_S, so a gateway
    whose clock is off by less than that makes no live client gone.  From then on it counts on its own clock."""
    store = ObjectStore(f"memory://presence-{uuid.uuid4().hex}")
    clock = Clock()
    presence = ClientPresence(store, check_s=0.0, cached_sessions=4, timeout_s=300.0, clock=clock)
    now = time.time()
    wall_clock_at(monkeypatch, now)
    beat(store, "sess-old", now - 3600.0)
    assert presence.gone("sess-old") == "sent no heartbeat for 3600 s"
    clock.now += 60.0
    assert presence.gone("sess-old") == "sent no heartbeat for 3660 s"  # 3600 s old when seen, 60 s watched since
    beat(store, "sess-old", now)  # its client beats again: there again
    assert presence.gone("sess-old") is None
    near = 300.0 + liveness.CLOCK_ALLOWANCE_S - 60.0  # 60 s inside the allowance: taken as a clock off, counted from now
    beat(store, "sess-near", now - near)
    assert presence.gone("sess-near") is None
    clock.now += 300.0
    assert presence.gone("sess-near") is None
    clock.now += 1.0
    assert presence.gone("sess-near") == "sent no heartbeat for 301 s"


def test_a_lapse_is_counted_from_the_read_before_the_record_last_changed():
    """The record a read finds new was written after the read before it, so its silence is counted from that read:
    a lapse is noticed at most one check late, not two, and a client beating every 10 s still never lapses."""
    store = ObjectStore(f"memory://presence-{uuid.uuid4().hex}")
    clock = Clock()
    presence = ClientPresence(store, check_s=60.0, cached_sessions=2, timeout_s=300.0, clock=clock)
    beat(store, "sess-a", time.time())
    assert presence.gone("sess-a") is None  # read at 1000 (first seen: counted from then)
    beat(store, "sess-a", time.time() + 1.0)  # its last beat, some time after 1000
    clock.now += 60.0
    assert presence.gone("sess-a") is None  # read at 1060: a new record, written after the read at 1000
    for _ in range(4):
        clock.now += 60.0
        assert presence.gone("sess-a") is None  # 1120 .. 1300: at most 300 s since 1000
    clock.now += 60.0
    assert presence.gone("sess-a") == "sent no heartbeat for 360 s"  # read at 1360: 360 s since 1000


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


def test_a_call_waiting_on_a_hung_read_takes_the_session_as_there(monkeypatch):
    """A store read that hangs holds only the thread making it: a call of the same session first seen meanwhile
    waits ``wait_s`` for that read, then takes the session as there, as for a store that cannot be read."""
    store = ObjectStore(f"memory://presence-{uuid.uuid4().hex}")
    wall_clock_at(monkeypatch, time.time())
    beat(store, "sess-a", liveness.time.time() - 3600.0)  # lapsed, once a read lands
    presence = ClientPresence(store, check_s=60.0, cached_sessions=2)
    presence.wait_s = 0.2
    reading, release = threading.Event(), threading.Event()
    get = store.get

    def hung(key: str) -> bytes:
        if threading.current_thread().name == "hung":
            reading.set()
            release.wait(10)
        return get(key)

    monkeypatch.setattr(store, "get", hung)
    first = threading.Thread(target=presence.gone, args=("sess-a",), name="hung")
    first.start()
    try:
        assert reading.wait(10)
        started = time.monotonic()
        assert presence.gone("sess-a") is None
        assert 0.2 <= time.monotonic() - started < 5.0
    finally:
        release.set()
        first.join(10)
    assert presence.gone("sess-a") == "sent no heartbeat for 3600 s"  # the read landed: its answer stands


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
