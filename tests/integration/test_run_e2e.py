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


def test_rlpipe_run_publishes_versions_within_staleness_and_reports(tmp_path, kafka_broker, tiny_trained_dir):
    run_id = "e2e-run"
    store_root = (tmp_path / "store").as_uri()
    config = {
        "run_id": run_id,
        "env": {"name": "cartpole", "overrides": {"history_turns": 0, "max_turns": 20, "max_actions_total": 20,
                                                   "max_env_steps": 20}},
        "model": {"base_model": str(tiny_trained_dir)},
        "bus": {"bootstrap_servers": kafka_broker.bootstrap_servers, "namespace": "e2erun"},
        "store": {"root": store_root},
        "sampler": {"backend": "vllm", "max_new_tokens": 8},
        "producer": {"group_size": 4, "groups_per_batch": 2, "concurrent_groups": 2, "batch_timeout_s": 10,
                     "heartbeat_interval_s": 1.0, "max_staleness": 1},
        "learner": {"batch_rows": 40, "max_steps": 3, "lora_rank": 4, "lora_alpha": 8, "max_staleness": 1,
                    "advantage": "return_to_go", "torch_threads": 1},
    }
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
