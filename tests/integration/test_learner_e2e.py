"""Learner acceptance tests against the real parts: the Tansu broker, ``rlpipe`` processes, a file:// store.

One set of small trajectory batches (``N_BATCHES`` of ``ROWS_PER_BATCH`` one-token answers, one optimizer
step per batch) is written once to the store under run ``src``.  Every learner below trains on exactly
those batches, in the same order, with the same seed and one torch thread, so on the CPU every learner
must end with bitwise the same adapter as the offline replay (``replay_train``, the reference).

1. Crash check: ``rlpipe learner start``, a real subprocess, is killed with SIGKILL at 10 points while
   ``rlpipe replay --to-topic`` feeds it (some batches announced twice): at exact points through the
   learner's ``RLPIPE_FAULT`` hook (a checkpoint durable but its offsets not committed; a version
   published but not checkpointed; before a checkpoint) and at random times from here.  After the final
   restart every batch was trained in exactly one step, steps are 1..N, adapter versions are dense, a
   step published twice (crash after publish) published the same weights twice, and every version equals
   the reference's version of its step bitwise.  The last start is stopped with SIGTERM while only
   already-trained duplicates wait: it exits 0 without a phantom step or version.
2. Replay: the event log through a real consumer group (``run_learner``) and the offline replay from
   Parquet (``replay_train``) give bitwise the same adapter at every version.  Both run in this process
   (a fresh interpreter costs about 10 s of imports here); the crash check runs the real command.
3. Stale rows: covered by ``tests/consumers/test_learner.py``; the Kafka path shares ``Learner.ingest``.
4. A broker restart between two learner runs: the embedded stack (broker log in S3 on the journaled local S3
   server) keeps every event at its offset, so the learner resumes where it was; a broker that lost its log
   (memory storage) is detected by the topic id recorded in the checkpoint and read from its start.  Either
   way every batch is trained exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from consumers.checkpoint import CheckpointStore
from consumers.cli import replay_command
from consumers.service import replay_train, run_learner
from consumers.sources import learner_group_id
from pipeline.config import resolve_config
from pipeline.devstack.broker import TansuBroker
from pipeline.devstack.gcs_emulator import free_port
from pipeline.devstack.stack import DevStack
from pipeline.io import bus
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.bus import GROUP_TIMINGS_ENV, describe_topic, group_lag
from pipeline.io.registry import AdapterRegistry
from pipeline.io.steplog import StepLog
from pipeline.io.store import ObjectStore
from pipeline.runtime import StopFlag
from schemas.checkpoint import LearnerState
from schemas.config import BusConfig
from schemas.events import AdapterPublished, LearnerCheckpointed
from schemas.trajectory import NO_ADAPTER_SHA

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SRC = "src"  # the run whose stored batches every learner here trains on
N_BATCHES = 24
ROWS_PER_BATCH = 4  # two groups of two answers, one rewarded and one not: advantages +-0.5
FIRST_DAY, SECOND_DAY = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 2, tzinfo=UTC)
FIRST_DAY_BATCHES = 6  # announced first; then every batch is announced, so these six travel twice
# Short group timings (passed through the learner's RLPIPE_KAFKA_GROUP_TIMINGS_MS): with Kafka's 45 s session
# a restarted learner waits about 80 s on Tansu for the killed member to time out.  A 4 s session has expired
# before the next learner has imported torch, and still tolerates a heartbeat thread starved on a busy machine.
GROUP_TIMINGS = {"session_timeout_ms": 4000, "heartbeat_interval_ms": 300, "max_poll_interval_ms": 30_000}
PROCESS_TIMEOUT_S = 120.0
LEARNER = {
    "lora_rank": 4, "lora_alpha": 8, "learning_rate": 2e-2, "batch_rows": ROWS_PER_BATCH, "publish_every": 1,
    "checkpoint_every": 1, "max_staleness": 1000, "max_steps": N_BATCHES, "device": "cpu", "torch_threads": 1,
    "seed": 0,
}


# ---- the batches ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    """The store holding ``src``'s batches, the model, and where processes keep their files."""

    root: Path
    store_url: str
    model_dir: str
    batch_ids: tuple[str, ...]  # in store (= replay = announcement) order
    processes: list[subprocess.Popen] = field(default_factory=list)  # killed at the end if still running

    @property
    def store(self) -> ObjectStore:
        return ObjectStore(self.store_url)


