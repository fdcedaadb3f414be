"""Engine activity: when the API's engines were busy, and for which session.

Each engine process (the trainer, ``consumers.api.worker``; the sampler,
``producers.api_sampler``) records one ``EngineActivity`` per call it executes:
the session and tenant it served, the op, wall-clock start and end (unix
seconds) and the tokens it processed (trained tokens of a ``forward_backward``,
sampled tokens of a ``sample``).  ``rlpipe report --server`` draws them as the
server's duty cycle, one colour per session (``pipeline.analysis.report.server``).

Layout (JSON lines, one object per flush, create-only; never pickled)::

  engines/<kind>-<engine id>/activity/<first start ms>-<last end ms>-<nonce>.jsonl

The object name carries the batch's time span, so a reader of a window skips
the objects outside it without opening them.  Recording appends to a list under
a lock; a daemon thread writes the batch every ``flush_every_s`` seconds or once
``flush_every_calls`` records wait, and ``close`` writes what is left, so the
call path never waits for the store.  A failed write is logged and its batch
dropped: activity is telemetry, never a reason to stop serving.

Objects are kept ``ACTIVITY_KEPT_S`` (30 days): ``sweep_activity`` (a trainer's
sweep, at most every ``ACTIVITY_SWEEP_S``) deletes every engine's objects that
ended before, by their names alone, and on a local store the emptied folder of an
engine left with none (a process that ended long ago).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pipeline.io.store import ObjectStore
from schemas.names import MAX_NAME_LENGTH, validate_name

log = logging.getLogger("rlpipe.api.activity")
EngineKind = Literal["trainer", "sampler"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("trainer", "sampler")
ENGINES_PREFIX = "engines"
_NAME_RE = re.compile(r"(\d+)-(\d+)-[0-9a-f]+\.jsonl")
ACTIVITY_KEPT_S = 30 * 86400.0  # engine activity older than this is deleted
ACTIVITY_SWEEP_S = 6 * 3600.0  # how often a trainer sweeps it (listing every engine's objects)


@dataclass(frozen=True)
class EngineActivity:
    """One executed call: which engine ran it, for whom, when (unix seconds) and on how many tokens."""

    engine: str  # "<kind>-<engine id>"
    kind: str  # trainer | sampler
    session: str
    tenant: str | None
    op: str
    start: float
    end: float
    tokens: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> EngineActivity:
        """A record from its JSON object; ``ValueError`` when a field is missing or of the wrong kind."""
        try:
            return cls(engine=str(value["engine"]), kind=str(value["kind"]), session=str(value["session"]),
                       tenant=None if value.get("tenant") is None else str(value["tenant"]), op=str(value["op"]),
                       start=float(value["start"]), end=float(value["end"]), tokens=int(value.get("tokens", 0)))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not an engine activity record: {exc}") from None


def default_engine_id() -> str:
    """``<host>-<pid>``, cut to the name alphabet: unique among the engines of one store."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-._") or "host"
    return f"{host[:40]}-{os.getpid()}"


def engine_name(kind: str, engine_id: str) -> str:
    """``<kind>-<engine id>``, checked: it becomes a folder of the store."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"engine kind {kind!r} is not one of {', '.join(ENGINE_KINDS)}")
    return validate_name(f"{kind}-{validate_name(engine_id, 'engine id')}"[:MAX_NAME_LENGTH], "engine name")


def activity_prefix(kind: str, engine_id: str) -> str:
    """Store folder of one engine's activity objects."""
    return _folder(engine_name(kind, engine_id))


def _folder(engine: str) -> str:
    return f"{ENGINES_PREFIX}/{engine}/activity"


