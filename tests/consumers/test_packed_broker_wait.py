"""A packed run whose writes wait for the broker skips its turns while the other runs train.

The broker can refuse one run and take the others': a run's events go to the partition its run id keys (one whose
leader is away, or below its in-sync replicas, refuses them) and its offsets to its group's coordinator.  The
refusals here are one run's (a), and last until the other run (b) has trained three steps or a deadline passes:
a loop in which a's wait held b would see them end on the deadline, with b at one step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest

from consumers.broker_wait import BrokerAwayOnStop
from consumers.checkpoint import CheckpointStore
from consumers.engine import TrainingEngine
from consumers.engine_data import EngineError
from consumers.engine_policy import EnginePolicy
from consumers.learner import Learner
from consumers.packed import PackedLearner
from consumers.policy import LoraPolicy
from consumers.sources import ReplaySource
from consumers.step_writer import StepWriter
from pipeline.io.bus import CommitError, PublishError
from pipeline.runtime import Announcer
from schemas.events import AdapterPublished, DeadLetter, LearnerCheckpointed
from tests.consumers.packed_runs import (
    SOURCES,
    batches,  # noqa: F401  # the fixture: runs a and b's batches in a store
    config,
    learner_of,
)
from tests.consumers.test_learner import setup  # noqa: F401  # the module fixture: tiny model, prompt, answers
from tests.fixtures.outages import RefusingOneRun, wait_for

HELD_FOR_S = 60.0  # how long the refusals last at most (a's wait holding b: until then); the tests take ~20 s


class Progress:
    """b's steps, and a's step as each of them was trained; ``refusing`` is true until b's third step."""

    def __init__(self, a) -> None:
        self.a, self.deadline = a, time.monotonic() + HELD_FOR_S
        self.b_steps: list[int] = []
        self.a_step_at_b_steps: list[int] = []

    def refusing(self) -> bool:
        return len(self.b_steps) < 3 and time.monotonic() < self.deadline

    def on_step(self, run: str, metrics: dict) -> None:
        if run == "b":
            self.b_steps.append(metrics["step"])
            self.a_step_at_b_steps.append(self.a.state.step)


def packed_pair(batches, setup, **overrides):  # noqa: F811
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    learners = [learner_of(batches, run, f"src-{run}", EnginePolicy(engine, run, config(run, **overrides)),
                           config(run, **overrides)) for run in SOURCES]
    return PackedLearner(engine, learners), learners


def announced(events: list, run: str) -> list[tuple[str, int]]:
    """``run``'s AdapterPublished (by version) and LearnerCheckpointed (by step), in the order they were taken."""
    return [(type(e.payload).__name__, e.payload.version if isinstance(e.payload, AdapterPublished) else e.payload.step)
            for e in events if e.run_id == run and isinstance(e.payload, AdapterPublished | LearnerCheckpointed)]


def announce_through(publisher, *learners: Learner) -> None:
    """Every one of ``learners`` announces (its steps' writes and its own) through ``publisher``."""
    for learner in learners:
        learner.announce = learner.outputs.announce = Announcer(publisher, learner.run_id)  # type: ignore[arg-type]


def test_a_run_whose_events_the_broker_refuses_skips_its_turns_while_the_other_trains(batches, setup):  # noqa: F811
    packed, (a, b) = packed_pair(batches, setup)
    progress = Progress(a)
    publisher = RefusingOneRun("a", progress.refusing)
    announce_through(publisher, a, b)
    packed.resume()
    packed.run(on_step=progress.on_step, poll_timeout_s=0)
    assert publisher.refused  # a's AdapterPublished v1 was refused, and tried again until taken
    # b trained steps 2 and 3 while a's first step's writes waited; a's second step was not started meanwhile
    assert progress.b_steps == [1, 2, 3, 4] and progress.a_step_at_b_steps[:3] == [1, 1, 1]
    for run in SOURCES:  # each run's writes in a learner's order, every step trained
        assert announced(publisher.taken, run) == [("AdapterPublished", 1), ("AdapterPublished", 2),
                                                   ("LearnerCheckpointed", 2), ("AdapterPublished", 3),
                                                   ("AdapterPublished", 4), ("LearnerCheckpointed", 4)], run
        assert CheckpointStore(batches, run).latest().state.step == 4


class RefusedCommits:
    """a's source: its offset commits refused (its group's coordinator away) while ``refusing()``; every commit
    taken is written to ``log`` beside the events, so their order can be read."""

    def __init__(self, source: ReplaySource, refusing, log: list) -> None:
        self.source, self.refusing, self.log = source, refusing, log
        self.refused = 0

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    def commit(self, positions: dict[str, int], timeout_s: float | None = None) -> None:
        if self.refusing():
            self.refused += 1
            raise CommitError("commit to group rlpipe-learner-a failed: NotCoordinatorForGroupError")
        self.log.append(("commit", dict(positions)))


def test_a_run_whose_offset_commit_the_broker_refuses_skips_its_turns_and_commits_after_its_checkpoints_event(
        batches, setup):  # noqa: F811
    packed, (a, _) = packed_pair(batches, setup, checkpoint_every=1)
    progress = Progress(a)
    log: list = []
    source = RefusedCommits(a.source, progress.refusing, log)
    a.source = source  # type: ignore[assignment]
    a.announce = a.outputs.announce = lambda payload: log.append(("event", payload))
    packed.resume()
    packed.run(on_step=progress.on_step, poll_timeout_s=0)
    assert source.refused  # the commit of a's step 1 was refused, and tried again at a's turns until taken
    assert progress.b_steps == [1, 2, 3, 4] and progress.a_step_at_b_steps[:3] == [1, 1, 1]
    checkpointed: list[dict[str, int]] = []  # the offsets of each LearnerCheckpointed, as announced
    for kind, item in log:
        if kind == "event" and isinstance(item, LearnerCheckpointed):
            checkpointed.append(item.offsets)
        elif kind == "commit":  # never before its checkpoint's event, and never one already committed
            assert checkpointed and item == checkpointed[-1], (item, checkpointed)
    assert [item for kind, item in log if kind == "commit"][-1] == checkpointed[-1]
    assert len(checkpointed) == 4 and CheckpointStore(batches, "a").latest().state.step == 4


def test_a_stop_ends_the_wait_of_a_run_the_broker_refuses_in_one_line_and_the_others_checkpoint(
        batches, setup):  # noqa: F811
    packed, (a, b) = packed_pair(batches, setup)
    progress = Progress(a)
    publisher = RefusingOneRun("a", lambda: time.monotonic() < progress.deadline)  # refused until the deadline
    announce_through(publisher, a, b)
    for learner in (a, b):
        learner.outputs.stopping = lambda: len(progress.b_steps) >= 2
    failures: dict[str, Exception] = {}
    packed.resume()
    packed.run(should_stop=lambda: len(progress.b_steps) >= 2, on_step=progress.on_step, poll_timeout_s=0,
               on_failure=failures.__setitem__)
    packed.finish_all(on_failure=failures.__setitem__)
    assert time.monotonic() < progress.deadline  # the stop ended a's wait, not the broker taking its events
    assert list(failures) == ["a"] and isinstance(failures["a"], BrokerAwayOnStop)
    assert len(str(failures["a"]).splitlines()) == 1 and "AdapterPublished v1" in str(failures["a"])
    assert progress.b_steps == [1, 2] and CheckpointStore(batches, "b").latest().state.step == 2
    assert CheckpointStore(batches, "a").latest() is None  # a's step 1 was never checkpointed: trained again


