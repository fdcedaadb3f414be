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
