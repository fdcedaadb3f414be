"""A run joins and leaves packed processes that serve another: ``--follow-runs`` with ``rlpipe runs create`` and
``rlpipe runs stop`` on the real broker, store and vLLM engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from tests.integration.test_run_e2e import RLPIPE, newest_state, run_config

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]


def wait_for(condition, what: str, timeout_s: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n" + "\n".join(p.read_text()[-3000:] for p in logs))
        time.sleep(1.0)


def test_a_run_joins_and_leaves_packed_processes_while_another_trains(tmp_path, kafka_broker, tiny_trained_dir):
    store_root = (tmp_path / "store").as_uri()
    files = {}
    for run_id in ("base", "late"):
        config = run_config(run_id, store_root, kafka_broker.bootstrap_servers, str(tiny_trained_dir))
        config["bus"]["namespace"] = "e2efollow"
        config["learner"]["max_steps"] = 100  # both would go on: only a stop ends them
        files[run_id] = tmp_path / f"{run_id}.yaml"
        files[run_id].write_text(yaml.safe_dump(config))
    env = {**os.environ, "RLPIPE_HOME": str(tmp_path / "home"), "VLLM_CPU_KVCACHE_SPACE": "1"}
    logs = {name: tmp_path / f"{name}.log" for name in ("learner", "producer")}
    processes = {
        name: subprocess.Popen([*RLPIPE, name, "start", "--config", str(files["base"]), "--follow-runs", "late-*"],
                               env=env, stdout=logs[name].open("wb"), stderr=subprocess.STDOUT)
        for name in ("learner", "producer")
    }
    store = ObjectStore(store_root)
    try:
        wait_for(lambda: AdapterRegistry(store, "base").versions(), "base's first version", 600, list(logs.values()))
        created = subprocess.run([*RLPIPE, "runs", "create", "--config", str(files["late"]), "--run", "late-1"],
                                 env=env, capture_output=True, text=True, timeout=120)
        assert created.returncode == 0 and "created run late-1" in created.stdout, created.stdout + created.stderr
        wait_for(lambda: len(AdapterRegistry(store, "late-1").versions()) >= 2, "late-1's second version", 600,
                 list(logs.values()))
        stopped = subprocess.run([*RLPIPE, "runs", "stop", "--run", "late-1", "--root", store_root, "--bootstrap",
                                  kafka_broker.bootstrap_servers, "--namespace", "e2efollow"],
                                 env=env, capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        wait_for(lambda: all("run late-1 left" in p.read_text() for p in logs.values()), "late-1 leaving", 300,
                 list(logs.values()))
        left_at = newest_state(store, "late-1")["step"]
        shown = subprocess.run([*RLPIPE, "runs", "show", "--run", "late-1", "--json", "--root", store_root,
                                "--bootstrap", kafka_broker.bootstrap_servers, "--namespace", "e2efollow"],
                               env=env, capture_output=True, text=True, timeout=120)
        assert json.loads(shown.stdout)["status"] == "stopped", shown.stdout + shown.stderr  # not its wind-down's
        base_then = len(AdapterRegistry(store, "base").versions())
        wait_for(lambda: len(AdapterRegistry(store, "base").versions()) > base_then, "base going on", 300,
                 list(logs.values()))
        assert newest_state(store, "late-1")["step"] == left_at  # nothing trains the run that left
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes = {name: process.wait(timeout=180) for name, process in processes.items()}
    assert codes == {"learner": 0, "producer": 0}, "\n".join(p.read_text()[-3000:] for p in logs.values())
    assert left_at >= 2
