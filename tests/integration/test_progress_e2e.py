"""A run keeps moving when producers wait for the learner: real broker, real ``rlpipe`` processes, file:// store.

Producers pause while ``producer.max_backlog_steps`` learner steps of rows wait unconsumed, and the learner
commits its offsets only at checkpoints.  Both tests run one producer (the transformers sampler on the tiny
model, Sokoban with one row per episode, 4 rows a batch) and one learner as real subprocesses:

1. With ``checkpoint_every: 10`` and ``max_backlog_steps: 1`` the learner reaches 12 steps: the backlog is
   measured against what the learner has ingested, which it announces on the control topic, not against
   its commits (otherwise the producer waits for step 10's commit and the learner for rows).
2. A learner killed at ``after_checkpoint`` (its checkpoint durable, its offsets not committed) and started
   again makes progress within 60 s while the producer keeps running untouched.
3. A second ``rlpipe learner start`` of the same run takes the learner lease: the first one exits with one
   line naming the new holder, and the run goes on under the second.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from consumers.checkpoint import CheckpointStore
from pipeline.io.bus import GROUP_TIMINGS_ENV
from pipeline.io.steplog import StepLog
from pipeline.io.store import ObjectStore
from schemas.config import BusConfig

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "progress"
ROWS_PER_BATCH = 4  # group_size 2 x groups_per_batch 2, one row per Sokoban episode
GROUP_TIMINGS = {"session_timeout_ms": 4000, "heartbeat_interval_ms": 300, "max_poll_interval_ms": 60_000}


def run_config(tmp_path: Path, bus: BusConfig, model_dir: str, **learner: Any) -> Path:
    config = {
        "run_id": RUN_ID,
        # a 0.5 s environment step: the producer writes a batch about every 4 s, so its backlog judgement
        # (re-made every second) pauses it within a batch of the limit
        "env": {"name": "sokoban", "overrides": {"max_turns": 2}, "step_delay_s": 0.5},
        "model": {"base_model": model_dir},
        "bus": {"bootstrap_servers": bus.bootstrap_servers, "namespace": bus.namespace, "connect_timeout_s": 5.0},
        "store": {"root": (tmp_path / "store").as_uri()},
        "sampler": {"backend": "transformers", "max_new_tokens": 8, "max_model_len": 512},
        # batch_timeout_s well above a group's time even on a loaded machine: every batch is whole (2 groups)
        "producer": {"group_size": 2, "groups_per_batch": 2, "concurrent_groups": 2, "batch_timeout_s": 30.0,
                     "heartbeat_interval_s": 1.0, "env_workers": 1, "max_backlog_steps": 1},
        "learner": {"lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-3, "publish_every": 1,
                    "max_staleness": 1000, "device": "cpu", "torch_threads": 1, **learner},
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


class Processes:
    """``rlpipe`` subprocesses with their logs; whatever still runs at the end is killed."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path, self.running = tmp_path, []

    def start(self, name: str, *args: str, fault: str | None = None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
        env |= {"RLPIPE_HOME": str(self.tmp_path / "home"), GROUP_TIMINGS_ENV: json.dumps(GROUP_TIMINGS),
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        if fault is not None:
            env["RLPIPE_FAULT"] = fault
        log = open(self.tmp_path / f"{name}.log", "wb")  # noqa: SIM115  # the child writes it until it exits
        command = [sys.executable, "-c", "from pipeline.cli.main import main; main()", *args]
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        proc.log_path = self.tmp_path / f"{name}.log"  # type: ignore[attr-defined]
        self.running.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(f"--- {p.log_path.name}:\n{p.log_path.read_text()[-2500:]}"  # type: ignore[attr-defined]
                         for p in self.running)

    def stop_all(self) -> None:
        for proc in self.running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, processes: Processes,
               alive: subprocess.Popen | None = None) -> float:
    """Poll ``condition``; fail with every log if time runs out (or ``alive`` exits) first; return the seconds taken."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s or (alive is not None and alive.poll() is not None):
            pytest.fail(f"{what}: not within {timeout_s:.0f} s\n{processes.logs()}")
        time.sleep(0.2)
    return time.monotonic() - started


def newest_checkpoint_step(store: ObjectStore) -> int:
    complete = CheckpointStore(store, RUN_ID).complete()
    return complete[0][0] if complete else 0


def test_backpressure_does_not_wait_for_checkpoints(tmp_path: Path, bus_config: BusConfig, tiny_model_dir: str,
                                                     processes: Processes) -> None:
    config = run_config(tmp_path, bus_config, tiny_model_dir, batch_rows=ROWS_PER_BATCH, checkpoint_every=10, max_steps=12)
    processes.start("producer", "producer", "start", "--config", str(config))
    learner = processes.start("learner", "learner", "start", "--config", str(config))
    try:
        learner.wait(timeout=420)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the learner did not reach step 12 within 420 s\n{processes.logs()}")
    assert learner.returncode == 0, processes.logs()
    store = ObjectStore((tmp_path / "store").as_uri())
    state = CheckpointStore(store, RUN_ID).latest()
    assert state is not None and state.state.step == 12
    assert all(m["rows"] == ROWS_PER_BATCH for m in StepLog(store, RUN_ID).read(upto=12))


def test_a_learner_killed_before_its_commit_resumes_without_touching_the_producer(
    tmp_path: Path, bus_config: BusConfig, tiny_model_dir: str, processes: Processes
) -> None:
    # Two batches per step: a producer paused at one step's rows past the learner's commit leaves the restarted
    # learner less than a step to read unless the backlog follows what the learner actually took.
    config = run_config(tmp_path, bus_config, tiny_model_dir, batch_rows=2 * ROWS_PER_BATCH, checkpoint_every=1)
    store = ObjectStore((tmp_path / "store").as_uri())
    producer = processes.start("producer", "producer", "start", "--config", str(config))
    first = processes.start("learner-1", "learner", "start", "--config", str(config), fault="after_checkpoint:1")
    first.wait(timeout=300)
    assert first.returncode == -signal.SIGKILL, processes.logs()
    killed_at = newest_checkpoint_step(store)
    assert killed_at == 1
    time.sleep(5.0)  # the producer settles into its pause
    assert producer.poll() is None
    processes.start("learner-2", "learner", "start", "--config", str(config))
    waited = wait_until(lambda: newest_checkpoint_step(store) > killed_at, 60.0,
                        "a step after the restarted learner resumed", processes, alive=producer)
    assert producer.poll() is None, "the producer was never touched"
    print(f"progress {waited:.1f} s after the restart")


def test_a_second_learner_takes_over_and_the_first_exits_naming_it(
    tmp_path: Path, bus_config: BusConfig, tiny_model_dir: str, processes: Processes
) -> None:
    config = run_config(tmp_path, bus_config, tiny_model_dir, batch_rows=ROWS_PER_BATCH, checkpoint_every=1)
    store = ObjectStore((tmp_path / "store").as_uri())
    processes.start("producer", "producer", "start", "--config", str(config))
    first = processes.start("learner-1", "learner", "start", "--config", str(config))
    wait_until(lambda: newest_checkpoint_step(store) >= 1, 180.0, "the first learner's first step", processes,
               alive=first)
    second = processes.start("learner-2", "learner", "start", "--config", str(config))
    try:
        first.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the first learner still runs beside the second\n{processes.logs()}")
    assert first.returncode == 1, processes.logs()
    log_text = first.log_path.read_text()  # type: ignore[attr-defined]
    errors = [line for line in log_text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, log_text[-3000:]
    assert "has a newer learner: " in errors[0] and f"-{second.pid} (epoch 2" in errors[0], errors
    taken_over_at = newest_checkpoint_step(store)
    wait_until(lambda: newest_checkpoint_step(store) > taken_over_at, 120.0, "a step of the second learner",
               processes, alive=second)
