"""``rlpipe replay`` and ``rlpipe learner`` argument checks (nothing is trained here)."""

from __future__ import annotations

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
