"""What a gateway keeps in memory of sessions' ends, so that a call need not read the store each time.

An end is final (``pipeline.api.lifecycle``: one create-only record), so a session seen ended is ended for good;
a session seen live is taken as live for ``live_check_s`` seconds, then its records are read again.  So a gateway
may accept a call up to ``live_check_s`` after another gateway recorded the session's end, which is why nothing a
session made is freed sooner than ``END_GRACE_S`` after it.  The ``cached_sessions`` sessions noted last are kept
(least recently noted dropped: a dropped one is only read again).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict

from pipeline.api.lifecycle import session_end
from pipeline.io.store import ObjectStore


class SessionLiveness:
    """Which sessions ended (and why), and until when each session seen live is taken as live."""

    def __init__(self, store: ObjectStore, live_check_s: float, session_expiry_s: float,
                 cached_sessions: int) -> None:
        self.store = store
        self.live_check_s, self.session_expiry_s, self.cached_sessions = live_check_s, session_expiry_s, cached_sessions
        self._seen: OrderedDict[str, tuple[str | None, float]] = OrderedDict()  # session -> (why it ended, or
        self._lock = threading.Lock()  # None and the monotonic time until which it is taken as live)

    def ended(self, session_id: str) -> str | None:
        """Why the session ended, or None while it lives (read from the store once ``live_check_s`` passed)."""
        with self._lock:
            ended, live_until = self._seen.get(session_id, (None, 0.0))
        if ended is None and time.monotonic() >= live_until:
            end = session_end(self.store, session_id, expiry_s=self.session_expiry_s)
            ended = None if end is None else end[0]
            self.note(session_id, ended, math.inf if end else time.monotonic() + self.live_check_s)
        return ended

    def note(self, session_id: str, ended: str | None, live_until: float) -> None:
        """Keep what was seen of a session (an end stands), the ``cached_sessions`` latest noted only."""
        with self._lock:
            if ended is None and self._seen.get(session_id, (None,))[0] is not None:
                return
            self._seen[session_id] = (ended, live_until)
            self._seen.move_to_end(session_id)
            while len(self._seen) > self.cached_sessions:
                self._seen.popitem(last=False)
