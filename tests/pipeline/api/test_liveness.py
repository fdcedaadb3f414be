"""What a gateway keeps of sessions' ends: an end stands, a live session is read again, the memory is bounded."""

import math
import uuid

from pipeline.api.lifecycle import record_end
from pipeline.api.liveness import SessionLiveness
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
