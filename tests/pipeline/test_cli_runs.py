"""`rlpipe runs list|show|delete` through typer's CliRunner, on a local store with runs `cart` and `cartpole`
(one name a prefix of the other, so delete must match whole names)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from consumers.checkpoint import CheckpointStore
from pipeline.analysis.runs import RunActivity, RunSummary, read_activity, run_status
from pipeline.cli.runs import app
from pipeline.io.bus import EventPublisher, tail
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.runtime import create_run
from schemas.checkpoint import LearnerState
from schemas.config import BusConfig, RunConfig
from schemas.events import (
    LearnerCheckpointed,
    LearnerLeft,
    LearnerProgress,
    ProducerHeartbeat,
    RunStarted,
    RunStopped,
    make_event,
)
from tests.pipeline.io.test_registry import make_adapter

runner = CliRunner(env={"COLUMNS": "220"})


def make_run(store: ObjectStore, tmp_path: Path, run_id: str, env: str, steps: int, max_steps: int | None) -> None:
    """run.json, one adapter version per step (reward 0.5 * step) and a checkpoint at the last step."""
    config = RunConfig.model_validate({"run_id": run_id, "env": {"name": env}, "learner": {"max_steps": max_steps}})
    create_run(store, config, "tiny")
    registry = AdapterRegistry(store, run_id)
    make_adapter(tmp_path / f"adapter-{run_id}", marker=1)
    for step in range(1, steps + 1):
        registry.publish(tmp_path / f"adapter-{run_id}", "tiny", step - 1, step, {"reward_mean": 0.5 * step})
    tensors = {"w": torch.zeros(2)}
    CheckpointStore(store, run_id).save(LearnerState(step=steps, version=steps), tensors, tensors, {})


@pytest.fixture
def two_runs(file_store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ObjectStore, Path]:
    """Runs `cart` (2 of 2 steps) and `cartpole` (3 steps, no limit), each with local folders under RLPIPE_HOME."""
    home = tmp_path / "home"
    monkeypatch.setenv("RLPIPE_HOME", str(home))
    make_run(file_store, tmp_path, "cart", "cartpole", steps=2, max_steps=2)
    make_run(file_store, tmp_path, "cartpole", "sokoban", steps=3, max_steps=None)
    for run in ("cart", "cartpole"):
        for folder in (home / "runs" / run, home / "adapter-cache" / f"{run}-p0" / run / "v000001",
                       home / "adapter-cache" / "eval-1234" / run / "v000001"):
            folder.mkdir(parents=True)
            (folder / "marker").write_text(run)
    return file_store, home


def _where(store: ObjectStore) -> list[str]:
    return ["--root", store.root, "--no-bus"]


def test_list_shows_every_run_from_the_store(two_runs: tuple[ObjectStore, Path]) -> None:
    store, _ = two_runs
    result = runner.invoke(app, ["list", *_where(store), "--json"])
    assert result.exit_code == 0, result.output
    runs = {r["run_id"]: r for r in json.loads(result.stdout)["runs"]}
    assert set(runs) == {"cart", "cartpole"}
    assert runs["cart"] | {"last_activity": None} == {
        "run_id": "cart", "status": "finished", "env": "cartpole", "base_model": "tiny", "steps": 2, "max_steps": 2,
        "versions": 2, "last_reward": 1.0, "last_activity": None, "stop_reason": None, "notes": [], "kind": "lora"}
    assert runs["cartpole"]["status"] == "unknown" and runs["cartpole"]["steps"] == 3
    assert runs["cartpole"]["last_reward"] == 1.5 and runs["cartpole"]["env"] == "sokoban"
    assert runs["cart"]["last_activity"].startswith(str(datetime.now(UTC).year))
    table = runner.invoke(app, ["list", *_where(store)])
    assert table.exit_code == 0, table.output
    assert "cartpole" in table.stdout and "finished" in table.stdout and "2/2" in table.stdout


def test_show_one_run_and_refuse_an_unknown_one(two_runs: tuple[ObjectStore, Path]) -> None:
    store, _ = two_runs
    shown = runner.invoke(app, ["show", "--run", "cartpole", *_where(store), "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["versions"] == 3
    table = runner.invoke(app, ["show", "--run", "cart", *_where(store)])
    assert "learner steps" in table.stdout and "2/2" in table.stdout
    missing = runner.invoke(app, ["show", "--run", "car", *_where(store)])
    assert missing.exit_code == 2 and "run 'car' not found" in missing.output and "cartpole" in missing.output
    unnamed = runner.invoke(app, ["show", *_where(store)])
    assert unnamed.exit_code == 2 and "--run RUN" in unnamed.output


def test_delete_asks_then_removes_only_that_run(two_runs: tuple[ObjectStore, Path]) -> None:
    store, home = two_runs
    kept_keys = store.list("runs/cartpole", recursive=True)
    declined = runner.invoke(app, ["delete", "--run", "cart", "--root", store.root], input="n\n")
    # declining is the user's answer, not a failure: exit 0, and no "error:"
    assert declined.exit_code == 0 and declined.stdout.splitlines()[-1] == "nothing deleted", declined.output
    assert "error" not in declined.output
    assert store.exists("runs/cart/run.json")

    deleted = runner.invoke(app, ["delete", "--run", "cart", "--root", store.root], input="y\n")
    assert deleted.exit_code == 0, deleted.output
    assert not store.list("runs/cart", recursive=True) and not store.exists("runs/cart")
    assert store.list("runs/cartpole", recursive=True) == kept_keys
    assert CheckpointStore(store, "cartpole").complete() and AdapterRegistry(store, "cartpole").versions() == [1, 2, 3]
    assert not (home / "runs" / "cart").exists() and (home / "runs" / "cartpole" / "marker").is_file()
    assert not (home / "adapter-cache" / "cart-p0").exists()  # the emptied cache folder goes too
    assert not (home / "adapter-cache" / "eval-1234" / "cart").exists()
    assert (home / "adapter-cache" / "eval-1234" / "cartpole" / "v000001" / "marker").is_file()
    assert (home / "adapter-cache" / "cartpole-p0" / "cartpole" / "v000001" / "marker").is_file()
    listed = json.loads(runner.invoke(app, ["list", *_where(store), "--json"]).stdout)["runs"]
    assert [r["run_id"] for r in listed] == ["cartpole"]

    again = runner.invoke(app, ["delete", "--run", "cart", "--root", store.root, "--yes"])
    assert again.exit_code == 2 and "not found" in again.output


def test_a_running_run_is_not_deleted(two_runs: tuple[ObjectStore, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from pipeline.cli import runs as runs_cli

    store, _ = two_runs
    recent = {"cart": RunActivity(last_event_s=time.time() - 2)}
    monkeypatch.setattr(runs_cli, "activity_or_note", lambda bus, timeout, run=None: (recent, None))
    refused = runner.invoke(app, ["delete", "--run", "cart", "--root", store.root, "--yes"])
    assert refused.exit_code == 2 and "is running" in refused.output
    assert store.exists("runs/cart/run.json")


def test_a_delete_that_cannot_read_the_log_says_it_could_not_check_the_run_is_stopped(
    two_runs: tuple[ObjectStore, Path]
) -> None:
    store, _ = two_runs
    declined = runner.invoke(app, ["delete", "--run", "cart", "--root", store.root, "--no-bus"], input="n\n")
    assert "not checked whether run cart is running: event log not read (--no-bus)" in declined.output
    assert declined.exit_code == 0 and store.exists("runs/cart/run.json")


def test_status_from_the_log() -> None:
    done = RunSummary("a", "unknown", steps=5, max_steps=5)
    now = 1_000_000.0
    assert run_status(done, None, log_read=False, now_s=now) == "finished"
    assert run_status(RunSummary("b", "unknown", steps=1), None, log_read=False, now_s=now) == "unknown"
    busy = RunActivity(last_event_s=now - 5)
    assert run_status(done, busy, log_read=True, now_s=now) == "running"  # resumed with a higher limit
    quiet = RunActivity(last_event_s=now - 3600)
    assert run_status(RunSummary("c", "unknown", steps=1), quiet, log_read=True, now_s=now) == "idle"
    stopped = RunActivity(last_event_s=now - 1, stopped_s=now - 1, stop_reason="stopped")
    assert run_status(RunSummary("d", "unknown", steps=1), stopped, log_read=True, now_s=now) == "stopped"


def test_a_run_whose_processes_report_while_letting_it_go_is_not_running_again() -> None:
    """A packed run is stopped while its processes serve it: the producers' last heartbeats, as they let it go, come
    just after its RunStopped and do not make it running.  A learner's report after a stop is its wind-down; after a
    newer RunStarted (a resume) it makes the run running at once: `runs delete` must not take a run that is running
    again."""
    now = 1_000_000.0
    heartbeat = ProducerHeartbeat(producer_id="p", adapter_version=3, samples_total=1, batches_total=1, tokens_total=1,
                                  env_steps_total=1, samples_per_s=0.0, tokens_per_s=0.0, env_steps_per_s=0.0,
                                  busy_fraction=0.0, interval_s=5.0)
    leaving = RunActivity()
    leaving.add(now - 10, RunStopped(reason="step budget reached"))
    leaving.add(now - 9, heartbeat)
    assert run_status(RunSummary("a", "unknown", steps=3, max_steps=3), leaving, log_read=True, now_s=now) == "finished"
    assert run_status(RunSummary("b", "unknown", steps=1), leaving, log_read=True, now_s=now) == "stopped"
    resumed = RunActivity()
    resumed.add(now - 10, RunStopped(reason="stopped by Ctrl-C or a signal"))
    resumed.add(now - 5, LearnerProgress(step=3, version=3, positions={}))
    assert run_status(RunSummary("c", "unknown", steps=3, max_steps=9), resumed, log_read=True, now_s=now) == "stopped"
    resumed.add(now - 4, _started("c"))
    resumed.add(now - 3, LearnerProgress(step=3, version=3, positions={}))
    assert run_status(RunSummary("c", "unknown", steps=3, max_steps=9), resumed, log_read=True, now_s=now) == "running"
    late = RunActivity()
    late.add(now - 100, RunStopped(reason="stopped"))
    late.add(now - 5, heartbeat)  # long after the stop: started again
    assert run_status(RunSummary("d", "unknown", steps=1), late, log_read=True, now_s=now) == "running"


def test_a_run_a_packed_learner_let_go_after_training_its_waiting_rows_is_stopped() -> None:
    """`runs stop` on a packed run: its learner trains the rows waiting and checkpoints after the RunStopped, then
    says it let the run go.  The run is stopped all along, its LearnerLeft read or not (it read "running", then "idle"
    for ever); a learner's report after a newer RunStarted (a resume) makes it running again."""
    now = 1_000_000.0
    checkpointed = LearnerCheckpointed(step=4, version=4, path="runs/a/checkpoints/4", offsets={})
    winding = RunActivity()
    winding.add(now - 30, RunStopped(reason="stopped by rlpipe runs stop", final_step=3))
    winding.add(now - 20, LearnerProgress(step=4, version=4, positions={}))
    winding.add(now - 19, checkpointed)
    assert run_status(RunSummary("a", "unknown", steps=4), winding, log_read=True, now_s=now) == "stopped"
    winding.add(now - 18, LearnerLeft(step=4, version=4))
    for later in (now, now + 3600):
        assert run_status(RunSummary("a", "unknown", steps=4), winding, log_read=True, now_s=later) == "stopped"
    assert winding.stop_reason == "stopped by rlpipe runs stop" and winding.last_step == 4
    winding.add(now - 6, _started("a"))  # resumed
    winding.add(now - 5, LearnerProgress(step=4, version=4, positions={}))
    assert run_status(RunSummary("a", "unknown", steps=4), winding, log_read=True, now_s=now) == "running"


