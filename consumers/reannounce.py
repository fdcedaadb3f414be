"""Announcing again, at each learner start, the checkpoint it resumes from and the versions published after it.

A step's version (its manifest) and checkpoint are durable in the store before their events (``AdapterPublished``,
``LearnerCheckpointed``) are sent, so a learner killed in between (SIGKILL, OOM, node loss), or stopped while the
broker refused the event (``consumers.broker_wait``), leaves a version that producers find in the registry, or a
checkpoint the next start resumes from, that no event names: the dashboard and ``rlpipe report``, which read the
events, would never see it, and the next start writes neither again (a version is retrained under the next number;
a checkpoint is resumed from).

So every start announces, before it trains, the checkpoint it resumes from, then every version newer than that
checkpoint's version, oldest first.  Nothing else can be unannounced: a learner writes in order (version, its event,
checkpoint, its event) and waits for each event before the next write, so a version whose event was never taken has
no checkpoint after it (every checkpoint records an older version), and a checkpoint whose event was never taken is
the newest.  Each event's ``event_id`` is derived from what it names (``schemas.events.announcement_id``), so a reader
that dedupes by it (``rlpipe report``) counts each once whether or not it was sent before; the others go by version
number or step (producers keep the newest version they heard of, ``rlpipe runs`` and the dashboard the newest step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from consumers.broker_wait import WaitReport, until_the_broker_takes
from consumers.checkpoint import Checkpoint, CheckpointStore
from consumers.step_writer import finite_numbers
from pipeline.io.registry import AdapterRegistry
from pipeline.runtime import announcing_once
from schemas.events import AdapterPublished, LearnerCheckpointed, Payload

log = logging.getLogger("rlpipe.learner")


def describe(payload: Payload) -> str:
    """An announcement as the learner's log lines name it ("AdapterPublished v3 (step 6)")."""
    if isinstance(payload, AdapterPublished):
        return f"AdapterPublished v{payload.version} (step {payload.learner_step})"
    if isinstance(payload, LearnerCheckpointed):
        return f"LearnerCheckpointed of step {payload.step}"
    return payload.event_type


def checkpoint_event(checkpoints: CheckpointStore, checkpoint: Checkpoint,
                     exclude: tuple[str, ...] = ()) -> LearnerCheckpointed:
    """``checkpoint``'s ``LearnerCheckpointed`` as its learner sent it: the offsets it stored (read before a resume
    moves them), the numbers of its step's log entry less ``exclude`` (none at step 0, which has no entry).

    A checkpoint of the old layout (written before the step log) carries its log inline, and its steps have no step
    objects until the next save writes them out (``consumers.checkpoint``): its entry is read from there."""
    state = checkpoint.state
    if state.legacy_layout:
        entries = [entry for entry in state.legacy_step_log if int(entry.get("step", -1)) == state.step]
    else:
        entries = checkpoints.steps.read(upto=state.step, since=state.step) if state.step else []
    metrics = finite_numbers(entries[0], exclude) if entries else {}
    return LearnerCheckpointed(step=state.step, version=state.version, path=checkpoint.key,
                               offsets=dict(state.positions), metrics=metrics)


def announce_again(announce: Callable[[Payload], Any], run_id: str, registry: AdapterRegistry,
                   resumed: LearnerCheckpointed | None, stopping: Callable[[], bool],
                   between_tries: Callable[[], None] | None = None, waiting: str | None = None) -> int:
    """Announce ``resumed`` (the checkpoint a start resumes from; None: it starts afresh), then every version in
    ``registry`` newer than its version that still has its files, each waiting out a broker that is away (a stop
    ends the wait with ``BrokerAwayOnStop``); how many events.  ``between_tries`` runs before each try again (a
    packed learner polls its other runs' consumers there, so their groups keep them while this run waits);
    ``waiting``: what waits meanwhile, as a wait's first line says (default: the learner).

    The versions are found by probing upward from the checkpoint's (``AdapterRegistry.newest_from``: one look when
    none is newer), so a long run's start does not list its registry for them.  A version ``keep_versions`` retired
    is left out: a producer that heard of it could not pull it."""
    since = resumed.version if resumed is not None else 0
    events: list[Payload] = [] if resumed is None else [resumed]
    newer = range(since + 1, registry.newest_from(since) + 1)
    events += [registry.published_event(registry.show(version)) for version in newer
               if registry.retired_reason(version) is None]
    for payload in events:
        what = f"{describe(payload)}, announced again at the start"
        report = WaitReport(what, run_id, waiting) if waiting is not None else None
        until_the_broker_takes(announcing_once(announce, payload), what, run_id, stopping, before_retry=between_tries,
                               report=report)
    if events:
        log.info("run %s: announced again %s (a reader counts each once, by its event id)", run_id,
                 ", ".join(describe(payload) for payload in events))
    return len(events)
