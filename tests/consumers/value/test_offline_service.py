"""Offline CQL as a run (preset cql-building): checkpoints, published versions that play the building, resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from consumers.value.offline_service import replay_train_offline
from pipeline.building_policy import BEHAVIOUR_FILE, POLICY_FILE, SCALER_FILE, load_building_policy, network_columns
from pipeline.config import load_preset
from pipeline.io.datasets import read_card
from pipeline.io.registry import AdapterRegistry, RetiredAdapterError
from pipeline.io.store import ObjectStore
from pipeline.value_network import CONFIG_FILE, WEIGHTS_FILE
from producers.offline.generation import GenerationSpec, generate_building_dataset
from schemas.config import RunConfig

DATASET = "hvac-two-days"


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("offline-cql") / "store"
    generate_building_dataset(ObjectStore(root.as_uri()), DATASET, GenerationSpec(days=2, policy="mixed", seed=1))
    return root


def small_config(root: Path, run_id: str, max_steps: int, **learner: object) -> RunConfig:
    raw = load_preset("cql-building")
    raw["run_id"], raw["store"] = run_id, {"root": root.as_uri()}
    raw["value"]["learner"].update(hidden_sizes=[16], batch_size=32, target_update_period=10, max_steps=max_steps,
                                   publish_every=2, checkpoint_every=2, **learner)
    raw["value"]["offline"].update(updates_per_step=10, support_threshold=0.0)  # plain CQL unless a test filters
    return RunConfig.model_validate(raw)


def test_training_publishes_playable_versions_and_names_the_dataset(store_root: Path) -> None:
    run = replay_train_offline(small_config(store_root, "cql-a", max_steps=3), DATASET)
    assert run.state.step == 3 and run.agent.training_steps == 30
    registry = AdapterRegistry(ObjectStore(store_root.as_uri()), "cql-a")
    # versions at steps 2 and 3 (the last step is always published)
    assert [registry.show(v).learner_step for v in (1, 2)] == [2, 3] and registry.latest().version == 2
    folder = registry.pull(2, store_root.parent / "cache", kind="value-network")
    assert {CONFIG_FILE, WEIGHTS_FILE, POLICY_FILE, SCALER_FILE} <= {p.name for p in folder.iterdir()}
    spec, policy = load_building_policy(folder)
    assert spec.dataset == DATASET and spec.first_held_out_day == 2 and spec.water_levels == spec.air_levels == 5
    card = read_card(ObjectStore(store_root.as_uri()), DATASET)  # the version reads no echo of its own setpoints
    assert list(spec.observation_columns) == network_columns(card.observation_columns, card.action_columns)
    assert len(spec.observation_columns) < len(card.observation_columns)
    torch.testing.assert_close(dict(policy.network.state_dict()), dict(run.agent.online.state_dict()))
    assert run.config.value is not None and run.config.value.offline is not None
    assert run.config.value.offline.dataset == DATASET  # written into run.json for rlpipe eval


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(store_root: Path) -> None:
    replay_train_offline(small_config(store_root, "cql-resumed", max_steps=2), DATASET)
    resumed = replay_train_offline(small_config(store_root, "cql-resumed", max_steps=4), DATASET)
    straight = replay_train_offline(small_config(store_root, "cql-straight", max_steps=4), DATASET)
    assert resumed.state.step == straight.state.step == 4 and resumed.agent.training_steps == 40
    torch.testing.assert_close(dict(resumed.agent.online.state_dict()), dict(straight.agent.online.state_dict()),
                               rtol=0, atol=0)
    again = replay_train_offline(small_config(store_root, "cql-straight", max_steps=4), DATASET)
    assert again.agent.training_steps == 40  # nothing left to train: no new updates


def test_refusals_name_the_fix(store_root: Path) -> None:
    with pytest.raises(ValueError, match=r"no dataset 'nope'.*rlpipe datasets generate building-hvac"):
        replay_train_offline(small_config(store_root, "cql-b", max_steps=1), "nope")
    config = small_config(store_root, "cql-c", max_steps=1)
    assert config.value is not None
    wrong = config.model_copy(update={"value": config.value.model_copy(update={"num_actions": 9})})
    with pytest.raises(ValueError, match="set them to 52 and 25"):
        replay_train_offline(wrong, DATASET)


def test_a_support_threshold_publishes_the_cloned_network_and_resumes_it(store_root: Path) -> None:
    def filtered(max_steps: int, run_id: str) -> RunConfig:
        config = small_config(store_root, run_id, max_steps=max_steps)
        assert config.value is not None and config.value.offline is not None
        offline = config.value.offline.model_copy(update={"support_threshold": 0.3})
        return config.model_copy(update={"value": config.value.model_copy(update={"offline": offline})})

    replay_train_offline(filtered(1, "bcq-resumed"), DATASET)
    resumed = replay_train_offline(filtered(2, "bcq-resumed"), DATASET)
    straight = replay_train_offline(filtered(2, "bcq-straight"), DATASET)
    assert resumed.behaviour is not None and straight.behaviour is not None
    torch.testing.assert_close(dict(resumed.behaviour.online.state_dict()),
                               dict(straight.behaviour.online.state_dict()), rtol=0, atol=0)
    folder = AdapterRegistry(ObjectStore(store_root.as_uri()), "bcq-straight").pull(
        1, store_root.parent / "cache-bcq", kind="value-network")
    spec, policy = load_building_policy(folder)
    assert (folder / BEHAVIOUR_FILE).exists() and spec.support_threshold == 0.3 and policy.behaviour is not None
    torch.testing.assert_close(dict(policy.behaviour.state_dict()), dict(straight.behaviour.online.state_dict()))


def test_a_partition_changed_since_the_card_refuses_the_run_naming_the_file(tmp_path: Path) -> None:
    store = ObjectStore((tmp_path / "store").as_uri())
    generate_building_dataset(store, "swapped", GenerationSpec(days=2, policy="mixed", seed=1))
    first, second = (f"datasets/swapped/{entry.path}" for entry in read_card(store, "swapped").files)
    day_one, day_two = store.get(first), store.get(second)
    store.put(first, day_two)  # two valid Parquet files, each where the other belongs
    store.put(second, day_one)
    with pytest.raises(ValueError, match=rf"{first}.*does not match.*sha256.*rlpipe datasets show swapped --verify"):
        replay_train_offline(small_config(tmp_path / "store", "cql-swapped", max_steps=1), "swapped")
    assert not store.exists("runs/cql-swapped")  # refused before anything of the run was written


def test_a_run_trained_on_one_dataset_refuses_another_naming_the_fix(store_root: Path) -> None:
    """Its checkpoint's network learnt the first dataset's scaled observations and its versions name that dataset's
    held-out days: resuming it on another would mix two logs under one run."""
    store = ObjectStore(store_root.as_uri())
    generate_building_dataset(store, "hvac-other", GenerationSpec(days=2, policy="mixed", seed=2))
    replay_train_offline(small_config(store_root, "cql-one-log", max_steps=1), DATASET)
    with pytest.raises(ValueError, match=r"value\.offline\.dataset.*new run_id") as raised:
        replay_train_offline(small_config(store_root, "cql-one-log", max_steps=2), "hvac-other")
    assert "\n" not in str(raised.value)
    assert AdapterRegistry(store, "cql-one-log").latest().learner_step == 1  # nothing trained on the other log


def test_a_restart_that_adds_the_support_filter_is_refused_in_one_line(store_root: Path) -> None:
    """The behaviour-cloning network trains alongside from step 1: a run trained without it has none in its
    checkpoint to go on with (dropping it is fine: the CQL network never reads it)."""
    def with_threshold(threshold: float, max_steps: int) -> RunConfig:
        config = small_config(store_root, "cql-unfiltered", max_steps=max_steps)
        assert config.value is not None and config.value.offline is not None
        offline = config.value.offline.model_copy(update={"support_threshold": threshold})
        return config.model_copy(update={"value": config.value.model_copy(update={"offline": offline})})

    replay_train_offline(with_threshold(0.0, 1), DATASET)
    with pytest.raises(ValueError, match=r"support_threshold.*new run_id") as raised:
        replay_train_offline(with_threshold(0.3, 2), DATASET)
    assert "\n" not in str(raised.value)
    assert AdapterRegistry(ObjectStore(store_root.as_uri()), "cql-unfiltered").latest().learner_step == 1


def test_setpoints_logged_in_another_unit_than_kelvin_are_refused_naming_the_column(tmp_path: Path) -> None:
    # 60 degC of supply water would sit below the grid's 310 K and become its lowest cell on every step
    from producers.offline.table import TableMapping, import_table

    csv = tmp_path / "plant.csv"
    csv.write_text("time,zone,water,air,r\n" + "".join(
        f"2023-05-01T10:{m:02d}:00Z,21.0,60.0,18.0,-0.5\n" for m in range(0, 30, 5)))
    store = ObjectStore((tmp_path / "store").as_uri())
    import_table(store, csv, "celsius", TableMapping(timestamp="time", observation=["zone"], action=["water", "air"],
                                                     reward="r", units={"water": "degC", "air": "degC"}))
    with pytest.raises(ValueError, match=r"water.*degC.*kelvin"):
        replay_train_offline(small_config(tmp_path / "store", "cql-celsius", max_steps=1), "celsius")


@pytest.mark.parametrize(("unit", "accepted"), [("kelvin", True), ("K", True), ("kelvins", True), ("degC", False)])
def test_setpoint_units_are_read_as_the_trajectory_conversion_reads_them(tmp_path: Path, unit: str,
                                                                         accepted: bool) -> None:
    from consumers.value.offline_service import _building_card
    from producers.offline.table import TableMapping, import_table

    csv = tmp_path / "plant.csv"
    csv.write_text("time,zone,water,air,r\n" + "".join(
        f"2023-05-01T10:{m:02d}:00Z,294.0,330.0,291.0,-0.5\n" for m in range(0, 30, 5)))
    store = ObjectStore((tmp_path / "store").as_uri())
    import_table(store, csv, "plant", TableMapping(timestamp="time", observation=["zone"], action=["water", "air"],
                                                   reward="r", units={"water": unit, "air": unit}))
    if accepted:
        assert _building_card(store, "plant").name == "plant"
    else:
        with pytest.raises(ValueError, match=rf"water.*{unit}.*kelvin"):
            _building_card(store, "plant")


def test_keep_versions_retires_the_older_versions_after_each_publish(store_root: Path) -> None:
    """``value.learner.keep_versions`` as the online value learner's: after each publish only the newest N versions
    keep their files (a resumed run retires those its earlier start published too); the numbers stay."""
    replay_train_offline(small_config(store_root, "cql-keep", max_steps=4), DATASET)  # v1 (step 2), v2 (step 4)
    registry = AdapterRegistry(ObjectStore(store_root.as_uri()), "cql-keep")
    assert registry.versions_with_files() == [1, 2]  # every version's files without the setting
    replay_train_offline(small_config(store_root, "cql-keep", max_steps=6, keep_versions=1), DATASET)  # v3
    assert registry.versions() == [1, 2, 3] and registry.versions_with_files() == [3]
    with pytest.raises(RetiredAdapterError, match=r"value.learner.keep_versions=1"):
        registry.pull(2, store_root.parent / "cache-keep", kind="value-network")
    assert registry.pull(3, store_root.parent / "cache-keep", kind="value-network").is_dir()