def test_activity_is_read_per_run_from_the_control_topic(bus_config: BusConfig) -> None:
    with EventPublisher(bus_config) as publisher:
        publisher.publish("control", make_event("r1", RunStarted(config_path="runs/r1/run.json", config_sha256="0" * 64,
                                                                  env="cartpole", base_model="tiny")))
        publisher.publish("control", make_event("r1", LearnerCheckpointed(step=4, version=4, path="p", offsets={},
                                                                          metrics={"reward_mean": 2.5})))
        publisher.publish("control", make_event("r2", RunStopped(reason="step budget reached")))
    activity = read_activity(bus_config, timeout_s=10.0)
    assert activity["r1"].last_step == 4 and activity["r1"].last_reward == 2.5 and activity["r1"].stopped_s is None
    assert activity["r2"].stop_reason == "step budget reached"
    assert set(read_activity(bus_config, timeout_s=10.0, run_id="r2")) == {"r2"}


@pytest.mark.parametrize("group", ["report", "eval"])
def test_commands_that_took_the_run_as_an_argument_take_run_and_note_the_old_spelling(
    group: str, tmp_path: Path
) -> None:
    if group == "report":
        from pipeline.cli.report_cmd import app as group_app
    else:
        from producers.eval_cli import app as group_app
    root = ["--root", (tmp_path / "store").as_uri()] + (["--no-bus"] if group == "report" else [])
    new = runner.invoke(group_app, ["--run", "nope", *root])
    assert new.exit_code == 2 and "deprecated" not in new.output and "'nope'" in new.output
    old = runner.invoke(group_app, ["nope", *root])
    assert old.exit_code == 2 and "'nope'" in old.output
    assert f"`rlpipe {group} RUN` is deprecated" in old.output and f"rlpipe {group} --run nope" in old.output
    unnamed = runner.invoke(group_app, root)
    assert unnamed.exit_code == 2 and f"rlpipe {group} --run RUN" in unnamed.output
    twice = runner.invoke(group_app, ["a", "--run", "b", *root])
    assert twice.exit_code == 2 and "named twice" in twice.output


