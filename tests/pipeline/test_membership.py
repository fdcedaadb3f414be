"""Runs joining and leaving a packed process: what ``RunMembership`` makes of the control topic."""

from __future__ import annotations

import logging
import time

import pytest

from consumers.packed_service import check_packable
from pipeline.io.bus.records import ConsumedEvent
from pipeline.io.store import ObjectStore
from pipeline.membership import (
    Comebacks,
    Joined,
    Left,
    RunMembership,
    RunsFailedError,
    control_topic_ends,
    engine_config,
)
from pipeline.runtime import create_run
from schemas.config import RunConfig
from schemas.events import LearnerCheckpointed, Payload, RunStarted, RunStopped, make_event


class Feed:
    """A follower of the control topic that hands over what the test queued."""

    def __init__(self) -> None:
        self.queued: list[ConsumedEvent] = []
        self.closed = False

    def put(self, run_id: str, payload: Payload) -> None:
        self.queued.append(ConsumedEvent("ns.control", 0, len(self.queued), run_id, make_event(run_id, payload)))

    def poll(self, timeout_s: float = 0.0) -> list[ConsumedEvent]:
        items, self.queued = self.queued, []
        return items

    def close(self) -> None:
        self.closed = True


def config(run_id: str, **values) -> RunConfig:
    return RunConfig.model_validate({"run_id": run_id, "bus": {"bootstrap_servers": "localhost:9092"}, **values})


@pytest.fixture
def setup(tmp_path):
    store = ObjectStore(tmp_path.as_uri())
    template = config("base", learner={"learning_rate": 1e-4}, store={"root": store.root})
    feed = Feed()
    return store, template, feed, RunMembership("exp-*", template, store, check_packable, follower=feed)


def started(store: ObjectStore, cfg: RunConfig) -> RunStarted:
    _, _, event = create_run(store, cfg, cfg.model.base_model)
    assert isinstance(event, RunStarted)
    return event


def joined_and_warnings(membership: RunMembership, caplog) -> tuple[list[str], str]:
    """The runs one ``changes`` call lets join, and the warnings it logged (one string)."""
    with caplog.at_level(logging.WARNING, logger="rlpipe.membership"):
        changes = membership.changes(serving=set())
    return ([c.config.run_id for c in changes if isinstance(c, Joined)],
            " | ".join(r.getMessage() for r in caplog.records))


def test_a_matching_run_joins_with_its_stored_configuration_and_leaves_when_stopped(setup):
    store, template, feed, membership = setup
    stored = config("exp-1", bus={"bootstrap_servers": "elsewhere:1"}, learner={"learning_rate": 3e-3})
    feed.put("exp-1", started(store, stored))
    feed.put("other", started(store, config("other")))  # not matching the pattern
    (joined,) = membership.changes(serving={"base"})
    assert isinstance(joined, Joined) and joined.config.run_id == "exp-1"
    assert joined.config.learner.learning_rate == 3e-3  # its own settings
    assert joined.config.bus == template.bus and joined.config.store == template.store  # this process's log

    feed.put("exp-1", LearnerCheckpointed(step=1, version=1, path="x", offsets={}))
    feed.put("exp-1", RunStopped(reason="done"))
    feed.put("exp-2", RunStopped(reason="never served"))
    assert membership.changes(serving={"base", "exp-1"}) == [Left("exp-1")]
    feed.put("exp-1", RunStopped(reason="again"))
    assert membership.changes(serving={"base"}) == []  # a run not served has nothing to leave
    membership.close()
    assert feed.closed


def test_a_run_that_cannot_share_the_engine_is_skipped_with_a_warning(setup, caplog):
    store, _, feed, membership = setup
    feed.put("exp-big", started(store, config("exp-big", model={"base_model": "Qwen/Qwen2.5-0.5B"})))
    feed.put("exp-gone", RunStarted(config_path="runs/exp-gone/run.json", config_sha256="0" * 64, env="cartpole",
                                    base_model="tiny"))  # announced, but no run.json in this store
    feed.put("exp-1", started(store, config("exp-1")))
    joined, messages = joined_and_warnings(membership, caplog)
    assert joined == ["exp-1"]
    assert "run exp-big cannot join" in messages and "model.base_model" in messages
    assert "run exp-gone cannot join" in messages and "no run.json" in messages


def test_a_following_process_may_start_with_no_run_but_a_plain_one_may_not():
    template, other = config("engine"), config("b", model={"base_model": "Qwen/Qwen2.5-0.5B"})
    assert engine_config([], "exp-*", template, check_packable) is template
    assert engine_config([other, template], None, None, lambda configs: None) is other
    with pytest.raises(ValueError, match="name at least one run, or follow runs"):
        engine_config([], None, template, check_packable)
    with pytest.raises(ValueError, match=r"model\.base_model"):
        engine_config([template, other], "exp-*", template, check_packable)


