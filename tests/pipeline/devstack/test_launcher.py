"""``rlpipe run``'s launcher: what it tells the user about the embedded stack it starts."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar

import pytest

from pipeline.devstack import launcher
from pipeline.devstack.dashboard import Dashboard
from pipeline.devstack.stack import StackState
from schemas.config import RunConfig, step_budget


def _state(home: Path) -> StackState:
    return StackState(pid=4242, bootstrap_servers="127.0.0.1:19092", store_root=(home / "store").as_uri(),
                      home=str(home), log_dir=str(home / "logs"), started_at=datetime.now(UTC))


def test_starting_the_embedded_stack_says_so_and_how_to_stop_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(launcher, "read_stack_state", lambda: None)
    monkeypatch.setattr(launcher, "start_background", lambda **kwargs: _state(tmp_path))
    with caplog.at_level(logging.INFO, logger="rlpipe.run"):
        started = launcher.ensure_stack(RunConfig())
    assert started is not None and started.pid == 4242
    text = caplog.text
    assert "started the embedded stack" in text and "127.0.0.1:19092" in text and "pid 4242" in text
    assert "rlpipe down" in text and "keeps running" in text


def test_a_stack_started_for_another_command_is_said_to_outlive_that_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """`rlpipe serve` starts the stack too, and is no run: the line says what the stack outlives."""
    monkeypatch.setattr(launcher, "read_stack_state", lambda: None)
    monkeypatch.setattr(launcher, "start_background", lambda **kwargs: _state(tmp_path))
    with caplog.at_level(logging.INFO, logger="rlpipe.run"):
        launcher.ensure_stack(RunConfig(), outlives="the server")
    assert "keeps running after the server stops" in caplog.text and "this run" not in caplog.text, caplog.text


def test_a_configured_or_running_broker_starts_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(**kwargs: object) -> StackState:
        raise AssertionError("no stack should be started")

    monkeypatch.setattr(launcher, "start_background", refuse)
    monkeypatch.setattr(launcher, "read_stack_state", lambda: _state(tmp_path))
    assert launcher.ensure_stack(RunConfig()) is None
    monkeypatch.setattr(launcher, "read_stack_state", lambda: None)
    assert launcher.ensure_stack(RunConfig.model_validate({"bus": {"bootstrap_servers": "kafka:9092"}})) is None


def test_a_ctrl_c_at_the_terminal_reaches_only_the_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The terminal sends Ctrl-C to its whole foreground process group: the learner and producers are in a group of
    their own, so they get one SIGTERM from the launcher (a clean stop) rather than SIGINT and then SIGTERM (an abort,
    and vLLM's engine process killed under the producer)."""
    import os
    import signal
    import sys

    monkeypatch.setattr(launcher, "rlpipe_command", lambda *args: [sys.executable, "-c", "import time; time.sleep(30)"])
    fake = launcher.Launcher.__new__(launcher.Launcher)
    fake.log_dir, fake.processes = tmp_path, {}
    fake.config = RunConfig()
    fake.bus = fake.config.bus.model_copy(update={"bootstrap_servers": "127.0.0.1:1"})
    fake.spawn("child")
    child = fake.processes["child"]
    try:
        assert os.getpgid(child.pid) != os.getpgid(0)
    finally:
        child.send_signal(signal.SIGTERM)
        child.wait()


def test_sigterm_and_sighup_stop_the_launcher_as_ctrl_c_does() -> None:
    """`kill` of the launcher (or its terminal closing) stops its processes too, instead of leaving them running."""
    import os
    import signal
    import time

    for sig in (signal.SIGTERM, signal.SIGHUP):
        before = signal.getsignal(sig)
        with pytest.raises(KeyboardInterrupt), launcher.stop_signals_interrupt():
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler runs at the next bytecode: this sleep is interrupted
            raise AssertionError("the signal did not interrupt")
        assert signal.getsignal(sig) == before  # put back afterwards


class Published:
    """Stands in for the event publisher: keeps what was published."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, topic: str, event) -> tuple[int, int]:
        self.events.append(event)
        return 0, len(self.events)


def packed_launcher(root: Path, budgets: dict[str, int]) -> launcher.Launcher:
    """A launcher of packed runs (run -> max_steps) on the store at ``root``, set up as far as announcing stops."""
    configs = [RunConfig.model_validate({"run_id": run, "learner": {"max_steps": steps}, "store": {"root": root.as_uri()}})
               for run, steps in budgets.items()]
    fake = launcher.Launcher.__new__(launcher.Launcher)
    fake.configs, fake.config = configs, configs[0]
    fake.boards = {c.run_id: Dashboard() for c in configs}
    fake.live, fake.step_lines = False, {}  # no view: the tests that want one set it up (``Launcher.views``)
    fake.stopped, fake.unbounded, fake.applied_changes, fake.unread_changes = {}, set(), {}, {}
    fake.producers_exited = fake.producers_done = False
    fake.catch_ups, fake.control_start_P = {}, {}
    return fake


def checkpoint_at(fake: launcher.Launcher, run: str, step: int) -> None:
    """A checkpoint of ``run`` at ``step`` in the launcher's store, as its learner writes one."""
    import torch

    from consumers.checkpoint import CheckpointStore
    from pipeline.runtime import open_store
    from schemas.checkpoint import LearnerState

    CheckpointStore(open_store(fake.config.store), run).save(LearnerState(step=step, version=step),
                                                             {"w": torch.zeros(1)}, {}, {})


def stopped_at_its_budget(fake: launcher.Launcher, run: str, step: int) -> tuple[Published, Callable[[int], None]]:
    """Views set up, ``run`` checkpointed at ``step`` (its budget) and its RunStopped read back from the feed; what
    was published, and a function that announces a checkpoint of ``run`` at a step."""
    from schemas.events import LearnerCheckpointed, make_event

    fake.views(dashboard=False)
    published = Published()

    def checkpointed(at: int) -> None:
        fake.on_control(make_event(run, LearnerCheckpointed(step=at, version=at, path=f"{run}{at}", offsets={})),
                        published)

    checkpointed(step)
    (first,) = published.events
    fake.on_control(first, published)  # its own stop, read back from the feed
    return published, checkpointed


def test_a_packed_run_that_reaches_its_budget_is_stopped_while_the_others_go_on(tmp_path: Path) -> None:
    """Packed runs of different kinds finish at different times: a finished run's RunStopped goes out at once (its
    producers let it go), and the shutdown announces only the runs still going."""
    from schemas.events import LearnerCheckpointed, RunStopped, make_event

    fake = packed_launcher(tmp_path, {"short": 2, "long": 5})
    published = Published()

    def checkpointed(run: str, step: int) -> None:
        fake.on_control(make_event(run, LearnerCheckpointed(step=step, version=step, path="x", offsets={})), published)

    checkpointed("short", 1)
    checkpointed("long", 2)
    assert published.events == []
    checkpointed("short", 2)
    checkpointed("short", 2)  # seen twice: announced once
    ((run, stopped),) = [(e.run_id, e.payload) for e in published.events]
    assert run == "short" and isinstance(stopped, RunStopped) and stopped.final_step == 2
    assert stopped.reason == "step budget reached"
    fake.announce_stops(published, {"learner": 0}, interrupted=False)
    assert [(e.run_id, e.payload.final_step, e.payload.reason) for e in published.events] == [
        ("short", 2, "step budget reached"), ("long", 2, "stopped")]


