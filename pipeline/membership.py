"""Runs joining and leaving a packed process while it serves the others, followed on the control topic.

A packed learner or producer started with ``--follow-runs PATTERN`` serves, beside
the runs it was started with, every run announced afterwards by ``RunStarted``
(``rlpipe runs create``) whose id matches the glob ``PATTERN`` and whose
configuration can share the process's engine; a served run's ``RunStopped``
(``rlpipe runs stop``) makes it leave.  The others go on meanwhile: a run joins
or is asked to leave between two turns of the packed loop (a learner run then
settles in its own turns before it is let go, ``consumers.packed.PackedLearner.leave``).

A joining run's configuration is its stored one (``run.json`` and the changes
recorded since, as ``rlpipe run --resume`` reads it) placed on the process's own
broker and store: the process found the run there, and packed runs share one
event log.  A run that cannot join (no stored configuration or a damaged one, a
setting the engine cannot share, a value-based run, which its own value learner
and producer serve) is logged and skipped; the process goes on.

A packed process started without ``--follow-runs`` follows no pattern: it takes
no new run, but still lets a served run go on its ``RunStopped`` (``rlpipe run``
announces it when a packed run reaches its step budget, ``rlpipe runs stop`` on
demand), so a finished run stops taking turns on the shared engines.  A single-run
learner or producer (``rlpipe learner|producer start`` naming one run) follows its
run's ``RunStopped`` too (``pipeline.run_stop``), and stops as a SIGTERM stops it.

A start or stop outlives the process: the commands that announce one
(``rlpipe runs create|stop|resume``, ``rlpipe run``) also keep it as the run's
newest membership event in the store (``runs/<run>/membership.json``, the event
itself), which the control topic's retention does not trim.  A process starting
(or restarted with the same command line) reads it: a named run whose newest
event is a ``RunStopped`` is not served until ``rlpipe runs resume`` announces it
again, and a run matching ``--follow-runs`` whose newest event is a
``RunStarted`` joins as if it had been announced after the start.  A named run
resumed while the process runs joins it again.

The control topic is followed from where it ended when the process started (``control_start``), taken before
the records are read: a start or stop is recorded before it is published, so one sent before that point is in
the records and one sent after it is read on the topic.  A point by offset, not by time: the events' timestamps
come from the clocks of the commands that sent them (or the broker's), and a start by time on a clock an hour
off theirs would miss the starts and stops sent while the process set up (ahead) or act again on old ones, a
stop from an earlier session read as new (behind).
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from pydantic import ValidationError

from pipeline.io.bus import EventFollower, EventPublisher, describe_topic, ensure_topics
from pipeline.io.registry import run_ids
from pipeline.io.store import ObjectStore
from pipeline.runtime import (
    change_number,
    numbered_run_config,
    open_store,
    recorded_change_config,
)
from pipeline.timefmt import utc_text
from schemas.config import BusConfig, RunConfig
from schemas.events import (
    Envelope,
    EventDecodeError,
    RunConfigChanged,
    RunStarted,
    RunStopped,
    decode_event,
    encode_event,
    make_event,
)
from schemas.names import validate_name

log = logging.getLogger("rlpipe.membership")

COMEBACK_FIRST_S = 30.0  # a run stopped on an error comes back after this pause, doubled for each failure in a row
COMEBACK_MAX_S = 600.0  # up to this


@dataclass(frozen=True)
class Joined:
    """A run to serve from now on, with its configuration."""

    config: RunConfig


@dataclass(frozen=True)
class Left:
    """A served run to let go (its last step trained and checkpointed, its sampling flushed)."""

    run_id: str


Change = Joined | Left


def engine_config(configs: list[RunConfig], follow_runs: str | None, template: RunConfig | None,
                  packable: Callable[[list[RunConfig]], None]) -> RunConfig:
    """The configuration a packed process sets its engine up from: its first run's, or ``template`` when it starts
    with no run and follows runs; ValueError (from ``packable`` too) when the runs cannot share it."""
    if configs:
        packable(configs)
        return configs[0]
    if follow_runs is None or template is None:
        raise ValueError("no run to pack; name at least one run, or follow runs with --follow-runs PATTERN")
    return template


def joining_config(store: ObjectStore, run_id: str, template: RunConfig) -> RunConfig:
    """Run ``run_id``'s stored configuration on ``template``'s broker and store (``stored_run_config``), if a packed
    process can serve it; ValueError naming what is wrong."""
    config = stored_run_config(store, run_id, template)
    if config.value is not None:  # its own value learner and producer serve it (they hold its lease)
        raise ValueError("it is value-based (value:); packed processes serve LoRA runs: start its own value "
                         "learner and producer")
    return config


def stored_run_config(store: ObjectStore, run_id: str, template: RunConfig) -> RunConfig:
    """Run ``run_id``'s stored configuration (``run.json`` and the changes recorded since) on ``template``'s broker
    and store; ValueError naming what is wrong."""
    return numbered_stored_config(store, run_id, template)[1]


def numbered_stored_config(store: ObjectStore, run_id: str, template: RunConfig) -> tuple[int, RunConfig]:
    """(number, configuration): ``stored_run_config``, and the number of the newest change it holds
    (``numbered_run_config``; 0 for ``run.json``)."""
    try:
        number, stored = numbered_run_config(store, run_id)
    except FileNotFoundError:
        raise ValueError(f"run {run_id} has no run.json in {store.root}") from None
    except (ValueError, KeyError, TypeError) as exc:  # not JSON, or not a configuration record
        raise ValueError(f"run {run_id}'s stored configuration cannot be read ({type(exc).__name__}: {exc}); "
                         "create the run again under a new name (rlpipe runs create)") from None
    return number, placed_run_config(stored, run_id, template)


def changed_run_config(store: ObjectStore, run_id: str, change: RunConfigChanged, template: RunConfig) -> RunConfig:
    """The configuration ``change`` (a ``RunConfigChanged`` of ``run_id``) announced, read from its record and checked
    against its sha256, on ``template``'s broker and store; ValueError naming what is wrong: a record that is not one
    of the run's changes (``change_number``), the record missing, holding other bytes than announced, or no valid
    configuration of the run."""
    change_number(run_id, change.config_path)  # another run's record would read as this run's configuration
    try:
        recorded = recorded_change_config(store, change.config_path, change.config_sha256)
    except (FileNotFoundError, ValueError, KeyError, TypeError) as exc:  # missing, replaced, not a change record
        raise ValueError(f"run {run_id}'s changed configuration cannot be read ({type(exc).__name__}: {exc})") from None
    return placed_run_config(recorded, run_id, template)


def placed_run_config(stored: dict[str, object], run_id: str, template: RunConfig) -> RunConfig:
    """Run ``run_id``'s configuration ``stored`` (as recorded: secrets and placement are not its) on ``template``'s
    broker and store; ValueError when it is not valid here or names another run."""
    stored = {**stored, "bus": template.bus.model_dump(), "store": template.store.model_dump()}
    try:
        config = RunConfig.model_validate(stored)
    except ValidationError as exc:
        raise ValueError(f"run {run_id}'s stored configuration is not valid here: {exc.errors()[0]['msg']}") from None
    if config.run_id != run_id:
        raise ValueError(f"run {run_id}'s stored configuration names run {config.run_id}; create the run again "
                         "under a new name (rlpipe runs create)")
    return config


def membership_key(run_id: str) -> str:
    """Where the store keeps the run's newest ``RunStarted`` or ``RunStopped``."""
    return f"runs/{validate_name(run_id, 'run_id')}/membership.json"