def test_a_run_started_and_stopped_within_one_poll_neither_joins_nor_joins_twice(setup):
    store, _, feed, membership = setup
    event = started(store, config("exp-1"))
    feed.put("exp-1", event)
    feed.put("exp-1", event)  # announced twice (a retried `rlpipe runs create`): one join
    feed.put("exp-2", started(store, config("exp-2")))
    feed.put("exp-2", RunStopped(reason="stopped before this process saw it start"))
    changes = membership.changes(serving=set())
    assert [(type(c).__name__, c.config.run_id) for c in changes] == [("Joined", "exp-1")]
    feed.put("exp-1", RunStopped(reason="done"))
    feed.put("exp-1", event)  # started again after it stopped: it leaves now and joins once let go
    assert membership.changes(serving={"exp-1"}) == [Left("exp-1")]
    (joined,) = membership.changes(serving=set())
    assert isinstance(joined, Joined) and joined.config.run_id == "exp-1"
    assert membership.changes(serving={"exp-1"}) == []


def test_a_process_following_no_pattern_only_lets_its_stopped_runs_go(setup):
    """A packed process started without --follow-runs takes no new run, but a served run's RunStopped (its budget
    reached under `rlpipe run`, or `rlpipe runs stop`) still makes it leave."""
    store, template, feed, _ = setup
    membership = RunMembership(None, template, store, check_packable, follower=feed)
    feed.put("exp-1", started(store, config("exp-1")))
    feed.put("base", RunStopped(reason="step budget reached"))
    assert membership.changes(serving={"base", "other"}) == [Left("base")]
    feed.put("base", started(store, config("base")))
    assert membership.changes(serving={"other"}) == []


def test_value_runs_damaged_configs_and_misnamed_ones_are_skipped_and_the_next_run_joins(setup, caplog):
    """A value-based run (its own value learner and producer hold its lease), a stored configuration that is not
    one, and a run.json naming another run never join; they are logged, and the sound run after them joins."""
    store, _, feed, membership = setup
    value = config("exp-dqn", env={"name": "cartpole"},
                   value={"observation_size": 4, "num_actions": 2, "learner": {"agent": "dqn"}})
    feed.put("exp-dqn", started(store, value))
    store.put("runs/exp-cut/run.json", b"{}")
    store.put("runs/exp-cut/config-changes/000001.json", b'{"changed": "cut short"}')
    feed.put("exp-cut", RunStarted(config_path="runs/exp-cut/run.json", config_sha256="0" * 64, env="cartpole",
                                   base_model="tiny"))
    store.put("runs/exp-list/run.json", b"[]")
    feed.put("exp-list", RunStarted(config_path="runs/exp-list/run.json", config_sha256="0" * 64, env="cartpole",
                                    base_model="tiny"))
    started(store, config("exp-copy"))
    store.put("runs/exp-other/run.json", store.get("runs/exp-copy/run.json"))
    feed.put("exp-other", RunStarted(config_path="runs/exp-other/run.json", config_sha256="0" * 64, env="cartpole",
                                     base_model="tiny"))
    feed.put("exp-1", started(store, config("exp-1")))
    joined, messages = joined_and_warnings(membership, caplog)
    assert joined == ["exp-1"]
    assert "run exp-dqn cannot join" in messages and "value-based" in messages
    assert "run exp-cut cannot join" in messages and "run exp-list cannot join" in messages
    assert "run exp-other cannot join" in messages and "names run exp-copy" in messages


def test_a_failed_run_comes_back_after_a_pause_that_doubles_and_a_lost_lease_is_not_retried():
    now = [0.0]
    comebacks = Comebacks(first_s=30.0, max_s=100.0, clock=lambda: now[0])
    b = RunConfig(run_id="b")
    assert comebacks.failed(b, OSError("bucket")) == 30.0 and comebacks.due() == []
    now[0] = 30.0
    assert comebacks.due() == [b] and comebacks.due() == []
    assert comebacks.failed(b, OSError("again")) == 60.0  # failures in a row: longer pauses, up to max_s
    now[0] = 90.0
    assert comebacks.due() == [b] and comebacks.failed(b, OSError("again")) == 100.0
    comebacks.progressed("b")  # it trained a step: the next failure is a first one
    assert comebacks.failed(b, OSError("later")) == 30.0 and set(comebacks.waiting) == {"b"}
    assert comebacks.forget("b") and comebacks.waiting == {}  # stopped while waiting: it stays stopped
    assert comebacks.failed(RunConfig(run_id="c"), RuntimeError("run c has a newer learner"), again=False) is None
    assert comebacks.waiting == {} and comebacks.lost == {"c": "run c has a newer learner"}