def test_each_run_the_launcher_stops_stays_stopped_for_packed_processes_started_later(tmp_path: Path) -> None:
    """The launcher's RunStopped is kept in the store as the run's newest membership event, as `rlpipe runs stop`
    keeps one: `rlpipe learner start --run a --run b` afterwards serves neither until `rlpipe runs resume`."""
    from pipeline.membership import recorded_membership, runs_not_stopped
    from pipeline.runtime import open_store
    from schemas.events import RunStopped

    fake = packed_launcher(tmp_path, {"a": 3, "b": 3})
    checkpoint_at(fake, "a", 3)
    fake.announce_stops(Published(), {"learner": 0}, interrupted=True)
    store = open_store(fake.config.store)
    recorded = {run: recorded_membership(store, run) for run in ("a", "b")}
    assert {run: (type(e.payload), e.payload.reason) for run, e in recorded.items() if e is not None} == {
        "a": (RunStopped, "step budget reached"), "b": (RunStopped, "stopped by Ctrl-C or a signal")}
    with pytest.raises(ValueError, match="every run named is stopped"):
        runs_not_stopped(fake.configs, None)


def test_the_stop_reason_says_why_each_run_stopped(tmp_path: Path) -> None:
    """A run interrupted before its budget is "stopped", never "step budget reached" (the learner exits 0 on a clean
    stop too); a failed process is named; the final step is the newest checkpoint's, even one the dashboard missed."""
    fake = packed_launcher(tmp_path / "store", {"done": 4, "cut": 4, "broken": 4})
    checkpoint_at(fake, "done", 4)  # written just before the learner exited
    published = Published()
    fake.announce_stops(published, {"learner": 0, "producer-0": 0}, interrupted=True)
    reasons = {e.run_id: (e.payload.reason, e.payload.final_step) for e in published.events}
    assert reasons == {"done": ("step budget reached", 4), "cut": ("stopped by Ctrl-C or a signal", 0),
                       "broken": ("stopped by Ctrl-C or a signal", 0)}
    failed, fake.stopped = Published(), {}
    fake.announce_stops(failed, {"learner": 0, "producer-0": 3}, interrupted=False)
    assert {e.run_id: e.payload.reason for e in failed.events}["cut"] == "producer-0 exited with 3"


class Flaky(Published):
    """A publisher whose first publish fails, as an unreachable broker's does."""

    def publish(self, topic: str, event) -> tuple[int, int]:
        if not getattr(self, "failed", False):
            self.failed = True
            raise OSError("broker unreachable")
        return super().publish(topic, event)


