"""A learner's events that the broker refused, kept in the store until it takes them.

A step's version and checkpoint are in the store before their events are sent, so a learner stopped while the
broker refuses an event (``consumers.broker_wait``) leaves a version that producers find in the registry, or a
checkpoint the next start resumes from, that no event names: the dashboard and ``rlpipe report``, which read the
events, would never see it, and the next start does not publish or checkpoint that step again (a version is
retrained under the next number; a checkpoint is resumed from).  So the first refused try keeps the event, its
envelope as it is sent, at ``runs/<run>/learner-unannounced/<event_id>.json``; the record is deleted once the
broker takes the event, and the next learner start announces whatever records remain, oldest first, before it
trains.  Every try of an event, before and after the restart, carries the same ``event_id``: a try the broker wrote
without acknowledging it is counted once by readers that dedupe by it (``rlpipe report``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from consumers.broker_wait import until_the_broker_takes
from pipeline.io.bus import BusError
from pipeline.io.store import ObjectStore
from pipeline.runtime import sending
from schemas.events import (
    AdapterPublished,
    Envelope,
    EventDecodeError,
    LearnerCheckpointed,
    Payload,
    decode_event,
    encode_event,
)
from schemas.names import validate_name

log = logging.getLogger("rlpipe.learner")

FOLDER = "learner-unannounced"


def unannounced_prefix(run_id: str) -> str:
    """Where a run's learner keeps the events the broker has not taken (``InvalidNameError`` for a bad run id)."""
    return f"runs/{validate_name(run_id, 'run_id')}/{FOLDER}"


def describe(payload: Payload) -> str:
    """An announcement as the learner's log lines name it ("AdapterPublished v3 (step 6)")."""
    if isinstance(payload, AdapterPublished):
        return f"AdapterPublished v{payload.version} (step {payload.learner_step})"
    if isinstance(payload, LearnerCheckpointed):
        return f"LearnerCheckpointed of step {payload.step}"
    return payload.event_type


class UnannouncedEvents:
    """The store's records of one run's learner events not taken by the broker yet (``ObjectStore`` keys)."""

    def __init__(self, store: ObjectStore, run_id: str) -> None:
        self.store, self.run_id, self.prefix = store, run_id, unannounced_prefix(run_id)

    def announce_until_taken(self, announce: Callable[[Payload], Any], envelope: Envelope, what: str,
                             stopping: Callable[[], bool], kept: bool = False) -> None:
        """Send ``envelope`` as it is with ``announce`` until the broker takes it (``until_the_broker_takes``: a
        stop ends the wait with ``BrokerAwayOnStop``); the first refused try records it (``kept``: recorded
        already), and the record goes once the broker takes it."""
        send = sending(announce, envelope)

        def try_once() -> Any:
            nonlocal kept
            try:
                return send()
            except BusError as exc:
                if exc.transient and not kept:  # owed from now on, until taken: a stop may come before that
                    self.keep(envelope)
                    kept = True
                raise

        until_the_broker_takes(try_once, what, self.run_id, stopping)
        if kept:
            self.taken(envelope)

    def announce_left(self, announce: Callable[[Payload], Any], stopping: Callable[[], bool]) -> int:
        """Announce the events the run's earlier learner left recorded (the broker had not taken them when it
        stopped), oldest first, each with the ``event_id`` of its earlier tries; how many."""
        owed = self.owed()
        for envelope in owed:
            what = describe(envelope.payload)
            self.announce_until_taken(announce, envelope, f"{what}, left unannounced by the run's last learner",
                                      stopping, kept=True)
            log.info("run %s: announced %s, which the broker had not taken before the last stop", self.run_id, what)
        return len(owed)

    def key(self, envelope: Envelope) -> str:
        return f"{self.prefix}/{envelope.event_id}.json"

    def keep(self, envelope: Envelope) -> None:
        """Record ``envelope`` as owed to the broker (overwriting the same event's record)."""
        self.store.put(self.key(envelope), encode_event(envelope))

    def taken(self, envelope: Envelope) -> None:
        """The broker took ``envelope``: its record goes."""
        self.store.delete(self.key(envelope), missing_ok=True)
        self.store.remove_empty_folder(self.prefix)

    def owed(self) -> list[Envelope]:
        """The events recorded as not taken, oldest first; a record that is no event is an error naming the fix."""
        envelopes = []
        for key in self.store.list(self.prefix):
            if not key.endswith(".json"):
                continue
            try:
                envelopes.append(decode_event(self.store.get(key)))
            except EventDecodeError as exc:
                raise ValueError(f"{self.store.url(key)} is not a learner event ({str(exc).splitlines()[0]}); "
                                 "delete it to start the learner (the event it held is then never announced)") from None
        return sorted(envelopes, key=lambda envelope: envelope.time)
