"""Waking long polls: ``ResultSignals`` follows ``<ns>.results`` and wakes the ``retrieve_future`` waiting
for each ``ApiResultReady``.

The store stays the source of truth (a poll always reads the result from there);
the signal only saves the wait, so a missed or late event costs at most one
re-check interval, never a result.  One follower thread per gateway process
(outside any consumer group: every gateway sees every result).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator

from pipeline.io.bus import BusError, EventFollower
from schemas.api import ApiResultReady
from schemas.config import BusConfig

log = logging.getLogger(__name__)


class ResultSignals:
    """request id -> the asyncio events of the polls waiting for it; thread-safe ``notify``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = defaultdict(list)

    @contextlib.contextmanager
    def watch(self, request_id: str) -> Iterator[asyncio.Event]:
        """An event set when ``request_id``'s result is announced (register before reading the store)."""
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiting[request_id].append(entry)
        try:
            yield entry[1]
        finally:
            with self._lock:
                waiting = self._waiting.get(request_id, [])
                if entry in waiting:
                    waiting.remove(entry)
                if not waiting:
                    self._waiting.pop(request_id, None)

    def notify(self, request_id: str) -> None:
        with self._lock:
            entries = list(self._waiting.get(request_id, ()))
        for loop, event in entries:
            loop.call_soon_threadsafe(event.set)

    def follow(self, bus: BusConfig, stop: Callable[[], bool]) -> threading.Thread:
        """Start the follower thread on ``<ns>.results`` (until ``stop()``)."""
        thread = threading.Thread(target=self._follow, args=(bus, stop), name="result-signals", daemon=True)
        thread.start()
        return thread

    def _follow(self, bus: BusConfig, stop: Callable[[], bool]) -> None:
        try:
            with EventFollower(bus, "results", start="latest") as follower:  # the default wait: see request_reader
                while not stop():
                    for consumed in follower.poll(timeout_s=0.5):
                        if isinstance(consumed.event.payload, ApiResultReady):
                            self.notify(consumed.event.payload.request_id)
        except BusError as exc:  # polls fall back to re-reading the store every interval
            log.warning("not following results (%s); long polls re-check the store instead", exc)