class Holding:
    """Stands in for the training engine: a turn only holds it."""

    @contextlib.contextmanager
    def holding(self, name: str):
        yield None, name


class Run:
    """A run's learner that records its turns and polls: ``delivered`` batches wait, and its writer's job (if
    ``release``) lasts until ``release`` is set, as one the broker refuses does (``refused``) or one that is only
    slow to write."""

    commit = Learner.commit  # a learner's blocking commit, over this stand-in's source
    wait_for_letter = Learner.wait_for_letter  # (its dead letters: none)

    def __init__(self, run_id: str, turns: list[str], delivered: int, release: threading.Event | None = None,
                 refused: bool = True) -> None:
        self.run_id, self.turns, self.cfg = run_id, turns, SimpleNamespace(seed=0)
        self.incoming = deque(range(delivered))
        self.kept_alive = 0
        self.source = SimpleNamespace(exhausted=lambda: False, keep_alive=self.keep_alive)
        # ``refused``: the job waits for the broker to take a write (else its writes are only going)
        self.outputs = SimpleNamespace(writer=StepWriter(), beside=StepWriter(), stopping=lambda: False,
                                       waiting_for_broker=lambda: refused)
        if release is not None:
            self.outputs.writer.submit(lambda: release.wait() and None)  # a job that writes no checkpoint
        self.poll_timeouts: list[float] = []
        self.turned_at: list[float] = []

    def keep_alive(self) -> None:
        self.kept_alive += 1

    def budget_reached(self) -> bool:
        return False

    def run(self, should_stop, on_step, poll_timeout_s: float, wait_for_writes: bool) -> None:
        self.turns.append(self.run_id)
        self.turned_at.append(time.monotonic())
        if not self.incoming:
            self.poll_timeouts.append(poll_timeout_s)

    def finish_step_writes(self) -> None:
        self.outputs.writer.wait()


def test_batches_delivered_to_a_run_whose_writes_wait_do_not_make_the_other_runs_polls_spin():
    """The run whose writes wait cannot ingest its batches; the idle run's polls wait as if none were delivered."""
    release, turns = threading.Event(), []
    waiting, idle = Run("waiting", turns, delivered=5, release=release), Run("idle", turns, delivered=0)
    packed = PackedLearner(Holding(), [waiting, idle])  # type: ignore[arg-type, list-item]
    threading.Timer(5.0, release.set).start()  # (the writes end, so the loop returns)
    packed.run(should_stop=lambda: len(idle.poll_timeouts) >= 3, poll_timeout_s=0.4)
    release.set()
    assert turns == ["idle"] * 3 and idle.poll_timeouts == [0.2] * 3
    assert waiting.kept_alive >= 1  # its consumer polled while it passes its turns


def test_when_every_runs_writes_wait_the_loop_waits_for_them_instead_of_spinning():
    release, turns, rounds = threading.Event(), [], []  # rounds: when each began, in seconds from the start
    runs = [Run(run_id, turns, delivered=1, release=release) for run_id in ("a", "b")]
    packed = PackedLearner(Holding(), runs)  # type: ignore[arg-type, list-item]
    started = time.monotonic()
    threading.Timer(2.5, release.set).start()
    packed.run(should_stop=lambda: {"a", "b"} <= set(turns), poll_timeout_s=0.0,
               between_rounds=lambda packed: rounds.append(time.monotonic() - started))
    assert min(run.turned_at[0] for run in runs) - started > 2.4  # no turn before their writes ended
    assert time.monotonic() - started < 10
    # about a round a second while both waited (a loop that spins makes thousands)
    assert len([at for at in rounds if at < 2.4]) <= 4, rounds
    assert all(run.kept_alive <= 4 for run in runs)  # their consumers polled about once a second, not each round


class Abandonable(Run):
    """A run whose ``finish_step_writes`` raises ``fails`` if given, else whose writer's job waits for the broker until
    its writes are abandoned (``StepOutputs.abandon``)."""

    def __init__(self, run_id: str, turns: list[str], fails: Exception | None = None) -> None:
        super().__init__(run_id, turns, delivered=0)
        self.fails, abandoning = fails, threading.Event()
        if fails is None:
            self.outputs.writer.submit(lambda: abandoning.wait(HELD_FOR_S) and None)
        self.outputs.abandon = lambda: (abandoning.set(), self.outputs.writer.wait_quietly())
        self.reader = SimpleNamespace(close=lambda: None)

    def finish_step_writes(self) -> None:
        if self.fails is not None:
            raise self.fails
        super().finish_step_writes()


def test_an_error_finishing_one_runs_writes_at_the_end_abandons_the_others_writes():
    """Without ``on_failure``, a's last writes failing as the loop ends raise from ``run``; b's writes, still waiting
    for the broker, are abandoned then (their wait ends after the try under way), not left running."""
    turns: list[str] = []
    a, b = Abandonable("a", turns, fails=OSError("the bucket is unreachable")), Abandonable("b", turns)
    packed = PackedLearner(Holding(), [a, b])  # type: ignore[arg-type, list-item]
    started = time.monotonic()
    with pytest.raises(OSError, match="unreachable"):
        packed.run(should_stop=lambda: True, poll_timeout_s=0.0)
    assert b.outputs.writer.done and not b.outputs.writer.busy  # its job ended and was waited for
    assert time.monotonic() - started < HELD_FOR_S / 2  # on the abandon, not on the broker


class SlowRefusals:
    """A source whose offset commits the broker refuses while ``refusing()``, each refusal coming after
    ``REFUSED_AFTER_S`` or the commit's own timeout if shorter (as kafka-python retries a retriable commit error, or
    waits for an unknown coordinator, until its timeout); ``commits`` holds the commits taken."""

    REFUSED_AFTER_S = 2.0

    def __init__(self, run: Run, refusing) -> None:
        self.refusing, self.commits, self.tries = refusing, [], 0
        self.exhausted, self.keep_alive = run.source.exhausted, run.source.keep_alive

    def commit(self, positions: dict[str, int], timeout_s: float | None = None) -> None:
        self.tries += 1
        if self.refusing():
            time.sleep(self.REFUSED_AFTER_S if timeout_s is None else min(timeout_s, self.REFUSED_AFTER_S))
            raise CommitError("commit to group rlpipe-learner-a failed: KafkaTimeoutError")
        self.commits.append(dict(positions))


