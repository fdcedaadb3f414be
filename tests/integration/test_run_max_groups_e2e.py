"""``rlpipe run`` whose producers write their ``producer.max_groups`` before the learner reaches ``max_steps``.

Real parts: the Tansu broker, the launcher, a learner and a producer as ``rlpipe`` processes, a file:// store, the
tiny model.  Three groups of two rows at two groups a batch: a batch of 4 rows (step 1 at ``batch_rows`` 4), then a
last batch of 2, too small for a step.  The run must end on its own: the learner trains the last batch when the
launcher stops it (step 2), checkpoints, and ``rlpipe run`` exits 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumers.checkpoint import CheckpointStore
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.store import ObjectStore
from schemas.config import BusConfig
from tests.integration.test_value_e2e import bus_section, finish, rlpipe, tail

pytestmark = pytest.mark.integration


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "home").mkdir()  # RLPIPE_HOME of the rlpipe processes
    yield tmp_path


@pytest.mark.slow  # the launcher, a learner and a producer as processes on the tiny model
def test_a_run_whose_producers_are_done_ends_with_every_batch_trained(root: Path, bus_config: BusConfig,
                                                                      tiny_model_dir: str) -> None:
    store = ObjectStore((root / "store").as_uri())
    config = {
        "run_id": "done-early", "bus": bus_section(bus_config), "store": {"root": store.url("")},
        "model": {"base_model": tiny_model_dir}, "num_producers": 1,
        "env": {"name": "cartpole", "overrides": {"max_turns": 1}},
        "sampler": {"backend": "transformers", "max_new_tokens": 4},
        "producer": {"group_size": 2, "groups_per_batch": 2, "concurrent_groups": 2, "env_workers": 1,
                     "max_groups": 3, "max_backlog_steps": None},
        "learner": {"torch_threads": 1, "batch_rows": 4, "advantage": "raw"},
    }
    path = root / "run.json"
    path.write_text(json.dumps(config))
    proc = rlpipe(root, ["run", "--config", str(path), "--max-steps", "10", "--no-dashboard"], "run.log")
    assert finish(proc, timeout_s=120) == 0, tail(proc)  # a hang fails here
    assert "every producer has exited 0" in tail(proc), tail(proc)
    written = TrajectoryArchive(store).list_batches("done-early")
    checkpoint = CheckpointStore(store, "done-early").latest()
    assert len(written) == 2 and checkpoint is not None
    assert checkpoint.state.step == 2, tail(proc)  # a step of its own for the last 2 rows: trained by the stop