def announce_membership(store: ObjectStore, publisher: EventPublisher, run_id: str,
                        payload: RunStarted | RunStopped) -> Envelope:
    """Keep ``payload`` as the run's newest membership event in the store, then publish it on the control topic.

    The store first: a stop that could not be published still holds at the next start of a packed process, and
    the command that failed says so (it raises).
    """
    event = make_event(run_id, payload)
    store.put(membership_key(run_id), encode_event(event))
    publisher.publish("control", event)
    return event


def recorded_membership(store: ObjectStore, run_id: str) -> Envelope | None:
    """The run's newest recorded ``RunStarted`` or ``RunStopped``; None when none was recorded (a run created by
    the process serving it); ``ValueError`` naming the key when the record is not such an event of this run."""
    key = membership_key(run_id)
    if not store.exists(key):
        return None
    try:
        event = decode_event(store.get(key))
    except EventDecodeError as exc:
        raise ValueError(f"{key} unreadable: {exc}") from None
    if not isinstance(event.payload, RunStarted | RunStopped) or event.run_id != run_id:
        raise ValueError(f"{key} unreadable: a {event.type} event of run {event.run_id}, not a start or stop of "
                         f"run {run_id}")
    return event


def stopped_line(store: ObjectStore, run_id: str) -> str | None:
    """Why a packed process starting does not serve the named run ``run_id`` (one line), None when it does."""
    fix = f"resume it with `rlpipe runs resume --run {run_id}`"
    try:
        event = recorded_membership(store, run_id)
    except ValueError as exc:  # read as a stop: a stop must never be undone by a damaged record
        return f"run {run_id} is not served: {exc}; {fix}"
    if event is None or not isinstance(event.payload, RunStopped):
        return None
    return f"run {run_id} was stopped at {utc_text(event.time.timestamp())} ({event.payload.reason}); {fix}"


