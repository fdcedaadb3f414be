"""Value runs against the real parts: the Tansu broker, ``rlpipe`` processes, a file:// store.

1. ``rlpipe run`` of a value preset (numeric actors + the value learner as separate processes) reaches
   ``max_steps`` with value-network versions published and the actors acting with them.
2. Crash check: ``rlpipe learner start`` of a value run, a real subprocess, is SIGKILLed at each of the
   learner's ``RLPIPE_FAULT`` points (a version published but not checkpointed; before a checkpoint; a
   checkpoint durable but its offsets not committed) while a fixed set of steps batches waits on the topic.
   After the final start every batch was trained in exactly one step, steps are 1..N, versions are dense, and
   the network equals bitwise an in-process learner's that trained the same batches in order without a crash
   (the replay memory rebuilt from the store on every restart included).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from consumers.checkpoint import CheckpointStore
from consumers.sources import BatchRef
from consumers.value.learner import ValueLearner
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.bus import GROUP_TIMINGS_ENV, EventPublisher
from pipeline.io.registry import AdapterRegistry
from pipeline.io.steplog import StepLog
from pipeline.io.store import ObjectStore
from pipeline.value_network import load_network
from producers.envs.classic import CartPole
from producers.value_actor import VERSION_FEATURE, ValueActor, ValueNetworkWatcher
from schemas.config import BusConfig
from schemas.events import make_event
from schemas.value import ValueActorConfig, ValueLearnerConfig

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GROUP_TIMINGS = {"session_timeout_ms": 4000, "heartbeat_interval_ms": 300, "max_poll_interval_ms": 30_000}
PROCESS_TIMEOUT_S = 180.0
N_BATCHES = 12
LEARNER = {"hidden_sizes": [16], "batch_size": 16, "min_replay_size": 64, "replay_capacity": 300,
           "replay_scheme": "prioritized", "n_step": 3, "updates_per_transition": 0.25, "checkpoint_every": 3,
           "publish_every": 2, "target_update_period": 20, "keep_checkpoints": None}


def bus_section(bus: BusConfig) -> dict[str, Any]:
    return {"bootstrap_servers": bus.bootstrap_servers, "namespace": bus.namespace,
            "connect_timeout_s": bus.connect_timeout_s}


def write_config(root: Path, run_id: str, store: ObjectStore, bus: BusConfig, learner: dict[str, Any],
                 actor: dict[str, Any] | None = None, num_producers: int = 1) -> Path:
    config = {"run_id": run_id, "env": {"name": "cartpole"}, "store": {"root": store.url("")},
              "bus": bus_section(bus), "num_producers": num_producers,
              "value": {"observation_size": 4, "num_actions": 2, "learner": learner, "actor": actor or {}}}
    path = root / f"{run_id}.json"
    path.write_text(json.dumps(config))
    return path


def rlpipe(root: Path, args: list[str], log_name: str, fault: str | None = None) -> subprocess.Popen:
    """``rlpipe <args>`` in a fresh interpreter (RLPIPE_HOME in tmp), output to a log file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    env |= {"RLPIPE_HOME": str(root / "home"), GROUP_TIMINGS_ENV: json.dumps(GROUP_TIMINGS), "PYTHONUNBUFFERED": "1"}
    if fault is not None:
        env["RLPIPE_FAULT"] = fault
    log = open(root / log_name, "w")  # noqa: SIM115  # closed by finish
    command = [sys.executable, "-c", "from pipeline.cli.main import main; main()", *args]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path, proc.log_file = root / log_name, log  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout_s: float = PROCESS_TIMEOUT_S) -> int:
    """The exit code; the process is killed (and the test fails with its output) past ``timeout_s``."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"process did not finish within {timeout_s:g}s:\n{Path(proc.log_path).read_text()[-3000:]}")  # type: ignore[attr-defined]
    finally:
        proc.log_file.close()  # type: ignore[attr-defined]


def tail(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text()[-3000:]  # type: ignore[attr-defined]


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "home").mkdir()
    yield tmp_path


@pytest.mark.slow  # the launcher, the learner and an actor as processes (about 60 s on two cores)
def test_rlpipe_run_of_a_value_preset_reaches_max_steps_with_versions_published(
    root: Path, bus_config: BusConfig
) -> None:
    store = ObjectStore((root / "store").as_uri())
    learner = {**LEARNER, "max_steps": 8, "checkpoint_every": 4}
    config = write_config(root, "dqn-e2e", store, bus_config, learner, {"steps_per_batch": 60})
    proc = rlpipe(root, ["run", "--config", str(config), "--no-dashboard"], "run.log")
    assert finish(proc) == 0, tail(proc)
    checkpoint = CheckpointStore(store, "dqn-e2e").latest()
    assert checkpoint is not None and checkpoint.state.step == 8
    registry = AdapterRegistry(store, "dqn-e2e")
    versions = registry.versions()
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= 2
    assert {registry.show(v).kind for v in versions} == {"value-network"}
    load_network(registry.pull(versions[-1], root / "cache", kind="value-network"))
    steps = StepLog(store, "dqn-e2e").read(upto=8)
    assert len({b["path"] for entry in steps for b in entry["batches"]}) == 8  # one new batch per step
    archive = TrajectoryArchive(store)
    written = [key for key in store.list("runs/dqn-e2e/env-steps", recursive=True) if key.endswith(".parquet")]
    acted_with = {archive.read_steps(key)[VERSION_FEATURE].to_numpy().max() for key in written}
    assert max(acted_with) >= 1  # the actors, which never wait for the learner, switched to a published version


@pytest.mark.slow  # four learner processes (about 25 s each to start)
def test_a_value_learner_killed_at_each_fault_point_loses_and_repeats_no_batch(
    root: Path, bus_config: BusConfig
) -> None:
    store = ObjectStore((root / "store").as_uri())
    actor = ValueActor(run_id="actors", actor_id="a0", env=CartPole(), archive=TrajectoryArchive(store),
                       watcher=ValueNetworkWatcher(AdapterRegistry(store, "actors"), root / "cache"),
                       config=ValueActorConfig(steps_per_batch=40))
    events = [actor.write_batch() for _ in range(N_BATCHES)]
    with EventPublisher(bus_config) as publisher:
        for event in events:
            publisher.publish("trajectories", make_event("crash", event))
    config = write_config(root, "crash", store, bus_config, {**LEARNER, "max_steps": N_BATCHES})
    for index, fault in enumerate(["after_publish:2", "before_checkpoint:2", "after_checkpoint:2"]):
        proc = rlpipe(root, ["learner", "start", "--config", str(config)], f"crash-{index}.log", fault=fault)
        assert finish(proc) == -9, f"{fault}: expected a SIGKILL\n{tail(proc)}"
    proc = rlpipe(root, ["learner", "start", "--config", str(config)], "final.log")
    assert finish(proc) == 0, tail(proc)

    checkpoint = CheckpointStore(store, "crash").latest()
    assert checkpoint is not None and checkpoint.state.step == N_BATCHES
    steps = StepLog(store, "crash").read(upto=N_BATCHES)
    assert [entry["step"] for entry in steps] == list(range(1, N_BATCHES + 1))
    trained = [batch_id for entry in steps for batch_id in entry["batch_ids"]]
    assert sorted(trained) == sorted(event.batch_id for event in events)  # every batch, none twice
    versions = AdapterRegistry(store, "crash").versions()
    assert versions == list(range(1, len(versions) + 1))

    reference = ValueLearner(
        run_id="reference", env_name="cartpole", config=ValueLearnerConfig(**{**LEARNER, "max_steps": N_BATCHES}),
        observation_size=4, num_actions=2, archive=TrajectoryArchive(store),
        registry=AdapterRegistry(store, "reference"), checkpoints=CheckpointStore(store, "reference"),
        source=_ListSource([BatchRef(e.batch_id, e.path, e.sha256, {"m:0": i + 1}) for i, e in enumerate(events)]),
    )
    reference.run(poll_timeout_s=0.0)
    for name, tensor in reference.agent.state_dict().items():
        assert torch.equal(checkpoint.adapter[name], tensor), name


class _ListSource:
    """Announcements from a list (the reference learner's, without a broker)."""

    def __init__(self, refs: list[BatchRef]) -> None:
        self.refs, self.index = refs, 0

    def poll(self, timeout_s: float) -> list[BatchRef]:
        self.index += 1
        return self.refs[self.index - 1 : self.index]

    def seek(self, positions: dict[str, int]) -> None:
        pass

    def commit(self, positions: dict[str, int]) -> None:
        pass

    def keep_alive(self) -> None:
        pass

    def exhausted(self) -> bool:
        return self.index >= len(self.refs)
