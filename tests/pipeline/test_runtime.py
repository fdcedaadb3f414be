"""Creating a run: ``run.json`` is the run's definition; a restart may change only what keeps stored data meaningful."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.io.store import ObjectStore, sha256_hex
from pipeline.runtime import (
    RunConfigConflictError,
    RunIdCaseError,
    create_run,
    effective_run_config,
    newest_change_number,
)
from schemas.config import RunConfig
from schemas.events import RunConfigChanged, RunStarted


@pytest.fixture
def store() -> ObjectStore:
    return ObjectStore("memory://runtime-test")


def config(**updates: dict) -> RunConfig:
    data: dict = {"run_id": "r1", "env": {"name": "cartpole"}, "model": {"base_model": "tiny"},
                  "learner": {"loss": "importance_sampling", "lora_rank": 8, "learning_rate": 1e-3}}
    for section, values in updates.items():
        data[section] = {**data.get(section, {}), **values} if isinstance(values, dict) else values
    return RunConfig.model_validate(data)


def test_a_new_run_is_created_and_the_same_config_again_changes_nothing(store: ObjectStore) -> None:
    key, _, started = create_run(store, config(), "tiny")
    assert isinstance(started, RunStarted) and key == "runs/r1/run.json"
    assert create_run(store, config(), "tiny")[2] is None
    assert store.list("runs/r1/config-changes") == []


def test_a_run_whose_id_differs_only_in_case_from_one_in_the_store_is_refused(store: ObjectStore, tmp_path) -> None:
    """On a case-insensitive filesystem (macOS, Windows) runs ``Demo`` and ``demo`` would share one folder, each
    reading the other's batches, checkpoints and adapters; so a new run may not differ from one only in case."""
    create_run(store, config(run_id="demo-A"), "tiny")
    with pytest.raises(RunIdCaseError, match=r"'demo-a' differs only in case from the run 'demo-A'.*name the run otherwise"):
        create_run(store, config(run_id="demo-a"), "tiny")
    assert "runs/demo-a" not in store.list("runs")
    assert create_run(store, config(run_id="demo-A"), "tiny")[2] is None  # the run itself goes on
    local = ObjectStore(f"file://{tmp_path}/store")
    create_run(local, config(run_id="Run1"), "tiny")
    with pytest.raises(RunIdCaseError):
        create_run(local, config(run_id="run1"), "tiny")


def found_ignoring_case(root: str, path: str) -> str:
    """``path`` under the folder ``root`` as macOS's and Windows's default filesystems find it: each part matched
    ignoring its case (a new name is made in the case given)."""
    found = Path(root)
    for part in Path(path).relative_to(root).parts:
        same = [child for child in found.iterdir() if child.name.lower() == part.lower()] if found.is_dir() else []
        found = same[0] if same else found / part
    return str(found)


class CaseInsensitiveStore(ObjectStore):
    """A local store on a filesystem that finds names ignoring their case."""

    def path(self, key: str = "") -> str:
        return found_ignoring_case(self._root_path, super().path(key))


def test_on_a_case_insensitive_filesystem_a_run_differing_only_in_case_is_refused_not_taken_for_the_other(
        tmp_path: Path) -> None:
    """There ``runs/demo/run.json`` exists once ``runs/Demo/run.json`` does: a new run ``demo`` must not be taken
    for a restart of ``Demo`` (it would train on, and record a change of, the other run's files)."""
    local = CaseInsensitiveStore(f"file://{tmp_path}/store")
    create_run(local, config(run_id="Demo"), "tiny")
    assert local.exists("runs/demo/run.json")  # the filesystem is as the test says
    with pytest.raises(RunIdCaseError, match=r"'demo' differs only in case from the run 'Demo'"):
        create_run(local, config(run_id="demo", learner={"learning_rate": 5e-4}), "tiny")
    assert local.list("runs/Demo/config-changes") == []
    assert create_run(local, config(run_id="Demo"), "tiny")[2] is None  # the run itself goes on


def test_runs_differing_only_in_case_made_before_the_check_both_restart(store: ObjectStore) -> None:
    """On a case-sensitive store, runs made before ids were compared ignoring case keep restarting."""
    for run_id in ("Old", "old"):
        store.put_create(f"runs/{run_id}/run.json", json.dumps(config(run_id=run_id).model_dump(mode="json")).encode())
    for run_id in ("Old", "old"):
        assert create_run(store, config(run_id=run_id), "tiny")[2] is None


