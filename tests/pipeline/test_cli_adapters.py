"""`rlpipe adapters list|show|pull` through typer's CliRunner, against a gs:// root on the emulator."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli.adapters import app
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from tests.pipeline.io.test_registry import make_adapter

runner = CliRunner(env={"COLUMNS": "200"})  # wide enough that rich does not fold table cells


@pytest.fixture
def published(gcs_store: ObjectStore, tmp_path: Path) -> tuple[ObjectStore, list[str]]:
    """Two versions of run 'demo' in a gs:// store; returns the store and the CLI's location flags."""
    registry = AdapterRegistry(gcs_store, "demo")
    make_adapter(tmp_path / "a", marker=1)
    registry.publish(tmp_path / "a", "tiny-base", 0, 10, {"loss": 0.75})
    registry.publish(tmp_path / "a", "tiny-base", 1, 20, {"loss": 0.5})
    return gcs_store, ["--root", gcs_store.root, "--gcs-endpoint", gcs_store.gcs_endpoint or ""]


def _one_line_error(result, code: int) -> str:  # type: ignore[no-untyped-def]
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ")
    return lines[0]


def test_list_shows_versions_from_a_gs_root(published: tuple[ObjectStore, list[str]]) -> None:
    _, where = published
    result = runner.invoke(app, ["list", "--run", "demo", *where])
    assert result.exit_code == 0, result.output
    assert "adapters of run demo" in result.output and "tiny-base" in result.output
    assert "loss=0.75" in result.output and "loss=0.5" in result.output
    as_json = runner.invoke(app, ["list", "--run", "demo", "--json", *where])
    assert [m["version"] for m in json.loads(as_json.output)] == [1, 2]


def test_the_list_fits_an_80_column_terminal_and_leads_with_reward_and_loss(gcs_store: ObjectStore,
                                                                           tmp_path: Path) -> None:
    registry = AdapterRegistry(gcs_store, "wide")
    make_adapter(tmp_path / "a", marker=1)
    metrics = {"batches_dead_lettered": 0.0, "clip_fraction": 0.0, "dropped_stale_rows": 0.0, "loss": 0.25,
               "reward_mean": 12.5, "tokens": 4096.0}
    registry.publish(tmp_path / "a", "/models/tiny-cacbf641467c8247", 0, 10, metrics)
    where = ["--root", gcs_store.root, "--gcs-endpoint", gcs_store.gcs_endpoint or ""]
    wide = runner.invoke(app, ["list", "--run", "wide", *where])
    assert "reward_mean=12.5, loss=0.25" in wide.output, wide.output  # what a reader looks for, first
    narrow = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["list", "--run", "wide", *where])
    assert narrow.exit_code == 0 and "…" not in narrow.output, narrow.output
    row = next(line for line in narrow.output.splitlines() if line.startswith("│"))
    files = registry.show(1).files
    assert [cell.strip() for cell in row.split("│")[1:6]] == ["1", "10", "0", str(len(files)),
                                                              str(sum(f.size for f in files.values()))]
    assert "left out to fit 80 columns" in narrow.output