def one_token_rows(batch_id: str, prompt: list[int], answers: tuple[int, int], base_logp: torch.Tensor) -> list[dict]:
    """Two groups, each with the rewarded answer and the other one, sampled (logprob) by the base model."""
    good, bad = answers
    rows = []
    for group in range(2):
        for token in (good, bad):
            rows.append(dict(
                run_id=SRC, batch_id=batch_id, episode_id=f"{batch_id}-{group}-{token}", group_id=f"{batch_id}-g{group}",
                env="toy", env_seed=group, producer_id="p", policy_version=0, adapter_sha256=NO_ADAPTER_SHA,
                tokens=prompt + [token], loss_mask=[0] * len(prompt) + [1],
                logprobs=[0.0] * len(prompt) + [float(base_logp[token])], turn_rewards=[float(token == good)],
                reward=float(token == good), num_turns=1, success=token == good, terminated=True, truncated=False,
                created_at=FIRST_DAY,
            ))
    return rows


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str, tiny_tokenizer: Any) -> Iterator[World]:
    root = tmp_path_factory.mktemp("learner-e2e")
    store = ObjectStore((root / "store").as_uri())
    prompt = list(tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say L or R."}], tokenize=True, add_generation_prompt=True, return_dict=False))
    answers = tuple(tiny_tokenizer.encode(text, add_special_tokens=False)[0] for text in ("L", "R"))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(torch.tensor([prompt])).logits
    base_logp = torch.log_softmax(logits[0, -1].float(), -1)
    archive, batch_ids = TrajectoryArchive(store), []
    for index in range(N_BATCHES):
        batch_id = f"b{index:03d}"
        day = FIRST_DAY if index < FIRST_DAY_BATCHES else SECOND_DAY
        archive.write_batch(SRC, one_token_rows(batch_id, prompt, answers, base_logp), batch_id=batch_id, created=day)
        batch_ids.append(batch_id)
    world = World(root, store.url(""), tiny_model_dir, tuple(batch_ids))
    yield world
    for proc in world.processes:  # a failed test may leave a learner behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- processes -----------------------------------------------------------------------------------------------


def write_config(world: World, run_id: str, bus: BusConfig | None = None, name: str | None = None,
                 **learner: Any) -> Path:
    config: dict[str, Any] = {
        "run_id": run_id,
        "model": {"base_model": world.model_dir},
        "store": {"root": world.store_url},
        "learner": {**LEARNER, **learner},
    }
    if bus is not None:
        config["bus"] = {"bootstrap_servers": bus.bootstrap_servers, "namespace": bus.namespace,
                         "connect_timeout_s": bus.connect_timeout_s}
    path = world.root / f"{name or run_id}-{bus.namespace if bus else 'offline'}.json"
    path.write_text(json.dumps(config))
    return path


def rlpipe(world: World, args: list[str], log_name: str, fault: str | None = None) -> subprocess.Popen:
    """``rlpipe <args>`` in a fresh interpreter (RLPIPE_HOME in tmp), output to a log file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    env |= {"RLPIPE_HOME": str(world.root / "home"), GROUP_TIMINGS_ENV: json.dumps(GROUP_TIMINGS),
            "PYTHONUNBUFFERED": "1"}
    if fault is not None:
        env["RLPIPE_FAULT"] = fault
    log = open(world.root / log_name, "w")  # noqa: SIM115  # closed with the process by wait_for
    command = [sys.executable, "-c", "from pipeline.cli.main import main; main()", *args]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = world.root / log_name  # type: ignore[attr-defined]
    proc.log_file = log  # type: ignore[attr-defined]
    world.processes.append(proc)
    return proc


def output_of(proc: subprocess.Popen, tail_chars: int = 3000) -> str:
    return Path(proc.log_path).read_text()[-tail_chars:]  # type: ignore[attr-defined]


def wait_until(condition: Callable[[], bool], proc: subprocess.Popen, what: str,
               timeout_s: float = PROCESS_TIMEOUT_S) -> None:
    """Poll ``condition`` while ``proc`` runs; fail with its output if it exits or time runs out first."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{what}: not reached (exit code {proc.poll()}):\n{output_of(proc)}")
        time.sleep(0.05)


