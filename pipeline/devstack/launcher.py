"""``rlpipe run``: one command for a whole local run.

Set up (one line each): the embedded stack if nothing is configured, the broker
answering, the base model, the run (``run.json`` then ``RunStarted``); then launch the learner and N
producers as separate processes (``rlpipe learner start`` / ``rlpipe producer
start``, the same commands a cluster runs) and watch them on one live
dashboard fed by the control topic (``pipeline.devstack.control_feed``; without one, ``--no-dashboard`` or
standard output not a terminal, one plain line per learner step from the same events).  The run ends when the
learner reaches its
step budget (``learner.max_steps``) or on Ctrl-C: producers get SIGTERM, flush
their finished groups and exit; then ``RunStopped``.  It also ends when every
producer has exited 0 (each wrote its ``producer.max_groups``) and the learner
has read every batch they announced (``pipeline.devstack.catch_up``): nothing
more will come, so the learner gets SIGTERM, which trains what is waiting (a
last step under ``learner.batch_rows`` too), checkpoints and commits.
Everything stays in the store and on the topics for ``rlpipe report``.

Several runs (``rlpipe run --runs N``) are launched packed: one learner
process trains them all (``rlpipe learner start --config A --config B ...``)
and each producer process serves them all on one sampling engine; each run
keeps its own ``run.json``, events, adapters and checkpoints, and the
dashboard shows one panel per run.  A packed run whose learner reaches its step
budget gets its ``RunStopped`` at once, and the packed processes let it go
(``pipeline.membership``) while the others go on.  Each ``RunStarted`` and
``RunStopped`` this launcher announces is also kept in the store, so packed
processes started later on the runs (``rlpipe learner start --run A --run B``)
serve them only once ``rlpipe runs resume`` announces them again.

``pipeline`` may not import the producer or learner code, and need not: it
starts them as commands, which is also what keeps each process's engine and
threads its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import yaml

from pipeline.cli.common import error_line
from pipeline.config import child_environment
from pipeline.devstack.catch_up import LearnerCatchUp
from pipeline.devstack.control_feed import ControlFeed
from pipeline.devstack.stack import (
    StackAlreadyRunningError,
    StackState,
    read_stack_state,
    rlpipe_home,
    start_background,
)
from pipeline.io.bus import (
    GROUP_TIMINGS_ENV,
    BusError,
    EventPublisher,
    UnknownTopicError,
    list_topics,
)
from pipeline.io.store import remote_failures
from pipeline.membership import announce_membership
from pipeline.runtime import Announcer, change_number, create_run, open_store, resolved_bus
from schemas.config import RunConfig
from schemas.events import RunStarted

log = logging.getLogger("rlpipe.run")

PRODUCERS_DONE = "every producer wrote its producer.max_groups groups"  # the RunStopped reason of such a run

# On the embedded broker Kafka's default group timings (45 s session) make the learner's first join take
# about 20 s, and a restarted learner wait for its dead predecessor's session to expire.  A 6 s session
# still survives a heartbeat thread starved on a busy 2-core machine; max_poll covers the longest step.
EMBEDDED_GROUP_TIMINGS_MS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 500,
                             "max_poll_interval_ms": 600_000}


def ensure_stack(config: RunConfig, outlives: str = "this run") -> StackState | None:
    """Start the embedded stack when no broker is configured and none runs; its state if started here.

    It is a background process that outlives the command that started it (``outlives``: this run, the
    server; the next run, ``rlpipe report`` and ``rlpipe topics`` use it), so the user is told where it
    listens and how to stop it.
    """
    if config.bus.bootstrap_servers or read_stack_state() is not None:
        return None
    log.info("no broker configured: starting the embedded stack in the background")
    try:
        state = start_background(with_gcs=False)
    except StackAlreadyRunningError:  # another command started it meanwhile: this run uses that one
        return None
    log.info("started the embedded stack (pid %d: Kafka broker at %s, store %s); it keeps running after %s "
             "stops: stop it with `rlpipe down`", state.pid, state.bootstrap_servers, state.store_root, outlives)
    return state


def write_resolved_config(config: RunConfig) -> Path:
    """The resolved config as YAML for the child processes (secrets stay in the environment, never on disk)."""
    folder = rlpipe_home() / "runs" / config.run_id
    folder.mkdir(parents=True, exist_ok=True)
    data = config.model_dump(mode="json")
    data["bus"]["sasl_password"] = None  # children read it from RLPIPE_BUS__SASL_PASSWORD like this process did
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=True))
    return path


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt while inside, as Ctrl-C does: a launcher that is killed or loses
    its terminal stops its processes instead of leaving them running; the handlers are put back afterwards."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def rlpipe_command(*args: str) -> list[str]:
    """The argv running ``rlpipe ARGS`` with this interpreter."""
    return [sys.executable, "-c", "from pipeline.cli.main import main; main()", *args]


def producer_args(config: RunConfig, config_path: str, index: int) -> list[str]:
    """The command line of producer ``index``: its id ``<run>-p<index>`` also picks its training seeds
    (``RunConfig.training_seeds``), so producers never share seeds nor play held-out ones."""
    return ["producer", "start", "--config", config_path, "--set", f"producer.producer_id={config.run_id}-p{index}"]


def packed_producer_args(config_paths: Sequence[str], index: int) -> list[str]:
    """The command line of packed producer ``index``, serving every run: its id in each run is ``packed-p<index>``
    (the ordinal picks the training seeds, as ``producer_args``'s does)."""
    configs = [arg for path in config_paths for arg in ("--config", path)]
    return ["producer", "start", *configs, "--set", f"producer.producer_id=packed-p{index}"]


class Launcher(ControlFeed):
    """Starts and watches the learner and producers of one run, or of several runs packed in the same processes;
    what it reads of them on the control topic is ``ControlFeed``'s."""

    def __init__(self, config: RunConfig | Sequence[RunConfig], dashboard: bool = True) -> None:
        configs = [config] if isinstance(config, RunConfig) else list(config)
        if not configs:
            raise ValueError("Launcher: no run to launch")
        self.started_stack = ensure_stack(configs[0])  # the stack, the model and the logs folder are the first run's
        super().__init__(configs, resolved_bus(configs[0].bus), dashboard)
        self.config_paths = [write_resolved_config(c) for c in self.configs]
        self.config_path = self.config_paths[0]
        self.log_dir = self.config_path.parent / "logs"
        self.log_dir.mkdir(exist_ok=True)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.watcher: threading.Thread | None = None  # feeds the dashboards (follow_control)
        self.producers_exited = False  # every producer exited 0
        self.catch_ups: dict[str, LearnerCatchUp] = {}  # per run going on when they had: what the learner read
        self.producers_done = False  # ... and the learner has read every batch they wrote

    # ---- set up -------------------------------------------------------------
    def reach_broker(self) -> None:
        """Ask the broker for its topics: one that does not answer is named in seconds, before the base model is
        set up (a first build of the tiny model takes minutes) or anything is written."""
        list_topics(self.bus)

    def prepare_model(self) -> None:
        """Build the tiny model once (the producer side builds it; the learner reads the recorded path)."""
        if self.config.model.base_model != "tiny" or self.config.value is not None:  # value runs need no model
            return
        log.info("initialising the tiny base model (built once, then cached)")
        args = ["model", "init-tiny"] + (["--out", self.config.model.tiny_dir] if self.config.model.tiny_dir else [])
        subprocess.run(rlpipe_command(*args), check=True)

    def create(self) -> None:
        """Each run's ``run.json``, then its ``RunStarted``; the change each run's configuration is, so that the feed
        ignores an older one's event (``applied_changes``)."""
        with EventPublisher(self.bus) as publisher:
            for config in self.configs:
                store = open_store(config.store)
                key, _, started = create_run(store, config, config.model.base_model)
                if key != f"runs/{config.run_id}/run.json":
                    self.applied_changes[config.run_id] = change_number(config.run_id, key)
                if isinstance(started, RunStarted):
                    announce_membership(store, publisher, config.run_id, started)
                elif started is not None:
                    Announcer(publisher, config.run_id)(started)

    def spawn(self, name: str, *args: str) -> None:
        out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it for its lifetime
        env = child_environment({"RLPIPE_BUS__BOOTSTRAP_SERVERS": self.bus.bootstrap_servers})
        if not self.config.bus.bootstrap_servers:  # the embedded broker: one learner, so join fast
            env.setdefault(GROUP_TIMINGS_ENV, json.dumps(EMBEDDED_GROUP_TIMINGS_MS))
        # a process group of its own: a Ctrl-C at the terminal reaches only this launcher, which then stops each
        # child once with SIGTERM (a second signal would abort it, and SIGINT would kill vLLM's engine process)
        self.processes[name] = subprocess.Popen(rlpipe_command(*args), stdout=out, stderr=subprocess.STDOUT, env=env,
                                                process_group=0)
        log.info("started %s (pid %d, log %s)", name, self.processes[name].pid, out.name)

    # ---- run ------------------------------------------------------------------
    def run(self) -> int:
        """Launch everything, watch until the learner is done or Ctrl-C, stop cleanly; return an exit code."""
        self.reach_broker()
        self.prepare_model()
        self.create()
        interrupted = False
        with stop_signals_interrupt():  # also while stopping: a second signal kills what has not stopped yet
            try:  # from the first spawn: a Ctrl-C (or a failed start) between two stops those already started
                self.launch()
                self.watch()
            except KeyboardInterrupt:
                interrupted = True
                log.info("Ctrl-C: stopping the run")
            finally:  # whatever ended the watch, the processes are stopped and the runs announced
                code = self.shutdown(interrupted=interrupted)
        return code

    def launch(self) -> None:
        """The learner, then the producers, then the dashboard's feed (which reads from here on)."""
        paths = [str(path) for path in self.config_paths]
        self.mark_start()
        self.spawn("learner", "learner", "start", *[arg for path in paths for arg in ("--config", path)])
        for index in range(self.config.num_producers):
            args = packed_producer_args(paths, index) if self.packed else producer_args(self.config, paths[0], index)
            self.spawn(f"producer-{index}", *args)
        self.watcher = threading.Thread(target=self.follow_control, daemon=True)
        self.watcher.start()

    def announce_stops(self, publisher: EventPublisher, codes: dict[str, int | None], interrupted: bool) -> None:
        """``RunStopped`` for every run not stopped yet (the end of the whole launch), saying why each stopped:
        its step budget reached, a Ctrl-C or signal, or the process that failed."""
        failed = next((f"{name} exited with {code}" for name, code in codes.items() if code not in (None, 0)), None)
        for config in self.configs:
            step, version = self.final_position(config)
            budget = self.known_budget(config)
            if budget is not None and step >= budget:
                reason = "step budget reached"
            elif self.producers_done and not failed:
                reason = PRODUCERS_DONE
            elif interrupted:
                reason = "stopped by Ctrl-C or a signal"
            else:
                reason = failed or "stopped"
            self.announce_stop(publisher, config.run_id, reason, step, version)

    def watch(self) -> None:
        """Until the learner exits, a producer fails, or the producers are done and the learner has read it all."""
        from rich.live import Live

        try:
            if not self.live:
                while self.going():
                    time.sleep(0.5)
                return
            with Live(self.render(), refresh_per_second=2) as live:
                while self.going():
                    live.update(self.render())
                    time.sleep(0.5)
                live.update(self.render())
        finally:
            for catch_up in self.catch_ups.values():
                catch_up.close()

    def going(self) -> bool:
        """Whether to keep watching."""
        return (self.processes["learner"].poll() is None and not self._producer_failed()
                and not self._producers_done())

    def _producers_done(self) -> bool:
        """Every producer exited 0 and the learner has read every batch of every run still going.

        Said once, when the last producer is seen gone; until the learner has read everything it trains on.
        """
        producers = [process for name, process in self.processes.items() if name != "learner"]
        if not producers or any(process.poll() != 0 for process in producers):
            return False
        if not self.producers_exited:
            self.producers_exited = True
            log.info("every producer has exited 0 (each wrote its producer.max_groups groups): the learner trains "
                     "what they wrote, then is stopped (a last batch under learner.batch_rows is trained too)")
        # a list, not a generator: every run's catch-up reads on at each look, not only up to the first behind
        self.producers_done = all([self._caught_up(c.run_id) for c in self.configs])
        return self.producers_done

    def _caught_up(self, run_id: str) -> bool:
        """Whether the learner has read every batch announced for ``run_id``, or let the run go (a packed run stopped
        at its budget); False while the log is unreachable."""
        if run_id in self.stopped:
            return True
        try:
            if run_id not in self.catch_ups:
                self.catch_ups[run_id] = LearnerCatchUp(self.bus, run_id, self.control_start_P or {})
            return self.catch_ups[run_id]()
        except (BusError, UnknownTopicError, OSError) as exc:  # the log unreachable, no topic yet: look again
            log.debug("whether the learner of %s has read everything: %s", run_id, exc)
            return False

    def _producer_failed(self) -> bool:
        return any(p.poll() not in (None, 0) for name, p in self.processes.items() if name != "learner")

    def shutdown(self, timeout_s: float = 120.0, interrupted: bool = False) -> int:
        """Stop every process (``stop_processes``), then RunStopped; non-zero if any child failed."""
        self.stopping.set()
        interrupted = self.stop_processes(timeout_s) or interrupted
        codes = {name: process.returncode for name, process in self.processes.items()}
        if self.watcher is not None:
            self.watcher.join(timeout=10.0)  # its own announcements done before the last ones
        failed = {name: code for name, code in codes.items() if code != 0}
        for name, code in failed.items():  # said first: a broker that is gone (often why a child died) ends below
            path = self.log_dir / f"{name}.log"
            log.error("%s exited with %s; the end of %s:\n%s", name, code, path, log_tail(path))
        announced = self.announce_final_stops(codes, interrupted)
        if self.started_stack is not None:
            log.info("the embedded stack started for this run is still running (pid %d); stop it with `rlpipe down`",
                     self.started_stack.pid)
        return 1 if failed or not announced else 0

    def announce_final_stops(self, codes: dict[str, int | None], interrupted: bool) -> bool:
        """``announce_stops`` on a publisher of its own; False, said in one line, when the store or the broker cannot
        take them (each stop is kept in the store, then published: either may have gone with the stack)."""
        try:
            with EventPublisher(self.bus) as publisher:
                self.announce_stops(publisher, codes, interrupted)
        except (BusError, OSError, *remote_failures()) as exc:  # the store's disk, or its GCS endpoint
            log.error("could not announce RunStopped for %s: %s; the processes are stopped, and `rlpipe runs stop "
                      "--run RUN` announces it once the store and the broker answer",
                      ", ".join(c.run_id for c in self.configs if c.run_id not in self.stopped), error_line(exc))
            return False
        return True

    def stop_processes(self, timeout_s: float) -> bool:
        """SIGTERM every child still running and wait for them (``timeout_s`` in all); True if interrupted again.

        A child still running after that, or every one on a second Ctrl-C, is killed with its process group (its
        own, from ``spawn``: an engine process under a producer dies with it); so is whatever a child stopped here
        left running in its group, so the run leaves no process behind.  The groups of children that had exited
        before are left alone: their ids may belong to other processes by now.
        """
        running = [process for process in self.processes.values() if process.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        interrupted = False
        try:
            for name, process in self.processes.items():
                try:
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in time: killing it", name)
        except KeyboardInterrupt:  # Ctrl-C (or a stop signal) again while stopping: do not wait any longer
            interrupted = True
            log.warning("interrupted again: killing the processes that have not stopped")
        finally:
            for process in running:
                with contextlib.suppress(ProcessLookupError, PermissionError):  # an empty group is gone
                    os.killpg(process.pid, signal.SIGKILL)
            for process in running:
                process.wait()
        return interrupted


def log_tail(path: Path, lines: int = 10) -> str:
    """The last ``lines`` lines of a child's log, indented (what says why it exited)."""
    try:
        text = path.read_text(errors="replace")[-4000:]
    except OSError as exc:
        return f"  (unreadable: {exc})"
    return "\n".join(f"  {line}" for line in text.rstrip().splitlines()[-lines:]) or "  (empty)"
