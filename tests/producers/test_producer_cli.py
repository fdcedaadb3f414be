"""``rlpipe producer start`` argument handling (nothing is sampled here)."""

from __future__ import annotations

from typer.testing import CliRunner

from producers.producer_cli import app

runner = CliRunner()


def test_producer_start_takes_the_run_as_run(monkeypatch) -> None:
    import producers.service

    started = []
    monkeypatch.setattr(producers.service, "run_producer", lambda cfg, stop: started.append(cfg))
    result = runner.invoke(app, ["--preset", "sokoban", "--run", "mine", "--max-groups", "2"])  # one-command app
    assert result.exit_code == 0, result.output
    assert started[0].run_id == "mine" and started[0].env.name == "sokoban" and started[0].producer.max_groups == 2