def owing(run: Run, refusing) -> SlowRefusals:
    """``run`` owes the commit of step 1's checkpoint (written and announced), which its source refuses while
    ``refusing()``."""
    run.source = SlowRefusals(run, refusing)  # type: ignore[assignment]
    run.writes_owed = SimpleNamespace(positions={"t:0": 3}, checkpoint=SimpleNamespace(step=1))
    return run.source


def test_a_commit_the_broker_refuses_slowly_does_not_hold_the_other_runs_turns():
    """Each try of a refused commit in a run's turn is bounded by its own timeout (0.3 s, doubled after each try
    that timed out: 0.6, 1.2, 2.4 s), not by the broker's 5 s refusal; the blocking wait is left to the end
    (``finish``)."""
    turns: list[str] = []
    owes, idle = Run("a", turns, delivered=0), Run("idle", turns, delivered=0)
    source = owing(owes, lambda: len(idle.turned_at) < 4)
    source.REFUSED_AFTER_S = 5.0
    packed = PackedLearner(Holding(), [owes, idle])  # type: ignore[arg-type, list-item]
    packed.runs[0].writes.owed = owes.writes_owed
    packed.run(should_stop=lambda: len(idle.turned_at) >= 4, poll_timeout_s=0.0)
    gaps = [later - earlier for earlier, later in zip(idle.turned_at, idle.turned_at[1:], strict=False)]
    # a try that held the idle run's turn for the whole refusal would leave a 5 s gap; the longest try is 2.4 s
    assert source.tries >= 4 and max(gaps) < source.REFUSED_AFTER_S - 1.5, gaps
    assert source.commits == [{"t:0": 3}]  # taken once the broker took it, at the end
    assert "a" not in turns  # a took no turn (nothing ingested, no step) while it owed the commit


def test_a_run_going_alone_whose_commit_is_refused_lets_comebacks_and_joins_in():
    """Another run waits to come back (or runs are followed for joins): the one run going passes its turns, as
    packed, instead of waiting for the broker in its turn while ``between_rounds`` never runs."""
    turns: list[str] = []
    rounds: list[float] = []
    owes = Run("a", turns, delivered=0)
    started = time.monotonic()
    refused_until = started + 6.0
    source = owing(owes, lambda: time.monotonic() < refused_until)
    source.REFUSED_AFTER_S = 0.0  # refused at once: the wait is the broker's, not one try's
    packed = PackedLearner(Holding(), [owes])  # type: ignore[arg-type, list-item]
    packed.runs[0].writes.owed = owes.writes_owed
    packed.run(should_stop=lambda: len(rounds) >= 3, poll_timeout_s=0.0, until_stopped=lambda: True,
               between_rounds=lambda packed: rounds.append(time.monotonic() - started))
    assert rounds[2] < 4.0, rounds  # rounds went on while a's commit was refused (comebacks and joins run there)
    assert source.commits == [{"t:0": 3}]  # and its commit was still taken, at the end


def test_one_wait_for_a_refused_commit_logs_one_start_line_and_one_end_line(caplog):
    """The commit refused in a's turns, then waited for at the end (``finish``): one wait, two lines."""
    turns: list[str] = []
    owes, idle = Run("a", turns, delivered=0), Run("idle", turns, delivered=0)
    source = owing(owes, lambda: len(idle.turned_at) < 4 or source.tries < 6)  # refused at the end's first try too
    source.REFUSED_AFTER_S = 0.0
    packed = PackedLearner(Holding(), [owes, idle])  # type: ignore[arg-type, list-item]
    packed.runs[0].writes.owed = owes.writes_owed
    with caplog.at_level(logging.INFO, logger="rlpipe.learner"):
        packed.run(should_stop=lambda: len(idle.turned_at) >= 4, poll_timeout_s=0.0)
    lines = [r.getMessage() for r in caplog.records if "step 1's checkpoint" in r.getMessage()]
    assert source.commits == [{"t:0": 3}] and source.tries >= 6
    assert len(lines) == 2, lines
    assert "did not take" in lines[0] and "passes its turns" in lines[0]
    assert "took" in lines[1]
    assert not any("next step waits" in line for line in lines)


def test_a_lone_run_whose_writes_are_only_going_trains_beside_them_while_runs_are_followed():
    """Runs are followed for joins (or one waits to come back), so the one run going is not alone; its last step's
    writes take 1.5 s and nothing refuses them: its next turn comes at once (its step trains beside the writes, and
    waits for them before its own, as a learner of one run), not after them: a step costs about the larger of its
    training and its writes, not their sum."""
    release, turns = threading.Event(), []
    lone = Run("a", turns, delivered=1, release=release, refused=False)
    threading.Timer(1.5, release.set).start()
    packed = PackedLearner(Holding(), [lone])  # type: ignore[arg-type, list-item]
    started = time.monotonic()
    packed.run(should_stop=lambda: bool(turns), poll_timeout_s=0.0, until_stopped=lambda: True)
    release.set()
    assert turns == ["a"] and lone.turned_at[0] - started < 0.75, lone.turned_at[0] - started


def test_a_lone_run_whose_writes_the_broker_refuses_passes_its_turns_while_runs_are_followed():
    """The same run whose writes the broker refuses passes its turns: rounds (joins and comebacks) go on."""
    release, turns, rounds = threading.Event(), [], []
    lone = Run("a", turns, delivered=1, release=release, refused=True)
    threading.Timer(2.5, release.set).start()
    packed = PackedLearner(Holding(), [lone])  # type: ignore[arg-type, list-item]
    started = time.monotonic()
    packed.run(should_stop=lambda: bool(turns), poll_timeout_s=0.0, until_stopped=lambda: True,
               between_rounds=lambda packed: rounds.append(time.monotonic() - started))
    release.set()
    assert lone.turned_at[0] - started > 2.4  # no turn while its writes waited for the broker
    assert len([at for at in rounds if at < 2.4]) >= 2, rounds  # and rounds went on meanwhile


class SlowCommits:
    """A source whose offset commits the broker takes only after ``TAKES_S`` (a far coordinator, a reconnect): a
    commit given less time is refused after its timeout; ``timeouts`` holds each try's."""

    TAKES_S = 1.0

    def __init__(self, run: Run) -> None:
        self.commits: list[dict[str, int]] = []
        self.timeouts: list[float | None] = []
        self.exhausted, self.keep_alive = run.source.exhausted, run.source.keep_alive

    def commit(self, positions: dict[str, int], timeout_s: float | None = None) -> None:
        self.timeouts.append(timeout_s)
        if timeout_s is not None and timeout_s < self.TAKES_S:
            time.sleep(timeout_s)
            raise CommitError("commit to group rlpipe-learner-a failed: KafkaTimeoutError")
        time.sleep(self.TAKES_S)
        self.commits.append(dict(positions))


