"""The cql-building preset through the CLI: ``rlpipe datasets generate`` -> ``rlpipe replay --train`` ->
``rlpipe eval`` of the published version on held-out days (energy, carbon and comfort) -> ``rlpipe report``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli.main import app

pytestmark = pytest.mark.integration


def test_generate_train_eval_report_through_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    root = (tmp_path / "store").as_uri()
    runner = CliRunner()

    def rlpipe(*args: str) -> str:
        result = runner.invoke(app, list(args), env={"RLPIPE_HOME": str(tmp_path / "home")})
        assert result.exit_code == 0, result.output
        return result.output

    rlpipe("datasets", "generate", "building-hvac", "--days", "2", "--policy", "mixed", "--seed", "1",
           "--name", "hvac-mixed", "--root", root)
    out = rlpipe("replay", "--run", "hvac-mixed", "--train", "--preset", "cql-building", "--set", f"store.root={root}",
                 "--set", "value.learner.max_steps=2", "--set", "value.offline.updates_per_step=20",
                 "--set", "value.learner.publish_every=1", "--set", "value.learner.hidden_sizes=[16]")
    assert "trained 2 steps (run cql-building, step 0 to 2); value-network version 2" in out
    again = rlpipe("replay", "--run", "hvac-mixed", "--train", "--preset", "cql-building", "--set",
                   f"store.root={root}", "--set", "value.learner.max_steps=2", "--set", "value.offline.updates_per_step=20",
                   "--set", "value.learner.publish_every=1", "--set", "value.learner.hidden_sizes=[16]")
    assert "already at step 2: nothing left to train" in again  # not "trained 2 steps" again
    results = json.loads(rlpipe("eval", "--run", "cql-building", "--root", root, "--version", "latest",
                                "--episodes", "2", "--baseline", "heuristic", "--json"))["results"]
    version, heuristic = results
    assert (version["policy"], version["version"], heuristic["policy"]) == ("value-network", 2, "heuristic")
    for result in results:  # the same held-out days (2 and 3, after the dataset's 0 and 1), reward parts broken out
        assert result["seed_start"] == 2 and result["episodes"] == 2
        assert {"comfort", "energy", "carbon", "energy_usd", "carbon_kg"} <= set(result["breakdown"])
        assert result["breakdown"]["energy_usd"] > 0 and result["breakdown"]["invalid_rate"] == 0
    validation = json.loads(rlpipe("eval", "--run", "cql-building", "--root", root, "--episodes", "2",
                                   "--baseline", "heuristic", "--validation", "--json"))
    assert [r["seed_start"] for r in validation["results"]] == [4, 4]  # the 2 days after the held-out ones
    assert validation["saved"] == []  # choosing on them leaves the report's held-out results alone
    assert validation["results"][1]["returns"] != heuristic["returns"]
    # the validation days stay after the held-out ones whatever --episodes plays of them
    first = json.loads(rlpipe("eval", "--run", "cql-building", "--root", root, "--episodes", "1", "--held-out", "2",
                              "--validation", "--json"))["results"][0]
    assert first["seed_start"] == 4 and first["returns"] == validation["results"][0]["returns"][:1]
    # without --held-out they start past the stored held-out results where those reach beyond --episodes
    alone = json.loads(rlpipe("eval", "--run", "cql-building", "--root", root, "--episodes", "1", "--validation",
                              "--json"))["results"][0]
    assert alone["seed_start"] == 4
    elsewhere = runner.invoke(app, ["eval", "--run", "cql-building", "--root", root, "--env", "cartpole"],
                              env={"RLPIPE_HOME": str(tmp_path / "home")})  # the network plays the building only
    assert elsewhere.exit_code == 2 and "plays building-hvac days only" in elsewhere.output, elsewhere.output
    refused = runner.invoke(app, ["eval", "--run", "cql-building", "--root", root, "--validation", "--save"],
                            env={"RLPIPE_HOME": str(tmp_path / "home")})
    assert refused.exit_code == 2 and "drop --save" in refused.output
    table = rlpipe("eval", "--run", "cql-building", "--root", root, "--episodes", "1", "--no-save")
    assert "value-network v2: comfort" in table and "kg a day" in table
    rlpipe("report", "--run", "cql-building", "--root", root)
    report = json.loads((tmp_path / "rlpipe-report-cql-building" / "report.json").read_text())
    assert "value-network" in json.dumps(report)