def test_a_run_that_cannot_be_announced_is_not_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes following runs take a run up only from its RunStarted: a run.json without one would never be
    served, and its name could not be created again."""
    from pipeline.devstack.process import free_port

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", f"file://{tmp_path}/store")
    monkeypatch.setenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", f"127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("RLPIPE_BUS__CONNECT_TIMEOUT_S", "1")
    result = runner.invoke(app, ["create", "--preset", "cartpole", "--run", "exp-1"])
    assert result.exit_code != 0 and "cannot reach Kafka" in result.output and "\n" not in result.output.strip()
    assert not ObjectStore(f"file://{tmp_path}/store").exists("runs/exp-1/run.json")


def test_a_run_created_meanwhile_under_the_same_name_is_left_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bus_config: BusConfig) -> None:
    import pipeline.cli.run_cmd as run_cmd
    from pipeline.cli.options import run_config

    store = ObjectStore(f"file://{tmp_path}/store")
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", store.root)
    monkeypatch.setenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", bus_config.bootstrap_servers)
    monkeypatch.setenv("RLPIPE_BUS__NAMESPACE", bus_config.namespace)
    other = run_config("cartpole", None, [f"store.root={store.root}"]).model_copy(update={"run_id": "exp-1"})
    create_run(store, other, other.model.base_model)  # another `runs create`, between the name check and the write
    before = store.get("runs/exp-1/run.json")
    monkeypatch.setattr(run_cmd, "new_run_id", lambda store, base, explicit: "exp-1")
    result = runner.invoke(app, ["create", "--preset", "cartpole", "--run", "exp-1"])
    assert result.exit_code == 2 and "already exists" in result.output
    assert store.get("runs/exp-1/run.json") == before


def test_creating_a_run_that_exists_names_the_command_that_continues_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", f"file://{tmp_path}/store")
    store = ObjectStore(f"file://{tmp_path}/store")
    create_run(store, RunConfig(run_id="exp-1"), "tiny")
    result = runner.invoke(app, ["create", "--preset", "cartpole", "--run", "exp-1"])
    assert result.exit_code == 2 and "\n" not in result.output.strip()
    assert "already exists" in result.output and "`rlpipe run --resume exp-1`" in result.output, result.output


def test_the_list_fits_an_80_column_terminal_with_every_column_readable(file_store: ObjectStore) -> None:
    base = "/root/.rlpipe/models/tiny-cacbf641467c8247"
    config = RunConfig.model_validate({"run_id": "cartpole-20261204-200014", "env": {"name": "cartpole"},
                                       "model": {"base_model": base}, "learner": {"max_steps": 6}})
    create_run(file_store, config, base)
    narrow = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["list", *_where(file_store)])
    assert narrow.exit_code == 0, narrow.output
    lines = [line for line in narrow.stdout.splitlines() if line[:1] in "┏┃┡│└"]  # the table's (text wraps itself)
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "run" in line and "status" in line)
    for column in ("status", "env", "steps", "versions", "reward"):
        assert f" {column} " in header, narrow.stdout
    row = next(line for line in lines if "cartpole-20261204-200014" in line)  # the id whole: it is copied
    assert "cartpole" in row.split("cartpole-20261204-200014", 1)[1] and "6" in row
    assert "base model and last active (UTC) left out" in narrow.stdout
    wide = CliRunner(env={"COLUMNS": "160"}).invoke(app, ["list", *_where(file_store)])
    assert "tiny-cacbf641467c8247 " in wide.stdout and base not in wide.stdout and "left out" not in wide.stdout


def test_a_long_run_id_stays_on_one_line_at_80_columns(file_store: ObjectStore) -> None:
    """A run id is copied from the list: other columns are left out before it would be split over two lines."""
    long_ids = ["cartpole-sokoban-20261204-200014-1", "slateq-recsim-offline-cql-20261204-200014"]
    for run_id in long_ids:
        create_run(file_store, RunConfig.model_validate({"run_id": run_id, "env": {"name": "cartpole"},
                                                         "learner": {"max_steps": 6}}), "tiny")
    narrow = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["list", *_where(file_store)])
    assert narrow.exit_code == 0, narrow.output
    lines = [line for line in narrow.stdout.splitlines() if line[:1] in "┏┃┡│└"]
    assert max(len(line) for line in lines) <= 80, narrow.stdout
    for run_id in long_ids:
        row = next((line for line in lines if run_id in line), None)
        assert row is not None and "0/6" in row, narrow.stdout  # whole, with its steps beside it
    assert "left out to fit 80 columns" in narrow.stdout


def test_stopping_a_run_already_stopped_says_so_and_announces_nothing(
        file_store: ObjectStore, tmp_path: Path, bus_config: BusConfig) -> None:
    make_run(file_store, tmp_path, "exp-2", "cartpole", steps=1, max_steps=5)
    where = ["--root", file_store.root, "--bootstrap", bus_config.bootstrap_servers, "--namespace", bus_config.namespace]
    first = runner.invoke(app, ["stop", "--run", "exp-2", *where])
    assert first.exit_code == 0 and "announced the end of run exp-2" in first.output, first.output
    assert "learner and producers serving it" in first.output and "single-run" in first.output, first.output
    again = runner.invoke(app, ["stop", "--run", "exp-2", *where])
    assert again.exit_code == 0 and "already stopped" in again.output, again.output
    stops = [r for r in tail(bus_config, "control", n=100, run_id="exp-2")
             if r.event is not None and isinstance(r.event.payload, RunStopped)]
    assert len(stops) == 1


def test_resuming_a_run_not_stopped_says_so_and_announces_nothing(
        file_store: ObjectStore, tmp_path: Path, bus_config: BusConfig) -> None:
    """A second resume is the first's twin: processes serve a run once, so it says the run is not stopped."""
    make_run(file_store, tmp_path, "exp-3", "cartpole", steps=1, max_steps=5)
    where = ["--root", file_store.root, "--bootstrap", bus_config.bootstrap_servers, "--namespace", bus_config.namespace]
    assert runner.invoke(app, ["stop", "--run", "exp-3", *where]).exit_code == 0
    first = runner.invoke(app, ["resume", "--run", "exp-3", *where])
    assert first.exit_code == 0 and "announced run exp-3 again" in first.output, first.output
    again = runner.invoke(app, ["resume", "--run", "exp-3", *where])
    assert again.exit_code == 0 and "\n" not in again.output.strip(), again.output
    assert "is not stopped" in again.output and "rlpipe runs stop --run exp-3" in again.output, again.output
    starts = [r for r in tail(bus_config, "control", n=100, run_id="exp-3")
              if r.event is not None and isinstance(r.event.payload, RunStarted)]
    assert len(starts) == 1