def test_a_commit_the_broker_always_takes_slowly_is_given_longer_tries_until_it_is_taken_in_the_turns():
    """Every commit takes 1 s, over the first try's 0.3 s: each timed-out try doubles the next one's (0.3, 0.6,
    1.2 s), so the commit is taken in a's turns and a trains again, instead of passing its turns forever."""
    turns: list[str] = []
    owes, idle = Run("a", turns, delivered=1), Run("idle", turns, delivered=0)
    owes.source = source = SlowCommits(owes)  # type: ignore[assignment]
    packed = PackedLearner(Holding(), [owes, idle])  # type: ignore[arg-type, list-item]
    packed.runs[0].writes.owed = SimpleNamespace(positions={"t:0": 3}, checkpoint=SimpleNamespace(step=1))
    packed.run(should_stop=lambda: "a" in turns or len(idle.turned_at) >= 20, poll_timeout_s=0.0)
    assert source.timeouts == [0.3, 0.6, 1.2] and source.commits == [{"t:0": 3}], source.timeouts
    assert "a" in turns  # taken in its turns: a went on
    assert packed.runs[0].writes.try_timeout_s == 0.3  # reset once taken


class Joining(Run):
    """A run joining (or coming back) whose consumer group assigns its partitions only at ``assigned_at``."""

    def __init__(self, run_id: str, turns: list[str], assigned_at: float) -> None:
        super().__init__(run_id, turns, delivered=0)
        self.source.join = lambda timeout_s: time.sleep(timeout_s) or time.monotonic() >= assigned_at
        self.outputs.abandon = lambda: None

    def resume(self, between_tries=None, beside: bool = False) -> bool:
        return False


def test_a_run_joining_its_group_keeps_the_served_runs_consumers_alive():
    """A joining run's group join waits between two rounds, where nothing else runs: the runs already served have
    their consumers polled meanwhile, so their groups keep them."""
    turns: list[str] = []
    served = Run("served", turns, delivered=0)
    packed = PackedLearner(Holding(), [served])  # type: ignore[arg-type, list-item]
    started = time.monotonic()
    packed.add(Joining("j", turns, assigned_at=started + 3.5))  # type: ignore[arg-type]
    assert time.monotonic() - started > 3.4  # it waited for its group
    assert served.kept_alive >= 2  # about once a second meanwhile (none without: nothing else polls it)
    assert [run.run_id for run in packed.runs] == ["served", "j"]


def test_a_warm_start_joining_while_the_broker_refuses_its_writes_keeps_the_served_runs_consumers_alive(
        batches, setup, caplog):  # noqa: F811
    """b joins warm-started from a's v1 while the broker refuses b's events for 3.5 s: its v1 and step-0 checkpoint
    are written between two rounds, where nothing else runs, so the run already served has its consumer polled
    while b's publish waits, and its group keeps it; the wait's first line says that every run waits."""
    caplog.set_level(logging.WARNING, logger="rlpipe.learner")
    cfg_a = config("a")
    a = learner_of(batches, "a", "src-a", LoraPolicy(setup["model_dir"], cfg_a), cfg_a)
    a.run(should_stop=lambda: a.state.step >= 1, poll_timeout_s=0)  # publishes its v1 (publish_every=1)
    served = Run("served", [], delivered=0)
    packed = PackedLearner(Holding(), [served])  # type: ignore[arg-type, list-item]
    refused_until = time.monotonic() + 3.5
    publisher = RefusingOneRun("b", lambda: time.monotonic() < refused_until)
    cfg_b = config("b", init_from="a")
    b = learner_of(batches, "b", "src-b", LoraPolicy(setup["model_dir"], cfg_b), cfg_b)
    announce_through(publisher, b)
    packed.add(b)
    assert publisher.refused and time.monotonic() >= refused_until  # b's start waited out the refusal
    assert served.kept_alive >= 2  # about once a second meanwhile (none without: nothing else polls it)
    assert announced(publisher.taken, "b") == [("AdapterPublished", 1), ("LearnerCheckpointed", 0)]
    assert [run.run_id for run in packed.runs] == ["served", "b"]
    first = [r.getMessage() for r in caplog.records if "did not take AdapterPublished v1" in r.getMessage()]
    assert len(first) == 1 and "every run it serves" in first[0], first


def b_joining_after_as_first_step(batches, setup, publisher: RefusingOneRun):  # noqa: F811
    """b checkpointed at step 2 by a learner before; a packed learner serving a, which b joins after a's first step
    (``between_rounds``), both announcing through ``publisher``, b's commits logged beside its events (in
    ``publisher.taken``).  The learner before, the packed learner, a, b once joined, and ``between_rounds``."""
    cfg = config("b")
    before = learner_of(batches, "b", "src-b", LoraPolicy(setup["model_dir"], cfg), cfg)
    before.run(should_stop=lambda: before.state.step >= 2, poll_timeout_s=0)  # checkpoint_every=2
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    a = learner_of(batches, "a", "src-a", EnginePolicy(engine, "a", config("a")), config("a"))
    announce_through(publisher, a)
    joined: list[Learner] = []

    def between_rounds(packed: PackedLearner) -> None:
        if a.state.step >= 1 and not joined:
            b = learner_of(batches, "b", "src-b", EnginePolicy(engine, "b", cfg), cfg)
            b.source.already_trained = lambda batch_id: batch_id in b.state.trained  # type: ignore[attr-defined]
            b.source = RefusedCommits(b.source, lambda: False, publisher.taken)  # type: ignore[assignment]
            announce_through(publisher, b)
            packed.add(b)
            joined.append(b)

    return before, PackedLearner(engine, [a]), a, joined, between_rounds