def runs_not_stopped(configs: list[RunConfig], follow_runs: str | None) -> list[RunConfig]:
    """The named runs a packed process starts serving: those whose newest recorded event is not a ``RunStopped``
    (each other one logged in one line naming ``rlpipe runs resume``); ValueError when every named run is
    stopped and the process follows no runs."""
    serving: list[RunConfig] = []
    for config in configs:
        line = stopped_line(open_store(config.store), config.run_id)
        if line is None:
            serving.append(config)
        else:
            log.warning(line)
    if configs and not serving and follow_runs is None:
        names = [config.run_id for config in configs]
        raise ValueError(f"every run named is stopped ({', '.join(names)}); resume them with "
                         + " and ".join(f"`rlpipe runs resume --run {name}`" for name in names))
    return serving


def control_topic_ends(bus: BusConfig) -> dict[int, int]:
    """Each partition of the control topic (created if missing) with its end offset: the offset its next event gets."""
    ensure_topics(bus, ["control"])
    return {p.partition: p.end_offset for p in describe_topic(bus, "control").partitions}


def control_start(configs: list[RunConfig], template: RunConfig | None) -> dict[int, int]:
    """Where a packed process follows the control topic from (``RunMembership``'s ``control_from_P``): the topic's
    end offsets on its runs' event log (``template``'s when it names no run), taken as the process starts, before
    it reads the runs' records (``runs_not_stopped``, then ``RunMembership``).  {} with no run and no template
    (``engine_config`` then says what is missing)."""
    first = configs[0] if configs else template
    return {} if first is None else control_topic_ends(first.bus)


