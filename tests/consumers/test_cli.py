"""``rlpipe replay`` and ``rlpipe learner`` argument checks (nothing is trained here)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from consumers.cli import replay_app

runner = CliRunner()


def test_replay_train_refuses_to_train_into_the_run_it_reads() -> None:
    same = runner.invoke(replay_app, ["--run", "cartpole", "--train", "--preset", "cartpole"])
    assert same.exit_code == 2, same.output
    line = same.output.strip()
    assert "\n" not in line and "cartpole" in line and "--set run_id=" in line
    also = runner.invoke(replay_app, ["--run", "mine", "--train", "--preset", "cartpole", "--set", "run_id=mine"])
    assert also.exit_code == 2 and "--set run_id=" in also.output


def test_learner_start_takes_the_run_as_run(monkeypatch) -> None:
    import consumers.service
    from consumers.cli import app

    started = []
    monkeypatch.setattr(consumers.service, "run_learner", lambda cfg, stop: started.append(cfg))
    result = runner.invoke(app, ["--preset", "cartpole", "--run", "mine"])  # a one-command app: no "start"
    assert result.exit_code == 0, result.output
    assert started[0].run_id == "mine" and started[0].env.name == "cartpole"


def test_learner_start_says_a_run_is_new_and_names_a_stored_run_close_to_it(monkeypatch, tmp_path) -> None:
    """The learner creates the run it is named; a typo of a stored run's id would start a new run quietly."""
    import consumers.service
    from consumers.cli import app
    from pipeline.io.store import ObjectStore
    from pipeline.runtime import create_run
    from schemas.config import RunConfig

    root = f"file://{tmp_path}/store"
    monkeypatch.setenv("RLPIPE_STORE__ROOT", root)
    create_run(ObjectStore(root), RunConfig(run_id="cartpole-exp"), "tiny")
    monkeypatch.setattr(consumers.service, "run_learner", lambda cfg, stop: None)
    typo = runner.invoke(app, ["--preset", "cartpole", "--run", "cartpole-exq"])
    assert typo.exit_code == 0, typo.output
    note = [line for line in typo.stderr.splitlines() if "cartpole-exq" in line]
    assert len(note) == 1 and "new run" in note[0] and "did you mean cartpole-exp?" in note[0], typo.stderr
    stored = runner.invoke(app, ["--preset", "cartpole", "--run", "cartpole-exp"])
    assert stored.exit_code == 0 and "new run" not in stored.stderr, stored.stderr


def test_replay_of_a_run_with_no_batches_is_refused_and_writes_nothing(tmp_path, monkeypatch) -> None:
    from pipeline.io.store import ObjectStore
    from pipeline.runtime import create_run
    from schemas.config import RunConfig

    root = f"file://{tmp_path}/store"
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", root)
    store = ObjectStore(root)
    create_run(store, RunConfig(run_id="empty"), "tiny")  # a run, but nothing sampled yet
    for args in (["--run", "nosuch", "--train"], ["--run", "nosuch", "--to-topic"],
                 ["--run", "empty", "--train"], ["--run", "empty", "--train", "--date-from", "2026-01-01"]):
        result = runner.invoke(replay_app, [*args, "--preset", "cartpole", "--set", "run_id=offline"])
        line = result.output.strip()
        assert result.exit_code == 2 and "\n" not in line, result.output
        assert "nothing to replay" in line and repr(args[1]) in line
        assert ("runs there: empty" in line) == (args[1] == "nosuch")
    value = runner.invoke(replay_app, ["--run", "empty", "--train", "--preset", "dqn-cartpole", "--set", "run_id=q"])
    assert value.exit_code == 2 and "has no steps batches" in value.output, value.output
    store.put("runs/actor/env-steps/date=2026-12-04/b1.parquet", b"not read here")  # a value run's steps batch
    language = runner.invoke(replay_app, ["--run", "actor", "--train", "--preset", "cartpole", "--set", "run_id=x"])
    assert language.exit_code == 2 and "--preset dqn-cartpole" in language.output, language.output
    assert sorted(p.name for p in (tmp_path / "store" / "runs").iterdir()) == ["actor", "empty"]


