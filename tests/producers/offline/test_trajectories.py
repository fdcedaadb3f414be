"""Datasets converted into one run: batch ids distinct per dataset, and a refused conversion that leaves the run
as it found it (the rendering itself: test_datasets)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.io.archive import TrajectoryArchive
from pipeline.io.archive_layout import unfinished_conversions
from pipeline.io.datasets import read_card
from pipeline.io.store import ObjectStore
from producers.offline.cli import app
from producers.offline.generation import GenerationSpec, generate_building_dataset
from producers.offline.trajectories import TrajectoryOptions, conversion_batch_id, dataset_to_trajectories
from schemas.names import MAX_NAME_LENGTH, validate_name

# Two dataset names of the longest length allowed that share their first 48 characters (and more).
LONG_A, LONG_B = ("hvac-" + "x" * 50 + suffix for suffix in ("-dataset1", "-dataset2"))
OPTIONS = TrajectoryOptions(episodes_per_batch=1, turns_per_batch=96, history_turns=0)  # 3 batches per day

runner = CliRunner()


@pytest.fixture
def store(tmp_path):
    return ObjectStore((tmp_path / "store").as_uri())


def test_batch_ids_of_names_sharing_a_long_prefix_differ_and_stay_valid_names():
    assert len(LONG_A) == MAX_NAME_LENGTH and LONG_A[:48] == LONG_B[:48]
    ids = [conversion_batch_id(name, index) for name in (LONG_A, LONG_B, "heur") for index in (0, 1, 1_000_000)]
    assert len(set(ids)) == len(ids)
    assert all(validate_name(i) == i and len(i) <= MAX_NAME_LENGTH for i in ids)
    assert conversion_batch_id("heur", 7).startswith("heur-") and conversion_batch_id("heur", 7).endswith("-000007")
    assert conversion_batch_id(LONG_A, 0).startswith(LONG_A[:40])  # readable: the name's start


def test_two_datasets_sharing_a_long_prefix_convert_into_one_run(store, tiny_tokenizer):
    for name in (LONG_A, LONG_B):
        generate_building_dataset(store, name, GenerationSpec(days=1, policy="heuristic"))
        assert dataset_to_trajectories(store, name, "both", tiny_tokenizer, OPTIONS).batches == 3
    commits = TrajectoryArchive(store).commits("both")
    assert len({c.batch_id for c in commits}) == len(commits) == 6  # the learner trains each batch id once
    assert unfinished_conversions(store, "both") == []


def test_a_refused_conversion_leaves_the_run_as_it_found_it_and_exits_non_zero(store, tiny_tokenizer,
                                                                               tiny_model_dir):
    for name in ("one", "two"):
        generate_building_dataset(store, name, GenerationSpec(days=1, policy="heuristic"))
    dataset_to_trajectories(store, "one", "run", tiny_tokenizer, OPTIONS)
    again = runner.invoke(app, ["to-trajectories", "one", "--run", "run", "--model", tiny_model_dir,
                                "--episodes-per-batch", "1", "--turns-per-batch", "96", "--root", store.root])
    assert again.exit_code != 0 and "already holds dataset one" in again.output, again.output
    # batch 0 of "two" already taken (by anything else): nothing of "two" is written, and no marker of it blocks
    # replay of the run's other dataset
    archive, taken_id = TrajectoryArchive(store), conversion_batch_id("two", 0)
    rows = [{**row, "batch_id": taken_id} for row in archive.read_batch(archive.list_batches("run")[0]).to_pylist()]
    archive.write_batch("run", rows, created=read_card(store, "two").created_at)
    taken = sorted(store.list("runs/run", recursive=True))
    with pytest.raises(FileExistsError, match="convert into a new --run"):
        dataset_to_trajectories(store, "two", "run", tiny_tokenizer, OPTIONS)
    assert sorted(store.list("runs/run", recursive=True)) == taken
    assert unfinished_conversions(store, "run") == []


def test_an_unknown_dataset_is_named_before_the_model_is_built(store, monkeypatch):
    from producers.offline import cli

    built: list[str] = []
    monkeypatch.setattr(cli, "_model_path", lambda model: built.append(model) or model)  # building tiny takes minutes
    result = runner.invoke(app, ["to-trajectories", "nosuch", "--run", "run", "--model", "tiny", "--root", store.root])
    assert result.exit_code != 0 and "no dataset 'nosuch'" in result.output, result.output
    assert built == []


class RetriedCreateStore(ObjectStore):
    """A gs:// create whose answer was lost: the client retries it, and the retry reports ``FileExistsError`` for
    the object the first attempt wrote."""

    def put_create(self, key: str, data: bytes) -> str:
        super().put_create(key, data)
        raise FileExistsError(f"{self.url(key)} already exists")


def test_a_retried_create_that_landed_is_not_taken_for_an_unfinished_conversion(tmp_path, tiny_tokenizer):
    """The marker (written first) and the summary (last) found as this conversion's own, not another's."""
    store = RetriedCreateStore((tmp_path / "store").as_uri())
    generate_building_dataset(store, "one", GenerationSpec(days=1, policy="heuristic"))
    assert dataset_to_trajectories(store, "one", "run", tiny_tokenizer, OPTIONS).batches == 3
    assert unfinished_conversions(store, "run") == [] and store.exists("runs/run/offline/one.json")


def test_a_dataset_logging_a_prompt_column_in_another_unit_is_refused_naming_it(store, tiny_tokenizer):
    # a zone at 21.5 (degC) would be shown as 21.5 K, and the outside air solved from it hundreds of K too cold
    from producers.offline.trajectories import building_env_for, check_building_dataset

    card = generate_building_dataset(store, "hvac", GenerationSpec(days=1, policy="heuristic"))
    env = building_env_for(card)
    check_building_dataset(card, env)  # the simulator's own units
    zone = "zone_0_0@zone_air_temperature_sensor"
    celsius = card.model_copy(update={"fields": [f.model_copy(update={"unit": "degC"}) if f.name == zone else f
                                                 for f in card.fields]})
    with pytest.raises(ValueError, match=rf"{zone}.*degC.*K"):
        check_building_dataset(celsius, env)


@pytest.mark.parametrize("spelling", ["kelvin", "K", " Kelvin"])
def test_a_prompt_column_in_kelvin_is_accepted_however_the_card_spells_it(store, spelling):
    from producers.offline.trajectories import building_env_for, check_building_dataset

    card = generate_building_dataset(store, "hvac", GenerationSpec(days=1, policy="heuristic"))
    spelled = card.model_copy(update={"fields": [f.model_copy(update={"unit": spelling}) if f.unit == "K" else f
                                                 for f in card.fields]})
    check_building_dataset(spelled, building_env_for(card))


def test_a_base_models_logged_answers_end_with_the_templates_closing_token(store, base_chatml_tokenizer):
    """Sampling stops a base model's turn at ``<|im_end|>`` (not its eos ``<|endoftext|>``): a logged answer is
    trained to end there, once, as a demonstration is, and never with eos."""
    tokenizer = base_chatml_tokenizer
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    generate_building_dataset(store, "hvac", GenerationSpec(days=1, policy="heuristic"))
    dataset_to_trajectories(store, "hvac", "run", tokenizer, OPTIONS)
    archive = TrajectoryArchive(store)
    rows = [r for key in archive.list_batches("run") for r in archive.read_batch(key).to_pylist()]
    assert len(rows) == 288
    for row in rows:
        trained = [t for t, m in zip(row["tokens"], row["loss_mask"], strict=True) if m]
        assert trained[-1] == im_end and trained.count(im_end) == 1, tokenizer.decode(trained)
        assert tokenizer.eos_token_id not in trained
