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


def test_producer_start_says_a_run_is_new_and_names_a_stored_run_close_to_it(monkeypatch, tmp_path) -> None:
    """Starting the parts yourself creates the run named; a typo of a stored run's id would start a new run quietly."""
    import producers.service
    from pipeline.io.store import ObjectStore
    from pipeline.runtime import create_run
    from schemas.config import RunConfig

    root = f"file://{tmp_path}/store"
    monkeypatch.setenv("RLPIPE_STORE__ROOT", root)
    create_run(ObjectStore(root), RunConfig(run_id="cartpole-exp"), "tiny")
    monkeypatch.setattr(producers.service, "run_producer", lambda cfg, stop: None)
    typo = runner.invoke(app, ["--preset", "cartpole", "--run", "cartpole-exq"])
    assert typo.exit_code == 0, typo.output
    note = [line for line in typo.stderr.splitlines() if "cartpole-exq" in line]
    assert len(note) == 1 and "new run" in note[0] and "did you mean cartpole-exp?" in note[0], typo.stderr
    fresh = runner.invoke(app, ["--preset", "cartpole", "--run", "sokoban-1"])  # new, and like no stored run
    assert fresh.exit_code == 0 and "new run" in fresh.stderr and "did you mean" not in fresh.stderr, fresh.stderr
    stored = runner.invoke(app, ["--preset", "cartpole", "--run", "cartpole-exp"])
    assert stored.exit_code == 0 and "new run" not in stored.stderr, stored.stderr


def test_a_producer_of_one_run_stops_on_the_runs_stop_sent_after_it_started(monkeypatch, tmp_path, bus_config) -> None:
    """`rlpipe runs stop` stops a single-run producer as SIGTERM does (its stop flag set: it flushes its complete
    groups and exits 0, saying why); a stop sent before it started is not read as new."""
    import producers.service
    from pipeline.io.bus import EventPublisher
    from schemas.events import RunStopped, make_event
    from tests.fixtures.run_stop import serves_until_stopped

    monkeypatch.setenv("RLPIPE_STORE__ROOT", f"file://{tmp_path}/store")
    monkeypatch.setenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", bus_config.bootstrap_servers)
    monkeypatch.setenv("RLPIPE_BUS__NAMESPACE", bus_config.namespace)
    publisher = EventPublisher(bus_config)
    publisher.publish("control", make_event("mine", RunStopped(reason="an earlier session's stop")))
    seen: dict[str, bool] = {}

    # stands in for run_producer: samples until its stop flag is set
    monkeypatch.setattr(producers.service, "run_producer", serves_until_stopped(publisher, seen))
    try:
        result = runner.invoke(app, ["--preset", "cartpole", "--run", "mine"])
    finally:
        publisher.close()
    assert result.exit_code == 0, result.output
    assert seen == {"before its own stop": False, "after it": True}
    assert "run mine was stopped (stopped by rlpipe runs stop)" in result.stdout, result.stdout
