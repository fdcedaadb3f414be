"""Packed learning: two runs as two adapters of one engine reach the weights each reaches alone.

A run failing, and settings or models packed runs cannot share, are in test_packed_failures.py.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from consumers.checkpoint import CheckpointStore
from consumers.engine import TrainingEngine
from consumers.engine_data import EngineError
from consumers.engine_policy import EnginePolicy
from consumers.packed import PackedLearner
from consumers.policy import LoraPolicy
from pipeline.io.registry import AdapterRegistry
from schemas.config import LearnerConfig
from tests.consumers.packed_runs import (
    SOURCES,
    adapter_of,
    batches,  # noqa: F401  # the fixture: runs a and b's batches in a store
    config,
    learner_of,
)
from tests.consumers.test_learner import setup  # noqa: F401  # the module fixture: tiny model, prompt, answers
from tests.consumers.test_learner_progress import ScriptedSource
from tests.fixtures.outages import wait_for


def test_two_packed_runs_reach_the_weights_each_reaches_alone(batches, setup):  # noqa: F811
    for run in SOURCES:
        alone = learner_of(batches, f"{run}-alone", f"src-{run}", LoraPolicy(setup["model_dir"], config(run)),
                           config(run))
        alone.resume()
        alone.run(poll_timeout_s=0)
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    learners = [learner_of(batches, run, f"src-{run}", EnginePolicy(engine, run, config(run)), config(run))
                for run in SOURCES]
    packed = PackedLearner(engine, learners)
    packed.resume()
    steps: list[str] = []
    packed.run(on_step=lambda run, metrics: steps.append(run), poll_timeout_s=0)
    assert sorted(steps) == ["a"] * 4 + ["b"] * 4 and steps[:2] != ["a", "a"]  # interleaved, each to max_steps
    for run in SOURCES:
        assert AdapterRegistry(batches, run).versions() == [1, 2, 3, 4]
        alone, together = adapter_of(batches, f"{run}-alone"), adapter_of(batches, run)
        assert alone.keys() == together.keys()
        assert max(float((alone[k] - together[k]).abs().max()) for k in alone) <= 1e-6, run
    assert not all(torch.equal(adapter_of(batches, "a")[k], adapter_of(batches, "b")[k]) for k in alone)


def test_two_packed_runs_with_lora_dropout_reach_the_weights_each_reaches_alone(batches, setup):  # noqa: F811
    """Dropout draws from the torch RNG: each run's draws come from its own RNG state, swapped in for its turn, so
    neither run's masks depend on the other's steps."""
    for run in SOURCES:
        alone = learner_of(batches, f"{run}-alone", f"src-{run}", LoraPolicy(setup["model_dir"], dropout(run)),
                           dropout(run))
        alone.run(poll_timeout_s=0)
    without = learner_of(batches, "a-without", "src-a", LoraPolicy(setup["model_dir"], config("a")), config("a"))
    without.run(poll_timeout_s=0)
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    packed = PackedLearner(engine, [learner_of(batches, run, f"src-{run}", EnginePolicy(engine, run, dropout(run)),
                                               dropout(run)) for run in SOURCES])
    packed.resume()
    packed.run(poll_timeout_s=0)
    for run in SOURCES:
        alone, together = adapter_of(batches, f"{run}-alone"), adapter_of(batches, run)
        assert alone.keys() == together.keys()
        assert max(float((alone[k] - together[k]).abs().max()) for k in alone) <= 1e-6, run
    alone, without_dropout = adapter_of(batches, "a-alone"), adapter_of(batches, "a-without")
    assert max(float((alone[k] - without_dropout[k]).abs().max()) for k in alone) > 1e-4  # dropout is in effect


def dropout(run: str) -> LearnerConfig:
    return config(run, lora_dropout=0.3)


def test_a_packed_run_resumes_from_its_own_checkpoint_alone(batches, setup):  # noqa: F811
    """A packed run's checkpoint (adapter, optimizer, schedule) continues in a single-run learner and back."""
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    learner = learner_of(batches, "a", "src-a", EnginePolicy(engine, "a", config("a")), config("a"))
    first = PackedLearner(engine, [learner])
    first.resume()
    first.run(should_stop=lambda: learner.state.step >= 2, poll_timeout_s=0)  # checkpoint_every=2
    alone = learner_of(batches, "a", "src-a", LoraPolicy(setup["model_dir"], config("a")), config("a"))
    alone.source.already_trained = lambda batch_id: batch_id in alone.state.trained
    assert alone.resume() and alone.state.step == 2
    alone.run(poll_timeout_s=0)
    reference = learner_of(batches, "ref", "src-a", LoraPolicy(setup["model_dir"], config("a")), config("a"))
    reference.run(poll_timeout_s=0)
    assert alone.state.step == reference.state.step == 4
    ours, theirs = adapter_of(batches, "a"), adapter_of(batches, "ref")
    assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) <= 1e-6