def test_show_and_pull(published: tuple[ObjectStore, list[str]], tmp_path: Path) -> None:
    store, where = published
    shown = runner.invoke(app, ["show", "--run", "demo", "latest", "--json", *where])
    assert shown.exit_code == 0, shown.output
    manifest = json.loads(shown.output)
    assert manifest["version"] == 2 and manifest["learner_step"] == 20
    assert manifest["adapter_sha256"] == AdapterRegistry(store, "demo").adapter_sha256(2)
    assert runner.invoke(app, ["show", "--run", "demo", "v000001", *where]).exit_code == 0
    pulled = runner.invoke(app, ["pull", "--run", "demo", "1", "--to", str(tmp_path / "cache"), *where])
    assert pulled.exit_code == 0, pulled.output
    assert (tmp_path / "cache" / "demo" / "v000001" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["list", "--run", "nobody"], "run 'nobody' not found"),
        (["show", "--run", "demo", "9"], "has no adapter version 9"),
        (["show", "--run", "demo", "nine"], "is not a number"),
        (["list", "--run", "../up"], "run_id '../up' is not allowed"),
        (["list", "--run", "sess-ab12:train:0"], "'sess-ab12:train:0' is a Tinker model id: its run is 'sess-ab12.train.0'"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(
    published: tuple[ObjectStore, list[str]], args: list[str], message: str
) -> None:
    assert message in _one_line_error(runner.invoke(app, [*args, *published[1]]), 2)


def test_bad_url_exits_2() -> None:
    assert "cannot open store root" in _one_line_error(
        runner.invoke(app, ["list", "--run", "x", "--root", "bogus://x"]), 2
    )


def test_unreachable_endpoint_exits_1_quickly() -> None:
    result = runner.invoke(app, ["list", "--run", "x", "--root", "gs://bucket", "--gcs-endpoint", "http://127.0.0.1:9"])
    assert "cannot reach the GCS endpoint" in _one_line_error(result, 1)


def test_tampered_pull_exits_1(published: tuple[ObjectStore, list[str]], tmp_path: Path) -> None:
    store, where = published
    entry = AdapterRegistry(store, "demo").show(1).files["adapter_config.json"]
    store.put(f"runs/demo/adapters/v000001/{entry.path}", b"{}")
    result = runner.invoke(app, ["pull", "--run", "demo", "1", "--to", str(tmp_path), *where])
    assert "checksum mismatch" in _one_line_error(result, 1)


def test_root_defaults_to_the_stack(published: tuple[ObjectStore, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    store, _ = published
    fake_stack = types.ModuleType("pipeline.devstack.stack")
    fake_stack.resolve_store_root = lambda: store.root  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pipeline.devstack.stack", fake_stack)
    result = runner.invoke(app, ["list", "--run", "demo", "--json", "--gcs-endpoint", store.gcs_endpoint or ""])
    assert [m["version"] for m in json.loads(result.output)] == [1, 2]

    def no_stack() -> str:
        raise RuntimeError("no stack is running; start one with `rlpipe up` or pass --root")

    fake_stack.resolve_store_root = no_stack  # type: ignore[attr-defined]
    assert "no stack is running" in _one_line_error(runner.invoke(app, ["list", "--run", "demo"]), 2)


def test_help_has_examples() -> None:
    for command in ("list", "show", "pull"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0 and "Example: rlpipe adapters " + command in result.output


def test_a_bug_keeps_its_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Store and network failures are one line; an error in rlpipe itself is not dressed up as one."""
    from pipeline.cli import adapters

    def broken(run: str, root: str | None, gcs_endpoint: str | None) -> AdapterRegistry:
        raise KeyError("version")

    monkeypatch.setattr(adapters, "_registry", broken)
    result = runner.invoke(app, ["list", "--run", "demo", "--root", f"file://{tmp_path}"])
    assert isinstance(result.exception, KeyError)


def test_a_root_without_an_atomic_create_only_write_exits_2_with_one_line() -> None:
    from pipeline.devstack.process import free_port

    root = f"ftp://127.0.0.1:{free_port()}/rlpipe"  # refused before it connects
    assert "has no atomic create-only write" in _one_line_error(
        runner.invoke(app, ["list", "--run", "x", "--root", root]), 2)


def test_a_to_that_is_a_file_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    taken = tmp_path / "notes.txt"
    taken.write_text("kept")
    result = runner.invoke(app, ["pull", "--run", "demo", "1", "--to", str(taken), "--root", f"file://{tmp_path}/s"])
    assert f"--to {taken} is a file, not a folder" in _one_line_error(result, 2)
    assert taken.read_text() == "kept"


def test_a_retired_version_is_listed_as_retired_and_its_pull_names_why(published: tuple[ObjectStore, list[str]],
                                                                       tmp_path: Path) -> None:
    store, where = published
    AdapterRegistry(store, "demo").retire(1, "learner.keep_versions=1 keeps the files of the newest 1 versions only")
    listed = runner.invoke(app, ["list", "--run", "demo", *where])
    assert listed.exit_code == 0, listed.output
    row = next(line for line in listed.output.splitlines() if re.match(r"│\s+1 │", line))
    assert "retired" in row, listed.output
    assert "1 version retired" in listed.output and "learner.keep_versions" in listed.output
    pulled = runner.invoke(app, ["pull", "--run", "demo", "1", "--to", str(tmp_path / "to"), *where])
    assert "learner.keep_versions=1" in _one_line_error(pulled, 2)  # a version that cannot be pulled: exit 2