def test_without_a_terminal_the_dashboard_gives_way_to_one_line_per_learner_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run piped to a file or a CI log (standard output not a terminal, here pytest's capture) cannot show the
    live view, so its control events print one line per learner step, per run, instead of nothing for minutes."""
    from schemas.events import LearnerCheckpointed, LearnerProgress, make_event

    fake = packed_launcher(tmp_path, {"a": 3, "b": 3})
    fake.views(dashboard=True)
    assert not fake.live
    for run, payload in [("a", LearnerProgress(step=1, version=1, positions={})),
                         ("a", LearnerCheckpointed(step=1, version=1, path="x1", offsets={})),
                         ("b", LearnerCheckpointed(step=1, version=1, path="y1", offsets={})),
                         ("a", LearnerCheckpointed(step=2, version=2, path="x2", offsets={}))]:
        fake.on_control(make_event(run, payload), Published())
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[:2] for line in lines] == [["run a", "step 1/3"], ["run b", "step 1/3"],
                                                        ["run a", "step 2/3"]], lines


def test_a_stop_that_could_not_be_published_is_announced_again(tmp_path: Path) -> None:
    from schemas.events import LearnerCheckpointed, make_event

    fake = packed_launcher(tmp_path, {"a": 1, "b": 1})
    flaky = Flaky()
    with pytest.raises(OSError):
        fake.on_control(make_event("a", LearnerCheckpointed(step=1, version=1, path="x", offsets={})), flaky)
    fake.announce_stops(flaky, {"learner": 0}, interrupted=False)
    assert sorted((e.run_id, e.payload.reason) for e in flaky.events) == [
        ("a", "step budget reached"), ("b", "stopped")]


def test_a_packed_run_at_its_budget_in_the_store_is_stopped_even_if_its_event_was_missed(tmp_path: Path) -> None:
    """The dashboard's feed may miss an event; the store's newest checkpoint says the same and is looked at too."""
    fake = packed_launcher(tmp_path, {"a": 2, "b": 2})
    checkpoint_at(fake, "a", 2)
    published = Published()
    fake.stop_finished_runs(published)
    fake.stop_finished_runs(published)
    assert [(e.run_id, e.payload.final_step) for e in published.events] == [("a", 2)]


def test_the_processes_are_stopped_whatever_ends_the_watch(tmp_path: Path) -> None:
    fake = launcher.Launcher.__new__(launcher.Launcher)
    calls: list[str] = []
    fake.reach_broker = fake.prepare_model = fake.create = fake.mark_start = lambda: None
    fake.config_paths, fake.configs = [tmp_path / "a.yaml"], [RunConfig()]
    fake.config = fake.configs[0]
    fake.spawn = lambda *args: None
    fake.follow_control = lambda: None

    def broken_watch() -> None:
        raise RuntimeError("the terminal went away")

    fake.watch = broken_watch
    fake.shutdown = lambda interrupted=False: calls.append("shutdown") or 0
    with pytest.raises(RuntimeError):
        fake.run()
    assert calls == ["shutdown"]


def test_a_run_stopped_by_hand_is_not_announced_again_at_the_end(tmp_path: Path) -> None:
    from schemas.events import RunStopped, make_event

    fake = packed_launcher(tmp_path, {"a": 9, "b": 9})
    published = Published()
    fake.on_control(make_event("a", RunStopped(reason="stopped by rlpipe runs stop")), published)  # seen on the feed
    fake.announce_stops(published, {"learner": 0}, interrupted=False)
    assert [e.run_id for e in published.events] == ["b"]


def test_a_child_reads_the_broker_it_is_given_whatever_the_case_of_the_launchers_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's processes get the broker as RLPIPE_BUS__BOOTSTRAP_SERVERS; a lower-case spelling of it in the
    launcher's environment (overridden by --set) must not reach them too, where the two values would be refused."""
    from pipeline.config import env_layer, resolve_config

    monkeypatch.setenv("rlpipe_bus__bootstrap_servers", "kafka:9092")
    config = resolve_config("cartpole", overrides=["bus.bootstrap_servers=other:9093"])
    started: list[dict[str, str]] = []

    class Popen:
        pid = 1

        def __init__(self, args: list[str], env: dict[str, str], **kwargs: object) -> None:
            started.append(env)

    monkeypatch.setattr(launcher.subprocess, "Popen", Popen)
    spawner = launcher.Launcher.__new__(launcher.Launcher)  # its spawn only: no stack, no broker
    spawner.config, spawner.bus, spawner.log_dir, spawner.processes = config, config.bus, tmp_path, {}
    spawner.spawn("learner", "learner")
    assert env_layer(started[0])["bus"]["bootstrap_servers"] == "other:9093"


class PublisherStub(Published):
    """The event publisher as a context manager, for the launcher's shutdown."""

    def __init__(self, bus: object = None) -> None:
        super().__init__()

    def __enter__(self) -> PublisherStub:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def scripted_launcher(root: Path, monkeypatch: pytest.MonkeyPatch, scripts: dict[str, str]) -> launcher.Launcher:
    """A launcher whose learner and producer processes run ``scripts[kind]`` (python code) instead of rlpipe,
    with no model, no stack and no broker; its announcements go to a stub."""
    import sys

    monkeypatch.setattr(launcher, "rlpipe_command", lambda *args: [sys.executable, "-c", scripts[args[0]]])
    monkeypatch.setattr(launcher, "EventPublisher", PublisherStub)
    fake = packed_launcher(root, {"run-a": 5})
    fake.config = fake.config.model_copy(update={"num_producers": 2})
    fake.reach_broker = fake.prepare_model = fake.create = fake.mark_start = fake.follow_control = lambda: None
    fake.config_paths, fake.log_dir, fake.processes = [root / "a.yaml"], root, {}
    fake.bus = fake.config.bus.model_copy(update={"bootstrap_servers": "127.0.0.1:1"})
    fake.started_stack, fake.watcher = None, None
    fake.stopping = threading.Event()
    return fake


def _gone(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rpartition(")")[2].split()[0] in ("Z", "X")


def test_a_learner_that_dies_at_start_is_reported_with_its_log_and_the_producers_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    scripts = {"learner": "import sys; print('loading the config'); sys.exit('error: no such preset: cartpol')",
               "producer": "import time; time.sleep(60)"}
    fake = scripted_launcher(tmp_path, monkeypatch, scripts)
    with caplog.at_level(logging.INFO, logger="rlpipe.run"):
        assert fake.run() == 1
    assert set(fake.processes) == {"learner", "producer-0", "producer-1"}
    assert all(process.poll() is not None for process in fake.processes.values())
    failure = next(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "learner" in r.getMessage())
    assert "no such preset: cartpol" in failure and str(tmp_path / "learner.log") in failure


def test_a_ctrl_c_while_the_processes_start_stops_those_already_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = scripted_launcher(tmp_path, monkeypatch, {"learner": "import time; time.sleep(60)", "producer": "pass"})
    spawn = fake.spawn

    def interrupted_spawn(name: str, *args: str) -> None:
        if name == "producer-1":
            raise KeyboardInterrupt
        spawn(name, *args)

    fake.spawn = interrupted_spawn
    try:
        with contextlib.suppress(KeyboardInterrupt):  # not pytest's own: it would end the session
            fake.run()
        assert fake.processes["learner"].poll() is not None, "the learner was left running"
    finally:
        fake.processes["learner"].kill()
        fake.processes["learner"].wait()


LEAVES_A_GRANDCHILD = """
import signal, subprocess, sys, time
ignore = {ignore}
if ignore:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                               "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
print(grandchild.pid, flush=True)
time.sleep(60)
"""


def test_stopping_the_run_leaves_no_process_of_a_child_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that ignores SIGTERM is killed with its own processes (an engine process under a producer), and a
    child that stops leaves none of its processes running either."""
    scripts = {"learner": LEAVES_A_GRANDCHILD.format(ignore=True), "producer": LEAVES_A_GRANDCHILD.format(ignore=False)}
    fake = scripted_launcher(tmp_path, monkeypatch, scripts)
    fake.config = fake.config.model_copy(update={"num_producers": 1})
    fake.spawn("learner", "learner")
    fake.spawn("producer-0", "producer")
    grandchildren: list[int] = []
    try:
        for name in ("learner", "producer-0"):
            deadline = time.monotonic() + 20
            while not (tmp_path / f"{name}.log").read_text().strip() and time.monotonic() < deadline:
                time.sleep(0.05)
            grandchildren.append(int((tmp_path / f"{name}.log").read_text().split()[0]))
        fake.shutdown(timeout_s=1.0)
        deadline = time.monotonic() + 5
        while not all(map(_gone, grandchildren)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(map(_gone, grandchildren)), "a child's process outlived the run"
    finally:
        import os
        import signal

        for pid in grandchildren:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


class CatchUpAfter:
    """Stands in for ``LearnerCatchUp``: the learner has read every announced batch from the ``after``-th look on."""

    after: ClassVar[int] = 2
    made: ClassVar[list[str]] = []

    def __init__(self, bus: object, run_id: str, control_from_P: dict[int, int]) -> None:
        self.run_id, self.looks, self.closed = run_id, 0, False
        CatchUpAfter.made.append(run_id)

    def __call__(self) -> bool:
        self.looks += 1
        return self.looks >= self.after

    def close(self) -> None:
        self.closed = True


STOPS_CLEANLY_ON_SIGTERM = """
import signal, sys, time
def stop(signum, frame):
    open({mark!r}, "w").write("stopped")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
time.sleep(20)  # a learner below its max_steps waiting for batches that never come
sys.exit(3)
"""


def test_producers_that_wrote_their_max_groups_end_the_run_once_the_learner_has_read_their_batches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Every producer exits 0 (producer.max_groups) before the learner reaches learner.max_steps: the launcher says so
    in one line, waits until the learner has read what they wrote, then stops it with SIGTERM (which trains what is
    waiting, checkpoints and commits) and exits 0, instead of waiting for the learner for ever."""
    mark = tmp_path / "learner-stopped"
    scripts = {"learner": STOPS_CLEANLY_ON_SIGTERM.format(mark=str(mark)), "producer": "pass"}
    fake = scripted_launcher(tmp_path, monkeypatch, scripts)
    CatchUpAfter.made = []
    monkeypatch.setattr(launcher, "LearnerCatchUp", CatchUpAfter, raising=False)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="rlpipe.run"):
        code = fake.run()
    assert code == 0 and mark.read_text() == "stopped", (code, caplog.text)
    assert time.monotonic() - started < 15, "the launcher waited for the learner's own timeout"
    assert CatchUpAfter.made == ["run-a"]
    said = [r.getMessage() for r in caplog.records if "every producer" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and "producer.max_groups" in said[0], said
    assert fake.stopped == {"run-a": "every producer wrote its producer.max_groups groups"}


def test_a_producer_that_fails_still_stops_the_run_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One producer exits 0, the other fails: everything is stopped and reported (exit 1), nothing waits to catch up."""
    scripts = {"learner": "import time; time.sleep(20)",
               "producer": "import sys, time; time.sleep(1.0 if sys.argv[-1].endswith('p1') else 0); "
                           "sys.exit(2 if sys.argv[-1].endswith('p1') else 0)"}
    fake = scripted_launcher(tmp_path, monkeypatch, scripts)
    monkeypatch.setattr(launcher, "rlpipe_command", lambda *args: [__import__("sys").executable, "-c",
                                                                    scripts[args[0]], *args])
    CatchUpAfter.made = []
    monkeypatch.setattr(launcher, "LearnerCatchUp", CatchUpAfter, raising=False)
    monkeypatch.setattr(CatchUpAfter, "after", 10_000)  # never caught up: only the failure ends the watch
    started = time.monotonic()
    assert fake.run() == 1
    assert time.monotonic() - started < 15
    assert fake.processes["producer-1"].returncode == 2 and fake.processes["learner"].returncode != 0
    assert "max_groups" not in fake.stopped["run-a"]


def test_an_unreachable_broker_is_named_before_the_tiny_model_is_built(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The first build of the tiny model takes minutes: a broker that does not answer is found in seconds first."""
    from pipeline.devstack.process import free_port
    from pipeline.io.bus import BusUnavailableError

    def build(*args: str) -> list[str]:
        raise AssertionError("the tiny model was built before the broker was reached")

    monkeypatch.setattr(launcher, "rlpipe_command", build)
    fake = packed_launcher(tmp_path, {"run-a": 5})
    fake.bus = fake.config.bus.model_copy(update={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    with pytest.raises(BusUnavailableError, match="cannot reach Kafka"):
        fake.run()


def test_a_child_that_died_is_named_with_its_log_even_when_the_stop_cannot_be_announced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The broker gone (its stack stopped) is often why a child died: the run still names the child and the end of
    its log, says in one line that the runs' RunStopped could not go out, and exits 1 instead of a traceback."""
    from pipeline.io.bus import BusUnavailableError

    class Unreachable(PublisherStub):
        def __init__(self, bus: object = None) -> None:
            raise BusUnavailableError("cannot reach Kafka at 127.0.0.1:1: connection refused")

    scripts = {"learner": "import sys; sys.exit('error: lost the broker at 127.0.0.1:1')",
               "producer": "import time; time.sleep(60)"}
    fake = scripted_launcher(tmp_path, monkeypatch, scripts)
    monkeypatch.setattr(launcher, "EventPublisher", Unreachable)
    with caplog.at_level(logging.INFO, logger="rlpipe.run"):
        assert fake.run() == 1
    assert all(process.poll() is not None for process in fake.processes.values())
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("learner exited with 1" in e and "lost the broker" in e for e in errors), errors
    assert any("RunStopped" in e and "cannot reach Kafka" in e and "\n" not in e for e in errors), errors


def test_a_final_stop_the_store_cannot_keep_is_one_line_naming_runs_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The RunStopped is kept in the store before it is published: a store gone with the stack (here a root under a
    file, so every write fails with an OSError) ends in one line naming `rlpipe runs stop`, not a traceback."""
    (tmp_path / "gone").write_text("not a folder")
    fake = packed_launcher(tmp_path / "gone" / "store", {"a": 3})
    fake.bus = fake.config.bus
    monkeypatch.setattr(launcher, "EventPublisher", PublisherStub)
    with caplog.at_level(logging.ERROR, logger="rlpipe.run"):
        assert fake.announce_final_stops({"learner": 0}, interrupted=True) is False
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "RunStopped" in error and "for a:" in error and "rlpipe runs stop --run" in error and "\n" not in error


def test_a_final_stop_a_gcs_endpoint_refuses_is_one_line_naming_runs_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A GCS endpoint that answers with an error status fails the store's write with gcsfs's HttpError, which is
    no OSError: it too ends in one line naming `rlpipe runs stop`."""
    from gcsfs.retry import HttpError

    def refused(*args: object, **kwargs: object) -> None:
        raise HttpError({"code": 503, "message": "Service Unavailable"})

    fake = packed_launcher(tmp_path / "store", {"a": 3})
    fake.bus = fake.config.bus
    monkeypatch.setattr(launcher, "EventPublisher", PublisherStub)
    monkeypatch.setattr("pipeline.io.store.ObjectStore.put", refused)
    monkeypatch.setattr("pipeline.io.store.ObjectStore.put_create", refused, raising=False)
    with caplog.at_level(logging.ERROR, logger="rlpipe.run"):
        assert fake.announce_final_stops({"learner": 0}, interrupted=True) is False
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "RunStopped" in error and "Service Unavailable" in error and "rlpipe runs stop --run" in error


def test_without_a_terminal_every_learner_step_gets_its_line_however_fast_they_come(
        bus_config, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The plain lines promise one per step, the last one included: the launcher's feed of the control topic misses
    no event sent while it also reads the learner's lag (one checkpoint every 0.1 s, as a small model's steps are)."""
    from pipeline.io.bus import EventPublisher
    from pipeline.runtime import Announcer
    from schemas.events import LearnerCheckpointed

    steps = 40
    config = RunConfig.model_validate({"run_id": "r", "learner": {"max_steps": steps},
                                       "store": {"root": (tmp_path / "store").as_uri()}})
    fake = launcher.Launcher.__new__(launcher.Launcher)
    launcher.ControlFeed.__init__(fake, [config], bus_config, dashboard=False)  # the feed only: no processes
    fake.mark_start()  # the feed reads from here on, however long its follower takes to come up
    watcher = threading.Thread(target=fake.follow_control, daemon=True)
    watcher.start()
    try:
        with EventPublisher(bus_config) as publisher:
            announce = Announcer(publisher, "r")
            for step in range(1, steps + 1):
                announce(LearnerCheckpointed(step=step, version=step, path=f"c{step}", offsets={}))
                time.sleep(0.1)
        deadline = time.monotonic() + 10.0
        while fake.step_lines["r"].shown_step < steps and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        fake.stopping.set()
        watcher.join(timeout=10.0)
    assert not watcher.is_alive(), "the feed did not end once the run stopped"
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("run r ")]  # (not log lines)
    shown = [int(line.split("  ")[1].split()[1].split("/")[0]) for line in lines]
    assert shown == list(range(1, steps + 1)), f"missing steps {sorted(set(range(1, steps + 1)) - set(shown))}"


@pytest.mark.parametrize("skew_s", [-3600.0, 3600.0], ids=["clock-behind", "clock-ahead"])
def test_the_feed_reads_the_launchs_events_and_no_earlier_ones_whatever_the_launchers_clock(
        bus_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        skew_s: float) -> None:
    """The launcher's clock an hour off the one that stamped the control topic's events: an earlier launch's
    checkpoint (step 7) and RunStopped are still not read as this launch's, nor the launch's own RunStarted as a
    resume (its budget would then be read from a store that has none: ``step 1/∞``), and the launch's first
    checkpoint (step 1), published by its learner before the feed's follower is up, is still read."""
    import types

    from pipeline.devstack import control_feed
    from pipeline.io.bus import EventPublisher, ensure_topics
    from pipeline.runtime import Announcer
    from schemas.events import LearnerCheckpointed, RunStarted, RunStopped

    config = RunConfig.model_validate({"run_id": "r", "learner": {"max_steps": 9},
                                       "store": {"root": (tmp_path / "store").as_uri()}})
    ensure_topics(bus_config, ["control"])
    with EventPublisher(bus_config) as publisher:  # an earlier launch of the run, then this one's ``create``
        announce = Announcer(publisher, "r")
        announce(LearnerCheckpointed(step=7, version=7, path="c7", offsets={}))
        announce(RunStopped(reason="an earlier launch's stop", final_step=7, final_version=7))
        announce(RunStarted(config_path="runs/r/run.json", config_sha256="0" * 64, env="cartpole", base_model="tiny"))
    skewed = types.SimpleNamespace(time=lambda: time.time() + skew_s, monotonic=time.monotonic, sleep=time.sleep)
    monkeypatch.setattr(control_feed, "time", skewed)
    monkeypatch.setattr(launcher, "time", skewed)
    fake = launcher.Launcher.__new__(launcher.Launcher)
    launcher.ControlFeed.__init__(fake, [config], bus_config, dashboard=False)
    fake.config_paths = [tmp_path / "r.yaml"]

    def spawn(name: str, *args: str) -> None:  # the learner checkpoints before the feed's follower is up
        if name == "learner":
            with EventPublisher(bus_config) as learner_publisher:
                Announcer(learner_publisher, "r")(LearnerCheckpointed(step=1, version=1, path="c1", offsets={}))

    fake.spawn = spawn
    fake.launch()
    try:
        deadline = time.monotonic() + 10.0
        while fake.step_lines["r"].shown_step < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        fake.stopping.set()
        fake.watcher.join(timeout=10.0)
    lines = [line.split("  ")[1] for line in capsys.readouterr().out.splitlines() if line.startswith("run r ")]
    assert lines == ["step 1/9"], lines
    assert fake.stopped == {}, "an earlier launch's RunStopped was read as this launch's"


def test_a_resumed_runs_first_line_is_a_step_it_trains_not_the_one_it_stopped_at(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run stopped at step 25 (checkpoint_every 10: its stop wrote the checkpoint) and resumed with a larger budget
    says step 25 again while its learner waits for rows, and announces that checkpoint again after a crash: neither is
    a step of this launch, so the first line is step 26's."""
    from schemas.events import LearnerCheckpointed, LearnerProgress, make_event

    config = RunConfig.model_validate({"run_id": "r", "learner": {"max_steps": 60, "checkpoint_every": 10},
                                       "store": {"root": (tmp_path / "store").as_uri()}})
    fake = packed_launcher(tmp_path / "store", {"r": 60})
    fake.configs, fake.config = [config], config
    checkpoint_at(fake, "r", 25)
    fake.views(dashboard=False)
    for payload in [LearnerProgress(step=25, version=25, positions={}),
                    LearnerCheckpointed(step=25, version=25, path="c25", offsets={}),
                    LearnerProgress(step=26, version=26, positions={})]:
        fake.on_control(make_event("r", payload), Published())
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[1] for line in lines] == ["step 26/60"], lines


def test_the_feed_stops_a_packed_run_whose_checkpoint_at_its_budget_it_reads(bus_config, tmp_path: Path) -> None:
    """The follower that feeds the lines also reads each packed run's checkpoints: one at its budget gets the run's
    RunStopped at once (long before the store is looked at), while the other run goes on."""
    from pipeline.io.bus import EventPublisher
    from pipeline.runtime import Announcer
    from schemas.events import LearnerCheckpointed

    fake = packed_launcher(tmp_path / "store", {"a": 2, "b": 5})
    fake.bus = bus_config
    fake.stopping = threading.Event()
    fake.mark_start()
    watcher = threading.Thread(target=fake.follow_control, daemon=True)
    watcher.start()
    try:
        with EventPublisher(bus_config) as publisher:
            for run, step in (("a", 1), ("b", 1), ("a", 2), ("b", 2)):
                Announcer(publisher, run)(LearnerCheckpointed(step=step, version=step, path=f"{run}{step}", offsets={}))
        deadline = time.monotonic() + 5.0
        while "a" not in fake.stopped and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        fake.stopping.set()
        watcher.join(timeout=10.0)
    assert fake.stopped == {"a": "step budget reached"}


def test_a_packed_run_resumed_with_a_raised_budget_is_stopped_again_at_the_new_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run a (budget 2) is stopped at step 2 while `rlpipe run` is open; its budget is raised to 4 in the store
    and `rlpipe runs resume` announces it again: the launcher reads the new budget from the store with the
    RunStarted, so step 3 is no end (its line says 3/4) and step 4 gets a second RunStopped."""
    from pipeline.runtime import create_run, open_store, record_config_change, started_again
    from schemas.events import RunStopped, make_event

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})
    store = open_store(fake.config.store)
    create_run(store, fake.configs[0], "tiny")
    published, checkpointed = stopped_at_its_budget(fake, "a", 2)
    (first,) = published.events  # a's stop at its budget
    raised = fake.configs[0].model_copy(update={"learner": fake.configs[0].learner.model_copy(update={"max_steps": 4})})
    record_config_change(store, raised)
    fake.on_control(make_event("a", started_again(store, "a")), published)
    checkpointed(3)
    assert published.events == [first]
    assert fake.boards["a"].ended(step_budget(fake.configs[0])) is None
    checkpointed(4)
    stops = [e.payload for e in published.events if isinstance(e.payload, RunStopped)]
    assert [(s.final_step, s.reason) for s in stops] == [(2, "step budget reached"), (4, "step budget reached")]
    lines = [line.split("  ")[1] for line in capsys.readouterr().out.splitlines() if line.startswith("run a ")]
    assert lines == ["step 2/2", "step 3/4", "step 4/4"], lines


def test_the_live_view_of_a_run_resumed_with_a_raised_budget_shows_the_new_budget(tmp_path: Path) -> None:
    """Run a (budget 2) stopped by hand at step 1, its budget raised to 4 and resumed: at step 2 its panel says 2/4
    and its producer's row shows the producer's rates, not ``done`` at the launch's budget."""
    from rich.console import Console

    from pipeline.runtime import create_run, open_store, record_config_change, started_again
    from schemas.events import LearnerCheckpointed, ProducerHeartbeat, RunStopped, make_event

    fake = packed_launcher(tmp_path, {"a": 2})
    store = open_store(fake.config.store)
    create_run(store, fake.config, "tiny")
    raised = fake.config.model_copy(update={"learner": fake.config.learner.model_copy(update={"max_steps": 4})})
    record_config_change(store, raised)
    beat = ProducerHeartbeat(producer_id="a-p0", adapter_version=2, samples_total=8, batches_total=1,
                             tokens_total=100, env_steps_total=8, samples_per_s=2.5, tokens_per_s=40.0,
                             env_steps_per_s=2.5, busy_fraction=0.5, interval_s=5.0)
    for payload in (LearnerCheckpointed(step=1, version=1, path="a1", offsets={}),
                    RunStopped(reason="stopped by rlpipe runs stop", final_step=1), started_again(store, "a"),
                    LearnerCheckpointed(step=2, version=2, path="a2", offsets={}), beat):
        fake.on_control(make_event("a", payload), Published())
    console = Console(width=200, record=True)
    console.print(fake.render())
    text = console.export_text()
    (row,) = [line for line in text.splitlines() if "a-p0" in line]
    assert "learner step 2/4" in text and "done" not in row and "2.50" in row, text


def test_a_run_resumed_whose_budget_cannot_be_read_is_not_stopped_again_at_the_launchs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Without a readable stored configuration the new budget is unknown, and the launch's may be the one the run
    was stopped at: stopping it there again would end the resumed run at once, so the launcher says so and leaves
    it to run."""
    from schemas.events import LearnerCheckpointed, RunStarted, make_event

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})  # no run.json in the store
    published = Published()
    fake.on_control(make_event("a", LearnerCheckpointed(step=2, version=2, path="a2", offsets={})), published)
    started = RunStarted(config_path="runs/a/run.json", config_sha256="0" * 64, env="cartpole", base_model="tiny")
    with caplog.at_level(logging.WARNING, logger="rlpipe.run"):
        fake.on_control(make_event("a", started), published)
    fake.on_control(make_event("a", LearnerCheckpointed(step=3, version=3, path="a3", offsets={})), published)
    fake.stop_finished_runs(published)
    assert [e.payload.final_step for e in published.events] == [2]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "run a was started again" in warning and "no run.json" in warning, warning


def test_a_run_resumed_whose_budget_cannot_be_read_still_gets_its_final_stop(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run a (budget 2) stopped at step 2, then resumed without a readable stored configuration: it goes on past the
    launch's budget (its lines name none), and when the launch ends (here a Ctrl-C) it gets its final RunStopped like
    any run still going, at its newest step, for the reason the launch ended (its own budget is unknown)."""
    from schemas.events import RunStarted, RunStopped, make_event

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})  # no run.json in the store
    published, checkpointed = stopped_at_its_budget(fake, "a", 2)
    started = RunStarted(config_path="runs/a/run.json", config_sha256="0" * 64, env="cartpole", base_model="tiny")
    fake.on_control(make_event("a", started), published)
    checkpointed(3)
    assert "a" not in fake.stopped, "a run going on is counted as let go (``_caught_up``)"
    fake.announce_stops(published, {"learner": 0}, interrupted=True)
    stops = [(e.run_id, e.payload.final_step, e.payload.reason) for e in published.events
             if isinstance(e.payload, RunStopped)]
    assert stops == [("a", 2, "step budget reached"), ("a", 3, "stopped by Ctrl-C or a signal"),
                     ("b", 0, "stopped by Ctrl-C or a signal")], stops
    lines = [line.split("  ")[1] for line in capsys.readouterr().out.splitlines() if line.startswith("run a ")]
    assert lines == ["step 2/2", "step 3/∞"], lines


def test_a_resumed_runs_lines_and_board_follow_its_stored_checkpoint_interval_and_heartbeat(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run a checkpointed every step (each line from its LearnerCheckpointed) is resumed with learner.checkpoint_every
    5 and producer.heartbeat_interval_s 20: steps 3 and 4 get their lines from LearnerProgress (no checkpoint comes for
    them), and its producers are called silent after 3 x 20 = 60 s, not the launch's 30 s."""
    from pipeline.runtime import create_run, open_store, record_config_change, started_again
    from schemas.events import LearnerCheckpointed, LearnerProgress, make_event

    fake = packed_launcher(tmp_path, {"a": 9, "b": 9})
    store = open_store(fake.config.store)
    create_run(store, fake.configs[0], "tiny")
    fake.views(dashboard=False)
    assert fake.boards["a"].silent_after_s == 30.0
    changed = fake.configs[0].model_copy(update={
        "learner": fake.configs[0].learner.model_copy(update={"checkpoint_every": 5}),
        "producer": fake.configs[0].producer.model_copy(update={"heartbeat_interval_s": 20.0})})
    record_config_change(store, changed)
    for payload in (LearnerCheckpointed(step=2, version=2, path="a2", offsets={}), started_again(store, "a"),
                    LearnerProgress(step=3, version=3, positions={}), LearnerProgress(step=4, version=4, positions={}),
                    LearnerProgress(step=5, version=5, positions={}),
                    LearnerCheckpointed(step=5, version=5, path="a5", offsets={})):
        fake.on_control(make_event("a", payload), Published())
    lines = [line.split("  ")[1] for line in capsys.readouterr().out.splitlines() if line.startswith("run a ")]
    assert lines == ["step 2/9", "step 3/9", "step 4/9", "step 5/9"], lines
    assert fake.boards["a"].silent_after_s == 60.0


def make_checkpoint(run: str, step: int):
    """The event of ``run``'s checkpoint at ``step``."""
    from schemas.events import LearnerCheckpointed, make_event

    return make_event(run, LearnerCheckpointed(step=step, version=step, path=f"{run}{step}", offsets={}))


def budget_changed(fake: launcher.Launcher, run: str, max_steps: int):
    """``run``'s budget changed to ``max_steps`` in the store, as a restart with that configuration records it; the
    ``RunConfigChanged`` event announcing it."""
    from pipeline.runtime import open_store, record_config_change
    from schemas.events import make_event

    config = next(c for c in fake.configs if c.run_id == run)
    changed = config.model_copy(update={"learner": config.learner.model_copy(update={"max_steps": max_steps})})
    _, _, change = record_config_change(open_store(fake.config.store), changed)
    return make_event(run, change)


def test_a_packed_runs_budget_raised_while_it_goes_is_the_one_it_is_stopped_at(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run a (budget 2) at step 1 has its budget raised to 4 (``RunConfigChanged``, no new start): step 2 is no end
    (its line says 2/4), step 4 is."""
    from pipeline.runtime import create_run, open_store
    from schemas.events import RunStopped

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})
    create_run(open_store(fake.config.store), fake.configs[0], "tiny")
    fake.views(dashboard=False)
    published = Published()
    fake.on_control(budget_changed(fake, "a", 4), published)
    for step in (1, 2, 3):
        fake.on_control(make_checkpoint("a", step), published)
    assert published.events == [] and step_budget(fake.configs[0]) == 4
    fake.on_control(make_checkpoint("a", 4), published)
    assert [(e.run_id, e.payload.final_step, e.payload.reason) for e in published.events
            if isinstance(e.payload, RunStopped)] == [("a", 4, "step budget reached")]
    lines = [line.split("  ")[1] for line in capsys.readouterr().out.splitlines() if line.startswith("run a ")]
    assert lines == ["step 1/4", "step 2/4", "step 3/4", "step 4/4"], lines


def test_a_packed_runs_budget_lowered_below_its_step_stops_it_at_once(tmp_path: Path) -> None:
    """Run a (budget 9) at step 3 has its budget lowered to 2: it is past it, so its RunStopped goes out with the
    change, at step 3, while run b goes on."""
    from pipeline.runtime import create_run, open_store

    fake = packed_launcher(tmp_path, {"a": 9, "b": 9})
    create_run(open_store(fake.config.store), fake.configs[0], "tiny")
    fake.views(dashboard=False)
    published = Published()
    fake.on_control(make_checkpoint("a", 3), published)
    fake.on_control(budget_changed(fake, "a", 2), published)
    assert [(e.run_id, e.payload.final_step, e.payload.reason) for e in published.events] == [
        ("a", 3, "step budget reached")]
    assert fake.stopped == {"a": "step budget reached"}


def test_a_budget_raised_after_the_run_was_stopped_at_its_old_one_does_not_start_it_again(
        tmp_path: Path) -> None:
    """A change is no start: run a, stopped at its budget 2, stays stopped when its budget is raised to 4; the new
    budget is the one it is stopped at once `rlpipe runs resume` starts it again."""
    from pipeline.runtime import create_run, open_store, started_again
    from schemas.events import RunStopped, make_event

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})
    store = open_store(fake.config.store)
    create_run(store, fake.configs[0], "tiny")
    published, checkpointed = stopped_at_its_budget(fake, "a", 2)
    (first,) = published.events
    fake.on_control(budget_changed(fake, "a", 4), published)
    assert published.events == [first] and "a" in fake.stopped and step_budget(fake.configs[0]) == 4
    fake.on_control(make_event("a", started_again(store, "a")), published)
    checkpointed(3)
    checkpointed(4)
    stops = [e.payload.final_step for e in published.events if isinstance(e.payload, RunStopped)]
    assert stops == [2, 4], stops


def test_a_change_whose_record_is_not_the_one_announced_leaves_the_run_without_a_budget(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    """A RunConfigChanged whose record is missing or holds other bytes than its sha256 says gives no budget to trust,
    and the launch's may be below the new one: as for a start whose configuration cannot be read, the run is not
    stopped at a budget, and says so."""
    from pipeline.runtime import create_run, open_store
    from schemas.events import RunConfigChanged, make_event

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9, "c": 2})
    create_run(open_store(fake.config.store), fake.configs[0], "tiny")
    fake.views(dashboard=False)
    published = Published()
    announced = budget_changed(fake, "a", 4)
    forged = announced.payload.model_copy(update={"config_sha256": "0" * 64})
    missing = RunConfigChanged(config_path="runs/c/config-changes/000001.json", config_sha256="0" * 64,
                               changes=announced.payload.changes)
    with caplog.at_level(logging.WARNING, logger="rlpipe.run"):
        fake.on_control(make_event("a", forged), published)
        fake.on_control(make_event("c", missing), published)
    for run in ("a", "c"):
        fake.on_control(make_checkpoint(run, 2), published)
    fake.stop_finished_runs(published)
    assert published.events == [] and fake.unbounded == {"a", "c"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w.split(",")[0] for w in warnings] == ["run a's configuration changed", "run c's configuration changed"]
    assert "checksum mismatch" in warnings[0] and "no object" in warnings[1], warnings
    assert all("it changed learner.max_steps" in w and "keeps the run unbounded" in w for w in warnings), warnings
    lines = [line.split("  ")[1] for line in capsys.readouterr().out.splitlines() if line.startswith("run a ")]
    assert lines == ["step 2/∞"], lines


def test_changes_read_out_of_order_leave_the_newest_ones_budget(tmp_path: Path) -> None:
    """Two restarts record changes 000001 (budget 4) and 000002 (budget 6) of run a and publish them in either
    order: read 2 then 1, the budget is change 2's (the stored configuration's), not that of the one read last, so
    step 4 is no end and step 6 is."""
    from pipeline.runtime import create_run, open_store

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})
    create_run(open_store(fake.config.store), fake.configs[0], "tiny")
    fake.views(dashboard=False)
    published = Published()
    first, second = budget_changed(fake, "a", 4), budget_changed(fake, "a", 6)
    assert [e.payload.config_path.rsplit("/", 1)[1] for e in (first, second)] == ["000001.json", "000002.json"]
    fake.on_control(second, published)
    fake.on_control(first, published)
    fake.on_control(make_checkpoint("a", 4), published)
    assert published.events == [] and step_budget(fake.configs[0]) == 6
    fake.on_control(make_checkpoint("a", 6), published)
    assert [(e.run_id, e.payload.final_step) for e in published.events] == [("a", 6)]


def test_a_change_older_than_a_starts_reread_configuration_is_ignored(tmp_path: Path) -> None:
    """Run a started again (``RunStarted``) re-reads its newest change (000002, budget 6); change 000001's event
    (budget 4), read after it, is older than that and lowers nothing."""
    from pipeline.runtime import create_run, open_store, started_again
    from schemas.events import make_event

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})
    store = open_store(fake.config.store)
    create_run(store, fake.configs[0], "tiny")
    fake.views(dashboard=False)
    published = Published()
    first, _ = budget_changed(fake, "a", 4), budget_changed(fake, "a", 6)
    fake.on_control(make_event("a", started_again(store, "a")), published)
    fake.on_control(first, published)
    fake.on_control(make_checkpoint("a", 4), published)
    assert published.events == [] and step_budget(fake.configs[0]) == 6


def test_a_change_older_than_the_one_the_launch_recorded_is_ignored(bus_config, tmp_path: Path) -> None:
    """Another process recorded change 000001 of run a (budget 4); the launch's own configuration (budget 6) is
    recorded as 000002 when it creates its runs, so 000001's event, read once the launch runs, is older and ignored."""
    from pipeline.runtime import create_run, open_store, record_config_change
    from schemas.events import make_event

    store_root = {"root": (tmp_path / "store").as_uri()}
    configs = [RunConfig.model_validate({"run_id": run, "learner": {"max_steps": steps}, "store": store_root})
               for run, steps in (("a", 6), ("b", 9))]
    store = open_store(configs[0].store)
    create_run(store, configs[0].model_copy(update={"learner": configs[0].learner.model_copy(update={"max_steps": 2})}),
               "tiny")
    _, _, other = record_config_change(
        store, configs[0].model_copy(update={"learner": configs[0].learner.model_copy(update={"max_steps": 4})}))
    fake = launcher.Launcher.__new__(launcher.Launcher)
    launcher.ControlFeed.__init__(fake, configs, bus_config, dashboard=False)  # the feed only: no processes
    fake.create()
    assert fake.applied_changes == {"a": 2}
    published = Published()
    fake.on_control(make_event("a", other), published)
    fake.on_control(make_checkpoint("a", 4), published)
    assert published.events == [] and step_budget(fake.configs[0]) == 6


def test_an_unreadable_change_that_leaves_the_budget_alone_keeps_the_budget(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A RunConfigChanged whose record does not match its sha256 but whose changes are only
    learner.learning_rate says the budget is what it was: run a keeps its budget 2 (with a warning) and is stopped
    there."""
    from pipeline.runtime import create_run, open_store, record_config_change
    from schemas.events import make_event

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})
    store = open_store(fake.config.store)
    config = fake.configs[0]
    create_run(store, config, "tiny")
    fake.views(dashboard=False)
    published = Published()
    faster = config.model_copy(update={"learner": config.learner.model_copy(update={"learning_rate": 3e-5})})
    _, _, change = record_config_change(store, faster)
    assert [c.field for c in change.changes] == ["learner.learning_rate"]
    forged = change.model_copy(update={"config_sha256": "0" * 64})
    with caplog.at_level(logging.WARNING, logger="rlpipe.run"):
        fake.on_control(make_event("a", forged), published)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "checksum mismatch" in warnings[0], warnings
    assert fake.unbounded == set() and step_budget(fake.configs[0]) == 2
    fake.on_control(make_checkpoint("a", 2), published)
    assert [(e.run_id, e.payload.final_step) for e in published.events] == [("a", 2)]


def budget_and_learning_rate_changed(fake: launcher.Launcher, run: str, max_steps: int):
    """``run``'s changes 000001 (budget ``max_steps``) and 000002 (learning rate only, on top of 000001) in the
    store; their events, the second's sha256 forged so that its record cannot be read."""
    from pipeline.runtime import open_store, record_config_change
    from schemas.events import make_event

    raised = budget_changed(fake, run, max_steps)
    config = next(c for c in fake.configs if c.run_id == run)
    faster = config.model_copy(update={"learner": config.learner.model_copy(
        update={"max_steps": max_steps, "learning_rate": 3e-5})})
    _, _, change = record_config_change(open_store(fake.config.store), faster)
    assert [c.field for c in change.changes] == ["learner.learning_rate"]  # relative to 000001, not to run.json
    return raised, make_event(run, change.model_copy(update={"config_sha256": "0" * 64}))


def test_an_unreadable_change_read_before_the_budget_change_it_follows_leaves_the_run_without_a_budget(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Change 000001 raises run a's budget from 2 to 6; 000002 changes only the learning rate and its record cannot
    be read.  Read 2 first, its changes say nothing of the budget the launch follows (run.json's, 2), only of
    000001's: the run is left without a budget, so step 2 is no end, and 000001, read after, is older and ignored.
    A warning says the first; an info line the second (events in either order are normal)."""
    from pipeline.runtime import create_run, open_store

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})
    create_run(open_store(fake.config.store), fake.configs[0], "tiny")
    fake.views(dashboard=False)
    published = Published()
    raised, unreadable = budget_and_learning_rate_changed(fake, "a", 6)
    with caplog.at_level(logging.INFO, logger="rlpipe.run"):
        fake.on_control(unreadable, published)
        fake.on_control(make_checkpoint("a", 2), published)
        fake.on_control(raised, published)
    fake.stop_finished_runs(published)
    assert published.events == [] and fake.unbounded == {"a"}
    (unbounded,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "read before change 1" in unbounded and "keeps the run unbounded" in unbounded, unbounded
    (ignored,) = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "older" in r.getMessage()]
    assert "000001.json" in ignored and "follows change 2" in ignored and "ignored" in ignored, ignored
    assert "unbounded" not in ignored and "ignored" not in unbounded


def test_an_unreadable_change_read_after_the_budget_change_it_follows_keeps_that_budget(tmp_path: Path) -> None:
    """The same changes read in order: 000002 follows 000001, the change the launch follows, and leaves the budget
    alone, so the run keeps 000001's budget 6: step 2 is no end, step 6 is."""
    from pipeline.runtime import create_run, open_store

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})
    create_run(open_store(fake.config.store), fake.configs[0], "tiny")
    fake.views(dashboard=False)
    published = Published()
    raised, unreadable = budget_and_learning_rate_changed(fake, "a", 6)
    fake.on_control(raised, published)
    fake.on_control(unreadable, published)
    fake.on_control(make_checkpoint("a", 2), published)
    assert published.events == [] and fake.unbounded == set() and step_budget(fake.configs[0]) == 6
    assert fake.applied_changes == {"a": 2}  # a third change that leaves the budget alone follows this one
    fake.on_control(make_checkpoint("a", 6), published)
    assert [(e.run_id, e.payload.final_step) for e in published.events] == [("a", 6)]


def test_a_change_naming_another_runs_record_is_refused_in_one_unnested_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A RunConfigChanged of run a whose config_path is run b's change record is refused: the warning names the
    path and says once what cannot be read, with no fix meant for a damaged run.json."""
    from pipeline.runtime import create_run, open_store
    from schemas.events import make_event

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})
    store = open_store(fake.config.store)
    for config in fake.configs:
        create_run(store, config, "tiny")
    fake.views(dashboard=False)
    others = budget_changed(fake, "b", 4)
    with caplog.at_level(logging.WARNING, logger="rlpipe.run"):
        fake.on_control(make_event("a", others.payload), Published())
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "runs/b/config-changes/000001.json" in warning and warning.count("cannot be read") <= 1, warning
    assert "rlpipe runs create" not in warning, warning
    assert fake.unbounded == {"a"} and [step_budget(c) for c in fake.configs] == [2, 9]


def test_a_change_of_a_run_the_launch_does_not_follow_is_ignored(tmp_path: Path) -> None:
    """Another run's RunConfigChanged on the shared control topic changes nothing of this launch's runs."""
    from pipeline.runtime import create_run, open_store, record_config_change
    from schemas.events import make_event

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})
    store = open_store(fake.config.store)
    other = RunConfig.model_validate({"run_id": "other", "learner": {"max_steps": 9},
                                      "store": {"root": tmp_path.as_uri()}})
    create_run(store, other, "tiny")
    lowered_config = other.model_copy(update={"learner": other.learner.model_copy(update={"max_steps": 1})})
    _, _, lowered = record_config_change(store, lowered_config)
    change = make_event("other", lowered)
    fake.views(dashboard=False)
    published = Published()
    fake.on_control(change, published)
    fake.on_control(make_checkpoint("a", 1), published)
    assert published.events == [] and [step_budget(c) for c in fake.configs] == [2, 9] and fake.unbounded == set()


def test_a_launcher_of_packed_runs_sets_up_its_feed_with_a_view_per_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A configured broker starts no stack; each run gets its board (silent after 3 of its own heartbeats) and its
    plain lines (its own budget and checkpoint interval), and nothing is stopped yet."""
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    configs = [RunConfig.model_validate({"run_id": run, "bus": {"bootstrap_servers": "kafka:9092"},
                                         "store": {"root": (tmp_path / "store").as_uri()},
                                         "learner": {"max_steps": steps, "checkpoint_every": every},
                                         "producer": {"heartbeat_interval_s": beat}})
               for run, steps, every, beat in (("a", 4, 2, 20.0), ("b", 6, 3, 1.0))]
    fed = launcher.Launcher(configs, dashboard=False)
    assert fed.started_stack is None and fed.bus.bootstrap_servers == "kafka:9092" and fed.packed
    assert [(lines.max_steps, lines.checkpoint_every) for lines in fed.step_lines.values()] == [(4, 2), (6, 3)]
    assert [board.silent_after_s for board in fed.boards.values()] == [60.0, 30.0]
    assert fed.stopped == {} and fed.unbounded == set() and not fed.stopping.is_set()
    assert [path.parent.name for path in fed.config_paths] == ["a", "b"]
    with pytest.raises(ValueError, match="no run"):
        launcher.Launcher([], dashboard=False)


def started_with_an_unreadable_newest_change(fake: launcher.Launcher, run: str, published: Published):
    """``run``'s changes 000001 (budget 4) and 000002 (budget 6) in the store, 000002's record then damaged, and
    ``rlpipe runs resume``'s ``RunStarted`` of ``run`` read by the feed; 000001's event, and a function that mends
    000002's record."""
    from pipeline.runtime import open_store
    from schemas.events import RunStarted, make_event

    store = open_store(fake.config.store)
    first, second = budget_changed(fake, run, 4), budget_changed(fake, run, 6)
    key = second.payload.config_path
    record = store.get(key)
    store.put(key, b"{not json")
    started = RunStarted(config_path=key, config_sha256=second.payload.config_sha256, env="cartpole",
                         base_model="tiny")
    fake.on_control(make_event(run, started), published)
    return first, lambda: store.put(key, record)


def test_a_change_older_than_an_unreadable_starts_newest_is_ignored(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Run a is started again while its newest change, 000002 (budget 6), cannot be read: the run is kept unbounded,
    and the listing of its changes still says 000002 is the newest, so 000001's event (budget 4), read after, is
    older and ignored (step 4 is no end), with a warning that says so.  A later change (000003, budget 8, once 000002
    is mended) bounds the run again."""
    from pipeline.runtime import create_run, open_store

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})
    create_run(open_store(fake.config.store), fake.configs[0], "tiny")
    fake.views(dashboard=False)
    published = Published()
    with caplog.at_level(logging.INFO, logger="rlpipe.run"):
        first, mend = started_with_an_unreadable_newest_change(fake, "a", published)
        fake.on_control(first, published)
    fake.on_control(make_checkpoint("a", 4), published)
    fake.stop_finished_runs(published)
    assert published.events == [] and fake.unbounded == {"a"} and fake.applied_changes == {"a": 2}
    assert step_budget(fake.configs[0]) == 2, "the launch's configuration, kept apart as unbounded"
    (started,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    (ignored,) = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "older" in r.getMessage()]
    assert "run a was started again" in started and "unbounded" in started, started
    assert "000001.json" in ignored and "change 2" in ignored and "ignored" in ignored, ignored
    mend()
    fake.on_control(budget_changed(fake, "a", 8), published)
    fake.on_control(make_checkpoint("a", 6), published)
    assert published.events == [] and fake.unbounded == set() and fake.applied_changes == {"a": 3}
    fake.on_control(make_checkpoint("a", 8), published)
    assert [(e.run_id, e.payload.final_step) for e in published.events] == [("a", 8)]


def started_on_an_unreadable_change(root: Path):
    """A packed launch of runs a (budget 2) and b whose run a has changes 000001 (budget 4) and 000002 (budget 6), and
    is started again while 000002's record cannot be read: (the launcher, its store, what it published, 000002's
    event, 000002's record to put back)."""
    from pipeline.runtime import create_run, open_store
    from schemas.events import RunStarted, make_event

    fake = packed_launcher(root, {"a": 2, "b": 9})
    store = open_store(fake.config.store)
    create_run(store, fake.configs[0], "tiny")
    fake.views(dashboard=False)
    published = Published()
    budget_changed(fake, "a", 4)
    second = budget_changed(fake, "a", 6)
    key = second.payload.config_path
    record = store.get(key)
    store.put(key, b"{not json")
    fake.on_control(make_event("a", RunStarted(config_path=key, config_sha256=second.payload.config_sha256,
                                               env="cartpole", base_model="tiny")), published)
    return fake, store, published, second, record


def test_the_newest_change_a_start_could_not_read_is_followed_when_its_own_event_comes(tmp_path: Path) -> None:
    """Run a is started again while its newest change, 000002 (budget 6), cannot be read (a store that failed for a
    moment): the run is kept unbounded.  000002's own event, read once its record can be read again, is no older than
    the change the listing named, but it was never read: it is followed, and bounds the run at 6."""
    fake, store, published, second, record = started_on_an_unreadable_change(tmp_path)
    assert fake.unbounded == {"a"}
    store.put(second.payload.config_path, record)
    fake.on_control(second, published)
    assert fake.unbounded == set() and fake.applied_changes == {"a": 2}
    fake.on_control(make_checkpoint("a", 4), published)
    fake.stop_finished_runs(published)
    assert published.events == []
    fake.on_control(make_checkpoint("a", 6), published)
    assert [(e.run_id, e.payload.final_step) for e in published.events] == [("a", 6)]


def test_a_start_s_unread_change_read_after_a_later_change_is_ignored(tmp_path: Path) -> None:
    """A start cannot read change 000002 (budget 6); change 000003 (budget 8), recorded after it, follows, unreadable
    too; 000002's own event, late, is older than the change followed now and is ignored: the run is not stopped
    at 6."""
    fake, store, published, second, record = started_on_an_unreadable_change(tmp_path)
    records = {second.payload.config_path: record}
    store.put(second.payload.config_path, records[second.payload.config_path])
    third = budget_changed(fake, "a", 8)  # recorded after the start
    records[third.payload.config_path] = store.get(third.payload.config_path)
    store.put(third.payload.config_path, b"{not json")
    fake.on_control(third, published)
    store.put(third.payload.config_path, records[third.payload.config_path])
    fake.on_control(second, published)
    assert fake.applied_changes == {"a": 3} and fake.unbounded == {"a"}
    fake.on_control(make_checkpoint("a", 6), published)
    fake.stop_finished_runs(published)
    assert published.events == []


def test_an_unreadable_change_that_leaves_the_budget_alone_keeps_an_unreadable_starts_run_unbounded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """After a start whose newest change (000002) cannot be read, change 000003 (learning rate only, its record
    unreadable too) is the next one: it leaves the budget alone, and that budget is none, so the run stays
    unbounded (its warning says so) rather than going back to the launch's budget 2."""
    from pipeline.runtime import create_run, open_store, record_config_change
    from schemas.events import make_event

    fake = packed_launcher(tmp_path, {"a": 2, "b": 9})
    store = open_store(fake.config.store)
    config = fake.configs[0]
    create_run(store, config, "tiny")
    fake.views(dashboard=False)
    published = Published()
    _, mend = started_with_an_unreadable_newest_change(fake, "a", published)
    mend()  # 000003 is recorded on top of it; its own record is the unreadable one
    faster = config.model_copy(update={"learner": config.learner.model_copy(
        update={"max_steps": 6, "learning_rate": 3e-5})})
    _, _, change = record_config_change(store, faster)
    assert change.config_path.endswith("000003.json") and [c.field for c in change.changes] == [
        "learner.learning_rate"]
    with caplog.at_level(logging.WARNING, logger="rlpipe.run"):
        fake.on_control(make_event("a", change.model_copy(update={"config_sha256": "0" * 64})), published)
    fake.on_control(make_checkpoint("a", 2), published)
    fake.stop_finished_runs(published)
    assert published.events == [] and fake.unbounded == {"a"} and fake.applied_changes == {"a": 3}
    *_, warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "checksum mismatch" in warning and "stays unbounded" in warning, warning