def wait_for(proc: subprocess.Popen, timeout_s: float = PROCESS_TIMEOUT_S) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"process did not finish within {timeout_s:g}s:\n{output_of(proc)}")
    finally:
        proc.log_file.close()  # type: ignore[attr-defined]


def announce(world: World, config: Path, date_to: str | None = None, date_from: str | None = None) -> None:
    """``rlpipe replay --run src --to-topic`` (in this process: the command, without a fresh interpreter)."""
    args = ["--run", SRC, "--to-topic", "--config", str(config)] + (["--date-to", date_to] if date_to else [])
    args += ["--date-from", date_from] if date_from else []
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level  # the command installs its own log handler
    try:
        result = CliRunner().invoke(replay_command, args, env={"RLPIPE_HOME": str(world.root / "home")})
    finally:
        root.handlers[:], root.level = handlers, level
    assert result.exit_code == 0, result.output


# ---- reading results -------------------------------------------------------------------------------------------


def adapter_tensors(store: ObjectStore, run_id: str, version: int, cache: Path) -> dict[str, torch.Tensor]:
    folder = AdapterRegistry(store, run_id).pull(version, cache)
    return load_file(str(folder / "adapter_model.safetensors"))


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def latest_step(checkpoints: CheckpointStore) -> int:
    complete = checkpoints.complete()
    return complete[0][0] if complete else 0


def final_state(store: ObjectStore, run_id: str) -> LearnerState:
    checkpoint = CheckpointStore(store, run_id).latest()
    assert checkpoint is not None, f"run {run_id} has no checkpoint"
    return checkpoint.state


def step_log(store: ObjectStore, run_id: str, state: LearnerState) -> list[dict[str, Any]]:
    """The step objects up to the checkpoint's step (the history that checkpoint stands on)."""
    return StepLog(store, run_id).read(upto=state.step)


def assert_each_batch_trained_once(store: ObjectStore, run_id: str, batch_ids: tuple[str, ...]) -> LearnerState:
    """Steps 1..N without a gap, each batch in exactly one step, and ``trained`` agreeing with the steps."""
    state = final_state(store, run_id)
    steps = step_log(store, run_id, state)
    assert state.step == N_BATCHES
    assert [m["step"] for m in steps] == list(range(1, N_BATCHES + 1))
    trained_in = [(batch_id, m["step"]) for m in steps for batch_id in m["batch_ids"]]
    assert sorted(b for b, _ in trained_in) == sorted(batch_ids), trained_in  # all, and none twice
    assert dict(trained_in) == state.trained
    assert all(m["rows"] == ROWS_PER_BATCH and not m.get("skipped") for m in steps)
    return state


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """The learners here run with ``torch_threads: 1`` (bitwise comparisons); give the test process its threads back."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(world: World) -> dict[int, dict[str, torch.Tensor]]:
    """Offline replay (``replay_train``, what ``rlpipe replay --train`` runs): the adapter of every version."""
    with one_torch_thread():
        replay_train(resolve_config(config_file=write_config(world, "offline")), SRC)
    assert_each_batch_trained_once(world.store, "offline", world.batch_ids)
    versions = AdapterRegistry(world.store, "offline").versions()
    assert versions == list(range(1, N_BATCHES + 1))
    adapters = {v: adapter_tensors(world.store, "offline", v, world.root / "cache") for v in versions}
    # Training moved the weights at every step (peft starts lora_B at zero), so equality below means something.
    assert any(t.abs().sum() > 0 for name, t in adapters[1].items() if "lora_B" in name)
    assert all(not bitwise_equal(adapters[v], adapters[v + 1]) for v in versions[:-1])
    return adapters


# ---- 2. replay from Parquet == the event log -------------------------------------------------------------------


def test_event_log_and_parquet_replay_give_bitwise_the_same_adapters(
    world: World, reference: dict, bus_config: BusConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run_learner`` (what ``rlpipe learner start`` runs) through a real consumer group == the Parquet replay."""
    config = write_config(world, "online", bus_config)
    announce(world, config)
    monkeypatch.setenv(GROUP_TIMINGS_ENV, json.dumps(GROUP_TIMINGS))
    with one_torch_thread():
        run_learner(resolve_config(config_file=config))  # stops at max_steps
    assert_each_batch_trained_once(world.store, "online", world.batch_ids)
    versions = AdapterRegistry(world.store, "online").versions()
    assert versions == sorted(reference)
    for version in versions:
        online = adapter_tensors(world.store, "online", version, world.root / "cache")
        assert bitwise_equal(online, reference[version]), f"version {version} differs from the Parquet replay"
    (lag,) = group_lag(bus_config, learner_group_id("online"))
    assert lag.lag == 0 and lag.committed == N_BATCHES