class ActivityRecorder:
    """Buffers one engine's ``EngineActivity`` records and writes them in batches off the call path."""

    def __init__(self, store: ObjectStore, kind: str, engine_id: str | None = None, flush_every_s: float = 10.0,
                 flush_every_calls: int = 500) -> None:
        if flush_every_s <= 0:
            raise ValueError(f"flush_every_s must be > 0 seconds, got {flush_every_s}")
        if flush_every_calls < 1:
            raise ValueError(f"flush_every_calls must be >= 1, got {flush_every_calls}")
        self.store, self.kind = store, kind
        self.engine = engine_name(kind, engine_id or default_engine_id())
        self.prefix = _folder(self.engine)
        self.flush_every_s, self.flush_every_calls = flush_every_s, flush_every_calls
        self._buffer: list[EngineActivity] = []
        self._lock = threading.Lock()
        self._wake, self._closed = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, name=f"activity-{self.engine}", daemon=True)
        self._thread.start()

    def record(self, session: str, tenant: str | None, op: str, start: float, end: float, tokens: int = 0) -> None:
        """Note one executed call (times in unix seconds); no I/O here."""
        activity = EngineActivity(self.engine, self.kind, session, tenant, op, start, end, tokens)
        with self._lock:
            self._buffer.append(activity)
            full = len(self._buffer) >= self.flush_every_calls
        if full:
            self._wake.set()

    def close(self) -> None:
        """Stop the flushing thread and write what is buffered."""
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=30.0)
        self.flush()

    def flush(self) -> None:
        """Write the buffered records as one object now (nothing when none wait)."""
        with self._lock:
            batch, self._buffer = self._buffer, []
        if not batch:
            return
        first = min(a.start for a in batch)
        last = max(a.end for a in batch)
        key = f"{self.prefix}/{int(first * 1000):013d}-{int(last * 1000):013d}-{uuid.uuid4().hex[:8]}.jsonl"
        body = "".join(json.dumps(asdict(a)) + "\n" for a in batch).encode()
        try:
            self.store.put_create(key, body)
        except Exception:
            log.warning("could not write %d activity records to %s; dropped", len(batch), key, exc_info=True)

    def _flush_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.flush_every_s)
            self._wake.clear()
            if not self._closed.is_set():
                self.flush()


def engines(store: ObjectStore) -> list[str]:
    """The engine names that recorded activity in ``store``."""
    return [key.rsplit("/", 1)[-1] for key in store.list(ENGINES_PREFIX)]


def read_activity(store: ObjectStore, since: float | None = None, until: float | None = None) -> list[EngineActivity]:
    """Every engine's records that overlap ``[since, until]`` (unix seconds; None = unbounded), by start time.

    Objects whose name says they lie outside the window are not opened; lines that
    are not records are skipped with a warning.
    """
    found: list[EngineActivity] = []
    for engine in engines(store):
        for key in store.list(_folder(engine)):
            match = _NAME_RE.fullmatch(key.rsplit("/", 1)[-1])
            if match is None:
                continue
            first, last = int(match[1]) / 1000, int(match[2]) / 1000
            if (since is not None and last + 0.001 < since) or (until is not None and first > until):
                continue
            found += _overlapping(_parse(store.get(key), key), since, until)
    return sorted(found, key=lambda a: (a.start, a.engine, a.end))


def sweep_activity(store: ObjectStore, now: float | None = None, kept_s: float = ACTIVITY_KEPT_S) -> int:
    """Delete every engine's activity objects that ended more than ``kept_s`` before ``now`` (read from their
    names), and the folder of an engine left with none; how many objects were deleted."""
    cutoff = (time.time() if now is None else now) - kept_s
    deleted = 0
    for engine in engines(store):
        keys = store.list(_folder(engine))
        old = [key for key in keys if (match := _NAME_RE.fullmatch(key.rsplit("/", 1)[-1]))
               and int(match[2]) / 1000 < cutoff]
        for key in old:
            store.delete(key, missing_ok=True)
        deleted += len(old)
        if old and len(old) == len(keys):  # only what was listed: a live engine may be writing meanwhile
            store.remove_empty_folder(_folder(engine))
            store.remove_empty_folder(f"{ENGINES_PREFIX}/{engine}")
    return deleted


def _parse(body: bytes, key: str) -> list[EngineActivity]:
    records = []
    for number, line in enumerate(body.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(EngineActivity.from_json(json.loads(line)))
        except ValueError as exc:
            log.warning("skipping line %d of %s: %s", number, key, exc)
    return records


def _overlapping(records: Iterable[EngineActivity], since: float | None, until: float | None) -> list[EngineActivity]:
    return [a for a in records if (since is None or a.end >= since) and (until is None or a.start <= until)]
