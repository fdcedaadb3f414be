"""Every command that names a run refuses an id differing only in case from a stored run, naming the stored one.

On a case-insensitive filesystem (macOS, Windows) ``runs/exp`` is ``runs/Exp``: a command naming ``exp`` would read
Exp's files as run exp's (a report, an evaluation, adapters pulled as exp's) or write into Exp's folder (batches,
evaluations, a replay's announcements for a run no learner may create).  A command reading or continuing a run
names the stored one as the fix; one creating a run (or filling one of its own) asks for another name, since the
stored one is not the run it makes.  The test store finds names ignoring case,
as those filesystems do; nothing listens on the broker's port, so a command that went on would fail otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli.main import app
from pipeline.devstack.process import free_port
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.store import ObjectStore
from tests.consumers.test_sources import rows
from tests.pipeline.test_cli_runs import make_run
from tests.pipeline.test_runtime import found_ignoring_case

runner = CliRunner(env={"COLUMNS": "220"})
RUN_FIX = "name it --run Exp"
NEW_RUN_FIX = "name the run otherwise"  # the stored run is another run: taking its name would write into it

# (the command, the fix its error names); {out} is a folder the command would write, which must stay absent
COMMANDS = [
    (["report", "--run", "exp", "--no-bus", "--out", "{out}"], RUN_FIX),
    (["report", "--run", "Exp", "--run", "exp", "--no-bus", "--out", "{out}"], RUN_FIX),
    (["adapters", "list", "--run", "exp"], RUN_FIX),
    (["adapters", "show", "--run", "exp", "1"], RUN_FIX),
    (["adapters", "pull", "--run", "exp", "latest", "--to", "{out}"], RUN_FIX),
    # a version Exp lacks: the refusal comes before anything is looked up (or a model loaded)
    (["eval", "--run", "exp", "--version", "3"], RUN_FIX),
    (["replay", "--run", "exp", "--to-topic", "--preset", "cartpole", "--set", "run_id=seeded"], RUN_FIX),
    (["replay", "--run", "Src", "--to-topic", "--preset", "cartpole", "--set", "run_id=exp"], NEW_RUN_FIX),
    (["replay", "--run", "Src", "--train", "--preset", "cartpole", "--set", "run_id=exp"], NEW_RUN_FIX),
    # a dataset the store lacks: the run is named before the dataset is read
    (["datasets", "to-trajectories", "missing", "--run", "exp", "--model", "tiny"], NEW_RUN_FIX),
    (["datasets", "eval-building", "--run", "exp", "--dataset", "missing"], RUN_FIX),
    (["envs", "record", "cartpole", "--run", "exp"], NEW_RUN_FIX),
    (["producer", "start", "--preset", "cartpole", "--run", "exp"], RUN_FIX),
    (["learner", "start", "--preset", "cartpole", "--run", "exp"], RUN_FIX),
    (["run", "--preset", "cartpole", "--run", "exp", "--no-dashboard"], NEW_RUN_FIX),
    # a budget Exp has reached: a resume that went on would end at once, starting nothing
    (["run", "--resume", "exp", "--max-steps", "1", "--no-dashboard"], "name it --resume Exp"),
]


@pytest.fixture
def case_insensitive_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    """A store holding run Exp (an adapter version, a checkpoint, a batch) and run Src (a batch), on a filesystem
    that finds names ignoring case; every command reads it through RLPIPE_STORE__ROOT."""
    exact = ObjectStore.path
    monkeypatch.setattr(ObjectStore, "path",
                        lambda self, key="": found_ignoring_case(self._root_path, exact(self, key)))
    store = ObjectStore(f"file://{tmp_path}/store")
    make_run(store, tmp_path, "Exp", "cartpole", steps=1, max_steps=5)
    archive = TrajectoryArchive(store)
    for run in ("Exp", "Src"):
        archive.write_batch(run, [{**row, "run_id": run} for row in rows(f"{run}-b1", "p0")])
    assert store.exists("runs/exp/run.json")  # the filesystem is as the test says
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", store.root)
    monkeypatch.setenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", f"127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("RLPIPE_BUS__CONNECT_TIMEOUT_S", "1")
    return store


@pytest.mark.parametrize(("command", "fix"), COMMANDS, ids=[" ".join(command) for command, _ in COMMANDS])
def test_a_run_named_in_another_case_than_the_stored_one_is_refused_naming_it(
        command: list[str], fix: str, case_insensitive_store: ObjectStore, tmp_path: Path) -> None:
    store = case_insensitive_store
    before = {key: store.get(key) for key in store.list("runs", recursive=True)}
    out = tmp_path / "out"
    result = runner.invoke(app, [part.format(out=out) for part in command])
    assert result.exit_code == 2 and "\n" not in result.output.strip(), result.output
    assert "'exp'" in result.output and "'Exp'" in result.output and fix in result.output, \
        result.output
    assert {key: store.get(key) for key in store.list("runs", recursive=True)} == before
    assert not out.exists()


def test_packed_runs_one_of_which_differs_only_in_case_from_a_stored_run_are_refused_as_twins(
        case_insensitive_store: ObjectStore, tmp_path: Path) -> None:
    """``--runs 3 --run exp`` makes exp-1 ... exp-3: with Exp-1 stored, exp-1 is its case twin, not a run of the
    same name to continue; the refusal asks for another name, as for one new run."""
    store = case_insensitive_store
    make_run(store, tmp_path, "Exp-1", "cartpole", steps=1, max_steps=5)
    result = runner.invoke(app, ["run", "--preset", "cartpole", "--runs", "3", "--run", "exp", "--no-dashboard"])
    assert result.exit_code == 2 and "\n" not in result.output.strip(), result.output
    assert "'exp-1'" in result.output and "'Exp-1'" in result.output and NEW_RUN_FIX in result.output, \
        result.output
    assert "already exist" not in result.output, result.output