# ---- 1. crash check ------------------------------------------------------------------------------------------------

# Where each learner start is killed: an RLPIPE_FAULT point (SIGKILL from inside, at that exact place), or
# "random" (SIGKILL from here at a random moment up to RANDOM_KILL_WINDOW_S after the start's first new
# checkpoint, or once the step after it is checkpointed if that comes first, so it lands in any phase of the
# next steps), or "early" (a random moment in the first seconds, before its first checkpoint:
# importing, loading the model, joining the group).  Every start has max_steps N, so one that finds the work
# done exits.  Exact points come early, so that batches are left for each whatever the random kills took.
# The last start (no max_steps) trains the rest and is stopped with SIGTERM.
KILL_PLAN = (
    "after_checkpoint:2", "after_publish:1", "before_checkpoint:2", "random", "after_checkpoint:1", "early",
    "before_version_event:2", "after_publish:2", "before_checkpoint_event:1", "random", "random", "random",
)
RANDOM_KILL_WINDOW_S = 0.3
SECOND_ANNOUNCEMENT_AT = 3  # the rest of the batches (and the first six again) are announced during this start


@dataclass
class Attempt:
    plan: str
    step_before: int
    step_after: int
    returncode: int
    killed: bool  # the process was alive until SIGKILL reached it


def run_until_killed(world: World, config: Path, plan: str, index: int, rng: random.Random) -> Attempt:
    checkpoints = CheckpointStore(world.store, "crash")
    before = latest_step(checkpoints)
    fault = plan if ":" in plan else None
    proc = rlpipe(world, ["learner", "start", "--config", str(config)], f"crash-{index:02d}.log", fault=fault)
    if index == SECOND_ANNOUNCEMENT_AT:
        announce(world, config)  # while this learner starts and trains
    killed = False
    if plan == "early":  # in the first seconds, and before this start's first checkpoint: on an idle machine a
        # start took 17 steps within 4 s, leaving the later starts nothing to be killed in
        killed = _kill_after(proc, rng.uniform(0.5, 4.0), sooner=lambda: latest_step(checkpoints) > before)
    elif plan == "random":
        deadline = time.monotonic() + PROCESS_TIMEOUT_S
        while latest_step(checkpoints) <= before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        first = latest_step(checkpoints)
        # within the window, but no later than the step after next: a fast learner would otherwise train every
        # batch left in one window and leave the later starts nothing to be killed in
        killed = _kill_after(proc, rng.uniform(0.0, RANDOM_KILL_WINDOW_S),
                             sooner=lambda: latest_step(checkpoints) > first + 1)
    returncode = wait_for(proc)
    if fault is not None:
        killed = returncode == -signal.SIGKILL
    return Attempt(plan, before, latest_step(checkpoints), returncode, killed)


def _kill_after(proc: subprocess.Popen, delay_s: float, sooner: Callable[[], bool] = lambda: False) -> bool:
    """SIGKILL after ``delay_s``, or as soon as ``sooner()`` is true; False if the process had already exited."""
    deadline = time.monotonic() + delay_s
    while time.monotonic() < deadline and not sooner():
        time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
    if proc.poll() is not None:
        return False
    os.kill(proc.pid, signal.SIGKILL)
    return True


