"""What ``rlpipe run`` reads from the control topic while its processes run (``pipeline.devstack.launcher``).

One follower reads the launch's control events from its start on (``control_start_P``: the topic's end offsets
when the launch's ``RunStarted`` are out, before its processes start) and feeds each run's dashboard (``Dashboard``),
or, without a live view, its plain lines (``StepLines``).  Each learner checkpoint it reads is also where a packed
run at its step budget is found, and stopped at once (``RunStopped``): the packed producers let it go while the
other runs go on.  The store is looked at every ``STORE_LOOK_S`` as well, for a checkpoint the feed missed.  A
``RunStarted`` of a run (``rlpipe runs resume``) makes it go on: it is stopped again at its budget, read again from
its stored configuration, which may have raised it.  A ``RunConfigChanged`` of a run (a process restarted on it with
another configuration) sets its budget, checkpoint interval and heartbeat from the record the event names, checked
against the event's sha256; it starts no run that was stopped, and stops a packed run already past a lowered budget.
Changes are numbered in the store (``runs/<run>/config-changes/<n>.json``) and two processes may publish theirs in
either order: a change no later than the one the run's configuration was last read from is ignored, so the budget is
the newest change's, as the store says, not the last event's.  A start whose stored configuration cannot be read
still takes that number from the store's listing of the run's changes, which names a change it cannot read.

Where the feed starts is an offset, not a time: the events' timestamps are set by the clocks of the processes that
publish them (or by the broker's), and a clock an hour off this machine's would move a start by time as far, reading
an earlier launch's events (its ``RunStopped``, its checkpoints) as this one's, or missing this launch's first ones.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.cli.common import error_line
from pipeline.devstack.dashboard import Dashboard, StepLines, silent_after_s
from pipeline.io.bus import BusError, EventFollower, EventPublisher, UnknownTopicError, group_lag
from pipeline.io.registry import AdapterRegistry
from pipeline.membership import announce_membership, changed_run_config, control_topic_ends, numbered_stored_config
from pipeline.runtime import change_number, newest_change_number, open_store
from schemas.config import STEP_BUDGET_FIELDS, BusConfig, RunConfig, active_learner, step_budget
from schemas.events import Envelope, LearnerCheckpointed, RunConfigChanged, RunStarted, RunStopped

log = logging.getLogger("rlpipe.run")

STORE_LOOK_S = 10.0  # how often a packed launch looks in the store for runs at their budget
LAG_LOOK_S = 2.0  # how often the dashboards' learner lag is read


class ControlFeed:
    """The launcher's views of its runs and what it reads for them: the part of ``Launcher`` that follows the
    control topic (in its own thread, ``follow_control``) and announces the stop of a packed run at its budget."""

    stop_lock = threading.Lock()  # one launcher per process: announcing a run's stop is checked and done under it

    def __init__(self, configs: Sequence[RunConfig], bus: BusConfig, dashboard: bool) -> None:
        """The feed of ``configs`` (the first, ``config``, is the one whose broker and store the launch uses) on
        ``bus`` (resolved: the embedded stack's broker when none is configured), with their views (``views``)."""
        if not configs:
            raise ValueError("ControlFeed: no run to follow")
        self.configs = list(configs)
        self.config = self.configs[0]
        self.bus = bus
        self.control_start_P: dict[int, int] | None = None  # offset per partition the feed reads from (mark_start)
        self.stopping = threading.Event()  # set: the feed ends
        self.stopped: dict[str, str] = {}  # runs whose RunStopped went out, with its reason
        # runs whose budget may have changed to one that could not be read (a start's stored configuration, or a
        # change record touching the budget): no budget stop
        self.unbounded: set[str] = set()
        # per run, the number of the newest configuration change followed (``change_number``; 0: ``run.json``):
        # an older change's event, read after it, is ignored
        self.applied_changes: dict[str, int] = {}
        # per run, a number in applied_changes taken from the listing of its changes alone (``newest_listed_change``):
        # that change's own event is still read
        self.unread_changes: dict[str, int] = {}
        self.views(dashboard)

    def views(self, dashboard: bool) -> None:
        """Each run's board; the live view when asked for and standard output is a terminal (elsewhere its frames
        would not show until the end), else a plain line per learner step (``StepLines``) after the step a resumed
        run's checkpoint holds (its learner says that step again while it waits, and after a crash)."""
        self.live = dashboard and sys.stdout.isatty()
        self.boards = {c.run_id: Dashboard(silent_after_s=silent_after_s(c)) for c in self.configs}
        self.board = self.boards[self.config.run_id]
        self.step_lines = {} if self.live else {
            c.run_id: StepLines(c.run_id, self.boards[c.run_id], step_budget(c),
                                active_learner(c).checkpoint_every,
                                shown_step=self.stored_step(c))
            for c in self.configs}

    def stored_step(self, config: RunConfig) -> int:
        """The step of the run's newest checkpoint in the store; 0 before the first, or while the store cannot be
        read (then a resumed run's first line may repeat its last step)."""
        from pipeline.analysis.runs import learner_step

        try:
            return learner_step(open_store(config.store), config.run_id)
        except Exception as exc:  # the store unreachable (any backend's error)
            log.debug("stored step of %s: %s", config.run_id, exc)
            return 0

    @property
    def packed(self) -> bool:
        """Several runs share the learner and producer processes."""
        return len(self.configs) > 1

    # ---- the feed ------------------------------------------------------------
    def mark_start(self) -> None:
        """Where the feed reads the control topic from: its end now (``control_start_P``).  The launch marks it once
        its ``RunStarted`` are out and before its processes start, so the feed reads every event of the launch and
        none from before it; nor its own ``RunStarted``, which would read as a resume (``started_again``)."""
        self.control_start_P = control_topic_ends(self.bus)

    def follow_control(self) -> None:
        """Feed each run's dashboard from the control topic until the runs stop.

        One follower reads the topic for the whole launch, from its start on (``control_start_P``, marked here when
        the launch did not), so no event is missed while the learner's lag or the store is looked at between two
        reads: the plain lines promise one per step, and a packed run's stop at its budget is read from its
        checkpoint event.
        """
        only = None if self.packed else self.config.run_id
        publisher: EventPublisher | None = None
        follower: EventFollower | None = None
        lag_looked = store_looked = 0.0  # when the learner's lag and the store were last looked at (monotonic)
        try:
            while not self.stopping.is_set():
                try:
                    publisher = publisher or EventPublisher(self.bus)
                    if self.control_start_P is None:
                        self.mark_start()
                    # a partition added since the start holds only later events: read from its beginning
                    follower = follower or EventFollower(self.bus, "control", run_id=only, start="earliest",
                                                         offsets=self.control_start_P)
                    for item in follower.poll(timeout_s=0.5):
                        self.on_control(item.event, publisher)
                        if self.stopping.is_set():
                            return
                    if time.monotonic() - lag_looked > LAG_LOOK_S:
                        lag_looked = time.monotonic()
                        self.read_lags()
                    if self.packed and time.monotonic() - store_looked > STORE_LOOK_S:
                        store_looked = time.monotonic()  # the store says a stop too, while the feed cannot be read
                        self.stop_finished_runs(publisher)
                except (BusError, UnknownTopicError, OSError) as exc:  # the log unreachable, no topic yet: retry
                    log.debug("dashboard feed: %s", exc)  # a follower keeps its positions: it reads on from there
                    time.sleep(1.0)
        finally:
            for client in (follower, publisher):
                if client is not None:
                    client.close()

    def read_lags(self) -> None:
        """Each run's learner lag (its group's unread batches) onto its dashboard."""
        for run_id, board in self.boards.items():
            lags = group_lag(self.bus, f"rlpipe-learner-{run_id}")
            board.lag = sum(p.lag for p in lags) if lags else None

    def on_control(self, event: Envelope, publisher: EventPublisher) -> None:
        """One control event: onto its run's dashboard; a packed run whose learner reached its step budget is
        stopped at once (``RunStopped``), so the packed producers let it go while the other runs go on."""
        board = self.boards.get(event.run_id)
        if board is None:
            return
        if isinstance(event.payload, RunStarted):  # before its board and lines read the budget
            self.started_again(event.run_id)
        elif isinstance(event.payload, RunConfigChanged):
            self.config_changed(event.run_id, event.payload, publisher)
        board.apply(event.payload)
        line = self.step_lines[event.run_id](event.payload) if event.run_id in self.step_lines else None
        if line is not None:
            print(line, flush=True)
        if isinstance(event.payload, RunStopped):  # stopped already (`rlpipe runs stop`, or this launcher's own)
            with self.stop_lock:
                self.stopped.setdefault(event.run_id, event.payload.reason)
            return
        budget = self.known_budget(self.launched(event.run_id))
        payload = event.payload
        if self.packed and isinstance(payload, LearnerCheckpointed) and budget is not None and payload.step >= budget:
            self.announce_stop(publisher, event.run_id, "step budget reached", payload.step, payload.version)

    def started_again(self, run_id: str) -> None:
        """A ``RunStarted`` of ``run_id`` (``rlpipe runs resume``, perhaps after its budget was raised): the run goes
        on, so it is stopped again at its budget, which is read again from its stored configuration, as the packed
        learner that takes it up reads it (``follow_config``).  When that cannot be read, the run is ``unbounded``
        and the number of its newest change is still taken from the store's listing (``newest_listed_change``)."""
        launched = self.launched(run_id)
        followed = self.follow_config(run_id, f"run {run_id} was started again",
                                      lambda: numbered_stored_config(open_store(launched.store), run_id, launched),
                                      restart=True, budget_doubt="its step budget is unknown")
        if followed is None:
            self.newest_listed_change(run_id)

    def newest_listed_change(self, run_id: str) -> None:
        """Take the number of ``run_id``'s newest change from the listing of its changes (``newest_change_number``),
        which names it even when its record cannot be read: an older change's event read after it is then ignored,
        as it would be had the stored configuration been read, and does not set a budget the store has since
        changed.  The run stays ``unbounded`` until that change's own event (``unread_changes``) or a later change is
        followed."""
        launched = self.launched(run_id)
        try:
            newest = newest_change_number(open_store(launched.store), run_id)
        except Exception as exc:  # the store unreachable (any backend's error), or a stray file among the changes
            log.debug("newest change of %s: %s", run_id, exc)
            return
        if newest > self.applied_changes.get(run_id, 0):
            self.applied_changes[run_id] = self.unread_changes[run_id] = newest

    def config_changed(self, run_id: str, change: RunConfigChanged, publisher: EventPublisher) -> None:
        """A ``RunConfigChanged`` of ``run_id``: a process restarted on the run records and announces the
        configuration it runs with, so the launch follows it too (``follow_config``), the one the event names and
        its sha256 vouches for, unless the configuration followed is that change's or a later one's (events of two
        processes' changes may be read in either order).  A change is no start: a run stopped stays stopped (the
        new budget holds once ``rlpipe runs resume`` starts it again), and a packed run going on already at or past
        a lowered budget is stopped now."""
        try:
            number: int | None = change_number(run_id, change.config_path)
        except ValueError:  # not one of the run's changes: refused by changed_run_config, said in the warning
            number = None
        applied = self.applied_changes.get(run_id, 0)
        if number is not None and number <= applied and number != self.unread_changes.get(run_id):
            self.older_change(run_id, change.config_path, number, applied)
            return
        launched = self.launched(run_id)
        followed = self.follow_config(
            run_id, f"run {run_id}'s configuration changed",
            lambda: (change_number(run_id, change.config_path),
                     changed_run_config(open_store(launched.store), run_id, change, launched)),
            budget_doubt=self.budget_doubt(run_id, number, change))
        if followed is None and number is not None:
            # unbounded by it, an older change's budget is stale; or its budget is the one followed: either way the
            # run's budget is this change's as far as it is known, and a change before it (one a start could not
            # read among them) is older
            self.applied_changes[run_id] = number
            if self.unread_changes.get(run_id, number) < number:
                del self.unread_changes[run_id]
        if followed is not None and self.packed:
            self.stop_if_finished(publisher, followed)

    def older_change(self, run_id: str, key: str, number: int, applied: int) -> None:
        """The change at ``key`` (``number``) is no later than the newest one read (``applied``): it is ignored.  An
        info line: two processes' events arriving in either order is normal, and the budget followed is right."""
        if number == applied:
            log.info("run %s: %s is the configuration change this launch follows already", run_id, key)
            return
        log.info("run %s's configuration changed (%s), but this launch follows change %d, a later one: this older "
                 "change is ignored", run_id, key, applied)

    def budget_doubt(self, run_id: str, number: int | None, change: RunConfigChanged) -> str | None:
        """Why ``change`` (the run's change ``number``, None when it is none of the run's) may give ``run_id``
        another budget than the one followed; None when it cannot.  Its ``changes`` are relative to the change
        before it (``run.json`` before the first), so they vouch for the budget followed only when that is the
        change before it: change 2 that leaves the budget alone, read before change 1 that raised it, says nothing
        of ``run.json``'s budget."""
        budget_fields = [field.field for field in change.changes if field.field in STEP_BUDGET_FIELDS]
        if budget_fields:
            return f"it changed {', '.join(budget_fields)}, so its new step budget is unknown"
        if number is None or number == self.unread_changes.get(run_id):
            return "its step budget is unknown"
        before = number - 1
        if before != self.applied_changes.get(run_id, 0):
            return (f"it was read before change {before}, and the fields it lists are those changed since that "
                    "one, so whether its step budget changed is unknown")
        return None

    def follow_config(self, run_id: str, what: str, read: Callable[[], tuple[int, RunConfig]], restart: bool = False,
                      budget_doubt: str | None = "its step budget is unknown") -> RunConfig | None:
        """Take ``run_id``'s budget, checkpoint interval and heartbeat (which its lines and board read) from the
        configuration ``read`` gives with the number of the change it is (``applied_changes``); ``what`` happened,
        for the warning; ``restart``: the run goes on, no longer ``stopped``.  The configuration followed, or None
        when it cannot be read: then the run is ``unbounded`` where its budget may have changed (``budget_doubt``
        says why): the launch's budget may be below the new one (the one it was stopped at, for a run started
        again), and stopping it there would end it early; it still gets its ``RunStopped`` when the launch ends, as
        any run going on does.  A change that leaves the budget followed alone (``budget_doubt`` None) leaves it as
        it was."""
        try:
            number, config = read()
        except Exception as exc:  # the store unreachable (any backend's error), or the record unreadable
            self.unreadable_config(run_id, what, exc, restart, budget_doubt)
            return None
        self.applied_changes[run_id] = number
        self.unread_changes.pop(run_id, None)
        index = self.configs.index(self.launched(run_id))
        self.configs[index] = config  # the stack, the logs and the processes stay the launch's (``self.config``)
        self.boards[run_id].silent_after_s = silent_after_s(config)
        if run_id in self.step_lines:  # which steps get a checkpoint, and so which event says each step's line
            lines = self.step_lines[run_id]
            lines.max_steps, lines.checkpoint_every = step_budget(config), active_learner(config).checkpoint_every
        with self.stop_lock:
            if restart:
                self.stopped.pop(run_id, None)
            self.unbounded.discard(run_id)
        return config

    def unreadable_config(self, run_id: str, what: str, exc: Exception, restart: bool,
                          budget_doubt: str | None) -> None:
        """``follow_config`` when its configuration cannot be read (``exc``): a warning, and the run ``unbounded``
        if its budget may have changed (``budget_doubt``, why), else its budget kept."""
        # the readers' ValueError names what cannot be read and why; anything else is the store's own error
        why = error_line(exc) if isinstance(exc, ValueError) else f"the store cannot be read ({error_line(exc)})"
        if budget_doubt is None:
            kept = "the run stays unbounded" if run_id in self.unbounded else "it stays as it was"
            log.warning("%s, but %s; its step budget is not among the changed fields, so %s", what, why, kept)
        else:
            log.warning("%s, but %s; %s: this launch keeps the run unbounded (no stop at a step budget)", what, why,
                        budget_doubt)
            if run_id in self.step_lines:
                self.step_lines[run_id].max_steps = None
        with self.stop_lock:
            if restart:
                self.stopped.pop(run_id, None)
            if budget_doubt is not None:
                self.unbounded.add(run_id)

    def launched(self, run_id: str) -> RunConfig:
        """The configuration this launch follows for ``run_id`` now."""
        return next(c for c in self.configs if c.run_id == run_id)

    def known_budget(self, config: RunConfig) -> int | None:
        """The run's step budget, None when it has none or it is ``unbounded`` (its stored budget unreadable)."""
        return None if config.run_id in self.unbounded else step_budget(config)

    def announce_stop(self, publisher: EventPublisher, run_id: str, reason: str, step: int, version: int) -> None:
        """``RunStopped`` for ``run_id``, once per run: marked only once published, so a failed publish (raised)
        is tried again by the next call."""
        with self.stop_lock:  # the watcher and the shutdown may race
            if run_id in self.stopped:
                return
            config = self.launched(run_id)
            announce_membership(open_store(config.store), publisher, run_id,
                                RunStopped(reason=reason, final_version=version, final_step=step))
            self.stopped[run_id] = reason

    def stop_finished_runs(self, publisher: EventPublisher) -> None:
        """``RunStopped`` for every packed run whose newest checkpoint in the store is at its step budget."""
        for config in self.configs:
            self.stop_if_finished(publisher, config)

    def stop_if_finished(self, publisher: EventPublisher, config: RunConfig) -> None:
        """``RunStopped`` for the run of ``config`` if it is not stopped and its newest checkpoint (``final_position``)
        is at or past its step budget."""
        budget = self.known_budget(config)
        if config.run_id in self.stopped or budget is None:
            return
        step, version = self.final_position(config)
        if step >= budget:
            self.announce_stop(publisher, config.run_id, "step budget reached", step, version)

    def final_position(self, config: RunConfig) -> tuple[int, int]:
        """(step, version) of the run's newest checkpoint: the store's (the last one may have been written after the
        dashboard's feed last looked), else the dashboard's."""
        from pipeline.analysis.runs import learner_step

        learner = self.boards[config.run_id].learner
        step, version = (learner.step, learner.version) if learner else (0, 0)
        try:
            store = open_store(config.store)
            stored = learner_step(store, config.run_id)
            versions = AdapterRegistry(store, config.run_id).versions()
        except Exception as exc:  # the store unreachable (any backend's error): what the dashboard saw
            log.debug("final position of %s: %s", config.run_id, exc)
            return step, version
        return max(step, stored), max([version, *versions[-1:]])

    def render(self) -> Any:
        """Every run's panel, one under the other."""
        from rich.console import Group

        return Group(*(self.boards[c.run_id].render(c.run_id, self.known_budget(c)) for c in self.configs))