def test_a_run_joining_while_the_broker_refuses_its_announcements_passes_its_turns_while_the_others_train(
        batches, setup, caplog):  # noqa: F811
    """b, checkpointed at step 2 by a learner before, joins after a's first step while the broker refuses b's events
    until a has trained its third step (or a deadline): its start's announcements are sent from its own thread, so
    a trains steps 2 and 3 meanwhile (a join that waited for them would hold a until the deadline), and b reads and
    trains nothing before the broker took them and its checkpoint's offsets are committed, after them, as the
    wait's first line says."""
    caplog.set_level(logging.WARNING, logger="rlpipe.learner")
    deadline = time.monotonic() + HELD_FOR_S
    steps: list[tuple[str, int]] = []
    publisher = RefusingOneRun("b", lambda: len(steps) < 3 and time.monotonic() < deadline)
    log = publisher.taken  # the events taken, and b's commits beside them, in order
    before, packed, _, joined, between_rounds = b_joining_after_as_first_step(batches, setup, publisher)
    read_at_a_steps: list[tuple[int, dict[str, int]]] = []  # b's step and what it had read, at a's steps 2 and 3

    def on_step(run: str, metrics: dict) -> None:
        steps.append((run, metrics["step"]))
        if run == "a" and joined and len(read_at_a_steps) < 2:
            read_at_a_steps.append((joined[0].state.step, dict(joined[0].ingested)))

    packed.resume()
    packed.run(on_step=on_step, poll_timeout_s=0, between_rounds=between_rounds)
    assert time.monotonic() < deadline  # a's third step ended the refusal, not the deadline
    assert publisher.refused  # b's LearnerCheckpointed of step 2, announced again at its start
    b = joined[0]
    # a trained its steps 2 and 3 while b's announcements were refused; b read and trained nothing meanwhile
    assert steps[:3] == [("a", 1), ("a", 2), ("a", 3)]
    assert read_at_a_steps == [(2, read_at_a_steps[0][1])] * 2 and read_at_a_steps[0][1] == before.state.positions
    assert sorted(step for run, step in steps if run == "b") == [3, 4]
    # b's writes, taken in this order: its checkpoint announced again first, its offsets committed once the broker
    # took it, then its own steps' writes
    b_writes = [item if isinstance(item, tuple) else (type(item.payload).__name__, item.payload)
                for item in log if isinstance(item, tuple) or item.run_id == "b"]
    assert [(kind, what if kind == "commit" else what.step if kind == "LearnerCheckpointed" else what.version)
            for kind, what in b_writes if kind in ("commit", "AdapterPublished", "LearnerCheckpointed")] == [
        ("LearnerCheckpointed", 2), ("commit", before.state.positions), ("AdapterPublished", 3),
        ("AdapterPublished", 4), ("LearnerCheckpointed", 4), ("commit", b.state.positions)]
    assert CheckpointStore(batches, "b").latest().state.step == b.state.step == 4
    first = [r.getMessage() for r in caplog.records if "did not take LearnerCheckpointed of step 2" in r.getMessage()]
    assert len(first) == 1 and "the run passes its turns, reading and training nothing" in first[0], first


def test_a_lone_run_training_beside_its_writes_while_runs_are_followed_keeps_a_learners_order(
        batches, setup):  # noqa: F811
    """The one run going, runs followed for joins: its steps train beside its writes, which stay in a learner's
    order (each commit after its checkpoint's event, every checkpoint written and committed)."""
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    cfg = config("a", checkpoint_every=1)
    a = learner_of(batches, "a", "src-a", EnginePolicy(engine, "a", cfg), cfg)
    log: list = []
    source = RefusedCommits(a.source, lambda: False, log)
    a.source = source  # type: ignore[assignment]
    a.announce = a.outputs.announce = lambda payload: log.append(("event", payload))
    packed = PackedLearner(engine, [a])
    packed.resume()
    steps: list[int] = []
    packed.run(should_stop=lambda: len(steps) >= 4, on_step=lambda run, metrics: steps.append(metrics["step"]),
               poll_timeout_s=0, until_stopped=lambda: True)
    checkpointed: list[dict[str, int]] = []
    for kind, item in log:
        if kind == "event" and isinstance(item, LearnerCheckpointed):
            checkpointed.append(item.offsets)
        elif kind == "commit":
            assert checkpointed and item == checkpointed[-1], (item, checkpointed)
    assert steps == [1, 2, 3, 4] and len(checkpointed) == 4
    assert [item for kind, item in log if kind == "commit"][-4:] == checkpointed
    assert CheckpointStore(batches, "a").latest().state.step == 4


class RefusingOneOfAs:
    """A publisher that refuses a's events that ``which(payload)`` picks while ``refusing()`` and takes every other
    event; ``taken`` holds what it took, in order.  ``for_good``: a refusal no try can change (not transient)."""

    def __init__(self, which, refusing, for_good: bool = False) -> None:
        self.which, self.refusing, self.for_good = which, refusing, for_good
        self.taken: list = []
        self.refused = 0

    def publish(self, kind: str, event):
        if event.run_id == "a" and self.which(event.payload) and self.refusing():
            self.refused += 1
            if self.for_good:
                raise PublishError(f"publishing a {event.type} to ns.{kind} failed: TopicAuthorizationFailedError",
                                   transient=False)
            raise PublishError(f"publishing a {event.type} to ns.{kind} failed: NotEnoughReplicasError")
        self.taken.append(event)
        return 0, len(self.taken)


def finishing_first(batches, setup):  # noqa: F811
    """a (2 steps, checkpoints every 3: its final checkpoint is a write of its own) finishes before b (4 steps)."""
    engine = TrainingEngine(setup["model_dir"], device="cpu")
    cfgs = {"a": config("a", max_steps=2, checkpoint_every=3), "b": config("b", max_steps=4)}
    learners = [learner_of(batches, run, f"src-{run}", EnginePolicy(engine, run, cfgs[run]), cfgs[run])
                for run in SOURCES]
    return PackedLearner(engine, learners), learners


class RefusedAtBSteps:
    """``Progress.on_step``, and at each of b's steps how many refusals a had met (``refused()``) and how far it had
    read, taken once a's writer and its dead letter have ended or wait for the broker, so what a's writes reached
    does not depend on their speed."""

    def __init__(self, progress: Progress, a: Learner, refused) -> None:
        self.progress, self.a, self.refused = progress, a, refused
        self.counts: list[int] = []
        self.a_read: list[dict[str, int]] = []

    def on_step(self, run: str, metrics: dict) -> None:
        self.progress.on_step(run, metrics)
        if run == "b":
            writes = self.a.outputs
            wait_for(lambda: (writes.writer.done or writes.waiting_for_broker())
                     and (writes.beside.done or self.refused() > 0), 20, "a's writes")
            self.counts.append(self.refused())
            self.a_read.append(dict(self.a.ingested))


def test_a_run_at_its_budget_whose_final_checkpoint_the_broker_refuses_passes_its_turns_while_the_other_trains(
        batches, setup):  # noqa: F811
    """a's final checkpoint (step 2) is written by its writer and its event refused until b has trained its last
    step: b trains steps 3 and 4 meanwhile (a loop in which a's settling held b would see the refusal end on the
    deadline instead), and a's final checkpoint is announced once the broker takes it."""
    packed, (a, b) = finishing_first(batches, setup)
    progress = Progress(a)
    publisher = RefusingOneOfAs(lambda payload: isinstance(payload, LearnerCheckpointed) and payload.step == 2,
                                lambda: len(progress.b_steps) < 4 and time.monotonic() < progress.deadline)
    announce_through(publisher, a, b)
    b_steps = RefusedAtBSteps(progress, a, lambda: publisher.refused)
    packed.resume()
    packed.run(on_step=b_steps.on_step, poll_timeout_s=0)
    assert time.monotonic() < progress.deadline  # b's last step ended the refusal, not the deadline
    assert progress.b_steps == [1, 2, 3, 4] and progress.a_step_at_b_steps[2:] == [2, 2]
    assert b_steps.counts[2] >= 1  # b's steps 3 and 4 trained while a's final checkpoint was refused
    assert announced(publisher.taken, "a") == [("AdapterPublished", 1), ("AdapterPublished", 2),
                                               ("LearnerCheckpointed", 2)]
    assert CheckpointStore(batches, "a").latest().state.step == 2
    assert CheckpointStore(batches, "b").latest().state.step == 4