class Joining:
    """A source whose group assigns its partitions on the n-th join call."""

    def __init__(self, calls: list[str], name: str, after: int) -> None:
        self.calls, self.name, self.after = calls, name, after

    def join(self, timeout_s: float) -> bool:
        self.calls.append(self.name)
        return self.calls.count(self.name) >= self.after


def test_resume_joins_every_runs_group_in_turns_before_any_run_trains():
    """A join needs several polls of its own consumer: taken in turns before training, not one per step."""
    calls: list[str] = []
    packed = PackedLearner.__new__(PackedLearner)
    packed.runs = [type("Run", (), {"run_id": name, "learner": type("L", (), {"source": Joining(calls, name, after)})})
                   for name, after in (("a", 2), ("b", 3))]
    packed.join(timeout_s=5)
    assert calls == ["a", "b", "a", "b", "b"]


def test_runs_join_and_leave_a_packed_learner_between_rounds(batches, setup):  # noqa: F811
    """b joins after a's first step; a is asked to leave after its second (it leaves once its checkpoint is written
    in its turns, its adapter deleted); b goes on to max_steps.  Each ends where it ends alone on the same batches."""
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    first = learner_of(batches, "a", "src-a", EnginePolicy(engine, "a", config("a")), config("a"))
    packed = PackedLearner(engine, [first])
    packed.resume()
    changes: list[str] = []

    def between_rounds(packed: PackedLearner) -> None:
        if first.state.step >= 1 and "+b" not in changes:
            packed.add(learner_of(batches, "b", "src-b", EnginePolicy(engine, "b", config("b")), config("b")))
            changes.append("+b")
        if first.state.step >= 2 and "leave a" not in changes:
            packed.leave("a", lambda learner: changes.append("-a" if learner is first else "-?"))
            changes.append("leave a")

    steps: list[str] = []
    packed.run(should_stop=lambda: "-a" in changes and all(run.finished() for run in packed.runs),
               on_step=lambda run, metrics: steps.append(run), poll_timeout_s=0, between_rounds=between_rounds)
    assert changes == ["+b", "leave a", "-a"] and [run.run_id for run in packed.runs] == ["b"]
    assert steps.count("a") == 2 and steps.count("b") == 4 and steps[0] == "a" and steps[-1] == "b"
    with pytest.raises(EngineError):  # a's adapter, optimizer and RNG left the engine with it
        engine.adapter_snapshot("a")
    with pytest.raises(ValueError, match="already packed"):
        packed.add(learner_of(batches, "b", "src-b", LoraPolicy(setup["model_dir"], config("b")), config("b")))
    for run, budget in (("a", 2), ("b", 4)):
        alone = learner_of(batches, f"{run}-alone", f"src-{run}", LoraPolicy(setup["model_dir"], config(run)),
                           config(run))
        alone.resume()
        alone.run(should_stop=lambda alone=alone, budget=budget: alone.state.step >= budget, poll_timeout_s=0)
        ours, theirs = adapter_of(batches, run), adapter_of(batches, f"{run}-alone")
        assert CheckpointStore(batches, run).latest().state.step == budget  # a's leaving checkpoint covers step 2
        assert max(float((ours[k] - theirs[k]).abs().max()) for k in ours) <= 1e-6, run


