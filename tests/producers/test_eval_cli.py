"""``rlpipe eval`` of a language-model run, on a local store with the model's play replaced by a small fake."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.runtime import create_run
from producers.eval_cli import app as eval_app
from schemas.config import RunConfig
from schemas.evaluation import EvalResult
from tests.pipeline.io.test_registry import make_adapter


class _Sampler:
    def close(self) -> None:
        pass


def test_each_version_says_what_it_plays_before_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each version's play loads a sampler and plays every episode (minutes on the CPU): a line on stderr says
    which version plays how many episodes, and one when it is done, so the wait is never silent."""
    store = ObjectStore((tmp_path / "store").as_uri())
    config = RunConfig.model_validate({"run_id": "lm", "env": {"name": "cartpole"}})
    create_run(store, config, "tiny")
    make_adapter(tmp_path / "adapter", marker=1)
    AdapterRegistry(store, "lm").publish(tmp_path / "adapter", "tiny", 0, 1, {})

    def play(config: RunConfig, store: ObjectStore, model_path: str, version: int, episodes: int,
             **_: object) -> EvalResult:
        return EvalResult.from_episodes(run_id="lm", env="cartpole", version=version, seed_start=0,
                                        returns=[10.0] * episodes, successes=[False] * episodes,
                                        policy="base" if version == 0 else "adapter")

    monkeypatch.setattr("producers.tiny_model.resolve_model", lambda model: "/models/tiny")
    monkeypatch.setattr("producers.samplers.sampler_for_run", lambda config, path: _Sampler())
    monkeypatch.setattr("producers.evaluation.evaluate_version", play)
    out = CliRunner(env={"COLUMNS": "120"}).invoke(
        eval_app, ["--run", "lm", "--root", store.url(""), "--version", "0", "--version", "latest",
                   "--episodes", "3", "--no-save"])
    assert out.exit_code == 0, out.output
    lines = out.stderr.splitlines()
    assert any("base model (v0)" in line and "3 held-out episodes" in line for line in lines), out.stderr
    assert any("v1" in line and "3 held-out episodes" in line for line in lines), out.stderr
    assert sum("done in" in line for line in lines) == 2, out.stderr
    assert "10.000" in out.stdout  # the table still follows on stdout
