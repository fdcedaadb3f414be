"""One dead letter per poison message and process: readers of one topic in one process (a packed learner reads
the shared trajectories topic once per run) meet each poison message once each; the first sends its dead
letter (``EventConsumer`` does, to ``<ns>.dlq``) and the others skip it."""

from __future__ import annotations

import contextlib
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from schemas.events import framed_sha256
from schemas.names import InvalidNameError, validate_name

_UNKNOWN_RUN = "unknown"


def dead_letter_run_id(key: str | None, raw: bytes | None) -> str:
    """The run a poison message probably belongs to: its key (run_id by convention), else ``unknown``."""
    with contextlib.suppress(InvalidNameError):
        return validate_name(key or "", "run_id")
    match = re.search(rb'"run_id"\s*:\s*"([A-Za-z0-9._-]{1,64})"', raw or b"")
    with contextlib.suppress(InvalidNameError):
        return validate_name(match.group(1).decode(), "run_id") if match else _UNKNOWN_RUN
    return _UNKNOWN_RUN


class PoisonOrigin(NamedTuple):
    """A poison message as readers of one process meet it.  The offset alone does not name it: a topic deleted and
    created again numbers from 0 again, and the consumer's idea of the topic's id can lag behind (it fetches by
    name), so the message's own timestamp and bytes tell a new poison message at a reused offset from the one
    dead-lettered there before.  Its dead letter carries the same timestamp and digest, from which its id is
    derived (``schemas.events.dead_letter_name``)."""

    servers: str  # the broker, as the reader was pointed at it
    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None  # the broker's timestamp of the message; None: it has none
    sha256: str  # of its whole key and value (``schemas.events.framed_sha256``)


def poison_origin(servers: list[str], record: Any) -> PoisonOrigin:
    """``record``'s ``PoisonOrigin`` on the broker ``servers`` name (Kafka's -1, "no timestamp": None)."""
    timestamp = getattr(record, "timestamp", None)
    return PoisonOrigin(",".join(servers), record.topic, record.partition, record.offset,
                        timestamp if isinstance(timestamp, int) and timestamp >= 0 else None,
                        framed_sha256((record.key, record.value)))


class DeadLettered:
    """The poison messages this process dead-lettered (``PoisonOrigin``): readers of one topic in one process (a
    packed learner's runs) send each one dead letter.  The newest ``limit`` are kept.

    Publishing happens outside the lock (it can wait half a minute on a broker that is away): only readers of
    the same message wait for it, and they skip the message once its dead letter is taken, or send it
    themselves when it was refused (the reader whose publish failed reads the message again, too)."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._sent: OrderedDict[PoisonOrigin, None] = OrderedDict()
        self._in_flight: dict[PoisonOrigin, threading.Event] = {}

    def send_once(self, origin: PoisonOrigin, publish: Callable[[], object]) -> bool:
        """Call ``publish`` unless a reader here already sent ``origin``'s dead letter (then False); its error
        propagates and leaves the message to the next reader."""
        while True:
            with self._lock:
                if origin in self._sent:
                    return False
                other = self._in_flight.get(origin)
                if other is None:
                    done = self._in_flight[origin] = threading.Event()
                    break
            other.wait()  # another reader is publishing it: taken, it is skipped; refused, it is ours to try
        try:
            publish()
            with self._lock:
                self._sent[origin] = None
                while len(self._sent) > self.limit:
                    self._sent.popitem(last=False)
        finally:
            with self._lock:
                del self._in_flight[origin]
            done.set()
        return True


DEAD_LETTERED = DeadLettered()