def test_a_start_the_store_keeps_but_the_topic_never_carried_is_announced_by_resume(
        file_store: ObjectStore, tmp_path: Path, bus_config: BusConfig) -> None:
    """`announce_membership` writes the store, then publishes: a failed publish leaves a start recorded that no
    following process saw.  Resume announces it (the topic lacks it); once the topic has it, resume refuses and
    names --force, which announces it again anyway."""
    make_run(file_store, tmp_path, "exp-4", "cartpole", steps=1, max_steps=5)
    _record(file_store, "exp-4", _started("exp-4"))  # recorded, never published
    where = ["--root", file_store.root, "--bootstrap", bus_config.bootstrap_servers, "--namespace", bus_config.namespace]

    def starts() -> int:
        return sum(1 for r in tail(bus_config, "control", n=100, run_id="exp-4")
                   if r.event is not None and isinstance(r.event.payload, RunStarted))

    first = runner.invoke(app, ["resume", "--run", "exp-4", *where])
    assert first.exit_code == 0 and "announced run exp-4 again" in first.output, first.output
    assert starts() == 1
    again = runner.invoke(app, ["resume", "--run", "exp-4", *where])
    assert again.exit_code == 0 and "is not stopped" in again.output, again.output
    assert "rlpipe runs resume --run exp-4 --force" in again.output, again.output
    assert starts() == 1
    forced = runner.invoke(app, ["resume", "--run", "exp-4", "--force", *where])
    assert forced.exit_code == 0 and "announced run exp-4 again" in forced.output, forced.output
    assert starts() == 2


def test_a_stop_the_store_keeps_but_the_topic_never_carried_is_announced_by_stop(
        file_store: ObjectStore, tmp_path: Path, bus_config: BusConfig) -> None:
    """Resume's twin: a stop recorded in the store whose publish failed was seen by no process serving the run.
    Stop announces it (the topic lacks it); once the topic has it too, stop says the run is already stopped."""
    make_run(file_store, tmp_path, "exp-5", "cartpole", steps=1, max_steps=5)
    _record(file_store, "exp-5", RunStopped(reason="stopped by rlpipe runs stop"))  # recorded, never published
    with EventPublisher(bus_config) as publisher:  # the control topic exists and is read: it carries another run
        publisher.publish("control", make_event("exp-6", _started("exp-6")))
    where = ["--root", file_store.root, "--bootstrap", bus_config.bootstrap_servers, "--namespace", bus_config.namespace]

    def stops() -> int:
        return sum(1 for r in tail(bus_config, "control", n=100, run_id="exp-5")
                   if r.event is not None and isinstance(r.event.payload, RunStopped))

    first = runner.invoke(app, ["stop", "--run", "exp-5", *where])
    assert first.exit_code == 0 and "announced the end of run exp-5" in first.output, first.output
    assert stops() == 1
    again = runner.invoke(app, ["stop", "--run", "exp-5", *where])
    assert again.exit_code == 0 and "already stopped" in again.output, again.output
    assert stops() == 1


