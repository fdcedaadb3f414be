"""What a gateway keeps of sessions' ends: an end stands, a live session is read again, the memory is bounded;
and what a sampler keeps of whether a session's client is there (ended or lapsed: gone), read again each check_s."""

import json
import math
import time
import uuid

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


def test_a_client_is_gone_once_its_session_ended_or_its_heartbeats_lapsed_and_a_lapse_can_end():
    store = ObjectStore(f"memory://presence-{uuid.uuid4().hex}")
    presence = ClientPresence(store, check_s=60.0, cached_sessions=2, timeout_s=300.0)

    def beat(session: str, ago_s: float) -> None:
        store.put(heartbeat_key(session), json.dumps({"time": time.time() - ago_s}).encode())

    beat("sess-a", 10.0)
    assert presence.gone("sess-a") is None
    record_end(store, "sess-a", "finished: success")
    assert presence.gone("sess-a") is None  # what was read stands for check_s (60 s here)
    presence.check_s = 0.0
    assert presence.gone("sess-a") == "ended (finished: success)"
    beat("sess-b", 301.0)  # 1 s past the timeout: its client is gone
    assert presence.gone("sess-b").startswith("sent no heartbeat for 30")  # 301 s, give or take the run
    beat("sess-b", 0.0)  # a laptop that slept beats again: there again
    assert presence.gone("sess-b") is None
    assert presence.gone("sess-none") is None  # no heartbeat yet: nothing to lapse from
    assert list(presence._seen) == ["sess-b", "sess-none"]  # 2 kept


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
