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