def test_a_control_topic_that_cannot_be_read_for_a_moment_changes_nothing_and_is_read_again(setup, caplog):
    store, _, feed, membership = setup
    feed.put("exp-1", started(store, config("exp-1")))
    poll = feed.poll
    feed.poll = lambda timeout_s=0.0: (_ for _ in ()).throw(ConnectionError("no broker"))
    with caplog.at_level(logging.WARNING, logger="rlpipe.membership"):
        assert membership.changes(serving={"base"}) == []
    assert "reading the control topic failed (ConnectionError: no broker)" in caplog.text
    feed.poll = poll
    assert [c.config.run_id for c in membership.changes(serving={"base"})] == ["exp-1"]


def test_a_process_stopped_while_a_run_waits_to_come_back_ends_in_an_error_naming_it():
    comebacks = Comebacks(first_s=30.0, clock=lambda: 0.0)
    comebacks.check_settled()  # nothing failed: a clean stop
    comebacks.failed(RunConfig(run_id="b"), OSError("bucket unreachable"))
    with pytest.raises(RunsFailedError, match=r"run b .*OSError: bucket unreachable") as caught:
        comebacks.check_settled()
    assert "\n" not in str(caught.value)
    comebacks.forget("b")  # stopped while waiting: it stays stopped, as asked
    comebacks.check_settled()
    comebacks.failed(RunConfig(run_id="c"), RuntimeError("run c has a newer learner"), again=False)
    comebacks.failed(RunConfig(run_id="d"), OSError("disk\nfull"))
    with pytest.raises(RunsFailedError, match=r"run c has a newer learner; run d .*OSError: disk full"):
        comebacks.check_settled()  # a lease taken is named as a single-run learner's exit names it


def test_a_run_stopped_after_the_process_started_leaves_though_it_stopped_before_the_log_was_followed(
        tmp_path, bus_config):
    """The control topic is followed from the process's start (``control_start``), not from when it is first read
    (after the imports and the connections): a stop in between is not missed.  A stop before the start makes no
    run leave: whether a named run is served at the start is its recorded event's to say (``runs_not_stopped``)."""

    from pipeline.io.bus import EventPublisher
    from pipeline.membership import control_start
    from pipeline.runtime import Announcer

    store = ObjectStore(tmp_path.as_uri())
    template = config("base", bus=bus_config.model_dump(), store={"root": store.root})
    with EventPublisher(bus_config) as publisher:
        Announcer(publisher, "exp-old")(RunStopped(reason="the last session's end"))
        control_from_P = control_start([], template)  # the process starts
        Announcer(publisher, "exp-1")(RunStopped(reason="stopped while the process set up"))
        membership = RunMembership(None, template, store, check_packable, control_from_P=control_from_P)
    try:
        changes: list = []
        deadline = time.monotonic() + 10.0
        while not changes and time.monotonic() < deadline:  # poll(0) hands over what a fetch brought: a pass or two
            changes = membership.changes(serving={"exp-old", "exp-1"})
            time.sleep(0.1)
        assert changes == [Left("exp-1")]
    finally:
        membership.close()


def _cli_on(monkeypatch, tmp_path, bus_config) -> tuple[ObjectStore, list[str]]:
    """`rlpipe runs ...` on a store of its own and the test's broker namespace; the options `runs stop` takes."""
    store = ObjectStore((tmp_path / "store").as_uri())
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", store.root)
    monkeypatch.setenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", bus_config.bootstrap_servers)
    monkeypatch.setenv("RLPIPE_BUS__NAMESPACE", bus_config.namespace)
    return store, ["--root", store.root, "--bootstrap", bus_config.bootstrap_servers,
                   "--namespace", bus_config.namespace]


def test_a_run_that_joined_before_a_restart_is_taken_up_again_and_a_stopped_one_is_not(
        tmp_path, bus_config, monkeypatch):
    """A packed process restarted with the same command line (a pod restart, a crash) serves what each run's newest
    start or stop says, though both came before its start: `rlpipe runs create` made exp-1 join (it is taken up
    again), `rlpipe runs stop` made exp-2 leave (it stays out)."""
    from typer.testing import CliRunner

    from pipeline.cli.options import run_config
    from pipeline.cli.runs import app

    store, where = _cli_on(monkeypatch, tmp_path, bus_config)
    runner = CliRunner()
    for run_id in ("exp-1", "exp-2"):
        created = runner.invoke(app, ["create", "--preset", "cartpole", "--run", run_id])
        assert created.exit_code == 0, created.output
    stopped = runner.invoke(app, ["stop", "--run", "exp-2", *where])
    assert stopped.exit_code == 0, stopped.output
    template = run_config("cartpole", None, []).model_copy(update={"run_id": "base"})
    control_from_P = control_topic_ends(template.bus)  # the process starts again
    membership = RunMembership("exp-*", template, store, check_packable, control_from_P=control_from_P)
    try:
        changes = membership.changes(serving={"base"})
        assert [(type(c).__name__, c.config.run_id) for c in changes] == [("Joined", "exp-1")]
        assert membership.changes(serving={"base", "exp-1"}) == []
    finally:
        membership.close()