class RunMembership:
    """Which runs join and leave, from ``RunStarted`` and ``RunStopped`` on the control topic (from its end now, or
    from ``control_from_P``, its offset per partition at the process's start, ``control_start``: what was
    announced while the process set up is not missed, and nothing announced before it is read as new).

    A run joins on its ``RunStarted`` when it matches ``pattern`` or is one of ``named`` (the runs the process was
    started with, served or not: a named run stopped and resumed comes back).  ``pattern`` None takes no other
    run up (only served runs leave).  The runs matching ``pattern`` whose newest recorded event is a
    ``RunStarted`` (joined before the process started) join on the first call.  ``packable`` raises ValueError
    for a run that cannot share the process's engine with ``template`` (the process's first run).  Not
    thread-safe: poll it from one thread.
    """

    def __init__(self, pattern: str | None, template: RunConfig, store: ObjectStore,
                 packable: Callable[[list[RunConfig]], None], follower: EventFollower | None = None,
                 control_from_P: Mapping[int, int] | None = None, named: Collection[str] = ()) -> None:
        self.pattern, self.template, self.store, self.packable = pattern, template, store, packable
        self.named = frozenset(named)
        if follower is None and control_from_P is None:
            follower = EventFollower(template.bus, "control", start="latest")
        elif follower is None:  # a partition added since the start holds only later events: read from its beginning
            follower = EventFollower(template.bus, "control", start="earliest", offsets=control_from_P)
        self.follower = follower
        # served runs stopped and started again, and at first the runs started before the process: they join on
        # the next call (a named run already served is left as it is)
        self._rejoining: dict[str, None] = dict.fromkeys(self._started_before())

    def _started_before(self) -> list[str]:
        """The runs matching the pattern whose newest recorded event is a ``RunStarted``."""
        if self.pattern is None:
            return []
        try:
            matching = [run_id for run_id in run_ids(self.store) if fnmatch.fnmatchcase(run_id, self.pattern)]
        except Exception as exc:  # the store failing: the runs announced from now on still join
            log.warning("listing the runs in %s failed (%s: %s); runs matching %s started before this process "
                        "join when named (--run) or resumed (rlpipe runs resume)", self.store.root,
                        type(exc).__name__, exc, self.pattern)
            return []
        started = []
        for run_id in matching:
            try:
                event = recorded_membership(self.store, run_id)
            except Exception as exc:  # a damaged record or the store failing: as a stop, never undone by it
                log.warning("run %s is not taken up: %s; resume it with `rlpipe runs resume --run %s`", run_id, exc,
                            run_id)
                continue
            if event is not None and isinstance(event.payload, RunStarted):
                started.append(run_id)
        return started

    def _follows(self, run_id: str) -> bool:
        """Whether a ``RunStarted`` of ``run_id`` makes it join."""
        return run_id in self.named or (self.pattern is not None and fnmatch.fnmatchcase(run_id, self.pattern))

    def changes(self, serving: Collection[str]) -> list[Change]:
        """What happened since the last call: runs to add (not yet ``serving``, matching) and served runs to drop.

        Read in order, so a run started and stopped within one call neither joins nor leaves, and a run announced
        twice joins once.  A served run stopped and started again leaves now and joins on the next call, once the
        process has let it go.
        """
        now = set(serving)
        found: dict[str, Change] = {}  # at most one change per run and call, in the order they happened
        rejoining, self._rejoining = self._rejoining, {}
        for run_id in rejoining:
            self._join(run_id, now, found)
        try:
            items = self.follower.poll(0.0)
        except Exception as exc:  # the broker unreachable for a moment: the served runs go on, and it is read later
            log.warning("reading the control topic failed (%s: %s); the served runs go on, and it is read again "
                        "next round", type(exc).__name__, exc)
            items = []
        for item in items:
            run_id, payload = item.event.run_id, item.event.payload
            if isinstance(payload, RunStarted) and self._follows(run_id):
                if isinstance(found.get(run_id), Left):
                    self._rejoining[run_id] = None
                else:
                    self._join(run_id, now, found)
            elif isinstance(payload, RunStopped):
                if run_id in self._rejoining:
                    del self._rejoining[run_id]
                elif run_id in now:
                    now.discard(run_id)
                    if isinstance(found.get(run_id), Joined):
                        del found[run_id]  # started and stopped within this call: nothing to do
                    else:
                        found[run_id] = Left(run_id)
        return list(found.values())

    def _join(self, run_id: str, now: set[str], found: dict[str, Change]) -> None:
        if run_id in now:
            return
        config = self._config(run_id)
        if config is not None:
            found[run_id] = Joined(config)
            now.add(run_id)

    def _config(self, run_id: str) -> RunConfig | None:
        try:
            config = joining_config(self.store, run_id, self.template)
            self.packable([self.template, config])
        except ValueError as exc:
            log.warning("run %s cannot join this packed process: %s", run_id, exc)
            return None
        except Exception as exc:  # the store failing: this run is skipped, and the process serves the others
            log.warning("run %s cannot join this packed process: reading its configuration failed (%s: %s); "
                        "name it (--run) when the packed process starts again", run_id, type(exc).__name__,
                        exc)
            return None
        return config

    def close(self) -> None:
        self.follower.close()


