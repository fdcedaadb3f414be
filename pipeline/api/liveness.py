"""What a gateway (``SessionLiveness``) and a sampler (``ClientPresence``) keep in memory of sessions' ends, so
that a call need not read the store each time.

An end is final (``pipeline.api.lifecycle``: one create-only record), so a session seen ended is ended for good;
a session seen live is taken as live for ``live_check_s`` seconds, then its records are read again.  So a gateway
may accept a call up to ``live_check_s`` after another gateway recorded the session's end, which is why nothing a
session made is freed sooner than ``END_GRACE_S`` after it.  The ``cached_sessions`` sessions noted last are kept
(least recently noted dropped: a dropped one is only read again).

A sampler asks another question: whether anybody still waits for a call's samples.  Its client is taken as gone
once the session ended (its end record, as ``lifecycle.session_status`` reads it: gone at once, for good) or its
heartbeats lapsed: its heartbeat record stayed unchanged for ``SESSION_TIMEOUT_S`` (the SDK beats every 10 s while
its process lives).  The lapse is measured on the sampler's own monotonic clock, from the read before the one that
found the record as it is (the record was written after that read), not by comparing the gateway's wall-clock time
in the record with the sampler's: clocks of two machines differ.  The one exception is a record's first sight (a
sampler restarted with calls queued): one older by the wall clocks than the timeout plus ``CLOCK_ALLOWANCE_S`` is
taken as that old, so a session that lapsed long before is not taken as live for another timeout; a younger one is
counted from then.  A lapse is not final (a laptop that slept beats again), so a live or lapsed answer is kept
``check_s`` seconds, then read again, by one thread at a time (the others take the last answer meanwhile: rounds of
many calls of one session ask at once; a call that has no answer yet waits at most ``WAIT_S`` for one).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from pipeline.api.lifecycle import session_end, session_status
from pipeline.io.store import ObjectStore, remote_failures
from schemas.api import SESSION_TIMEOUT_S

log = logging.getLogger("rlpipe.api.liveness")
# a heartbeat record first seen is taken as lapsed only when the wall clocks (the gateway's in the record, the
# sampler's) make it older than the timeout by more than this: machines' clocks may differ by minutes, not by this
CLOCK_ALLOWANCE_S = 600.0
WAIT_S = 5.0  # how long a call waits for another thread's read of its session before taking the session as there


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


@dataclasses.dataclass
class _Presence:
    """What a sampler saw of one session, on its own monotonic clock."""

    read_at: float = -math.inf  # when its records were last read
    why: str | None = None  # why its client is gone, or None while it is there
    ended: bool = False  # an end is final: this entry is never read or changed again
    beat_at: float | None = None  # the time its heartbeat record holds (the gateway's clock: see `_silent_since`)
    beat_seen_at: float = -math.inf  # when its silence since that record is counted from (its clock); -inf: none seen
    reading: threading.Event | None = None  # set once the read in flight landed; None when none is


class ClientPresence:
    """Whether a session's client is still there to read its calls' results (see the module docstring); each
    session's answer is read from the store at most every ``check_s`` seconds (two small objects), by one thread
    at a time.  A lapse is ``timeout_s`` seconds of ``clock`` (monotonic) during which the session's heartbeat
    record stayed unchanged: the record's time is the gateway's clock, compared with ours only on its first sight
    and then with ``CLOCK_ALLOWANCE_S`` to spare, so a sampler whose clock is off takes no live client as gone."""

    def __init__(self, store: ObjectStore, check_s: float, cached_sessions: int,
                 timeout_s: float = SESSION_TIMEOUT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.check_s, self.cached_sessions, self.timeout_s = store, check_s, cached_sessions, timeout_s
        self.clock = clock
        self.wait_s = WAIT_S  # how long a call waits for another thread's read of its session
        self._seen: OrderedDict[str, _Presence] = OrderedDict()  # the cached_sessions sessions asked of last
        self._lock = threading.Lock()

    def gone(self, session_id: str) -> str | None:
        """Why the session's client is taken as gone (``ended (<why>)``, ``sent no heartbeat for <n> s``), or None
        while it is there.  While one thread reads the session's records, the others take the last answer, or
        wait up to ``wait_s`` for that read when there is none yet.  A store that cannot be read (or a read that
        outlasts that wait) leaves the session taken as there until the next read."""
        with self._lock:
            seen = self._note(session_id)
            if seen.ended or self.clock() - seen.read_at < self.check_s:
                return seen.why
            reading = seen.reading
            if reading is None:
                seen.reading = threading.Event()
            elif seen.read_at > -math.inf:
                return seen.why
        if reading is not None:
            if not reading.wait(self.wait_s):  # a hung store read holds its own thread, not every call of the session
                log.warning("session %s: its records were not read within %g s; taken as live", session_id, self.wait_s)
                return None
            with self._lock:
                return seen.why
        read = None
        try:
            read = self._read(session_id)
        finally:
            with self._lock:  # landed before the threads waiting for it wake
                why = self._land(seen, read)
                landed, seen.reading = seen.reading, None
            if landed is not None:
                landed.set()
        return why

    def _note(self, session_id: str) -> _Presence:
        """The session's entry (a new one when it is not kept), as the latest asked of; under ``_lock``."""
        seen = self._seen.get(session_id)
        if seen is None:
            seen = self._seen[session_id] = _Presence()
        self._seen.move_to_end(session_id)
        while len(self._seen) > self.cached_sessions:
            self._seen.popitem(last=False)
        return seen

    def _read(self, session_id: str) -> tuple[str | None, float | None] | None:
        """(why it ended, or None; the time its heartbeat record holds, or None without one) from the store; None
        for a store that cannot be read."""
        try:
            status = session_status(self.store, session_id)
        except (OSError, *remote_failures()) as exc:  # the second part is looked at only once something failed
            log.warning("session %s: its records could not be read (%s); taken as live until the next look",
                        session_id, exc)
            return None
        return (status.why or "ended") if status.state == "ended" else None, status.beat_at

    def _land(self, seen: _Presence, read: tuple[str | None, float | None] | None) -> str | None:
        """Note a read (``_read``) in ``seen`` and say what it makes of the client; under ``_lock``.  Only the
        read in flight for ``seen`` lands here, and none starts once it ended, so an end is never overwritten."""
        now, read_before = self.clock(), seen.read_at
        seen.read_at, seen.why = now, None  # a store that cannot be read: taken as there
        if read is None:
            return None
        ended, beat_at = read
        if ended is not None:
            seen.ended, seen.why = True, f"ended ({ended})"
            return seen.why
        if beat_at is None:  # no heartbeat yet: nothing to lapse from
            seen.beat_at = None
            return None
        if beat_at != seen.beat_at:
            seen.beat_at, seen.beat_seen_at = beat_at, self._silent_since(seen, beat_at, now, read_before)
        if now - seen.beat_seen_at > self.timeout_s:
            seen.why = f"sent no heartbeat for {now - seen.beat_seen_at:.0f} s"
        return seen.why

    def _silent_since(self, seen: _Presence, beat_at: float, now: float, read_before: float) -> float:
        """When (on ``clock``) the silence after heartbeat record ``beat_at``, found by the read landing at ``now``,
        starts.  A record seen before was replaced after the read before this one (``read_before``).  On a first
        sight the wall clocks are compared: past the timeout plus ``CLOCK_ALLOWANCE_S`` the record is as old as they
        say (a sampler restarted long after the session's client went), otherwise it counts from now."""
        if seen.beat_seen_at > -math.inf:
            return read_before
        age = time.time() - beat_at
        return now - age if age > self.timeout_s + CLOCK_ALLOWANCE_S else now
