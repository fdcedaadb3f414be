"""The packed learner process's handling of runs leaving (``consumers.packed_service``): a ``RunStopped`` asks the
run to leave, and only once it is let go (settled) is ``LearnerLeft`` announced, the run closed and its health series
removed; a run started again while still leaving joins once it has left; a run that fails while leaving stays
stopped.  The packed loop, the broker and the engine are stand-ins, so the rounds are scripted."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from consumers import packed_service
from pipeline.health import HealthServer
from pipeline.membership import Joined, Left, RunsFailedError
from schemas.config import RunConfig
from schemas.events import LearnerLeft

SERVING = "rlpipe_learner_run_serving"


class Learner:
    """Stands in for a run's learner: what it announced, and whether its metric logger was closed."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.state = SimpleNamespace(step=3, version=2)
        self.announced: list = []
        self.metric_logger = SimpleNamespace(closed=False)
        self.metric_logger.close = lambda: setattr(self.metric_logger, "closed", True)

    def announce(self, payload) -> None:
        self.announced.append(payload)


class Source:
    """Stands in for a run's ``KafkaSource``: whether it was closed."""

    def __init__(self, bus, run_id: str) -> None:
        self.run_id, self.closed = run_id, False

    def close(self) -> None:
        self.closed = True


class Membership:
    """Stands in for ``RunMembership``: each call of ``changes`` hands over the next round's scripted changes and
    records who was served then."""

    def __init__(self, rounds: list[list]) -> None:
        self.rounds, self.serving = list(rounds), []

    def changes(self, serving) -> list:
        self.serving.append(set(serving))
        return self.rounds.pop(0) if self.rounds else []

    def close(self) -> None:
        pass


class Packed:
    """Stands in for ``PackedLearner``: ``run`` calls ``between_rounds`` and then the next step of ``script`` (what
    the round did: a run let go once settled, a run failing, a run reaching its ``max_steps``), once per step; as
    ``PackedLearner.run`` does, it returns before a round in which no run is going (each finished or leaving)
    unless ``until_stopped()``."""

    def __init__(self, script: list[Callable[[Packed], None]], engine, learners: list[Learner]) -> None:
        self.script, self.engine = script, engine
        self.runs = [SimpleNamespace(run_id=learner.run_id, learner=learner) for learner in learners]
        self.on_left: dict[str, Callable] = {}
        self.finished: set[str] = set()  # runs at their max_steps
        self.asked: list[str] = []  # leave's calls, in order
        self.on_failure: Callable[[str, Exception], None] | None = None

    def resume(self) -> None:
        pass

    def add(self, learner: Learner) -> None:
        self.runs.append(SimpleNamespace(run_id=learner.run_id, learner=learner))

    def leave(self, run_id: str, on_left: Callable) -> None:
        self.asked.append(run_id)
        self.on_left.setdefault(run_id, on_left)

    def let_go(self, run_id: str) -> None:
        """``run_id`` settled: taken out, then ``on_left`` told, as ``PackedLearner.let_go`` does; what ``on_left``
        raises drops the run, as ``PackedLearner._failed`` does."""
        run = next(run for run in self.runs if run.run_id == run_id)
        self.runs.remove(run)
        try:
            self.on_left.pop(run_id)(run.learner)
        except Exception as exc:
            self.fail(run_id, exc)

    def finish(self, run_id: str) -> None:
        """``run_id`` reached its ``max_steps``: it is no longer going."""
        self.finished.add(run_id)

    def fail(self, run_id: str, error: Exception) -> None:
        """``run_id``'s turn raised: dropped and reported, as ``PackedLearner._failed`` does."""
        self.runs = [run for run in self.runs if run.run_id != run_id]
        self.on_left.pop(run_id, None)
        assert self.on_failure is not None
        self.on_failure(run_id, error)

    def run(self, should_stop, on_step, between_rounds, until_stopped, on_failure) -> None:
        self.on_failure = on_failure
        for step in self.script:
            between_rounds(self)
            going = [run for run in self.runs if run.run_id not in self.finished | set(self.on_left)]
            if not going and not until_stopped():
                return
            step(self)

    def finish_all(self, on_step, on_failure) -> None:
        pass