def test_a_run_asked_to_leave_with_rows_waiting_trains_them_in_its_turn_and_checkpoints_them(
        batches, setup):  # noqa: F811
    """a (batch_rows 32: two 16-row batches a step, checkpoints every 10) is asked to leave after its first step
    with its third batch's 16 rows waiting: its next turn trains them as step 2 (as a stop would) while b trains
    on, and its final checkpoint, there when it is let go, is step 2's and covers all three batches."""
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    cfgs = {"a": config("a", batch_rows=32, checkpoint_every=10), "b": config("b")}
    a, b = (learner_of(batches, run, f"src-{run}", EnginePolicy(engine, run, cfgs[run]), cfgs[run]) for run in SOURCES)
    packed = PackedLearner(engine, [a, b])
    packed.resume()
    steps: list[tuple[str, int, int]] = []  # run, step, rows trained
    asked: list[int] = []  # rows a had waiting when asked
    left: list[tuple[int, int]] = []  # a's stored checkpoint when it was let go: step, batches covered

    def between_rounds(packed: PackedLearner) -> None:
        if a.state.step == 1 and a.work_waiting() and not asked:
            asked.append(sum(pending.table.num_rows for pending in a.pending))
            packed.leave("a", on_left)

    def on_left(learner) -> None:
        stored = CheckpointStore(batches, "a").latest().state
        left.append((stored.step, len(stored.trained)))

    packed.run(on_step=lambda run, metrics: steps.append((run, metrics["step"], metrics["rows"])), poll_timeout_s=0,
               between_rounds=between_rounds, until_stopped=lambda: not left)
    assert asked == [16] and left == [(2, 3)]
    assert [(step, rows) for run, step, rows in steps if run == "a"] == [(1, 32), (2, 16)]
    assert steps.index(("a", 2, 16)) < steps.index(("b", 4, 16))  # trained in its turn, b still training after it
    assert [run.run_id for run in packed.runs] == ["b"] and b.state.step == 4
    assert CheckpointStore(batches, "b").latest().state.step == 4


def test_one_runs_writes_go_on_while_the_next_run_trains(batches, setup):  # noqa: F811
    """A run's publish and checkpoint are written in the background while the other runs take their turns, and
    are all written when the packed loop returns."""
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    learners = [learner_of(batches, run, f"src-{run}", EnginePolicy(engine, run, config(run, max_steps=2)),
                           config(run, max_steps=2)) for run in SOURCES]
    a = learners[0]
    b_stepped, seen = threading.Event(), []
    write_step = a.outputs.write_step

    def slow_write(*args, **kwargs):
        if not seen:  # a's first step: its writes end only once b has trained a step beside them
            seen.append(b_stepped.wait(timeout=20))
        return write_step(*args, **kwargs)

    a.outputs.write_step = slow_write
    packed = PackedLearner(engine, learners)
    packed.resume()
    packed.run(on_step=lambda run, metrics: b_stepped.set() if run == "b" else None, poll_timeout_s=0)
    assert seen == [True]
    for run in SOURCES:  # every step's writes are done once the loop returns
        assert AdapterRegistry(batches, run).versions() == [1, 2]
        assert CheckpointStore(batches, run).latest().state.step == 2


