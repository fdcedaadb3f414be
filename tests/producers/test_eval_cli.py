"""``rlpipe eval``: its one-line answers to a run it cannot evaluate."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from pipeline.cli.main import app
from pipeline.io.store import ObjectStore

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
    from pipeline.runtime import create_run

    store = ObjectStore((tmp_path / "store").as_uri())
    config = resolve_config("dqn-cartpole", overrides=["run_id=wil", f"store.root={store.url('')}"], environ={})
    create_run(store, config, config.env.name)
    out = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["eval", "--run", "wil", "--root", store.url(""),
                                                         "--version", "0", "--episodes", "3", "--no-save"])
    assert out.exit_code == 0, out.output
    assert "success (95% Wilson CI)" in out.output
    row = next(line for line in out.output.splitlines() if "uniform random" in line)
    assert "0% (0% to 56%)" in row