class Process:
    """``run_packed_learner`` over runs a and b with every part around the packed loop stood in: the learners
    opened (``opened``: run -> its learners, in order), their sources, the health server."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, rounds: list[list], script: list[Callable]) -> None:
        self.membership = Membership(rounds)
        self.opened: dict[str, list[Learner]] = {}
        self.sources: dict[str, list[Source]] = {}
        self.health: HealthServer | None = None
        self.packed: Packed | None = None

        def health_server(port) -> HealthServer:
            self.health = HealthServer(None)
            return self.health

        def packed(engine, learners) -> Packed:
            self.packed = Packed(script, engine, learners)
            return self.packed

        def source(bus, run_id: str) -> Source:
            self.sources.setdefault(run_id, []).append(Source(bus, run_id))
            return self.sources[run_id][-1]

        def build_learner(cfg, store, source, announcer, base_model, policy, stopping) -> Learner:
            self.opened.setdefault(cfg.run_id, []).append(Learner(cfg.run_id))
            return self.opened[cfg.run_id][-1]

        stand_ins = {
            "RunMembership": lambda *args, **kwargs: self.membership, "HealthServer": health_server,
            "PackedLearner": packed, "KafkaSource": source, "build_learner": build_learner,
            "control_start": lambda configs, template: {}, "runs_not_stopped": lambda configs, follow_runs: configs,
            "engine_config": lambda configs, follow_runs, template, packable: configs[0],
            "resolved_bus": lambda bus: bus, "EventPublisher": lambda bus: SimpleNamespace(close=lambda: None),
            "open_store": lambda store: None, "create_run": lambda store, cfg, base_model: (None, None, None),
            "resolve_base_model": lambda model: "tiny", "TrainingEngine": lambda *args, **kwargs: None,
            "EnginePolicy": lambda *args, **kwargs: None, "record_resumed": lambda *args, **kwargs: None,
        }
        for name, stand_in in stand_ins.items():
            monkeypatch.setattr(packed_service, name, stand_in)

    def run(self, follow_runs: str | None = "*") -> None:
        packed_service.run_packed_learner([RunConfig(run_id="a"), RunConfig(run_id="b")], follow_runs=follow_runs)

    def serving(self, run_id: str) -> float | None:
        assert self.health is not None
        return self.health.metric_value(SERVING, {"run": run_id})


def test_a_run_stopped_is_asked_to_leave_and_is_announced_left_closed_and_unreported_only_once_let_go(monkeypatch):
    """b's RunStopped asks it to leave; while it settles it is no longer offered as served to the membership, but
    its LearnerLeft, its closing and the removal of its series wait for it to be let go."""
    seen: dict[str, object] = {}

    def while_leaving(packed: Packed) -> None:
        b = process.opened["b"][0]
        seen.update(asked=list(packed.asked), announced=list(b.announced), closed=process.sources["b"][0].closed,
                    serving=process.serving("b"))

    process = Process(monkeypatch, rounds=[[Left("b")]], script=[while_leaving, lambda packed: packed.let_go("b"),
                                                                  lambda packed: None])
    process.run()
    assert seen == {"asked": ["b"], "announced": [], "closed": False, "serving": 1.0}
    b = process.opened["b"][0]
    assert b.announced == [LearnerLeft(step=3, version=2)]  # once, with where it left
    assert process.sources["b"][0].closed and b.metric_logger.closed
    assert process.serving("b") is None and process.serving("a") == 1.0  # its series gone, a's kept
    # offered as served until asked to leave, then no longer (its leaving is not a change to look for)
    assert process.membership.serving == [{"a", "b"}, {"a"}, {"a"}]
    assert [run.run_id for run in process.packed.runs] == ["a"]


def test_a_run_started_again_while_leaving_joins_once_it_has_left(monkeypatch):
    """b is started again while it still settles: it is not joined beside itself, but once it has left it joins
    again with a new learner (resumed from the checkpoint it left at)."""
    joined_while_leaving: list[int] = []
    process = Process(monkeypatch, rounds=[[Left("b")], [Joined(RunConfig(run_id="b"))]],
                      script=[lambda packed: None,
                              lambda packed: joined_while_leaving.append(len(process.opened["b"])),
                              lambda packed: packed.let_go("b"), lambda packed: None])
    process.run()
    assert joined_while_leaving == [1]  # the start waited for the leaving
    first, again = process.opened["b"]
    assert first.announced == [LearnerLeft(step=3, version=2)] and again.announced == []
    assert [run.learner for run in process.packed.runs] == [process.opened["a"][0], again]
    assert process.serving("b") == 1.0
    assert process.membership.serving[1:] == [{"a"}, {"a", "b"}, {"a", "b"}]  # b waits to join, then is served


def test_a_named_run_started_again_while_leaving_is_served_once_it_has_left_though_the_others_finished(monkeypatch):
    """Without --follow-runs: a is stopped, then resumed while it still settles, and b reaches its max_steps
    meanwhile.  No run is going then, but the process serves on until a has left and joins it again."""
    process = Process(monkeypatch, rounds=[[Left("a")], [Joined(RunConfig(run_id="a"))]],
                      script=[lambda packed: None, lambda packed: packed.finish("b"), lambda packed: packed.let_go("a"),
                              lambda packed: None])
    process.run(follow_runs=None)
    first, again = process.opened["a"]
    assert first.announced == [LearnerLeft(step=3, version=2)] and first.metric_logger.closed
    assert [run.learner for run in process.packed.runs] == [process.opened["b"][0], again]
    assert process.serving("a") == 1.0


def test_a_run_stopped_again_while_waiting_to_join_after_leaving_stays_stopped(monkeypatch):
    process = Process(monkeypatch, rounds=[[Left("b")], [Joined(RunConfig(run_id="b"))], [Left("b")]],
                      script=[lambda packed: None, lambda packed: None, lambda packed: packed.let_go("b"),
                              lambda packed: None])
    process.run()
    assert len(process.opened["b"]) == 1 and process.packed.asked == ["b"]
    assert [run.run_id for run in process.packed.runs] == ["a"] and process.serving("b") is None


def test_a_run_stopped_again_after_it_left_and_before_it_joined_again_stays_stopped(monkeypatch):
    """b, started again while leaving, has left; its second RunStopped comes before the next round: it is not
    joined (resumed, its checkpoint announced again) only to be asked to leave at once, a second LearnerLeft."""
    process = Process(monkeypatch, rounds=[[Left("b")], [Joined(RunConfig(run_id="b"))], [Left("b")]],
                      script=[lambda packed: None, lambda packed: packed.let_go("b"), lambda packed: None])
    process.run()
    assert len(process.opened["b"]) == 1 and process.packed.asked == ["b"]
    assert process.opened["b"][0].announced == [LearnerLeft(step=3, version=2)]
    assert [run.run_id for run in process.packed.runs] == ["a"] and process.serving("b") is None


def test_a_run_that_fails_while_leaving_stays_stopped_instead_of_coming_back(monkeypatch, caplog):
    """b fails while it settles (its final checkpoint's write failing): it is closed and unreported, announces no
    LearnerLeft, and does not wait to come back (the process ends without ``RunsFailedError``); its newest
    checkpoint stands for when it is served again.  The same failure of a run not leaving makes it wait."""
    process = Process(monkeypatch, rounds=[[Left("b")]],
                      script=[lambda packed: packed.fail("b", OSError("the bucket is unreachable")),
                              lambda packed: None])
    with caplog.at_level(logging.ERROR, logger="rlpipe.learner"):
        process.run()  # no RunsFailedError: b was stopped
    b = process.opened["b"][0]
    assert b.announced == [] and process.sources["b"][0].closed and b.metric_logger.closed
    assert process.serving("b") is None and process.membership.serving == [{"a", "b"}, {"a"}]
    assert any("run b failed while leaving" in record.getMessage() for record in caplog.records)

    process = Process(monkeypatch, rounds=[], script=[lambda packed: packed.fail("b", OSError("unreachable"))])
    with pytest.raises(RunsFailedError, match="run b stopped on an error"):
        process.run()
    assert process.serving("b") == 0.0  # waits to come back


@pytest.mark.parametrize("failing", ["source", "metric logger"])
def test_a_run_that_left_stays_stopped_when_closing_it_fails(monkeypatch, caplog, failing):
    """b left (its final checkpoint durable, its LearnerLeft announced), but closing its source or its metric
    logger raises: that is logged in one line, and b neither waits to come back nor counts as failed."""

    def let_go_failing(packed: Packed) -> None:
        b = process.opened["b"][0]
        part = process.sources["b"][0] if failing == "source" else b.metric_logger

        def close() -> None:
            raise OSError("the bucket is unreachable")

        part.close = close
        packed.let_go("b")

    process = Process(monkeypatch, rounds=[[Left("b")]], script=[lambda packed: None, let_go_failing,
                                                                  lambda packed: None])
    with caplog.at_level(logging.ERROR, logger="rlpipe.learner"):
        process.run()  # no RunsFailedError: b left
    assert process.opened["b"][0].announced == [LearnerLeft(step=3, version=2)]
    assert process.serving("b") is None and [run.run_id for run in process.packed.runs] == ["a"]
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert errors == ["run b left at step 3, version 2, but closing it failed (OSError: the bucket is unreachable)"]
    if failing == "source":  # its metrics flushed all the same
        assert process.opened["b"][0].metric_logger.closed