def test_a_run_at_its_budget_is_checkpointed_while_the_others_train_and_can_leave_then(batches, setup):  # noqa: F811
    """a reaches its max_steps first: its final checkpoint is handed to its writer at its next turn once its last
    step's writes are taken (not when the process ends), so its end is durable and announced while b trains; its
    leaving once it is settled is immediate, and trains and writes nothing more."""
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    budgets = {"a": 1, "b": 3}
    cfgs = {run: config(run, max_steps=budgets[run], checkpoint_every=10) for run in SOURCES}
    learners = [learner_of(batches, run, f"src-{run}", EnginePolicy(engine, run, cfgs[run]), cfgs[run])
                for run in SOURCES]
    packed = PackedLearner(engine, learners)
    packed.resume()
    seen_by_b: list[int | None] = []

    def on_step(run: str, metrics: dict) -> None:
        if run == "b":  # (once a's writer has ended its job: what a's writes reached does not depend on their speed)
            wait_for(lambda: learners[0].outputs.writer.done, 20, "a's writes")
            latest = CheckpointStore(batches, "a").latest()
            seen_by_b.append(None if latest is None else latest.state.step)

    left: list[str] = []
    a = packed.runs[0]

    def between_rounds(packed: PackedLearner) -> None:
        if a.settled and not left:
            packed.leave("a", lambda learner: left.append(learner.run_id))
            assert left == ["a"] and [run.run_id for run in packed.runs] == ["b"]  # at once

    packed.run(on_step=on_step, poll_timeout_s=0, between_rounds=between_rounds)  # returns: every run finished
    assert seen_by_b[1:] == [1, 1] and left == ["a"]  # from b's second step on (its first: a's step 1 being written)
    assert CheckpointStore(batches, "a").latest().state.step == 1 and learners[0].state.step == 1
    assert AdapterRegistry(batches, "a").versions() == [1]
    packed.finish_all()
    assert CheckpointStore(batches, "b").latest().state.step == 3


class IdleSource(ScriptedSource):
    """A run with nothing to train: each poll's timeout (what an idle Kafka poll waits out) is recorded."""

    def __init__(self) -> None:
        super().__init__([])
        self.timeouts: list[float] = []

    def poll(self, timeout_s: float) -> list:
        self.timeouts.append(timeout_s)
        return []


def test_an_idle_run_does_not_wait_out_its_poll_while_another_run_has_batches_delivered(batches, setup):  # noqa: F811
    """b needs four delivered batches for one step and ingests one per turn; a, idle, polls between them without
    waiting, so b's step never waits for a's empty polls (they wait only when no run has anything to do)."""
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    cfg_b = config("b", batch_rows=64)
    a = learner_of(batches, "a", "src-a", EnginePolicy(engine, "a", config("a")), config("a"))
    b = learner_of(batches, "b", "src-b", EnginePolicy(engine, "b", cfg_b), cfg_b)
    a.source, b.source.batches_per_poll = IdleSource(), 100
    packed = PackedLearner(engine, [a, b])
    packed.resume()
    packed.run(should_stop=lambda: b.state.step >= 1, poll_timeout_s=4.0)
    assert b.state.step == 1 and len(a.source.timeouts) >= 3
    assert a.source.timeouts[0] == 2.0  # before b's first poll nobody had anything: half of the round's wait
    assert set(a.source.timeouts[1:]) == {0.0}  # b had batches delivered: a's polls did not wait


def test_a_packed_run_reads_each_batch_from_the_store_once_as_it_does_alone(batches, setup):  # noqa: F811
    """The batches a run starts reading ahead before its step are kept for its next turns, not dropped at the end of
    the turn and read from the store a second time."""
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    learners = [learner_of(batches, run, f"src-{run}", EnginePolicy(engine, run, config(run)), config(run))
                for run in SOURCES]
    reads: list[str] = []
    for learner in learners:
        read_batch = learner.reader.archive.read_batch

        def counted(path, sha256, read_batch=read_batch):
            reads.append(path)
            return read_batch(path, sha256)

        learner.reader.archive.read_batch = counted
    packed = PackedLearner(engine, learners)
    packed.resume()
    packed.run(poll_timeout_s=0)
    assert [learner.state.step for learner in learners] == [4, 4]
    assert len(reads) == 8 and len(set(reads)) == 8, sorted(reads)


class Holding:
    """Stands in for the training engine: a turn only holds it."""

    @contextlib.contextmanager
    def holding(self, name: str):
        yield None, name


