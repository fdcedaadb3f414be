"""The gateway's backpressure on sampling: the sample calls of each base model that have no result yet.

A gateway holds at most ``max_places`` such calls per base model, and one tenant's calls at
most ``tenant_share`` of them, so one tenant's burst never takes every place; beyond either
``take`` raises ``BusyError`` (HTTP 429: the SDK backs off and resends).  A call leaves the
queue when its result is polled here; a queue at a limit is also checked against the results
in the store (by one call at a time, at most every ``recheck_s``), since a call's client may
never poll this gateway (it died, or polls another) and its place would otherwise be held for
ever, for every tenant.  The queue is in memory: each gateway keeps its own.
"""

from __future__ import annotations

import math
import threading
import time

from pipeline.api.wire import session_of_request
from pipeline.io.store import ObjectStore
from schemas.api import ApiError, result_path

MAX_PENDING_SAMPLES = 512  # sample calls per base model a gateway holds without a result before answering 429
TENANT_SHARE = 0.5  # of those places, the most one tenant's calls may hold
PENDING_RECHECK_S = 1.0  # a queue at a limit is checked against the stored results at most this often


class BusyError(ApiError):
    """The sampler's queue for a base model is full, or the tenant holds its share of it (HTTP 429)."""


class SampleQueue:
    """Sample calls without a result, per base model, with their tenants; safe to share between threads."""

    def __init__(self, store: ObjectStore, max_places: int = MAX_PENDING_SAMPLES, tenant_share: float = TENANT_SHARE,
                 recheck_s: float = PENDING_RECHECK_S) -> None:
        self.store = store
        self.max_places, self.tenant_share, self.recheck_s = max_places, tenant_share, recheck_s
        self._pending: dict[str, dict[str, str]] = {}  # base model -> request without a result -> its tenant
        self._checked: dict[str, float] = {}  # base model -> monotonic time its queue was last re-checked
        self._lock = threading.Lock()  # the sample calls and the polls run in worker threads

    @property
    def tenant_places(self) -> int:
        """The most places one tenant's calls may hold."""
        return max(1, int(self.max_places * self.tenant_share))

    def take(self, base_model: str, request_id: str, tenant: str) -> bool:
        """Queue call ``request_id`` of ``tenant``, or refuse it (``BusyError``) when the base model's queue is full
        or the tenant holds its share of it; True when it was queued now, False for a resent call already queued.

        The counting and the queueing are one step under the lock, so calls taking places at the same time in
        several threads never pass a limit."""
        self._recheck_at_limit(base_model, request_id, tenant)
        with self._lock:
            pending = self._pending.setdefault(base_model, {})
            if request_id in pending:
                return False
            queued, mine = len(pending), sum(owner == tenant for owner in pending.values())
            if queued >= self.max_places:
                raise BusyError(f"the sampler of {base_model} has {queued} calls queued; retry shortly", "server")
            if mine >= self.tenant_places:
                raise BusyError(f"your sample calls hold {mine} of the {self.max_places} places of the sampler of "
                                f"{base_model}, your share; retry once some are answered", "server")
            pending[request_id] = tenant
            return True

    def answered(self, request_id: str) -> None:
        """A call's result was read: its place is free."""
        with self._lock:
            for pending in self._pending.values():
                pending.pop(request_id, None)

    def queued(self, base_model: str | None = None) -> int:
        """Calls without a result (of one base model, or of all)."""
        with self._lock:
            return sum(len(pending) for model, pending in self._pending.items() if base_model in (None, model))

    def _recheck_at_limit(self, base_model: str, request_id: str, tenant: str) -> None:
        """Drop from a queue at a limit (all of it, or ``tenant``'s share) that new call ``request_id`` would wait
        behind the calls whose result is in the store: by one call at a time, at most every ``recheck_s``, and
        outside the lock (it reads the store)."""
        with self._lock:
            pending = dict(self._pending.get(base_model, {}))
            mine = sum(owner == tenant for owner in pending.values())
            at_limit = len(pending) >= self.max_places or mine >= self.tenant_places
            if request_id in pending or not at_limit:
                return
            if time.monotonic() - self._checked.get(base_model, -math.inf) < self.recheck_s:
                return
            self._checked[base_model] = time.monotonic()  # those arriving meanwhile go by the counts as they are
        answered = {queued for queued in pending if self._has_result(queued)}
        with self._lock:
            still = self._pending.setdefault(base_model, {})
            for queued in answered:
                still.pop(queued, None)

    def _has_result(self, request_id: str) -> bool:
        session_id = session_of_request(request_id)
        return any(self.store.exists(result_path(session_id, request_id, fmt)) for fmt in ("pb", "json"))