def test_a_named_run_stopped_before_a_restart_stays_stopped_until_resumed(tmp_path, bus_config, monkeypatch, caplog):
    """Naming a run (--run) serves it unless its newest recorded event is a stop: a restart does not undo a stop.
    `rlpipe runs resume` does, and a process naming the run takes it up again as it runs."""
    from typer.testing import CliRunner

    from pipeline.cli.options import run_config
    from pipeline.cli.runs import app
    from pipeline.membership import runs_not_stopped

    store, where = _cli_on(monkeypatch, tmp_path, bus_config)
    runner = CliRunner()
    for run_id in ("a", "b"):
        assert runner.invoke(app, ["create", "--preset", "cartpole", "--run", run_id]).exit_code == 0
    stopped = runner.invoke(app, ["stop", "--run", "a", *where])
    assert stopped.exit_code == 0 and "rlpipe runs resume --run a" in stopped.output, stopped.output
    named = [run_config("cartpole", None, []).model_copy(update={"run_id": run_id}) for run_id in ("a", "b")]
    control_from_P = control_topic_ends(named[0].bus)  # the process starts again with --run a --run b
    with caplog.at_level(logging.INFO, logger="rlpipe.membership"):
        assert [c.run_id for c in runs_not_stopped(named, None)] == ["b"]
    assert "run a was stopped at " in caplog.text and "resume it with `rlpipe runs resume --run a`" in caplog.text
    with pytest.raises(ValueError, match=r"every run named is stopped \(a\).*rlpipe runs resume --run a"):
        runs_not_stopped(named[:1], None)
    assert [c.run_id for c in runs_not_stopped(named[:1], "a*")] == []  # following: it may wait for runs

    membership = RunMembership(None, named[1], store, check_packable, named=["a", "b"], control_from_P=control_from_P)
    try:
        assert membership.changes(serving={"b"}) == []
        resumed = runner.invoke(app, ["resume", "--run", "a", *where])
        assert resumed.exit_code == 0 and "announced run a again" in resumed.output, resumed.output
        changes: list = []
        deadline = time.monotonic() + 10.0
        while not changes and time.monotonic() < deadline:  # poll(0) hands over what a fetch brought: a pass or two
            changes = membership.changes(serving={"b"})
            time.sleep(0.1)
        assert [(type(c).__name__, c.config.run_id) for c in changes] == [("Joined", "a")]
    finally:
        membership.close()
    assert [c.run_id for c in runs_not_stopped(named, None)] == ["a", "b"]  # the next restart serves it too


def test_a_damaged_membership_record_counts_as_a_stop_naming_the_fix(setup, caplog):
    """A record that is not a start or stop of its run never undoes a stop: the named run is not served and a
    following process does not take it up; each says in one line how to resume it."""
    from pipeline.membership import membership_key, runs_not_stopped

    store, template, feed, _ = setup
    cfg = config("exp-1", store={"root": store.root})
    started(store, cfg)
    store.put(membership_key("exp-1"), b"{not json")
    with caplog.at_level(logging.WARNING, logger="rlpipe.membership"):
        assert runs_not_stopped([cfg], "exp-*") == []
        membership = RunMembership("exp-*", template, store, check_packable, follower=feed)
        assert membership.changes(serving=set()) == []
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("runs/exp-1/membership.json unreadable" in line for line in lines), lines
    assert all("`rlpipe runs resume --run exp-1`" in line and "\n" not in line for line in lines)


def test_a_change_is_read_only_from_its_own_runs_change_records(tmp_path):
    """changed_run_config reads run a's change from run a's record; a RunConfigChanged of run a naming run b's change
    record (valid, and vouched for by its sha256) is refused in one line naming the path, not read as a's."""
    from pipeline.membership import changed_run_config
    from pipeline.runtime import record_config_change
    from schemas.events import RunConfigChanged

    store = ObjectStore(tmp_path.as_uri())
    template = config("base", store={"root": store.root})
    changes: dict[str, RunConfigChanged] = {}
    for run in ("a", "b"):
        created = config(run, store={"root": store.root})
        create_run(store, created, "tiny")
        _, _, changes[run] = record_config_change(
            store, created.model_copy(update={"learner": created.learner.model_copy(update={"max_steps": 7})}))
    assert changed_run_config(store, "a", changes["a"], template).learner.max_steps == 7
    with pytest.raises(ValueError) as refused:
        changed_run_config(store, "a", changes["b"], template)
    message = str(refused.value)
    assert "runs/b/config-changes/000001.json" in message and "runs/a/config-changes/" in message, message
    assert "\n" not in message and "rlpipe runs create" not in message, message
