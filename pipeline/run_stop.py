"""A single-run learner or producer following its run's ``RunStopped`` (``rlpipe runs stop``) on the control topic.

``rlpipe learner|producer start`` naming one run serves it until SIGTERM, Ctrl-C or the run's stop sent after the
process started, which stops it alike (``pipeline.cli.common.serve_until_run_stopped``).  A packed process follows
its runs' starts and stops with ``pipeline.membership.RunMembership`` instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pipeline.io.bus import EventFollower
from pipeline.runtime import StopFlag, resolved_bus
from schemas.config import BusConfig, RunConfig
from schemas.events import RunStopped

log = logging.getLogger("rlpipe.run_stop")


class RunStopFollower:
    """Sets a single-run process's ``stop`` on its run's ``RunStopped`` (``rlpipe runs stop``): the process then stops
    as a SIGTERM stops it (the step or batch in hand finished, checkpointed or flushed, exit 0).

    A thread of its own connects to the control topic and polls it (``EventFollower`` is not thread-safe: only that
    thread touches it), so neither the process's start nor its loop waits on the broker for it.  A broker away as the
    process starts is the process's own to report (it fails on its own connection in one line); this thread tries
    again quietly every ``RETRY_S`` and warns once if the topic still cannot be read ``WARN_AFTER_S`` after the
    start, so a broker that comes back late still delivers the run's stop.  A poll that fails is logged and tried
    again.

    Where the topic is followed from: when the broker answers the first try, from the topic's end then (an offset,
    as a packed process takes its start, ``pipeline.membership.control_start``): a stop sent before is not read, so a
    run stopped earlier is served again when its process is started again.  When the first try fails, no offset can be
    read yet, so a later try follows each partition from its first event at or after the moment this was made (the
    process's start; ``EventFollower``'s ``since_s``, the broker's ``offsets_for_times``): a stop sent while the broker
    was away is still read.  Only then do the clocks matter: a stop sent within the clocks' difference of the start
    (the sending command's clock stamps the event, this process's the start) may be missed, or read as new.
    """

    POLL_S = 1.0  # how long one poll may wait for the next event
    RETRY_S = 5.0  # the pause between two tries to reach the control topic
    WARN_AFTER_S = 60.0  # how long after the start a topic not yet read is worth a warning

    def __init__(self, bus: BusConfig, run_id: str, stop: StopFlag,
                 connect: Callable[[float | None], EventFollower] | None = None) -> None:
        self.run_id, self.stop = run_id, stop
        self.started_s = time.time()
        # ``connect(None)``: from the topic's end now; ``connect(t)``: from the first event at or after time t
        self.connect = connect or (lambda since_s: EventFollower(bus, "control", run_id=run_id, since_s=since_s))
        self.stopped: RunStopped | None = None  # the RunStopped followed, once read
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"run-stop-{run_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        follower = self._connected()
        if follower is None:
            return
        try:
            self._follow(follower)
        finally:
            follower.close()

    def _connected(self) -> EventFollower | None:
        """The control topic's follower once the broker answers; None when the process stops first."""
        warned, since_s = False, None  # the first try from the topic's end, later ones from the start's time
        while not self._closing.is_set() and not self.stop():
            try:
                return self.connect(since_s)
            except Exception as exc:  # the broker away: the process reports its own connection, this tries again
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                log.debug("run %s's control topic cannot be read yet (%s)", self.run_id, reason)
                if not warned and time.time() - self.started_s >= self.WARN_AFTER_S:
                    log.warning("run %s's RunStopped is not followed yet (%s); this process keeps trying, and "
                                "SIGTERM or Ctrl-C stop it meanwhile", self.run_id, reason)
                    warned = True
            since_s = self.started_s
            self._closing.wait(self.RETRY_S)
        return None

    def _follow(self, follower: EventFollower) -> None:
        while not self._closing.is_set() and not self.stop():
            try:
                items = follower.poll(self.POLL_S)
            except Exception as exc:  # the broker away for a while: the run goes on, and the topic is read again
                log.warning("reading the control topic failed (%s: %s); run %s goes on, and it is read again",
                            type(exc).__name__, exc, self.run_id)
                self._closing.wait(self.POLL_S)
                continue
            for item in items:  # a follower made by ``connect`` may hand over other runs' events too
                if item.event.run_id == self.run_id and isinstance(item.event.payload, RunStopped):
                    self.stopped = item.event.payload
                    log.info("run %s was stopped (%s): finishing cleanly, as on SIGTERM", self.run_id,
                             self.stopped.reason)
                    self.stop.run_stopped = True
                    self.stop.set()
                    return

    def close(self) -> None:
        """Stop following; a thread still waiting on the broker is not waited for (it ends on its next answer)."""
        self._closing.set()
        self._thread.join(timeout=2 * self.POLL_S)


@contextmanager
def following_run_stop(config: RunConfig, stop: StopFlag) -> Iterator[RunStopFollower | None]:
    """A ``RunStopFollower`` of ``config``'s run for the block, which reaches the broker in its own time and says
    nothing as the process starts; None when no broker is configured (the process fails on it at once, saying how
    to start one)."""
    from pipeline.devstack.stack import NoBrokerConfiguredError

    try:
        bus = resolved_bus(config.bus)
    except NoBrokerConfiguredError as exc:
        log.debug("run %s's RunStopped is not followed: %s", config.run_id, exc)
        yield None
        return
    follower = RunStopFollower(bus, config.run_id, stop)
    try:
        yield follower
    finally:
        follower.close()


def stopped_by_line(run_id: str, stopped: RunStopped) -> str:
    """What a single-run process stopped by its run's ``RunStopped`` says as it exits."""
    return (f"run {run_id} was stopped ({stopped.reason}); to go on, resume it with `rlpipe runs resume --run "
            f"{run_id}` and start this process again")