class Turns:
    """A run's learner that records its turns: ``delivered`` batches wait at first (a run fallen behind), each
    poll brings ``per_poll`` more, and every pass ingests one batch and steps on it (as a ``batch_rows`` of one
    batch does)."""

    def __init__(self, run_id: str, turns: list[str], delivered: int, per_poll: int) -> None:
        self.run_id, self.turns, self.per_poll = run_id, turns, per_poll
        self.cfg = SimpleNamespace(seed=0)
        self.incoming = deque(range(delivered))
        self.source = SimpleNamespace(exhausted=lambda: False)
        idle = SimpleNamespace(busy=False, done=True, going=False, wait=lambda keep_alive=None: None)
        self.outputs = SimpleNamespace(writer=idle, beside=idle)  # no writes, no dead letters
        self.steps = 0
        self.poll_timeouts: list[float] = []

    def budget_reached(self) -> bool:
        return False

    def run(self, should_stop, on_step, poll_timeout_s: float, wait_for_writes: bool) -> None:
        while not should_stop():
            self.turns.append(self.run_id)
            if not self.incoming:
                self.poll_timeouts.append(poll_timeout_s)
                self.incoming.extend(range(self.per_poll))
            if self.incoming:
                self.incoming.popleft()
                self.steps += 1
                on_step({"step": self.steps})

    def wait_for_letter(self) -> None:
        pass

    def finish_step_writes(self) -> None:
        pass


def test_runs_take_one_pass_each_in_turn_however_far_behind_one_is():
    """Round-robin, as the README states: a run with a hundred batches waiting (its learner fell behind) takes one
    pass per round like the others, so it never trains two steps while another waits; the run with nothing
    delivered polls without waiting while the busy one has batches delivered."""
    turns: list[str] = []
    behind, idle, steady = Turns("behind", turns, 100, 1), Turns("idle", turns, 0, 0), Turns("steady", turns, 0, 1)
    packed = PackedLearner(Holding(), [behind, idle, steady])  # type: ignore[arg-type, list-item]
    packed.run(should_stop=lambda: len(turns) >= 30, poll_timeout_s=3.0)
    assert turns == ["behind", "idle", "steady"] * 10
    assert (behind.steps, idle.steps, steady.steps) == (10, 0, 10)
    assert set(idle.poll_timeouts) == {0.0}  # behind had batches delivered at each of idle's turns


def test_a_packed_runs_writes_wait_out_a_broker_that_refuses_them_and_announce_each_in_order(
        batches, setup):  # noqa: F811
    """Packed runs write through the same step writer as a learner of one run: an announcement the broker refuses
    (away for longer than the publisher waits) is tried again until taken, and nothing after it goes first."""
    from pipeline.io.bus import PublishError
    from schemas.events import AdapterPublished, LearnerCheckpointed

    engine = TrainingEngine(setup["model_dir"], device="cpu")
    learners = [learner_of(batches, run, f"src-{run}", EnginePolicy(engine, run, config(run, max_steps=2)),
                           config(run, max_steps=2)) for run in SOURCES]
    refusals, taken = {"a": 3}, {run: [] for run in SOURCES}

    def announcer(run: str):
        def announce(payload) -> None:
            if refusals.get(run, 0):
                refusals[run] -= 1
                raise PublishError(f"publishing a {type(payload).__name__} to ns.control failed: no acknowledgement")
            taken[run].append(payload)
        return announce

    for learner in learners:
        learner.announce = learner.outputs.announce = announcer(learner.run_id)
    packed = PackedLearner(engine, learners)
    packed.resume()
    packed.run(poll_timeout_s=0)
    assert refusals["a"] == 0  # a's first announcements were refused, then taken
    for run in SOURCES:
        events = [(type(p).__name__, getattr(p, "version", None) if isinstance(p, AdapterPublished) else p.step)
                  for p in taken[run] if isinstance(p, AdapterPublished | LearnerCheckpointed)]
        assert events == [("AdapterPublished", 1), ("AdapterPublished", 2), ("LearnerCheckpointed", 2)], run
        assert CheckpointStore(batches, run).latest().state.step == 2
