"""A store that goes away under a running learner: it ends with one line naming the store, not a traceback.

The store is a bucket on a fake-gcs-server of the test's own (the session's is shared).  A learner waiting for
rows reads the store every few seconds (its lease); once the emulator is stopped, gcsfs retries for about half a
minute and then fails.  Nothing is lost by ending there: the learner resumes from its newest checkpoint, and
what it had read but not checkpointed is read again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.devstack.gcs_emulator import FakeGCSServer, ensure_bucket
from pipeline.io.bus import GROUP_TIMINGS_ENV
from schemas.config import BusConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
GROUP_TIMINGS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 300, "max_poll_interval_ms": 60_000}


@pytest.fixture
def emulator() -> Iterator[FakeGCSServer]:
    server = FakeGCSServer().start()
    try:
        yield server
    finally:
        server.stop()


def test_a_learner_whose_store_goes_away_ends_with_one_line(
        tmp_path: Path, bus_config: BusConfig, tiny_model_dir: str, emulator: FakeGCSServer) -> None:
    bucket = f"outage-{uuid.uuid4().hex[:12]}"
    ensure_bucket(emulator.endpoint_url, bucket)
    root = f"gs://{bucket}/runs-root"
    config = {
        "run_id": "store-away",
        "model": {"base_model": tiny_model_dir},
        "bus": {"bootstrap_servers": bus_config.bootstrap_servers, "namespace": bus_config.namespace,
                "connect_timeout_s": 5.0},
        "store": {"root": root, "gcs_endpoint": emulator.endpoint_url},
        "learner": {"lora_rank": 4, "lora_alpha": 8, "device": "cpu", "torch_threads": 1},
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    env |= {"RLPIPE_HOME": str(tmp_path / "home"), GROUP_TIMINGS_ENV: json.dumps(GROUP_TIMINGS),
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    log_path = tmp_path / "learner.log"
    with open(log_path, "wb") as log:
        learner = subprocess.Popen(
            [sys.executable, "-c", "from pipeline.cli.main import main; main()", "learner", "start", "-c", str(path)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while b"starting at step 0" not in log_path.read_bytes():  # set up and resumed: waiting for rows
            assert learner.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the learner never got going:\n" + log_path.read_text()[-3000:]
            time.sleep(0.5)
        emulator.stop()
        code = learner.wait(120)
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait()
    output = log_path.read_text()
    assert code == 1, output[-3000:]
    # gcsfs logs each retry's traceback (indented in the log's own column); none may end the process
    assert not any(line.startswith("Traceback") for line in output.splitlines()), output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("error: ") and root in last and "rlpipe learner start" in last, last
