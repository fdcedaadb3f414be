"""A store whose GCS endpoint does not answer ends every command that reads it with one line naming the endpoint
(exit 1), not gcsfs's connection traceback; and the store is the one the environment or --set names."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli.main import app
from pipeline.devstack.process import free_port

COMMANDS = [
    ["sessions", "list"],
    ["sessions", "show", "sess-0123"],
    ["eval", "--run", "cp", "--episodes", "1"],
    ["replay", "--run", "cp", "--to-topic", "--preset", "cartpole", "--set", "run_id=seeded"],
    ["runs", "create", "--preset", "cartpole", "--run", "exp-1"],
    ["run", "--preset", "cartpole", "--run", "cp", "--no-dashboard"],
    ["learner", "start", "--preset", "cartpole", "--run", "cp"],
    ["producer", "start", "--preset", "cartpole", "--run", "cp"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: " ".join(command[:2]))
def test_a_store_whose_endpoint_does_not_answer_is_one_line_naming_it(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", "gs://bucket/rlpipe")
    monkeypatch.setenv("RLPIPE_STORE__GCS_ENDPOINT", endpoint)
    monkeypatch.setenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", f"127.0.0.1:{free_port()}")  # configured: no stack starts
    result = CliRunner().invoke(app, command)
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert f"error: cannot reach the GCS endpoint {endpoint}" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize("how", ["environment", "--set"])
def test_eval_finds_the_run_in_the_store_the_environment_or_set_names(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rlpipe eval` looked for the run in the embedded stack's store whatever RLPIPE_STORE__ROOT said."""
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    other = (tmp_path / "other").as_uri()
    (tmp_path / "other").mkdir()
    if how == "environment":
        monkeypatch.setenv("RLPIPE_STORE__ROOT", other)
        args = []
    else:
        args = ["--set", f"store.root={other}"]
    result = CliRunner().invoke(app, ["eval", "--run", "cp", "--episodes", "1", *args])
    assert result.exit_code == 2
    assert f"no run 'cp' in {other}" in result.output


def test_a_long_running_process_keeps_gcsfs_warnings(tmp_path) -> None:
    """Only the short listing commands silence gcsfs; a learner or producer keeps its warnings for the run."""
    import logging

    from pipeline.cli.common import reachable_store
    from schemas.config import StoreConfig

    gcsfs_log = logging.getLogger("gcsfs")
    level = gcsfs_log.level
    try:
        gcsfs_log.setLevel(logging.NOTSET)
        reachable_store(StoreConfig(root=tmp_path.as_uri()))
        assert gcsfs_log.level == logging.NOTSET
        reachable_store(StoreConfig(root=tmp_path.as_uri()), quiet=True)
        assert gcsfs_log.level == logging.CRITICAL
    finally:
        gcsfs_log.setLevel(level)