def test_eval_of_a_version_the_run_does_not_have_is_one_line(two_runs: tuple[ObjectStore, Path]) -> None:
    from producers.eval_cli import app as eval_app

    store, _ = two_runs
    result = runner.invoke(eval_app, ["--run", "cart", "--version", "9", "--root", store.root])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "\n" not in result.output.strip() and "no adapter version 9" in result.output
    assert "rlpipe adapters list --run cart" in result.output


def test_a_value_run_is_shown_with_its_own_budget_network_and_return(file_store: ObjectStore) -> None:
    """A DQN run's budget is value.learner.max_steps (the LoRA learner's does not apply), it has no base model but a
    value network of its agent, and its versions carry episode_return_mean rather than reward_mean."""
    from pipeline.config import resolve_config

    config = resolve_config("dqn-cartpole", overrides=["run_id=dq", "value.learner.max_steps=40"])
    create_run(file_store, config, "dqn:cartpole")
    registry = AdapterRegistry(file_store, "dq")
    for step in (1, 2):
        registry.publish_files({"value_network.safetensors": b"w", "value_config.json": b"{}"}, "dqn:cartpole",
                               step - 1, step, {"episode_return_mean": 10.0 * step}, kind="value-network")
    shown = runner.invoke(app, ["show", "--run", "dq", "--json", "--root", file_store.root, "--no-bus"])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.output)
    assert summary["max_steps"] == 40 and summary["steps"] == 2 and summary["last_reward"] == 20.0
    assert summary["base_model"] == "dqn value network"
    table = runner.invoke(app, ["show", "--run", "dq", "--root", file_store.root, "--no-bus"])
    assert "2/40" in table.output and "value-network versions" in table.output and "tiny" not in table.output


