"""``rlpipe model init-tiny``: the real command on a tiny budget, and its one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from producers.model_cli import app
from producers.tiny_model import MARKER_FILE, read_marker

runner = CliRunner()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    return tmp_path


def test_init_tiny_builds_reports_and_reuses(home: Path) -> None:
    out = home / "tiny"
    result = runner.invoke(app, ["init-tiny", "--out", str(out), "--steps", "2"])
    assert result.exit_code == 0, result.output
    marker = read_marker(out)
    assert marker is not None and marker["spec"]["steps"] == 2
    assert f"parameters: {marker['params']:,}" in result.stdout
    assert f"final loss: {marker['final_loss']:.4f}" in result.stdout
    built_at = (out / MARKER_FILE).stat().st_mtime_ns
    again = runner.invoke(app, ["init-tiny", "--out", str(out), "--steps", "2"])
    assert again.exit_code == 0 and (out / MARKER_FILE).stat().st_mtime_ns == built_at  # cached, not rebuilt


def test_init_tiny_shows_progress_lines_where_no_bar_can_be_drawn(home: Path) -> None:
    """Redirected to a file or a CI log there is no terminal for the bar: lines say how far it got."""
    result = runner.invoke(app, ["init-tiny", "--out", str(home / "tiny"), "--steps", "20"])
    assert result.exit_code == 0, result.output
    assert "building the tiny model" in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("pre-training ")]
    assert len(lines) >= 5 and lines[-1].startswith("pre-training 20/20 steps"), result.stderr
    assert all("loss" in line for line in lines)


def test_init_tiny_default_location_is_recorded_for_the_learner(home: Path) -> None:
    from pipeline.models import resolve_base_model
    from schemas.config import ModelConfig

    result = runner.invoke(app, ["init-tiny", "--steps", "0"])
    assert result.exit_code == 0, result.output
    built = resolve_base_model(ModelConfig())  # what the learner side will load
    assert Path(built).parent == home / "home" / "models" and read_marker(built)["spec"]["steps"] == 0


def test_init_tiny_refuses_an_occupied_folder_in_one_line(home: Path) -> None:
    out = home / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    result = runner.invoke(app, ["init-tiny", "--out", str(out), "--steps", "0"])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0 and "--force" in result.stderr
    assert "Traceback" not in result.output and (out / "keep.txt").exists()


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_init_tiny_refuses_a_file_as_its_folder_before_building(home: Path, force: list[str]) -> None:
    """--force replaces a folder, never a file: the error says the path must be a folder, before any build."""
    out = home / "notes.txt"
    out.write_text("x")
    result = runner.invoke(app, ["init-tiny", "--out", str(out), "--steps", "0", *force])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().count("\n") == 0 and "is a file" in result.stderr, result.stderr
    assert "--force" not in result.stderr and "building" not in result.stderr
    assert out.read_text() == "x" and [p.name for p in home.iterdir()] == ["notes.txt"]


def test_init_tiny_rejects_a_negative_step_count(home: Path) -> None:
    result = runner.invoke(app, ["init-tiny", "--out", str(home / "x"), "--steps", "-1"])
    assert result.exit_code == 2 and not (home / "x").exists()
