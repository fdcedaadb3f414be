"""``rlpipe run --preset slateq-recsim`` against the real parts: the Tansu broker, ``rlpipe`` processes, a file:// store.

The launcher starts a slate actor and the value learner as separate processes; the run reaches
``--max-steps`` with item-value versions published (kind ``value-network``, agent ``slateq``) and the
actor's batches holding slates; ``rlpipe eval`` of the latest version and version 0 then plays held-out
users and prints engagement per session.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumers.checkpoint import CheckpointStore
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.value_network import load_network
from schemas.config import BusConfig
from tests.integration.test_value_e2e import finish, rlpipe, tail

pytestmark = pytest.mark.integration


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "home").mkdir()
    yield tmp_path


@pytest.mark.slow  # the launcher, the learner and an actor as processes, then rlpipe eval (about 60 s on two cores)
def test_rlpipe_run_of_slateq_recsim_publishes_versions_that_rlpipe_eval_plays(root: Path,
                                                                                bus_config: BusConfig,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich's table on one line per row
    store = ObjectStore((root / "store").as_uri())
    overrides = ["run_id=slateq-e2e", f"store.root={store.url('')}",
                 f"bus.bootstrap_servers={bus_config.bootstrap_servers}", f"bus.namespace={bus_config.namespace}",
                 "value.actor.steps_per_batch=100",
                 "value.learner.min_replay_size=64", "value.learner.updates_per_transition=0.2",
                 "value.learner.hidden_sizes=[16]", "value.learner.checkpoint_every=2"]
    sets = [arg for item in overrides for arg in ("--set", item)]
    proc = rlpipe(root, ["run", "--preset", "slateq-recsim", "--max-steps", "4", "--no-dashboard", *sets], "run.log")
    assert finish(proc) == 0, tail(proc)
    checkpoint = CheckpointStore(store, "slateq-e2e").latest()
    assert checkpoint is not None and checkpoint.state.step == 4
    registry = AdapterRegistry(store, "slateq-e2e")
    versions = registry.versions()
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= 2
    spec, _ = load_network(registry.pull(versions[-1], root / "cache", kind="value-network"))
    assert spec.agent == "slateq" and spec.slate is not None and spec.slate.slate_size == 2
    written = [key for key in store.list("runs/slateq-e2e/env-steps", recursive=True) if key.endswith(".parquet")]
    table = TrajectoryArchive(store).read_steps(written[0])
    assert {len(a) for a in table["action"].to_pylist()} == {2}  # a slate of two candidates per step

    proc = rlpipe(root, ["eval", "--run", "slateq-e2e", "--root", store.url(""), "--version", "latest",
                         "--version", "0", "--episodes", "3"], "eval.log")
    assert finish(proc) == 0, tail(proc)
    assert "engagement per session" in tail(proc) and f"v{versions[-1]}" in tail(proc)
    proc = rlpipe(root, ["eval", "--run", "slateq-e2e", "--root", store.url(""), "--version", "latest",
                         "--episodes", "3", "--json", "--no-save"], "eval-json.log")
    assert finish(proc) == 0, tail(proc)
    output = Path(proc.log_path).read_text()  # type: ignore[attr-defined]
    result = json.loads(output[output.index("{"):])
    assert result["results"][0]["version"] == versions[-1] and result["results"][0]["mean_return"] > 0
    proc = rlpipe(root, ["eval", "--run", "slateq-e2e", "--root", store.url(""), "--version", "latest",
                         "--episodes", "3", "--json", "--validation"], "eval-validation.log")
    assert finish(proc) == 0, tail(proc)
    output = Path(proc.log_path).read_text()  # type: ignore[attr-defined]
    validation = json.loads(output[output.index("{"):])
    # the 3 users after the held-out ones, and nothing stored for the report
    assert validation["results"][0]["seed_start"] == result["results"][0]["seed_start"] + 3
    assert validation["saved"] == []