@pytest.mark.parametrize("mistake", [["--baseline", "heuristc"], ["--env", "cartpol"]])
def test_eval_refuses_a_misspelt_baseline_or_environment_before_any_model_loads(
        mistake: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import producers.eval_cli as eval_cli

    def loaded(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a model was loaded before the mistake was named")

    monkeypatch.setattr(eval_cli, "evaluate_model_versions", loaded)
    store = ObjectStore((tmp_path / "store").as_uri())
    create_run(store, RunConfig(run_id="typo", store={"root": store.root}), "tiny")
    result = runner.invoke(eval_cli.app, ["--run", "typo", "--root", store.root, "--version", "0", *mistake])
    assert result.exit_code == 2 and mistake[1] in result.output and "AssertionError" not in repr(result.exception)


def test_folders_without_a_run_json_say_what_wrote_them(file_store: ObjectStore, tmp_path: Path) -> None:
    """A Tinker API training client's weights and a converted dataset are listed, each named for what it is."""
    make_adapter(tmp_path / "adapter", marker=1)
    AdapterRegistry(file_store, "sess-0123abcd.train.0").publish(tmp_path / "adapter", "tiny", 0, 1, {})
    file_store.put("runs/hvac-data/offline/hvac-mini.json", b"{}")
    file_store.put("runs/recorded/trajectories/date=2026-12-04/b1.parquet", b"demonstrations")
    result = runner.invoke(app, ["list", *_where(file_store), "--json"])
    runs = {r["run_id"]: r for r in json.loads(result.stdout)["runs"]}
    api, dataset, other = runs["sess-0123abcd.train.0"], runs["hvac-data"], runs["recorded"]
    assert api["env"] == "(Tinker API)" and "rlpipe sessions show sess-0123abcd" in api["notes"][0]
    assert dataset["env"] == "(dataset)" and "dataset hvac-mini converted" in dataset["notes"][0]
    assert "rlpipe replay --run hvac-data --train --preset building-hvac --set run_id=hvac-data-awr" in dataset["notes"][0]
    assert other["env"] is None
    assert "e.g. envs record" in other["notes"][0]


@pytest.mark.parametrize("damage", [b"[1, 2]", b"{not json"])
def test_one_unreadable_run_json_is_noted_and_the_other_runs_are_listed(
    two_runs: tuple[ObjectStore, Path], damage: bytes
) -> None:
    store, _ = two_runs
    store.put_create("runs/broken/run.json", damage)
    table = runner.invoke(app, ["list", *_where(store)])
    assert table.exit_code == 0, (table.output, table.exception)
    assert "cartpole" in table.output and "sokoban" in table.output and "broken" in table.output
    assert "runs/broken/run.json unreadable:" in table.output
    listed = runner.invoke(app, ["list", *_where(store), "--json"])
    runs = {r["run_id"]: r for r in json.loads(listed.stdout)["runs"]}
    assert set(runs) == {"cart", "cartpole", "broken"} and runs["cart"]["notes"] == []
    assert runs["broken"]["env"] is None and runs["broken"]["notes"][0].startswith("runs/broken/run.json unreadable:")
    shown = runner.invoke(app, ["show", "--run", "broken", *_where(store)])
    assert shown.exit_code == 0 and "runs/broken/run.json unreadable:" in shown.output


def test_entries_of_the_runs_folder_that_cannot_be_run_ids_are_not_listed(two_runs: tuple[ObjectStore, Path]) -> None:
    store, _ = two_runs
    runs_folder = Path(store.path("runs"))
    (runs_folder / ".DS_Store").write_bytes(b"\0")  # what a file browser leaves in a local store's folders
    (runs_folder / "not a run").mkdir()
    listed = runner.invoke(app, ["list", *_where(store), "--json"])
    assert listed.exit_code == 0, listed.output
    assert [r["run_id"] for r in json.loads(listed.stdout)["runs"]] == ["cart", "cartpole"]
    missing = runner.invoke(app, ["show", "--run", "car", *_where(store)])
    assert missing.exit_code == 2 and "runs there: cart, cartpole" in missing.output


def test_a_run_with_an_unreadable_adapter_manifest_is_noted_and_the_other_runs_are_listed(
    two_runs: tuple[ObjectStore, Path],
) -> None:
    store, _ = two_runs
    store.put_create("runs/cart/adapters/v000003/manifest.json", b"{not json")  # damaged, or a newer rlpipe's
    listed = runner.invoke(app, ["list", *_where(store), "--json"])
    assert listed.exit_code == 0, listed.output
    runs = {r["run_id"]: r for r in json.loads(listed.stdout)["runs"]}
    assert runs["cartpole"]["versions"] == 3 and runs["cartpole"]["notes"] == []
    assert runs["cart"]["versions"] == 3 and runs["cart"]["last_reward"] is None
    assert "v000003/manifest.json" in runs["cart"]["notes"][0]
    table = runner.invoke(app, ["list", *_where(store)])
    assert table.exit_code == 0 and "v000003/manifest.json" in table.output
    shown = runner.invoke(app, ["show", "--run", "cart", *_where(store)])
    assert shown.exit_code == 0 and "v000003/manifest.json" in shown.output


def _record(store: ObjectStore, run_id: str, payload: RunStarted | RunStopped, at: datetime | None = None) -> None:
    """The run's newest start or stop as `rlpipe runs create|stop|resume` keep it in the store."""
    from pipeline.membership import membership_key
    from schemas.events import encode_event

    event = make_event(run_id, payload)
    store.put(membership_key(run_id), encode_event(event if at is None else event.model_copy(update={"time": at})))


def _started(run_id: str) -> RunStarted:
    return RunStarted(config_path=f"runs/{run_id}/run.json", config_sha256="0" * 64, env="cartpole", base_model="tiny")


def test_a_stop_the_store_keeps_but_the_topic_lacks_lists_the_run_as_stopped(
        file_store: ObjectStore, tmp_path: Path, bus_config: BusConfig) -> None:
    """Packed processes starting obey the run's recorded start or stop (runs/<run>/membership.json); the listing
    agrees: a stop the topic lacks (its publish failed) or no longer holds (trimmed by retention) is a stop, and a
    resume recorded after the topic's stop is not."""
    from datetime import timedelta

    for run in ("missed", "trimmed", "resumed", "newer-stop"):
        make_run(file_store, tmp_path, run, "cartpole", steps=1, max_steps=5)
    long_ago = datetime.now(UTC) - timedelta(days=8)
    with EventPublisher(bus_config) as publisher:
        publisher.publish("control", make_event("missed", _started("missed")))
        publisher.publish("control", make_event("resumed", RunStopped(reason="stopped by rlpipe runs stop")))
        _record(file_store, "newer-stop", _started("newer-stop"), at=long_ago)
        publisher.publish("control", make_event("newer-stop", RunStopped(reason="step budget reached")))
    _record(file_store, "missed", RunStopped(reason="stopped by rlpipe runs stop"))
    _record(file_store, "trimmed", RunStopped(reason="step budget reached"), at=long_ago)
    _record(file_store, "resumed", _started("resumed"))
    where = ["--root", file_store.root, "--bootstrap", bus_config.bootstrap_servers, "--namespace", bus_config.namespace]
    listed = runner.invoke(app, ["list", *where, "--json"])
    assert listed.exit_code == 0, listed.output
    runs = {r["run_id"]: r for r in json.loads(listed.stdout)["runs"]}
    assert (runs["missed"]["status"], runs["missed"]["stop_reason"]) == ("stopped", "stopped by rlpipe runs stop")
    assert (runs["trimmed"]["status"], runs["trimmed"]["stop_reason"]) == ("stopped", "step budget reached")
    assert runs["resumed"]["status"] == "running" and runs["resumed"]["stop_reason"] is None  # announced just now
    assert runs["newer-stop"]["status"] == "stopped"  # the topic's stop is newer than the recorded start
    shown = runner.invoke(app, ["show", "--run", "missed", *where])
    assert shown.exit_code == 0 and "stopped (stopped by rlpipe runs stop)" in shown.output, shown.output


def test_without_the_log_a_run_recorded_stopped_is_stopped_and_a_damaged_record_is_a_stop(
        two_runs: tuple[ObjectStore, Path]) -> None:
    """`--no-bus` reads status from the store alone, and the record is in the store.  A damaged record is what
    packed processes take for a stop: listed so, with a note naming the file and the fix."""
    from pipeline.membership import membership_key

    store, _ = two_runs
    _record(store, "cartpole", RunStopped(reason="stopped by rlpipe runs stop"))
    runs = {r["run_id"]: r for r in json.loads(runner.invoke(app, ["list", *_where(store), "--json"]).stdout)["runs"]}
    assert runs["cartpole"]["status"] == "stopped" and runs["cartpole"]["stop_reason"] == "stopped by rlpipe runs stop"
    assert runs["cart"]["status"] == "finished"  # at its budget: finished goes before stopped
    _record(store, "cartpole", _started("cartpole"))
    assert json.loads(runner.invoke(app, ["show", "--run", "cartpole", *_where(store), "--json"]).stdout)[
        "status"] == "unknown"  # started: whether it runs only the log says
    store.put(membership_key("cartpole"), b"{not json")
    table = runner.invoke(app, ["list", *_where(store)])
    assert table.exit_code == 0, table.output
    assert "runs/cartpole/membership.json unreadable" in table.output
    assert "rlpipe runs resume --run cartpole" in table.output
    shown = json.loads(runner.invoke(app, ["show", "--run", "cartpole", *_where(store), "--json"]).stdout)
    assert shown["status"] == "stopped" and "membership.json unreadable" in shown["notes"][0]


def _heartbeat() -> ProducerHeartbeat:
    return ProducerHeartbeat(producer_id="p", adapter_version=3, samples_total=1, batches_total=1, tokens_total=1,
                             env_steps_total=1, samples_per_s=0.0, tokens_per_s=0.0, env_steps_per_s=0.0,
                             busy_fraction=0.0, interval_s=5.0)


def test_a_stop_trimmed_from_the_topic_whose_producers_last_heartbeats_are_kept_is_stopped(
        memory_store: ObjectStore, tmp_path: Path) -> None:
    """Retention trims the oldest events first: the RunStopped goes while the producers' heartbeats just after it
    (they let the run go) and the learner's wind-down up to its LearnerLeft stay.  The recorded stop makes the
    run stopped, as it would had the topic kept it: those events are read against it, not as the run going."""
    from pipeline.analysis.runs import summarize

    now = 1_000_000.0
    stop = RunStopped(reason="stopped by rlpipe runs stop")
    for run in ("producers-left", "learner-left", "served-again"):
        make_run(memory_store, tmp_path, run, "cartpole", steps=1, max_steps=5)
        _record(memory_store, run, stop, at=datetime.fromtimestamp(now - 600, UTC))
    topic = {run: RunActivity() for run in ("producers-left", "learner-left", "served-again")}
    for seconds in (590, 585, 580):  # within LEAVING_WITHIN_S of the stop
        topic["producers-left"].add(now - seconds, _heartbeat())
    topic["learner-left"].add(now - 595, LearnerCheckpointed(step=2, version=2, path="p", offsets={}))
    topic["learner-left"].add(now - 594, LearnerLeft(step=2, version=2))
    topic["learner-left"].add(now - 590, _heartbeat())
    topic["served-again"].add(now - 590, _heartbeat())
    topic["served-again"].add(now - 300, _heartbeat())  # long after the stop: a producer serves it again
    status = {run: summarize(memory_store, run, activity, log_read=True, now_s=now)
              for run, activity in topic.items()}
    assert (status["producers-left"].status, status["producers-left"].stop_reason) == ("stopped", stop.reason)
    assert status["learner-left"].status == "stopped"
    assert status["served-again"].status == "idle"  # its last event is older than ACTIVE_WITHIN_S
    # the same events with the stop still on the topic read the same
    kept = RunActivity()
    kept.add(now - 600, stop)
    for seconds in (590, 585, 580):
        kept.add(now - seconds, _heartbeat())
    assert run_status(RunSummary("k", "unknown", steps=1), kept, log_read=True, now_s=now) == "stopped"


@pytest.mark.parametrize("command", [["stop"], ["resume"], ["delete", "--yes"], ["show", "--no-bus"]])
def test_a_run_named_in_another_case_than_the_stored_one_is_refused_naming_it(
        command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a case-insensitive filesystem (macOS, Windows) runs/exp is runs/Exp: acting on `exp` would write a record
    of run `exp` into run Exp's folder (which packed processes then read as damaged, a stop), announce a run no
    process serves, or delete Exp's files.  Run ids are case-sensitive, as `runs create` and `rlpipe run` hold."""
    from pipeline.cli import runs as runs_cli
    from pipeline.devstack.process import free_port
    from pipeline.membership import membership_key
    from tests.pipeline.test_runtime import CaseInsensitiveStore

    store = CaseInsensitiveStore(f"file://{tmp_path}/store")
    make_run(store, tmp_path, "Exp", "cartpole", steps=1, max_steps=5)
    _record(store, "Exp", _started("Exp"))
    before = {key: store.get(key) for key in store.list("runs/Exp", recursive=True)}
    assert store.exists("runs/exp/run.json")  # the filesystem is as the test says
    monkeypatch.setattr(runs_cli, "_store", lambda root, gcs_endpoint: store)
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", f"127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("RLPIPE_BUS__CONNECT_TIMEOUT_S", "1")
    result = runner.invoke(app, [*command, "--run", "exp"])
    assert result.exit_code == 2 and "\n" not in result.output.strip(), result.output
    assert "'exp'" in result.output and "'Exp'" in result.output and "--run Exp" in result.output, result.output
    assert {key: store.get(key) for key in store.list("runs/Exp", recursive=True)} == before
    assert store.get(membership_key("Exp")) == before[membership_key("Exp")]


def test_a_tinker_training_client_shows_its_sessions_state(file_store: ObjectStore, tmp_path: Path) -> None:
    """A training client's weights have no run.json and no control events: its status is its API session's, so an
    ended session's client is ``ended`` (with the end as its reason), a live one's ``running``, a lapsed one's
    ``idle``, never ``idle`` for a session long over."""
    import time

    from pipeline.api.lifecycle import heartbeat_key, record_end
    from schemas.api import SESSION_TIMEOUT_S

    make_adapter(tmp_path / "adapter", marker=1)
    beats = {"sess-00000001": time.time(), "sess-00000002": time.time(), "sess-00000003": time.time() - 2 * SESSION_TIMEOUT_S}
    for session, beat_at in beats.items():
        AdapterRegistry(file_store, f"{session}.train.0").publish(tmp_path / "adapter", "tiny", 0, 1, {})
        file_store.put(f"sessions/{session}/session.json", json.dumps({"tenant": "t", "created_at": beat_at}).encode())
        file_store.put(heartbeat_key(session), json.dumps({"time": beat_at}).encode())
    record_end(file_store, "sess-00000001", "finished: success")
    result = runner.invoke(app, ["list", *_where(file_store), "--json"])
    runs = {r["run_id"]: r for r in json.loads(result.stdout)["runs"]}
    ended, live, lapsed = (runs[f"{session}.train.0"] for session in beats)
    assert (ended["status"], ended["stop_reason"]) == ("ended", "finished: success")
    assert live["status"] == "running" and lapsed["status"] == "idle"
    shown = runner.invoke(app, ["show", "--run", "sess-00000001.train.0", *_where(file_store)])
    assert "ended (finished: success)" in shown.output, shown.output


def test_a_live_tinker_sessions_training_client_is_not_deleted_even_without_the_log(
    file_store: ObjectStore, tmp_path: Path
) -> None:
    """Its status is its session's, read from the store alone: with --no-bus too, delete refuses a live session's
    client and names the command that ends the session (it has no events, and ``runs stop`` does not apply);
    once the session ended, the weights are deleted without a note about the unread log."""
    import time

    from pipeline.api.lifecycle import heartbeat_key, record_end

    make_adapter(tmp_path / "adapter", marker=1)
    AdapterRegistry(file_store, "sess-00000004.train.0").publish(tmp_path / "adapter", "tiny", 0, 1, {})
    file_store.put("sessions/sess-00000004/session.json", json.dumps({"tenant": "t", "created_at": time.time()}).encode())
    file_store.put(heartbeat_key("sess-00000004"), json.dumps({"time": time.time()}).encode())
    refused = runner.invoke(app, ["delete", "--run", "sess-00000004.train.0", *_where(file_store), "--yes"])
    assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert "rlpipe sessions end sess-00000004" in refused.output and "stop it" not in refused.output, refused.output
    assert AdapterRegistry(file_store, "sess-00000004.train.0").versions() == [1]
    record_end(file_store, "sess-00000004", "finished: success")
    deleted = runner.invoke(app, ["delete", "--run", "sess-00000004.train.0", *_where(file_store), "--yes"])
    assert deleted.exit_code == 0 and "not checked" not in deleted.output, deleted.output
    assert not file_store.list("runs/sess-00000004.train.0", recursive=True)


def test_a_lapsed_tinker_sessions_training_client_is_not_deleted(file_store: ObjectStore, tmp_path: Path) -> None:
    """A lapsed session (no heartbeat for over ``SESSION_TIMEOUT_S``) has not ended: the trainers only unload it until
    its next call, which needs its weights.  Only an ended session's client is deleted."""
    import time

    from pipeline.api.lifecycle import heartbeat_key
    from schemas.api import SESSION_TIMEOUT_S

    make_adapter(tmp_path / "adapter", marker=1)
    AdapterRegistry(file_store, "sess-00000009.train.0").publish(tmp_path / "adapter", "tiny", 0, 1, {})
    beat_at = time.time() - 2 * SESSION_TIMEOUT_S
    file_store.put("sessions/sess-00000009/session.json", json.dumps({"tenant": "t", "created_at": beat_at}).encode())
    file_store.put(heartbeat_key("sess-00000009"), json.dumps({"time": beat_at}).encode())
    listed = json.loads(runner.invoke(app, ["list", *_where(file_store), "--json"]).stdout)["runs"]
    assert [r["status"] for r in listed if r["run_id"] == "sess-00000009.train.0"] == ["idle"], listed
    refused = runner.invoke(app, ["delete", "--run", "sess-00000009.train.0", *_where(file_store), "--yes"])
    assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert "lapsed" in refused.output and "rlpipe sessions end sess-00000009" in refused.output, refused.output
    assert AdapterRegistry(file_store, "sess-00000009.train.0").versions() == [1]


def test_runs_list_and_sessions_list_agree_on_a_session_without_a_heartbeat_yet(
    file_store: ObjectStore, tmp_path: Path
) -> None:
    """A session just created has no heartbeat to lapse from (the trainers keep it loaded): ``sessions list`` says
    ``live``, and ``runs list`` shows its training client ``running``, not ``idle``."""
    import time

    from pipeline.cli.main import app as main_app

    make_adapter(tmp_path / "adapter", marker=1)
    AdapterRegistry(file_store, "sess-00000005.train.0").publish(tmp_path / "adapter", "tiny", 0, 1, {})
    file_store.put("sessions/sess-00000005/session.json", json.dumps({"tenant": "t", "created_at": time.time()}).encode())
    sessions = runner.invoke(main_app, ["sessions", "list", "--json", "--set", f"store.root={file_store.root}"])
    assert [s["state"] for s in json.loads(sessions.stdout)] == ["live"], sessions.output
    runs = json.loads(runner.invoke(app, ["list", *_where(file_store), "--json"]).stdout)["runs"]
    assert [r["status"] for r in runs if r["run_id"] == "sess-00000005.train.0"] == ["running"], runs


def test_a_run_going_again_after_a_stop_shows_running_without_the_stops_reason(
        two_runs: tuple[ObjectStore, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer beating long after the run's stop shows it going again: `runs show` says `running`, not `running
    (stopped by rlpipe runs stop)`, which contradicts itself.  A stopped run shows why it stopped."""
    import time

    from pipeline.cli import runs as runs_cli

    store, _ = two_runs
    now = time.time()
    going, stopped = RunActivity(), RunActivity()
    for activity in (going, stopped):
        activity.add(now - 300, RunStopped(reason="stopped by rlpipe runs stop"))
    going.add(now - 2, _heartbeat())
    logs = {"cartpole": going}
    monkeypatch.setattr(runs_cli, "activity_or_note", lambda bus, timeout, run=None: (logs, None))
    shown = runner.invoke(app, ["show", "--run", "cartpole", *_where(store)])
    status = next(line for line in shown.stdout.splitlines() if "status" in line)
    assert "running" in status and "stopped" not in status, shown.stdout
    logs["cartpole"] = stopped
    shown = runner.invoke(app, ["show", "--run", "cartpole", *_where(store)])
    status = next(line for line in shown.stdout.splitlines() if "status" in line)
    assert "stopped (stopped by rlpipe runs stop)" in status, shown.stdout