def test_learner_killed_at_random_points_trains_every_batch_exactly_once(
    world: World, reference: dict, bus_config: BusConfig
) -> None:
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    config = write_config(world, "crash", bus_config)
    announce(world, config, date_to=FIRST_DAY.date().isoformat())
    attempts = [run_until_killed(world, config, plan, index, rng) for index, plan in enumerate(KILL_PLAN)]
    stopped = run_until_caught_up_then_terminate(world, bus_config, config)
    report = f"seed {seed}; attempts {attempts}"

    # Every exact kill point was reached (the process died by its own SIGKILL), and at least 10 kills in all.
    assert all(a.killed for a in attempts if ":" in a.plan), report
    assert sum(a.killed for a in attempts) >= 10, report
    # After each restart training continued from the newest checkpoint (never went back).
    steps = [step for a in attempts for step in (a.step_before, a.step_after)]
    assert steps == sorted(steps), report

    state = assert_each_batch_trained_once(world.store, "crash", world.batch_ids)
    # Versions are dense; a step published by a learner killed before its checkpoint was retrained from the
    # previous checkpoint and published again under the next number, with bitwise the same weights.
    registry = AdapterRegistry(world.store, "crash")
    versions = registry.versions()
    assert versions == list(range(1, len(versions) + 1)), report
    learner_steps = [registry.show(v).learner_step for v in versions]
    assert learner_steps == sorted(learner_steps) and set(learner_steps) == set(range(1, N_BATCHES + 1)), report
    republished = len(versions) - N_BATCHES
    assert republished >= 3, report  # after_publish:1, before_checkpoint:2, after_publish:2 (and some random kills)
    cache = world.root / "cache"
    for version, step in zip(versions, learner_steps, strict=True):
        assert bitwise_equal(adapter_tensors(world.store, "crash", version, cache), reference[step]), (
            f"version {version} (step {step}) differs from the uninterrupted replay; {report}")
    assert state.version == versions[-1] and step_log(world.store, "crash", state)[-1]["version"] == versions[-1]
    # Every version, and every checkpoint left, was announced, each under one event id: a kill between writing it
    # and its event (before_version_event, before_checkpoint_event) is made good by the next start's announcing
    # again, under the same id, what it resumes from and what it published after
    announced = _announcement_ids(bus_config, "adapters", AdapterPublished, lambda payload: payload.version)
    assert {version: len(ids) for version, ids in announced.items()} == dict.fromkeys(versions, 1), report
    # (by folder: a step can have two checkpoints, e.g. the stop's, which passes duplicates it read after its step)
    kept = {key for _, key in CheckpointStore(world.store, "crash").complete()}
    checkpointed = _announcement_ids(bus_config, "control", LearnerCheckpointed, lambda payload: payload.path)
    assert kept <= set(checkpointed), (sorted(kept - set(checkpointed)), report)
    assert all(len(ids) == 1 for ids in checkpointed.values()), (checkpointed, report)
    # SIGTERM with nothing but already-trained duplicates waiting: no phantom step, no new version.  The stop's
    # checkpoint passes the duplicates it read, so the committed offset is the end of all three announcements
    # and the next start reads none of them again.
    assert stopped.returncode == 0 and stopped.versions_before == len(versions), report
    (lag,) = group_lag(bus_config, learner_group_id("crash"))
    assert (lag.committed, lag.lag) == (N_BATCHES + 2 * FIRST_DAY_BATCHES, 0), report


def _announcement_ids(bus_config: BusConfig, kind: str, payload_type: type, key: Callable[[Any], Any]
                      ) -> dict[Any, set[str]]:
    """Run "crash"'s ``payload_type`` events on ``kind``'s topic: their event ids by ``key`` (version, folder)."""
    ids: dict[Any, set[str]] = {}
    for record in bus.tail(bus_config, kind, n=100_000):
        event = record.event
        if event is not None and event.run_id == "crash" and isinstance(event.payload, payload_type):
            ids.setdefault(key(event.payload), set()).add(str(event.event_id))
    return ids


@dataclass
class Stopped:
    returncode: int
    versions_before: int  # adapter versions when SIGTERM was sent