@pytest.mark.parametrize(("updates", "field"), [
    ({"model": {"base_model": "Qwen/Qwen2.5-0.5B"}}, "model.base_model"),
    ({"env": {"name": "sokoban"}}, "env.name"),
    ({"env": {"overrides": {"max_steps": 50}}}, "env.overrides"),
    ({"learner": {"loss": "ppo"}}, "learner.loss"),
    ({"learner": {"lora_rank": 4}}, "learner.lora_rank"),
    ({"learner": {"target_modules": ["q_proj"]}}, "learner.target_modules"),
])
def test_a_restart_that_changes_what_stored_data_means_is_refused(
    store: ObjectStore, updates: dict, field: str
) -> None:
    create_run(store, config(), "tiny")
    with pytest.raises(RunConfigConflictError, match=f"^run r1 .*{field}") as raised:
        create_run(store, config(**updates), "tiny")
    assert "\n" not in str(raised.value) and "new run_id" in str(raised.value)
    assert store.list("runs/r1/config-changes") == []


def test_safe_changes_are_allowed_and_recorded_once(store: ObjectStore) -> None:
    create_run(store, config(), "tiny")
    changed = config(learner={"learning_rate": 5e-4, "max_steps": 40}, num_producers=3)
    key, _, event = create_run(store, changed, "tiny")
    assert isinstance(event, RunConfigChanged)
    assert {c.field: (c.before, c.after) for c in event.changes} == {
        "learner.learning_rate": (1e-3, 5e-4), "learner.max_steps": (None, 40), "num_producers": (1, 3)}
    assert key == event.config_path and store.exists(key)
    assert json.loads(store.get(key))["config"]["learner"]["learning_rate"] == 5e-4
    assert effective_run_config(store, "r1")["learner"]["max_steps"] == 40
    # The same configuration again is no change; going back is one.
    assert create_run(store, changed, "tiny")[2] is None
    back = create_run(store, config(), "tiny")[2]
    assert isinstance(back, RunConfigChanged) and len(back.changes) == 3
    assert len(store.list("runs/r1/config-changes")) == 2
    # Where the run's parts connect (broker, store, health ports) is not part of its definition.
    moved = config(bus={"bootstrap_servers": "kafka:9092"}, learner={"health_port": 9100})
    assert create_run(store, moved, "tiny")[2] is None


def test_the_newest_change_number_is_listed_even_when_its_record_cannot_be_read(tmp_path: Path) -> None:
    """0 before any change; then the newest change's number, from the listing alone: change 2's record damaged
    makes the run's configuration unreadable, not its number."""
    store = ObjectStore(tmp_path.as_uri())
    create_run(store, config(), "tiny")
    assert newest_change_number(store, "r1") == 0
    create_run(store, config(learner={"max_steps": 40}), "tiny")
    key = create_run(store, config(learner={"max_steps": 60}), "tiny")[0]
    store.put(key, b"{not json")
    with pytest.raises(ValueError, match=r"000002\.json unreadable"):
        effective_run_config(store, "r1")
    assert newest_change_number(store, "r1") == 2


@pytest.mark.parametrize("damage", [b"[1, 2]", b"{not json"])
def test_a_run_json_that_is_not_a_json_object_is_an_error_naming_the_file(store: ObjectStore, damage: bytes) -> None:
    store.put("runs/damaged/run.json", damage)  # the memory store outlives a test: overwrite, and not r1's
    with pytest.raises(ValueError, match=r"^runs/damaged/run\.json unreadable: (not JSON|a JSON list, not an object)"):
        effective_run_config(store, "damaged")


class RetriedCreateStore(ObjectStore):
    """A gs:// create whose answer was lost: the client retries it, and the retry reports ``FileExistsError`` for
    the object the first attempt wrote."""

    def put_create(self, key: str, data: bytes) -> str:
        super().put_create(key, data)
        raise FileExistsError(f"{self.url(key)} already exists")


def test_a_retried_create_that_landed_still_starts_the_run_and_records_the_change(tmp_path) -> None:
    """Otherwise ``rlpipe runs create`` refuses its own new run, and no ``RunStarted`` reaches packed followers."""
    store = RetriedCreateStore(tmp_path.as_uri())
    key, digest, started = create_run(store, config(), "tiny")
    assert isinstance(started, RunStarted) and started.config_sha256 == digest == sha256_hex(store.get(key))
    key, _, changed = create_run(store, config(learner={"learning_rate": 5e-4}), "tiny")
    assert isinstance(changed, RunConfigChanged) and key == "runs/r1/config-changes/000001.json"
    assert store.list("runs/r1/config-changes") == [key]


def test_a_signal_after_the_runs_stop_finishes_cleanly_and_only_a_second_signal_aborts() -> None:
    """A stop flag set by the run's RunStopped (``rlpipe runs stop``) is no first Ctrl-C: the SIGTERM that `rlpipe
    run` sends a process still winding down is the first signal, which finishes cleanly; a second one aborts."""
    import signal as signals

    import pytest as pytest_

    from pipeline.runtime import StopFlag

    stop = StopFlag()
    stop.run_stopped = True
    stop.set()
    stop._handle(signals.SIGTERM, None)
    assert stop() and stop.signal_name == "SIGTERM"
    with pytest_.raises(KeyboardInterrupt):
        stop._handle(signals.SIGTERM, None)
