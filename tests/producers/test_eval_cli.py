"""``rlpipe eval``: its one-line answers to a run it cannot evaluate, its table, and its progress lines (a
language-model run's play replaced by a small fake)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli.main import app
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.runtime import create_run
from producers.eval_cli import app as eval_app
from schemas.config import RunConfig
from schemas.evaluation import EvalResult
from tests.pipeline.io.test_registry import make_adapter

runner = CliRunner()


def test_a_run_folder_without_run_json_is_named_as_such_not_as_missing(tmp_path: Path) -> None:
    """A folder written by a command that starts no run (envs record) is in the store: eval says what it lacks."""
    store = ObjectStore((tmp_path / "store").as_uri())
    store.put("runs/recorded/trajectories/date=2026-01-01/part-0.parquet", b"rows")
    result = runner.invoke(app, ["eval", "--run", "recorded", "--root", store.root])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert f"run 'recorded' in {store.root} has no run.json" in result.output
    assert "no run 'recorded'" not in result.output


def test_the_table_gives_the_wilson_interval_of_each_success_rate(tmp_path: Path) -> None:
    """Version 0 of a value run (uniform random CartPole) fails all 3 held-out episodes: 0%, and the 95% Wilson
    interval of 0 in 3 is [0, z^2/3 / (1 + z^2/3)] = [0, 1.280486 / 2.280486] = [0%, 56%]."""
    from pipeline.config import resolve_config

    store = ObjectStore((tmp_path / "store").as_uri())
    config = resolve_config("dqn-cartpole", overrides=["run_id=wil", f"store.root={store.url('')}"], environ={})
    create_run(store, config, config.env.name)
    out = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["eval", "--run", "wil", "--root", store.url(""),
                                                         "--version", "0", "--episodes", "3", "--no-save"])
    assert out.exit_code == 0, out.output
    assert "success (95% Wilson CI)" in out.output
    row = next(line for line in out.output.splitlines() if "uniform random" in line)
    assert "0% (0% to 56%)" in row

class _Sampler:
    def close(self) -> None:
        pass


def test_each_version_says_what_it_plays_before_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each version's play loads a sampler and plays every episode (minutes on the CPU): a line on stderr says
    which version plays how many episodes, and one when it is done, so the wait is never silent."""
    store = ObjectStore((tmp_path / "store").as_uri())
    config = RunConfig.model_validate({"run_id": "lm", "env": {"name": "cartpole"}})
    create_run(store, config, "tiny")
    make_adapter(tmp_path / "adapter", marker=1)
    AdapterRegistry(store, "lm").publish(tmp_path / "adapter", "tiny", 0, 1, {})

    def play(config: RunConfig, store: ObjectStore, model_path: str, version: int, episodes: int,
             **_: object) -> EvalResult:
        return EvalResult.from_episodes(run_id="lm", env="cartpole", version=version, seed_start=0,
                                        returns=[10.0] * episodes, successes=[False] * episodes,
                                        policy="base" if version == 0 else "adapter")

    monkeypatch.setattr("producers.tiny_model.resolve_model", lambda model: "/models/tiny")
    monkeypatch.setattr("producers.samplers.sampler_for_run", lambda config, path: _Sampler())
    monkeypatch.setattr("producers.evaluation.evaluate_version", play)
    out = CliRunner(env={"COLUMNS": "120"}).invoke(
        eval_app, ["--run", "lm", "--root", store.url(""), "--version", "0", "--version", "latest",
                   "--episodes", "3", "--no-save"])
    assert out.exit_code == 0, out.output
    lines = out.stderr.splitlines()
    assert any("base model (v0)" in line and "3 held-out episodes" in line for line in lines), out.stderr
    assert any("v1" in line and "3 held-out episodes" in line for line in lines), out.stderr
    assert sum("done in" in line for line in lines) == 2, out.stderr
    assert "10.000" in out.stdout  # the table still follows on stdout