def run_until_caught_up_then_terminate(world: World, bus_config: BusConfig, config: Path) -> Stopped:
    """The last start (no max_steps): train the rest, skip a third announcement of day one, then SIGTERM."""
    unlimited = write_config(world, "crash", bus_config, name="crash-unlimited", max_steps=None)
    proc = rlpipe(world, ["learner", "start", "--config", str(unlimited)], "crash-final.log")
    checkpoints = CheckpointStore(world.store, "crash")
    wait_until(lambda: latest_step(checkpoints) == N_BATCHES, proc, f"step {N_BATCHES} checkpointed")
    skipped_before = output_of(proc, 10**6).count("already trained")
    announce(world, config, date_to=FIRST_DAY.date().isoformat())
    topic = describe_topic(bus_config, "trajectories")
    assert topic.messages == N_BATCHES + 2 * FIRST_DAY_BATCHES
    wait_until(lambda: output_of(proc, 10**6).count("already trained") >= skipped_before + FIRST_DAY_BATCHES, proc,
               "the third announcement skipped")
    versions_before = len(AdapterRegistry(world.store, "crash").versions())
    proc.send_signal(signal.SIGTERM)
    return Stopped(wait_for(proc), versions_before)


# ---- 4. a broker restart -------------------------------------------------------------------------------------------

RESTART_TIMEOUT_S = 120.0  # a learner that skipped batches waits for them forever: stop it and let the asserts say so


def run_learner_until(config: Path, timeout_s: float = RESTART_TIMEOUT_S) -> None:
    """``run_learner`` in this process until ``max_steps``, or stopped after ``timeout_s``."""
    stop = StopFlag()
    timer = threading.Timer(timeout_s, stop.set)
    timer.start()
    try:
        with one_torch_thread():
            run_learner(resolve_config(config_file=config), stop=stop)
    finally:
        timer.cancel()


def train_across_a_restart(world: World, run_id: str, bus_config: BusConfig, restart: Callable[[], None]) -> None:
    """Day one announced and trained (a learner stopped at max_steps), ``restart()``, day two announced and trained."""
    first = write_config(world, run_id, bus_config, name=f"{run_id}-day1", max_steps=FIRST_DAY_BATCHES)
    announce(world, first, date_to=FIRST_DAY.date().isoformat())
    run_learner_until(first)
    assert final_state(world.store, run_id).step == FIRST_DAY_BATCHES
    restart()
    rest = write_config(world, run_id, bus_config, name=f"{run_id}-day2")
    announce(world, rest, date_from=SECOND_DAY.date().isoformat())  # offsets 6.. on a kept log, 0.. on a new one
    run_learner_until(rest)


def test_a_restarted_embedded_stack_keeps_the_log_and_every_batch_is_trained_once(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rlpipe down` / `up` between two learner runs: the log keeps its offsets, the learner resumes where it was."""
    monkeypatch.setenv(GROUP_TIMINGS_ENV, json.dumps(GROUP_TIMINGS))
    home, port = tmp_path / "home", free_port()
    stack = DevStack(home=home, kafka_port=port, with_gcs=False).start()
    bus_config = BusConfig(bootstrap_servers=f"127.0.0.1:{port}", namespace="restart", connect_timeout_s=5.0)

    def restart() -> None:
        nonlocal stack
        stack.stop()
        stack = DevStack(home=home, kafka_port=port, with_gcs=False).start()

    try:
        train_across_a_restart(world, "stack-restart", bus_config, restart)
        (lag,) = group_lag(bus_config, learner_group_id("stack-restart"))
    finally:
        stack.stop()
    assert_each_batch_trained_once(world.store, "stack-restart", world.batch_ids)
    assert (lag.committed, lag.lag) == (N_BATCHES, 0)


def test_a_learner_resuming_on_a_new_log_reads_it_from_the_start(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker that lost its log (memory storage restarted): the checkpoint's offsets point into the old log,
    the learner sees another topic id, reads the new log from offset 0 and still trains each batch once."""
    monkeypatch.setenv(GROUP_TIMINGS_ENV, json.dumps(GROUP_TIMINGS))
    broker = TansuBroker(port=free_port()).start()
    bus_config = BusConfig(bootstrap_servers=broker.bootstrap_servers, namespace="lost", connect_timeout_s=5.0)

    def restart() -> None:
        broker.stop()
        broker.start()

    try:
        train_across_a_restart(world, "log-lost", bus_config, restart)
    finally:
        broker.stop()
    assert_each_batch_trained_once(world.store, "log-lost", world.batch_ids)
