"""What a gateway (``SessionLiveness``) and a sampler (``ClientPresence``) keep in memory of sessions' ends, so
that a call need not read the store each time.

An end is final (``pipeline.api.lifecycle``: one create-only record), so a session seen ended is ended for good;
a session seen live is taken as live for ``live_check_s`` seconds, then its records are read again.  So a gateway
may accept a call up to ``live_check_s`` after another gateway recorded the session's end, which is why nothing a
session made is freed sooner than ``END_GRACE_S`` after it.  The ``cached_sessions`` sessions noted last are kept
(least recently noted dropped: a dropped one is only read again).

A sampler asks another question: whether anybody still waits for a call's samples.  Its client is taken as gone
once the session ended or its heartbeats lapsed (``SESSION_TIMEOUT_S`` without one; the SDK beats every 10 s while
its process lives), as ``lifecycle.session_status`` says from the store, which every process shares.  A lapse is
not final (a laptop that slept beats again), so every answer is kept ``check_s`` seconds, then read again.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict

from pipeline.api.lifecycle import session_end, session_status
from pipeline.io.store import ObjectStore, remote_failures
from schemas.api import SESSION_TIMEOUT_S

log = logging.getLogger("rlpipe.api.liveness")


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


class ClientPresence:
    """Whether a session's client is still there to read its calls' results (see the module docstring); each
    session's answer is read from the store at most every ``check_s`` seconds (two small objects)."""

    def __init__(self, store: ObjectStore, check_s: float, cached_sessions: int,
                 timeout_s: float = SESSION_TIMEOUT_S) -> None:
        self.store, self.check_s, self.cached_sessions, self.timeout_s = store, check_s, cached_sessions, timeout_s
        self._seen: OrderedDict[str, tuple[float, str | None]] = OrderedDict()  # session -> (monotonic time read,
        self._lock = threading.Lock()  # why its client is gone, or None)

    def gone(self, session_id: str) -> str | None:
        """Why the session's client is taken as gone (``ended (<why>)``, ``sent no heartbeat for <n> s``), or None
        while it is there.  A store that cannot be read leaves the session taken as there until the next read."""
        with self._lock:
            read_at, why = self._seen.get(session_id, (-math.inf, None))
        if time.monotonic() - read_at < self.check_s:
            return why
        now = time.time()
        try:
            status = session_status(self.store, session_id, now, self.timeout_s)
        except (OSError, *remote_failures()) as exc:  # the second part is looked at only once something failed
            log.warning("session %s: its records could not be read (%s); taken as live until the next look",
                        session_id, exc)
            status = None
        why = None
        if status is not None and status.state == "ended":
            why = f"ended ({status.why})"
        elif status is not None and status.state == "lapsed" and status.beat_at is not None:
            why = f"sent no heartbeat for {now - status.beat_at:.0f} s (its client is gone)"
        with self._lock:
            self._seen[session_id] = (time.monotonic(), why)
            self._seen.move_to_end(session_id)
            while len(self._seen) > self.cached_sessions:
                self._seen.popitem(last=False)
        return why