def test_a_run_at_its_budget_whose_final_commit_the_broker_refuses_passes_its_turns_and_commits_after_its_event(
        batches, setup):  # noqa: F811
    """The broker takes a's final checkpoint's event but refuses its offset commit until b has trained its last
    step: b trains meanwhile, and a's final commit follows its checkpoint's event."""
    packed, (a, _) = finishing_first(batches, setup)
    progress = Progress(a)
    log: list = []
    source = RefusedCommits(a.source, lambda: len(progress.b_steps) < 4 and time.monotonic() < progress.deadline, log)
    a.source = source  # type: ignore[assignment]
    a.announce = a.outputs.announce = lambda payload: log.append(("event", payload))
    b_steps = RefusedAtBSteps(progress, a, lambda: source.refused)
    packed.resume()
    packed.run(on_step=b_steps.on_step, poll_timeout_s=0)
    assert time.monotonic() < progress.deadline  # b's last step ended the refusal, not the deadline
    assert progress.b_steps == [1, 2, 3, 4] and progress.a_step_at_b_steps[2:] == [2, 2]
    assert b_steps.counts[3] >= 1  # b's last step trained while a's final commit was refused
    checkpointed: list[dict[str, int]] = []
    for kind, item in log:
        if kind == "event" and isinstance(item, LearnerCheckpointed):
            checkpointed.append(item.offsets)
        elif kind == "commit":  # never before its checkpoint's event
            assert checkpointed and item == checkpointed[-1], (item, checkpointed)
    assert len(checkpointed) == 1 and [item for kind, item in log if kind == "commit"] == checkpointed
    assert CheckpointStore(batches, "a").latest().state.step == 2


def damaging_second_batch(a: Learner) -> str:
    """a's second batch cannot be read (its rows do not match its checksum): it is dead-lettered; its id."""
    damaged = a.source.queue[1].batch_id  # type: ignore[attr-defined]
    read = a.reader.read

    def read_or_refuse(ref):
        if ref.batch_id == damaged:
            raise ValueError(f"trajectory batch {ref.batch_id}: its rows do not match its checksum")
        return read(ref)

    a.reader.read = read_or_refuse  # type: ignore[method-assign]
    return damaged


def test_a_run_whose_dead_letter_the_broker_refuses_passes_its_turns_and_reads_nothing_past_the_batch(
        batches, setup):  # noqa: F811
    """a's second batch cannot be read, and the broker refuses its DeadLetter until b has trained its last step: b
    trains meanwhile, a reads nothing past the batch until the letter is taken, and the step that covers the batch
    is announced after it."""
    packed, (a, b) = packed_pair(batches, setup)
    damaged = damaging_second_batch(a)
    progress = Progress(a)
    publisher = RefusingOneOfAs(lambda payload: isinstance(payload, DeadLetter),
                                lambda: len(progress.b_steps) < 4 and time.monotonic() < progress.deadline)
    announce_through(publisher, a, b)
    b_steps = RefusedAtBSteps(progress, a, lambda: publisher.refused)
    packed.resume()
    packed.run(on_step=b_steps.on_step, poll_timeout_s=0)
    assert time.monotonic() < progress.deadline  # b's last step ended the refusal, not the deadline
    assert progress.b_steps == [1, 2, 3, 4]
    # a met the batch in its second turn: b's steps 2 to 4 trained while its letter was refused, and a read nothing
    # past the batch (nor trained) meanwhile
    assert b_steps.counts[1] >= 1 and b_steps.a_read[1] == b_steps.a_read[2] == b_steps.a_read[3]
    assert progress.a_step_at_b_steps[1:] == [1, 1, 1]
    taken = [(type(e.payload).__name__, getattr(e.payload, "key", None)) for e in publisher.taken
             if e.run_id == "a" and isinstance(e.payload, AdapterPublished | LearnerCheckpointed | DeadLetter)]
    assert taken == [("AdapterPublished", None), ("DeadLetter", damaged), ("AdapterPublished", None),
                     ("LearnerCheckpointed", None), ("AdapterPublished", None), ("LearnerCheckpointed", None)]
    latest = CheckpointStore(batches, "a").latest().state
    assert latest.step == 3 and damaged not in latest.trained and len(latest.trained) == 3


def stopping_once(progress: Progress, refused, learners: list[Learner]):
    """A stop once b has trained three steps and a's write has been refused (``refused()``), which also ends the
    learners' waits for the broker (``StepOutputs.stopping``)."""

    def should_stop() -> bool:
        return len(progress.b_steps) >= 3 and refused() >= 1

    for learner in learners:
        learner.outputs.stopping = should_stop
    return should_stop


def test_a_stop_while_a_run_settles_in_its_turns_and_its_final_checkpoint_is_refused_ends_its_wait_in_one_line(
        batches, setup):  # noqa: F811
    """a, at its budget, settles in its turns while the broker refuses its final checkpoint's event until a
    deadline; a stop comes meanwhile: a's wait ends (``BrokerAwayOnStop``, one line, its offsets never committed:
    the next start announces the event and resumes), and b is checkpointed at its last step."""
    packed, (a, b) = finishing_first(batches, setup)
    progress = Progress(a)
    publisher = RefusingOneOfAs(lambda payload: isinstance(payload, LearnerCheckpointed) and payload.step == 2,
                                lambda: time.monotonic() < progress.deadline)
    announce_through(publisher, a, b)
    commits: list = []
    a.source = RefusedCommits(a.source, lambda: False, commits)  # type: ignore[assignment]
    should_stop = stopping_once(progress, lambda: publisher.refused, [a, b])
    failures: dict[str, Exception] = {}
    packed.resume()
    packed.run(should_stop=should_stop, on_step=progress.on_step, poll_timeout_s=0, on_failure=failures.__setitem__)
    packed.finish_all(on_failure=failures.__setitem__)
    assert time.monotonic() < progress.deadline  # the stop ended a's wait, not the broker taking its event
    assert list(failures) == ["a"] and isinstance(failures["a"], BrokerAwayOnStop)
    assert len(str(failures["a"]).splitlines()) == 1 and "LearnerCheckpointed of step 2" in str(failures["a"])
    assert a.state.step == 2 and commits == []  # its final checkpoint's offsets never committed
    assert announced(publisher.taken, "a") == [("AdapterPublished", 1), ("AdapterPublished", 2)]
    assert [run.run_id for run in packed.runs] == ["b"] and b.state.step >= 3
    assert CheckpointStore(batches, "b").latest().state.step == b.state.step


