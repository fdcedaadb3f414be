"""A learner or producer whose store fails mid-run ends with one line naming the store; any other OSError does not.

transformers raises a plain ``OSError`` for a model id the hub does not know (and requests' errors, a full disk
elsewhere, are OSErrors too): such a failure is not the store's, and calling it so would give the wrong advice
(start again once the store answers) and hide the traceback.  The run itself is replaced here by a function that
fails one way or the other; the store is a local folder.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from pipeline.cli.main import app
from pipeline.devstack.process import free_port
from pipeline.io.store import ObjectStore

START = {
    "learner": (["learner", "start", "--preset", "cartpole", "--run", "cp"], "consumers.service.run_learner"),
    "producer": (["producer", "start", "--preset", "cartpole", "--run", "cp"], "producers.service.run_producer"),
}
NOT_A_MODEL = "typo/model is not a local folder and is not a valid model identifier listed on the hub"


def load_model(name: str) -> None:
    """What transformers does with a base model the hub does not know."""
    raise OSError(f"{name} is not a local folder and is not a valid model identifier listed on the hub")


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", (tmp_path / "store").as_uri())
    monkeypatch.setenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", f"127.0.0.1:{free_port()}")  # configured: no stack starts
    (tmp_path / "store").mkdir()
    return ObjectStore((tmp_path / "store").as_uri())


def start_with_run(which: str, run: Callable[..., None], monkeypatch: pytest.MonkeyPatch) -> Result:
    command, target = START[which]
    monkeypatch.setattr(target, run)
    return CliRunner().invoke(app, command)


@pytest.mark.parametrize("which", sorted(START))
def test_an_oserror_from_outside_the_store_is_not_called_the_stores(
        which: str, store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    result = start_with_run(which, lambda cfg, stop, **_: load_model("typo/model"), monkeypatch)
    assert isinstance(result.exception, OSError), result.output  # it keeps its traceback
    assert str(result.exception) == NOT_A_MODEL
    assert "failed:" not in result.output, result.output


@pytest.mark.parametrize("which", sorted(START))
def test_a_store_that_fails_mid_run_is_one_line_naming_it(
        which: str, store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ObjectStore, "_local_write", disk_full)
    result = start_with_run(which, lambda cfg, stop, **_: store.put("runs/cp/x", b"1"), monkeypatch)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith(f"error: the store {store.root} failed: "), lines[-1]
    assert "No space left on device; once it answers" in lines[-1], lines[-1]
    assert "Traceback" not in result.output