def damage(store, mode: str) -> str:
    """Two batches of run src, one damaged as ``mode`` says; the damaged batch's id."""
    from datetime import UTC, datetime

    from pipeline.io.archive import TrajectoryArchive, parquet_bytes
    from pipeline.io.archive_layout import commit_record_key
    from tests.consumers.test_sources import rows

    archive = TrajectoryArchive(store)
    first, second = (archive.write_batch("src", [{**row, "run_id": "src"} for row in rows(batch_id, "p")],
                                         created=datetime(2026, 3, 1, minute, tzinfo=UTC)).path
                     for minute, batch_id in enumerate(("b1", "b2")))
    if mode in ("rewritten", "unrecorded"):  # another valid Parquet file under the same name
        table = archive.read_batch(second)
        store.put(second, parquet_bytes(table.set_column(table.schema.get_field_index("reward"), "reward",
                                                         pa.array([-1.0], pa.float32()))))
        if mode == "unrecorded":  # and its commit record deleted
            store.delete(commit_record_key(second))
    elif mode == "corrupt record":
        record = store.get(commit_record_key(second))
        store.put(commit_record_key(second), record.replace(b'"sha256":"', b'"sha256":"zz'))
    else:  # b2's commit record names b1: b2 would never be read
        store.put(commit_record_key(second), store.get(commit_record_key(first)))
    return "b2"


@pytest.mark.parametrize("mode", ["rewritten", "unrecorded", "corrupt record", "record of another batch"])
@pytest.mark.parametrize("how", ["--train", "--to-topic"])
def test_replay_of_a_damaged_run_is_refused_in_one_line_before_anything_is_written(tmp_path, monkeypatch, mode,
                                                                                   how) -> None:
    from pipeline.io.store import ObjectStore

    root = f"file://{tmp_path}/store"
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", root)
    monkeypatch.setenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", "127.0.0.1:1")  # nothing listens: the refusal comes first
    batch = damage(ObjectStore(root), mode)
    result = runner.invoke(replay_app, ["--run", "src", how, "--preset", "cartpole", "--set", "run_id=offline"])
    errors = [line for line in result.output.splitlines() if "error" in line]  # log lines may come before
    assert result.exit_code == 2 and len(errors) == 1 and errors[0].startswith("error: "), result.output
    line = errors[0]
    assert f"{batch}." in line or f"batch {batch} " in line, line
    assert "rlpipe runs delete --run src --yes" in line
    assert sorted(p.name for p in (tmp_path / "store" / "runs").iterdir()) == ["src"]  # nothing trained or created


def test_replay_refuses_a_date_that_is_not_one_and_a_run_with_batches_of_its_own(tmp_path, monkeypatch) -> None:
    from pipeline.io.store import ObjectStore

    root = f"file://{tmp_path}/store"
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", root)
    bad_date = runner.invoke(replay_app, ["--run", "src", "--train", "--date-from", "notadate", "--preset", "cartpole",
                                          "--set", "run_id=off"])
    assert bad_date.exit_code == 2 and "'notadate' is not a date; write it YYYY-MM-DD" in bad_date.output
    for other_spelling in ("20261204", "2026-W49-4"):  # dates to Python, but not as the store's folders spell them
        refused = runner.invoke(replay_app, ["--run", "src", "--train", "--date-to", other_spelling, "--preset",
                                             "cartpole", "--set", "run_id=off"])
        assert refused.exit_code == 2 and "write it YYYY-MM-DD" in refused.output
    store = ObjectStore(root)
    store.put("runs/online/trajectories/date=2026-12-04/b1.parquet", b"an online run's batch")
    into_online = runner.invoke(replay_app, ["--run", "src", "--train", "--preset", "cartpole",
                                             "--set", "run_id=online"])
    assert into_online.exit_code == 2, into_online.output
    assert "run online holds batches of its own" in into_online.output and "--set run_id=src-offline" in into_online.output