def test_a_stop_while_a_runs_dead_letter_is_refused_ends_its_wait_and_commits_nothing_past_the_batch(
        batches, setup, caplog):  # noqa: F811
    """a's second batch is dead-lettered and the broker refuses its DeadLetter until a deadline; a stop comes
    meanwhile: a's wait ends (``BrokerAwayOnStop`` naming the letter), nothing of a's is committed or checkpointed
    past the batch (the next start dead-letters it again), and b is checkpointed at its last step."""
    packed, (a, b) = packed_pair(batches, setup, checkpoint_every=1)
    damaged = damaging_second_batch(a)
    progress = Progress(a)
    publisher = RefusingOneOfAs(lambda payload: isinstance(payload, DeadLetter),
                                lambda: time.monotonic() < progress.deadline)
    announce_through(publisher, a, b)
    commits: list = []
    a.source = RefusedCommits(a.source, lambda: False, commits)  # type: ignore[assignment]
    should_stop = stopping_once(progress, lambda: publisher.refused, [a, b])
    failures: dict[str, Exception] = {}
    packed.resume()
    with caplog.at_level(logging.WARNING, logger="rlpipe.learner"):
        packed.run(should_stop=should_stop, on_step=progress.on_step, poll_timeout_s=0,
                   on_failure=failures.__setitem__)
    packed.finish_all(on_failure=failures.__setitem__)
    assert time.monotonic() < progress.deadline  # the stop ended a's wait, not the broker taking the letter
    assert list(failures) == ["a"] and isinstance(failures["a"], BrokerAwayOnStop)
    assert len(str(failures["a"]).splitlines()) == 1 and f"DeadLetter of batch {damaged}" in str(failures["a"])
    assert any(f"{damaged} quarantined" in r.getMessage() and "sending to the dead-letter topic" in r.getMessage()
               for r in caplog.records)  # logged as being sent: the broker had not taken it
    assert not any(isinstance(e.payload, DeadLetter) for e in publisher.taken)
    # step 1's checkpoint (its first batch) committed; nothing checkpointed or committed past the damaged batch
    assert announced(publisher.taken, "a") == [("AdapterPublished", 1), ("LearnerCheckpointed", 1)]
    latest = CheckpointStore(batches, "a").latest().state
    assert latest.step == 1 and len(latest.trained) == 1 and damaged not in latest.trained
    assert [item for _, item in commits] == [latest.positions]
    assert b.state.step >= 3 and CheckpointStore(batches, "b").latest().state.step == b.state.step


def test_a_dead_letter_the_broker_refuses_for_good_drops_its_run_at_its_next_turn_and_the_other_trains_on(
        batches, setup):  # noqa: F811
    """The broker refuses a's DeadLetter in a way no try changes (not transient): the letter's thread ends on it
    at once, and a's next turn raises it, so a is dropped (reported to ``on_failure``) with nothing committed past
    the batch, while b trains all its steps."""
    packed, (a, b) = packed_pair(batches, setup)
    damaged = damaging_second_batch(a)
    progress = Progress(a)
    publisher = RefusingOneOfAs(lambda payload: isinstance(payload, DeadLetter), lambda: True, for_good=True)
    announce_through(publisher, a, b)
    failures: list[tuple[str, Exception, int]] = []  # who failed, on what, at how many of b's steps
    packed.resume()
    packed.run(on_step=progress.on_step, poll_timeout_s=0,
               on_failure=lambda run, exc: failures.append((run, exc, len(progress.b_steps))))
    assert publisher.refused == 1  # tried once: no try changes it
    assert [(run, type(exc)) for run, exc, _ in failures] == [("a", PublishError)]
    assert "TopicAuthorizationFailedError" in str(failures[0][1])
    assert failures[0][2] < 4  # dropped while b trained on, not at the loop's end
    assert a.state.step == 1 and [run.run_id for run in packed.runs] == ["b"]
    assert CheckpointStore(batches, "a").latest() is None  # (checkpoints every 2) nothing past the batch either
    assert damaged not in a.state.trained and len(a.state.trained) == 1
    assert progress.b_steps == [1, 2, 3, 4] and CheckpointStore(batches, "b").latest().state.step == 4


@pytest.mark.parametrize("refused", ["event", "commit"])
def test_a_run_asked_to_leave_whose_final_checkpoint_the_broker_refuses_settles_in_its_turns_while_the_other_trains(
        batches, setup, refused):  # noqa: F811
    """a is asked to leave after its first step (checkpoints every 3: its final checkpoint, step 1, is a write of its
    own), and the broker refuses that checkpoint's event, or its offset commit, until b has trained three steps: b
    trains meanwhile (a leave that held b would see the refusal end on the deadline instead), and a is taken out
    only once the broker took them, its checkpoint committed once."""
    packed, (a, b) = packed_pair(batches, setup, checkpoint_every=3)
    progress = Progress(a)
    publisher = RefusingOneOfAs(lambda payload: refused == "event" and isinstance(payload, LearnerCheckpointed),
                                progress.refusing)
    announce_through(publisher, a, b)
    commits: list = []
    source = RefusedCommits(a.source, lambda: refused == "commit" and progress.refusing(), commits)
    a.source = source  # type: ignore[assignment]
    b_steps = RefusedAtBSteps(progress, a, lambda: publisher.refused + source.refused)
    left: list[tuple[Learner, list, list]] = []  # who left, with a's events and commits taken by then

    def on_left(learner: Learner) -> None:
        left.append((learner, announced(publisher.taken, "a"), [dict(item) for _, item in commits]))

    asked: list[str] = []

    def between_rounds(packed: PackedLearner) -> None:
        if a.state.step >= 1 and not asked:
            packed.leave("a", on_left)
            asked.append("a")

    packed.resume()
    packed.run(on_step=b_steps.on_step, poll_timeout_s=0, between_rounds=between_rounds,
               until_stopped=lambda: not left)
    assert time.monotonic() < progress.deadline  # b's third step ended the refusal, not the deadline
    assert progress.b_steps == [1, 2, 3, 4] and progress.a_step_at_b_steps == [1, 1, 1, 1]  # a trained no more
    assert b_steps.counts[2] >= 1  # b's steps trained while a's final checkpoint was refused
    checkpointed = [e.payload.offsets for e in publisher.taken
                    if e.run_id == "a" and isinstance(e.payload, LearnerCheckpointed)]
    assert len(checkpointed) == 1 and CheckpointStore(batches, "a").latest().state.step == 1
    # a left once, after the broker took its final checkpoint's event and commit, which it committed once
    assert [(learner, events) for learner, events, _ in left] == [
        (a, [("AdapterPublished", 1), ("LearnerCheckpointed", 1)])]
    assert left[0][2] == checkpointed and [item for _, item in commits] == checkpointed
    assert [run.run_id for run in packed.runs] == ["b"]
    with pytest.raises(EngineError):  # its adapter left the engine with it
        packed.engine.adapter_snapshot("a")
    assert CheckpointStore(batches, "b").latest().state.step == 4


