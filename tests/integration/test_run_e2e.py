"""`rlpipe run` end to end: real broker, real store, real vLLM producer, the learner, then `rlpipe report`.

Asserts what the run must leave behind: at least two adapter versions, every
trained row within ``max_staleness`` of the version that trained it, every
process exiting 0, and a report with its HTML and figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.steplog import StepLog
from pipeline.io.store import ObjectStore

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]

RLPIPE = [sys.executable, "-c", "from pipeline.cli.main import main; main()"]


def newest_state(store: ObjectStore, run_id: str) -> dict:
    manifests = [k for k in store.list(f"runs/{run_id}/checkpoints", recursive=True) if k.endswith("manifest.json")]
    newest = max(manifests, key=lambda k: int(k.split("/")[-2].split("-")[1]))
    manifest = json.loads(store.get(newest))
    state_key = newest.replace("manifest.json", "state.json")
    return json.loads(store.get(state_key, sha256=manifest["files"]["state.json"]))["state"]


def run_config(run_id: str, store_root: str, bootstrap_servers: str, base_model: str) -> dict:
    """A short CartPole run: 3 learner steps of 40 rows, staleness 1."""
    return {
        "run_id": run_id,
        "env": {"name": "cartpole", "overrides": {"history_turns": 0, "max_turns": 20, "max_actions_total": 20,
                                                   "max_env_steps": 20}},
        "model": {"base_model": base_model},
        "bus": {"bootstrap_servers": bootstrap_servers, "namespace": "e2erun"},
        "store": {"root": store_root},
        "sampler": {"backend": "vllm", "max_new_tokens": 8},
        "producer": {"group_size": 4, "groups_per_batch": 2, "concurrent_groups": 2, "batch_timeout_s": 10,
                     "heartbeat_interval_s": 1.0, "max_staleness": 1},
        "learner": {"batch_rows": 40, "max_steps": 3, "lora_rank": 4, "lora_alpha": 8, "max_staleness": 1,
                    "advantage": "return_to_go", "torch_threads": 1},
    }


def test_rlpipe_run_publishes_versions_within_staleness_and_reports(tmp_path, kafka_broker, tiny_trained_dir):
    run_id = "e2e-run"
    store_root = (tmp_path / "store").as_uri()
    config = run_config(run_id, store_root, kafka_broker.bootstrap_servers, str(tiny_trained_dir))
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config))
    env = {**os.environ, "RLPIPE_HOME": str(tmp_path / "home"), "VLLM_CPU_KVCACHE_SPACE": "1"}
    run = subprocess.run([*RLPIPE, "run", "--config", str(config_file), "--no-dashboard"], env=env,
                         capture_output=True, text=True, timeout=900)
    logs = tmp_path / "home" / "runs" / run_id / "logs"
    assert run.returncode == 0, run.stderr[-3000:] + "".join(
        p.read_text()[-2000:] for p in logs.glob("*.log"))

    store = ObjectStore(store_root)
    versions = AdapterRegistry(store, run_id).versions()
    assert len(versions) >= 2 and versions == list(range(1, len(versions) + 1))

    state = newest_state(store, run_id)
    trained_steps = [m for m in StepLog(store, run_id).read(upto=state["step"]) if m.get("rows", 0) > 0]
    assert trained_steps, "the learner trained nothing"
    for metrics in trained_steps:  # every trained row within max_staleness of the version training on it
        assert metrics["version_trained_from"] - metrics["policy_version_min"] <= 1, metrics
    # and the rows themselves: every batch the learner trained exists, with the versions the metrics claim
    rows = TrajectoryArchive(store).scan(run_id=run_id).collect()
    assert rows.height > 0 and rows["policy_version"].max() <= max(versions)

    out = tmp_path / "report"
    report = subprocess.run([*RLPIPE, "report", "--run", run_id, "--root", store_root, "--out", str(out),
                             "--bootstrap", kafka_broker.bootstrap_servers, "--namespace", "e2erun"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    html = (out / "report.html").read_text()
    pngs = sorted(Path(out).glob("*.png"))
    assert len(pngs) >= 4 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert "data:image/png;base64," in html


def test_rlpipe_run_runs_2_trains_two_packed_runs_to_their_budget(tmp_path, kafka_broker, tiny_trained_dir):
    """``--runs 2``: one learner and one producer process serve both runs; each run reaches max_steps with its own
    versions, and the packed report draws both."""
    store_root = (tmp_path / "store").as_uri()
    config = run_config("ignored", store_root, kafka_broker.bootstrap_servers, str(tiny_trained_dir))
    config["learner"]["max_steps"] = 2
    del config["run_id"]
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config))
    env = {**os.environ, "RLPIPE_HOME": str(tmp_path / "home"), "VLLM_CPU_KVCACHE_SPACE": "1"}
    run = subprocess.run([*RLPIPE, "run", "--config", str(config_file), "--run", "pair", "--runs", "2",
                          "--no-dashboard"], env=env, capture_output=True, text=True, timeout=900)
    logs = tmp_path / "home" / "runs" / "pair-1" / "logs"
    assert run.returncode == 0, run.stderr[-3000:] + "".join(p.read_text()[-2000:] for p in logs.glob("*.log"))
    assert sorted(p.name for p in logs.glob("*.log")) == ["learner.log", "producer-0.log"]  # one of each, packed
    assert "rlpipe report --run pair-1 --run pair-2" in run.stdout

    store = ObjectStore(store_root)
    for run_id in ("pair-1", "pair-2"):
        assert newest_state(store, run_id)["step"] == 2
        versions = AdapterRegistry(store, run_id).versions()
        assert versions == [1, 2]
        rows = TrajectoryArchive(store).scan(run_id=run_id).collect()
        assert rows.height >= 80 and set(rows["run_id"].to_list()) == {run_id}

    out = tmp_path / "report"
    report = subprocess.run([*RLPIPE, "report", "--run", "pair-1", "--run", "pair-2", "--root", store_root,
                             "--out", str(out), "--bootstrap", kafka_broker.bootstrap_servers, "--namespace", "e2erun"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    packed = json.loads((out / "packed.json").read_text())
    assert set(packed["runs"]) == {"pair-1", "pair-2"}, packed
    for lane in packed["duty_cycle"]["lanes"]:  # the trainer and the sampler each served both runs
        assert all(share > 0 for share in lane["busy_fraction_by_run"].values()), lane["name"]
    assert (out / "packed_duty_cycle.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