def test_replay_refuses_a_date_range_that_ends_before_it_starts(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", f"file://{tmp_path}/store")
    for how in ("--train", "--to-topic"):
        result = runner.invoke(replay_app, ["--run", "src", how, "--date-from", "2026-12-05", "--date-to", "2026-12-01",
                                            "--preset", "cartpole", "--set", "run_id=dst"])
        line = result.output.strip()
        assert result.exit_code == 2 and "\n" not in line, result.output
        assert "--date-from 2026-12-05 is after --date-to 2026-12-01" in line and "swap them" in line


@pytest.mark.parametrize(("source", "expected"), [
    (["--preset", "cartpole"], "rlpipe learner start --preset cartpole --run seeded"),
    (["--config", "my run.yaml"], "rlpipe learner start --config 'my run.yaml' --run seeded"),
])
def test_replay_to_topic_names_the_command_that_trains_the_seeded_run(tmp_path, monkeypatch, source,
                                                                      expected) -> None:
    """The batches wait on the topic for a run that exists only once its learner starts: the line names that
    learner, with the configuration the replay was given."""
    import consumers.cli
    import consumers.replay

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", f"file://{tmp_path}/store")
    (tmp_path / "my run.yaml").write_text("env: {name: cartpole}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(consumers.cli, "_require_batches", lambda *args, **kwargs: None)
    monkeypatch.setattr(consumers.cli, "_require_intact_batches", lambda *args, **kwargs: None)
    monkeypatch.setattr(consumers.replay, "announce_batches", lambda cfg, run, date_from, date_to: 3)
    result = runner.invoke(replay_app, ["--run", "src", "--to-topic", *source, "--set", "run_id=seeded"])
    assert result.exit_code == 0, result.output
    assert "announced 3 batches of run src for run seeded" in result.output, result.output
    assert expected in result.output, result.output


def test_a_learner_of_one_run_stops_on_the_runs_stop_sent_after_it_started(monkeypatch, tmp_path, bus_config) -> None:
    """`rlpipe runs stop` stops a single-run learner as SIGTERM does (its stop flag set: it finishes the step in hand,
    checkpoints and exits 0, saying why).  A stop sent before it started (an earlier session's) and another run's
    stop are not its own."""
    import consumers.service
    from consumers.cli import app
    from pipeline.io.bus import EventPublisher
    from schemas.events import RunStopped, make_event
    from tests.fixtures.run_stop import serves_until_stopped

    monkeypatch.setenv("RLPIPE_STORE__ROOT", f"file://{tmp_path}/store")
    monkeypatch.setenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", bus_config.bootstrap_servers)
    monkeypatch.setenv("RLPIPE_BUS__NAMESPACE", bus_config.namespace)
    publisher = EventPublisher(bus_config)
    publisher.publish("control", make_event("mine", RunStopped(reason="an earlier session's stop")))
    seen: dict[str, bool] = {}

    # stands in for run_learner: trains until its stop flag is set; another run's stop comes first
    monkeypatch.setattr(consumers.service, "run_learner", serves_until_stopped(publisher, seen, other_run="other"))
    try:
        result = runner.invoke(app, ["--preset", "cartpole", "--run", "mine"])
    finally:
        publisher.close()
    assert result.exit_code == 0, result.output
    assert seen == {"before its own stop": False, "after it": True}
    assert "run mine was stopped (stopped by rlpipe runs stop)" in result.stdout, result.stdout


def test_a_learner_its_runs_stop_ended_announces_that_it_left(tmp_path, bus_config, tiny_model_dir) -> None:
    """A single-run learner stopped by its run's RunStopped sends LearnerLeft after its final checkpoint, as a packed
    learner does, so `rlpipe runs show` reads what it sent after the stop as its wind-down and a learner started on
    the run later as the run going; stopped by a signal, it sends none (the run goes on)."""
    from consumers.service import run_learner
    from pipeline.io import bus
    from pipeline.runtime import StopFlag
    from schemas.config import RunConfig
    from schemas.events import LearnerLeft

    def learner_left(run_id: str, run_stopped: bool) -> list[LearnerLeft]:
        config = RunConfig.model_validate({
            "run_id": run_id, "model": {"base_model": tiny_model_dir}, "store": {"root": tmp_path.as_uri()},
            "bus": bus_config.model_dump(), "learner": {"lora_rank": 4, "lora_alpha": 8, "torch_threads": 1,
                                                        "device": "cpu", "max_steps": 5}})
        stop = StopFlag()
        stop.run_stopped = run_stopped
        stop.set()  # stopped before its first step: it sets up, resumes, and stops at once
        run_learner(config, stop)
        return [r.event.payload for r in bus.tail(bus_config, "control", n=50)
                if r.event is not None and r.event.run_id == run_id and isinstance(r.event.payload, LearnerLeft)]

    assert learner_left("stopped-run", run_stopped=True) == [LearnerLeft(step=0, version=0)]
    assert learner_left("signalled-run", run_stopped=False) == []