def test_a_retired_version_is_refused_in_one_line_before_anything_loads(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A version whose files learner.keep_versions deleted is still listed: eval says so before building a sampler."""
    store = ObjectStore((tmp_path / "store").as_uri())
    create_run(store, RunConfig.model_validate({"run_id": "lm", "env": {"name": "cartpole"}}), "tiny")
    make_adapter(tmp_path / "adapter", marker=1)
    registry = AdapterRegistry(store, "lm")
    for step in (1, 2):
        registry.publish(tmp_path / "adapter", "tiny", step - 1, step, {})
    registry.retire(1, "learner.keep_versions=1 keeps the files of the newest 1 versions only")
    monkeypatch.setattr("producers.tiny_model.resolve_model", lambda model: pytest.fail("a model was resolved"))
    result = runner.invoke(app, ["eval", "--run", "lm", "--root", store.root, "--version", "1", "--no-save"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "version 1" in result.output and "learner.keep_versions=1" in result.output


def _value_run(tmp_path: Path, run_id: str) -> tuple[ObjectStore, RunConfig]:
    """A DQN CartPole run with nothing trained: its version 0 (uniform random) plays without a model."""
    from pipeline.config import resolve_config

    store = ObjectStore((tmp_path / "store").as_uri())
    config = resolve_config("dqn-cartpole", overrides=[f"run_id={run_id}", f"store.root={store.url('')}"], environ={})
    create_run(store, config, config.env.name)
    return store, config


def _seed_starts(store: ObjectStore, *args: str) -> list[int]:
    import json

    out = runner.invoke(app, ["eval", "--root", store.url(""), "--version", "0", "--json", *args])
    assert out.exit_code == 0, out.output
    return [result["seed_start"] for result in json.loads(out.stdout)["results"]]


def test_validation_seeds_come_after_every_stored_held_out_seed(tmp_path: Path) -> None:
    """``eval --episodes 4`` stores seeds offset+0..offset+3; a validation of 2 episodes then plays offset+4 and
    offset+5, not offset+2 and offset+3 (the held-out count follows the stored results, not its own --episodes)."""
    store, config = _value_run(tmp_path, "val")
    offset = config.env.eval_seed_offset
    assert _seed_starts(store, "--run", "val", "--episodes", "4") == [offset]
    assert _seed_starts(store, "--run", "val", "--episodes", "2", "--validation") == [offset + 4]
    assert _seed_starts(store, "--run", "val", "--episodes", "2", "--validation", "--held-out", "6") == [offset + 6]


def test_validation_without_stored_results_skips_its_own_episode_count(tmp_path: Path) -> None:
    """Nothing stored yet: the held-out seeds a later ``eval --episodes N`` plays are the first N, so a validation
    of N episodes comes after those."""
    store, config = _value_run(tmp_path, "fresh")
    offset = config.env.eval_seed_offset
    assert _seed_starts(store, "--run", "fresh", "--episodes", "3", "--validation") == [offset + 3]


def test_a_held_out_count_below_the_stored_one_is_refused(tmp_path: Path) -> None:
    """--held-out 2 after 4 stored held-out episodes would validate on seeds the report's results played."""
    store, config = _value_run(tmp_path, "short")
    offset = config.env.eval_seed_offset
    _seed_starts(store, "--run", "short", "--episodes", "4")
    out = runner.invoke(app, ["eval", "--run", "short", "--root", store.url(""), "--version", "0", "--episodes", "2",
                              "--validation", "--held-out", "2"])
    assert out.exit_code == 2 and "Traceback" not in out.output, out.output
    assert f"{offset}-{offset + 3}" in out.output and "--held-out 4" in out.output, out.output


def test_validation_never_lands_on_the_seeds_a_longer_held_out_evaluation_plays(tmp_path: Path) -> None:
    """4 stored held-out episodes, then a validation of 8: it skips 8 (offset+8..15), as far as the held-out
    ``eval --episodes 8`` that reports the chosen run reaches, not 4 (offset+4..11 would be chosen on and reported
    on both)."""
    store, config = _value_run(tmp_path, "longer")
    offset = config.env.eval_seed_offset
    _seed_starts(store, "--run", "longer", "--episodes", "4")
    assert _seed_starts(store, "--run", "longer", "--episodes", "8", "--validation") == [offset + 8]


def test_a_validation_is_refused_while_a_stored_result_cannot_be_read(tmp_path: Path) -> None:
    """The seeds a damaged stored result played are unknown, so a default validation might replay them: refused
    in one line naming its key and the two ways on; an explicit --held-out is the operator's answer."""
    store, config = _value_run(tmp_path, "damaged")
    store.put("runs/damaged/eval/v000001-adapter.json", b"{not json")
    out = runner.invoke(app, ["eval", "--run", "damaged", "--root", store.url(""), "--version", "0", "--episodes", "2",
                              "--validation"])
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1, out.output
    assert "runs/damaged/eval/v000001-adapter.json" in out.output, out.output
    assert "delete it" in out.output and "--held-out" in out.output, out.output
    offset = config.env.eval_seed_offset
    assert _seed_starts(store, "--run", "damaged", "--episodes", "2", "--validation", "--held-out", "8") == [offset + 8]


def test_the_refusal_of_a_short_held_out_count_names_the_seeds_stored_results_played(tmp_path: Path) -> None:
    """Stored results on offset+0..3 and offset+10..11 (one stored with a raised offset): the refusal names those
    two ranges, not offset+0..11 as if the gap had been played, and the --held-out that clears them (12)."""
    from producers.evaluation import save_result

    store, config = _value_run(tmp_path, "gaps")
    offset = config.env.eval_seed_offset
    for start, episodes in ((offset, 4), (offset + 10, 2)):
        save_result(store, EvalResult.from_episodes(run_id="gaps", env=config.env.name, version=start - offset,
                                                    seed_start=start, returns=[0.0] * episodes,
                                                    successes=[False] * episodes, policy="random"))
    out = runner.invoke(app, ["eval", "--run", "gaps", "--root", store.url(""), "--version", "0", "--episodes", "2",
                              "--validation", "--held-out", "5"])
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1, out.output
    assert f"{offset}-{offset + 3} and {offset + 10}-{offset + 11}" in out.output, out.output
    assert "--held-out 12" in out.output, out.output


def test_validation_skips_its_episode_count_from_a_stored_result_with_a_raised_offset(tmp_path: Path) -> None:
    """A result stored with env.eval_seed_offset raised by 100 played offset+100..103; its held-out seeds start
    there, so a later ``eval --episodes 8`` with that offset plays offset+100..107.  A validation of 8 skips past
    those (offset+108), as it skips 8 from the run's own offset, not only past the 4 seeds stored there."""
    store, config = _value_run(tmp_path, "raised")
    offset = config.env.eval_seed_offset
    raised = f"env.eval_seed_offset={offset + 100}"
    assert _seed_starts(store, "--run", "raised", "--episodes", "4", "--set", raised) == [offset + 100]
    assert _seed_starts(store, "--run", "raised", "--episodes", "8", "--validation") == [offset + 108]
    assert _seed_starts(store, "--run", "raised", "--episodes", "8", "--validation", "--set", raised) == [offset + 108]
    assert _seed_starts(store, "--run", "raised", "--episodes", "2", "--validation") == [offset + 104]


def test_a_held_out_evaluation_is_refused_on_seeds_a_validation_played(tmp_path: Path) -> None:
    """A validation of 2 with nothing stored plays offset+2..3 and records them; a later held-out ``eval
    --episodes 8`` (offset+0..7) would report on seeds runs were chosen on: refused in one line naming them and the
    --episodes that stays before them.  2 held-out episodes, or 8 from past the validation's seeds, play."""
    store, config = _value_run(tmp_path, "chosen")
    offset = config.env.eval_seed_offset
    assert _seed_starts(store, "--run", "chosen", "--episodes", "2", "--validation") == [offset + 2]
    assert _seed_starts(store, "--run", "chosen", "--episodes", "2", "--validation") == [offset + 2]  # again: same
    out = runner.invoke(app, ["eval", "--run", "chosen", "--root", store.url(""), "--version", "0", "--episodes", "8"])
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1, out.output
    assert f"{offset + 2}-{offset + 3}" in out.output and "--episodes 2 or fewer" in out.output, out.output
    assert f"env.eval_seed_offset={offset + 4}" in out.output, out.output
    assert not store.list("runs/chosen/eval/")  # nothing played, nothing stored
    assert _seed_starts(store, "--run", "chosen", "--episodes", "2") == [offset]
    assert _seed_starts(store, "--run", "chosen", "--episodes", "8", "--set",
                        f"env.eval_seed_offset={offset + 4}") == [offset + 4]


def test_an_explicit_held_out_count_stays_as_given_and_its_seeds_are_refused_to_a_later_held_out_eval(
        tmp_path: Path) -> None:
    """A result stored with env.eval_seed_offset raised by 100 played offset+100..103.  ``--held-out 104`` clears
    it, so a validation of 8 plays offset+104..111 as asked (the default would skip to offset+108, past the 8 a
    later ``eval --episodes 8`` from offset+100 plays).  That later eval would reach offset+104..107: refused in one
    line naming them, the --episodes 4 that stays before them and the offset past every validated seed (112)."""
    store, config = _value_run(tmp_path, "given")
    offset = config.env.eval_seed_offset
    raised = f"env.eval_seed_offset={offset + 100}"
    assert _seed_starts(store, "--run", "given", "--episodes", "4", "--set", raised) == [offset + 100]
    assert _seed_starts(store, "--run", "given", "--episodes", "8", "--validation", "--held-out", "104") == [
        offset + 104]
    out = runner.invoke(app, ["eval", "--run", "given", "--root", store.url(""), "--version", "0", "--episodes", "8",
                              "--set", raised])
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1, out.output
    assert f"{offset + 104}-{offset + 107}" in out.output and "--episodes 4 or fewer" in out.output, out.output
    assert f"env.eval_seed_offset={offset + 112}" in out.output, out.output
    assert _seed_starts(store, "--run", "given", "--episodes", "4", "--set", raised) == [offset + 100]


def _newer(record: bytes) -> bytes:
    """``record`` as a newer rlpipe would write it: a newer major schema version."""
    import json

    return json.dumps({**json.loads(record), "schema_version": "2.0"}).encode()


def test_a_validation_is_refused_while_a_stored_result_is_newer_than_this_rlpipe_saying_to_upgrade(
        tmp_path: Path) -> None:
    """A stored result written by a newer rlpipe is not damaged: deleting it would lose it.  The refusal names it
    and says to upgrade rlpipe (or pass --held-out), not to delete it."""
    from schemas.evaluation import eval_key, eval_to_bytes

    store, config = _value_run(tmp_path, "newer")
    result = EvalResult.from_episodes(run_id="newer", env=config.env.name, version=0,
                                      seed_start=config.env.eval_seed_offset, returns=[1.0, 2.0],
                                      successes=[False, True], policy="random")
    store.put(eval_key(result), _newer(eval_to_bytes(result)))
    out = runner.invoke(app, ["eval", "--run", "newer", "--root", store.url(""), "--version", "0", "--episodes", "2",
                              "--validation"])
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1, out.output
    assert eval_key(result) in out.output and "schema version 2.0" in out.output, out.output
    assert "upgrade rlpipe" in out.output and "--held-out" in out.output, out.output
    assert "delete" not in out.output, out.output


def test_a_held_out_eval_is_refused_while_a_validation_record_is_newer_than_this_rlpipe_saying_to_upgrade(
        tmp_path: Path) -> None:
    """A validation record written by a newer rlpipe: the seeds it played are unknown here, so held-out episodes
    are refused, in one line naming it and saying to upgrade rlpipe, not to delete it (which would lose the record
    of seeds runs were chosen on)."""
    from schemas.evaluation import ValidationPlayed, validation_key, validation_to_bytes

    store, config = _value_run(tmp_path, "newval")
    played = ValidationPlayed(run_id="newval", env=config.env.name, seed_start=config.env.eval_seed_offset + 8,
                              episodes=8)
    store.put(validation_key(played), _newer(validation_to_bytes(played)))
    out = runner.invoke(app, ["eval", "--run", "newval", "--root", store.url(""), "--version", "0", "--episodes", "2"])
    assert out.exit_code == 2 and len(out.output.strip().splitlines()) == 1, out.output
    assert validation_key(played) in out.output and "schema version 2.0" in out.output, out.output
    assert "upgrade rlpipe" in out.output, out.output
    assert "delete" not in out.output, out.output
    assert not store.list("runs/newval/eval/")  # nothing played, nothing stored