class RunsFailedError(RuntimeError):
    """A packed process ended with runs that did not end as asked: stopped on an error and not back, or let go."""


class Comebacks:
    """Runs of a packed process that stopped on an error, brought back from their newest checkpoint after a pause.

    The pause is ``first_s`` doubled for each failure in a row, at most ``max_s``, as a supervisor restarts a
    single-run process; progress (a step trained, a batch written) resets the count.  A run that must not come
    back (its learner lease taken by another learner, which serves it now) is kept in ``lost`` with why, for the
    process's exit.
    """

    def __init__(self, first_s: float = COMEBACK_FIRST_S, max_s: float = COMEBACK_MAX_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first_s, self.max_s, self.clock = first_s, max_s, clock
        self.waiting: dict[str, tuple[RunConfig, float]] = {}  # run -> (its configuration, when it comes back)
        self.failures: dict[str, int] = {}  # run -> failures in a row
        self.lost: dict[str, str] = {}  # run -> why it is not brought back
        self.errors: dict[str, str] = {}  # run -> the error it waits to come back from

    def failed(self, config: RunConfig, error: Exception, again: bool = True) -> float | None:
        """Note ``config``'s run stopped on ``error``; the pause before it comes back (None: not ``again``)."""
        run_id = config.run_id
        if not again:
            self.lost[run_id] = str(error)
            log.error("run %s left this packed process: %s", run_id, error)
            return None
        self.errors[run_id] = f"{type(error).__name__}: {error}"
        count = self.failures[run_id] = self.failures.get(run_id, 0) + 1
        pause = min(self.max_s, self.first_s * 2 ** (count - 1))
        self.waiting[run_id] = (config, self.clock() + pause)
        log.error("run %s stopped on an error (%s: %s); it comes back from its newest checkpoint in %.0f s "
                  "(failure %d in a row)", run_id, type(error).__name__, error, pause, count)
        return pause

    def due(self) -> list[RunConfig]:
        """The runs whose pause is over, taken off the waiting list."""
        now = self.clock()
        ready = [run_id for run_id, (_, at) in self.waiting.items() if at <= now]
        return [self.waiting.pop(run_id)[0] for run_id in ready]

    def progressed(self, run_id: str) -> None:
        """``run_id`` made progress: its next failure pauses ``first_s`` again."""
        self.failures.pop(run_id, None)

    def forget(self, run_id: str) -> bool:
        """``run_id`` was stopped (``RunStopped``): it does not come back; whether it was waiting to."""
        self.failures.pop(run_id, None)
        return self.waiting.pop(run_id, None) is not None

    def check_settled(self) -> None:
        """At the process's end, raise ``RunsFailedError`` (one line) naming each run that did not end as asked:
        one whose lease was taken, one still waiting to come back from an error (its newest checkpoint stands),
        so a supervisor sees the failure as it would a single-run process's."""
        parts = [*self.lost.values()]
        parts += [f"run {run_id} stopped on an error and had not come back ({self.errors[run_id]}); it resumes from "
                  "its newest checkpoint when served again" for run_id in self.waiting]
        if parts:
            raise RunsFailedError("; ".join(" ".join(part.split()) for part in parts))