def test_a_stop_while_a_run_is_leaving_still_writes_its_final_checkpoint_and_lets_it_go(batches, setup):  # noqa: F811
    """The loop stops after b's second step while the broker still refuses the final checkpoint's event of a, asked
    to leave after its first step: the stop waits for the broker to take it (here 2 s after the stop), commits it
    and lets a go, and b's final checkpoint is written too."""
    packed, (a, b) = packed_pair(batches, setup, checkpoint_every=3)
    progress = Progress(a)
    stopped_at: list[float] = []

    def should_stop() -> bool:
        if len(progress.b_steps) >= 2 and not stopped_at:
            stopped_at.append(time.monotonic())
        return bool(stopped_at)

    publisher = RefusingOneOfAs(lambda payload: isinstance(payload, LearnerCheckpointed),
                                lambda: not stopped_at or time.monotonic() < stopped_at[0] + 2.0)
    announce_through(publisher, a, b)
    commits: list = []
    a.source = RefusedCommits(a.source, lambda: False, commits)  # type: ignore[assignment]
    left: list[Learner] = []

    def between_rounds(packed: PackedLearner) -> None:
        if a.state.step >= 1 and not any(run.leaving for run in packed.runs) and not left:
            packed.leave("a", left.append)

    packed.resume()
    packed.run(should_stop=should_stop, on_step=progress.on_step, poll_timeout_s=0, between_rounds=between_rounds,
               until_stopped=True)
    packed.finish_all()
    assert publisher.refused and progress.b_steps == [1, 2]
    assert left == [a] and [run.run_id for run in packed.runs] == ["b"]
    checkpointed = [e.payload.offsets for e in publisher.taken
                    if e.run_id == "a" and isinstance(e.payload, LearnerCheckpointed)]
    assert len(checkpointed) == 1 and [item for _, item in commits] == checkpointed  # committed once
    assert CheckpointStore(batches, "a").latest().state.step == 1 and a.state.step == 1
    assert CheckpointStore(batches, "b").latest().state.step == 2


def test_a_run_finished_with_its_dead_letter_refused_commits_nothing_past_it() -> None:
    """Finishing a packed run's writes waits for its dead letter before the step's offsets: a letter refused for
    good raises, and the checkpoint's positions (past the lettered batch) are not committed."""
    from consumers.packed_writes import RunWrites

    def refused() -> None:
        raise PublishError("publishing a DeadLetter to rlpipe.dlq failed: refused", transient=False)

    letters = StepWriter("test-letters")
    letters.submit(refused)
    committed: list[str] = []
    learner = SimpleNamespace(outputs=SimpleNamespace(beside=letters), source=SimpleNamespace(keep_alive=lambda: None),
                              finish_step_writes=lambda: committed.append("the step's offsets"))
    learner.wait_for_letter = lambda: Learner.wait_for_letter(learner)  # type: ignore[arg-type]
    with pytest.raises(PublishError, match="DeadLetter"):
        RunWrites(learner).finish()  # type: ignore[arg-type]
    assert committed == []


@pytest.mark.parametrize("settles", ["at its budget", "leaving"])
def test_a_run_settling_while_the_others_writes_are_refused_settles_without_waiting_for_them(
        batches, setup, settles):  # noqa: F811
    """a settles in its turns (at its budget, or asked to leave after its first step) while the broker refuses b's
    events until a has settled (or a deadline): b, the one run still training, passes its turns instead of waiting
    for the broker in them as a run going alone would, so a's final checkpoint is written and taken (a let go)
    while b's writes are refused, and b trains on once the broker takes them."""
    if settles == "leaving":
        packed, (a, b) = packed_pair(batches, setup, checkpoint_every=3)
    else:
        packed, (a, b) = finishing_first(batches, setup)
    deadline = time.monotonic() + HELD_FOR_S
    left: list[Learner] = []

    def a_settled() -> bool:
        return bool(left) or any(run.run_id == "a" and run.settled for run in packed.runs)

    publisher = RefusingOneRun("b", lambda: not a_settled() and time.monotonic() < deadline)
    announce_through(publisher, a, b)

    def between_rounds(packed: PackedLearner) -> None:
        if settles == "leaving" and a.state.step >= 1 and not any(run.leaving for run in packed.runs) and not left:
            packed.leave("a", left.append)

    packed.resume()
    packed.run(poll_timeout_s=0, between_rounds=between_rounds)
    assert time.monotonic() < deadline  # a settled while b's writes were refused, not once the deadline ended them
    assert publisher.refused  # b's first step's AdapterPublished, refused until a settled
    final = 1 if settles == "leaving" else 2
    assert announced(publisher.taken, "a")[-1] == ("LearnerCheckpointed", final)
    assert CheckpointStore(batches, "a").latest().state.step == a.state.step == final
    assert left == ([a] if settles == "leaving" else [])
    # b's writes in a learner's order, every step trained: a checkpoint every ``checkpoint_every`` steps, and its last
    every = b.cfg.checkpoint_every
    assert announced(publisher.taken, "b") == [
        event for step in range(1, 5) for event in [("AdapterPublished", step)]
        + ([("LearnerCheckpointed", step)] if step % every == 0 or step == 4 else [])]
    assert CheckpointStore(batches, "b").latest().state.step == 4


def test_a_stop_while_a_joining_runs_announcements_are_refused_ends_its_wait_and_commits_nothing(
        batches, setup):  # noqa: F811
    """The broker refuses b's events until a deadline; a stop after a's third step ends the wait of b's start
    (``BrokerAwayOnStop``, one line): b committed and trained nothing, and a is checkpointed at its last step."""
    deadline = time.monotonic() + HELD_FOR_S
    publisher = RefusingOneRun("b", lambda: time.monotonic() < deadline)
    _, packed, a, joined, between_rounds = b_joining_after_as_first_step(batches, setup, publisher)

    def should_stop() -> bool:
        return a.state.step >= 3 and publisher.refused >= 1

    a.outputs.stopping = should_stop

    def joining(packed: PackedLearner) -> None:
        between_rounds(packed)
        for b in joined:
            b.outputs.stopping = should_stop

    failures: dict[str, Exception] = {}
    packed.resume()
    packed.run(should_stop=should_stop, poll_timeout_s=0, between_rounds=joining, on_failure=failures.__setitem__)
    packed.finish_all(on_failure=failures.__setitem__)
    assert time.monotonic() < deadline  # the stop ended b's wait, not the broker taking its events
    assert list(failures) == ["b"] and isinstance(failures["b"], BrokerAwayOnStop)
    assert len(str(failures["b"]).splitlines()) == 1 and "LearnerCheckpointed of step 2" in str(failures["b"])
    b = joined[0]
    assert b.state.step == 2 and not [item for item in publisher.taken if isinstance(item, tuple)]  # no commit
    assert CheckpointStore(batches, "b").latest().state.step == 2
    assert [run.run_id for run in packed.runs] == ["a"]
    assert CheckpointStore(batches, "a").latest().state.step == a.state.step >= 3
