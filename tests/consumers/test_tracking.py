"""Experiment tracking: which numbers of a step are scalars, where event files go, when W&B is used."""

from __future__ import annotations

import logging
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from consumers.tracking import (
    FanOut,
    TensorBoardLogger,
    WandbLogger,
    open_metric_logger,
    step_scalars,
    tensorboard_dir,
    wandb_configured,
)
from pipeline.io.store import ObjectStore
from schemas.config import LearnerConfig, RunConfig, StoreConfig

METRICS = {
    "step": 3, "started_at": 1_700_000_000.0, "finished_at": 1_700_000_002.5, "rows": 16, "loss": 0.25,
    "ratio_mean": math.nan, "skipped": False, "batch_ids": ["b1"], "staleness_histogram": {"0": 12, "2": 4},
    "tokens_per_s": 812.5, "version": 2,
}  # fmt: skip


def read_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value, as TensorBoard itself reads the folder."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_scalars_are_the_finite_numbers_with_dicts_flattened_and_the_mean_staleness() -> None:
    step, scalars = step_scalars(METRICS)
    assert step == 3
    assert scalars == {"rows": 16.0, "loss": 0.25, "staleness_histogram/0": 12.0, "staleness_histogram/2": 4.0,
                       "tokens_per_s": 812.5, "version": 2.0, "staleness_mean": 0.5}  # fmt: skip


def test_tensorboard_logger_writes_scalars_at_the_step_with_its_wall_time(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path / "tb")
    logger.log(METRICS)
    logger.log({**METRICS, "step": 4, "loss": 0.125})
    logger.close()
    scalars = read_scalars(tmp_path / "tb")
    assert scalars["loss"] == {3: 0.25, 4: 0.125}
    assert scalars["staleness_histogram/2"] == {3: 4.0, 4: 4.0}
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert events.Scalars("rows")[0].wall_time == pytest.approx(METRICS["finished_at"])


def test_event_files_go_under_the_run_of_a_local_store_else_under_rlpipe_home(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    local = ObjectStore((tmp_path / "store").as_uri())
    config = RunConfig(run_id="cartpole-1")
    assert tensorboard_dir(config, local) == tmp_path / "store" / "runs" / "cartpole-1" / "tensorboard"
    remote = ObjectStore("memory://tracking-test")
    assert tensorboard_dir(config, remote) == tmp_path / "home" / "tensorboard" / "cartpole-1"
    chosen = RunConfig(run_id="cartpole-1", learner=LearnerConfig(tensorboard_dir=str(tmp_path / "tb")))
    assert tensorboard_dir(chosen, local) == tmp_path / "tb" / "cartpole-1"


def fake_wandb(monkeypatch, server: dict[str, dict[int, dict[str, float]]] | None = None) -> list[tuple[str, Any]]:
    """A stand-in ``wandb`` module recording what the logger asks of it.

    ``server``: run id -> step -> the row W&B holds.  Its runs keep W&B's step rule: a resumed run starts at
    its last row's step + 1 (``run.step``), a step below ``run.step`` is dropped (W&B warns and ignores it), and
    a row is held back until a later step or ``commit=True`` (what a killed process held back is lost).
    """
    calls: list[tuple[str, Any]] = []
    server = {} if server is None else server

    class Run:
        def __init__(self, run_id: str) -> None:
            self.rows = server.setdefault(run_id, {})
            self.step = max(self.rows) + 1 if self.rows else 0
            self.pending: dict[str, float] = {}

        def log(self, data: dict[str, float], step: int, commit: bool | None = None) -> None:
            if step < self.step:
                calls.append(("dropped", step))
                return
            calls.append(("log", (step, data)))
            if step > self.step:
                self.commit()
                self.step = step
            self.pending.update(data)
            if commit:
                self.commit()
                self.step += 1

        def commit(self) -> None:
            if self.pending:
                self.rows[self.step], self.pending = self.pending, {}

        def finish(self) -> None:
            self.commit()
            calls.append(("finish", None))

    def init(**kwargs: Any) -> Run:
        calls.append(("init", kwargs))
        return Run(kwargs["id"])

    module = types.ModuleType("wandb")
    module.init = init  # type: ignore[attr-defined]
    module.__spec__ = types.SimpleNamespace(name="wandb")  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_is_used_only_when_installed_and_configured(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable
    assert not wandb_configured({"WANDB_MODE": "offline"})
    fake_wandb(monkeypatch)
    assert wandb_configured({"WANDB_MODE": "offline"})
    assert wandb_configured({"WANDB_PROJECT": "rl"})
    assert not wandb_configured({})
    assert not wandb_configured({"WANDB_MODE": "disabled", "WANDB_PROJECT": "rl"})


def test_wandb_logger_resumes_the_run_named_after_the_rlpipe_run(monkeypatch) -> None:
    calls = fake_wandb(monkeypatch)
    monkeypatch.setenv("WANDB_PROJECT", "rl-experiments")
    logger = WandbLogger("cartpole-1", {"learner": {"loss": "ppo"}})
    logger.log(METRICS)
    logger.close()
    (_, init), (_, (step, data)), (finish, _) = calls
    assert init == {"project": "rl-experiments", "id": "cartpole-1", "name": "cartpole-1", "resume": "allow",
                    "config": {"learner": {"loss": "ppo"}}, "reinit": "create_new"}  # fmt: skip
    assert (step, data) == step_scalars(METRICS) and finish == "finish"


def test_a_restarted_learner_leaves_each_step_once_and_in_order_in_wandb(monkeypatch, caplog) -> None:
    """W&B cannot rewrite a run's history: a learner resumed from its checkpoint at step 2, after logging up to
    step 4, logs the steps it trains again (3, 4) only from the first one the W&B run lacks, and says so once;
    each step reaches W&B as it is logged, so a killed learner loses none of them."""
    server: dict[str, dict[int, dict[str, float]]] = {}
    calls = fake_wandb(monkeypatch, server)
    crashed = WandbLogger("cartpole-1")
    for step in (1, 2, 3, 4):
        crashed.log({"step": step, "loss": 1.0})
    assert sorted(server["cartpole-1"]) == [1, 2, 3, 4]  # killed here: never closed
    caplog.set_level(logging.INFO, logger="rlpipe.tracking")
    resumed = WandbLogger("cartpole-1")
    for step in (3, 4, 5):
        resumed.log({"step": step, "loss": 0.5})
    resumed.close()
    assert [name for name, _ in calls if name == "dropped"] == []
    assert {step: row["loss"] for step, row in server["cartpole-1"].items()} == {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 0.5}
    notes = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]
    assert len(notes) == 1 and "steps 3-4" in notes[0], notes


def test_packed_runs_in_one_process_each_log_to_their_own_wandb_run(monkeypatch) -> None:
    """A packed learner holds one logger per run: each makes its own W&B run (``reinit="create_new"``, not the
    process's one active run) and logs only there; one run leaving finishes only its own."""
    calls = fake_wandb(monkeypatch)
    a, b = WandbLogger("run-a"), WandbLogger("run-b")
    a.log(METRICS)
    b.log(METRICS)
    assert a._run is not b._run and [kwargs["reinit"] for name, kwargs in calls if name == "init"] == ["create_new"] * 2
    b.close()
    a.log({**METRICS, "step": 4})
    assert [name for name, _ in calls] == ["init", "log", "init", "log", "finish", "log"]


def test_open_metric_logger_adds_wandb_when_configured(tmp_path: Path, monkeypatch) -> None:
    store = ObjectStore((tmp_path / "store").as_uri())
    config = RunConfig(run_id="r1", store=StoreConfig(root=store.root))
    for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert [type(b).__name__ for b in open_metric_logger(config, store).backends] == ["TensorBoardLogger"]
    calls = fake_wandb(monkeypatch)
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = open_metric_logger(config, store)
    assert [type(b).__name__ for b in logger.backends] == ["TensorBoardLogger", "WandbLogger"]
    logger.log(METRICS)
    logger.close()
    assert calls[0][1]["config"]["learner"]["loss"] == "importance_sampling"
    assert "store" not in calls[0][1]["config"]  # only what describes the training, never credentials
    assert read_scalars(tmp_path / "store" / "runs" / "r1" / "tensorboard")["loss"] == {3: 0.25}


def test_wandb_asked_for_but_not_installed_is_said_once_with_the_fix(tmp_path: Path, monkeypatch, caplog) -> None:
    """WANDB_MODE=offline without the wandb package: TensorBoard only, and a warning saying how to get W&B."""
    store = ObjectStore((tmp_path / "store").as_uri())
    config = RunConfig(run_id="r1", store=StoreConfig(root=store.root))
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable
    monkeypatch.setenv("WANDB_MODE", "offline")
    with caplog.at_level("WARNING", logger="rlpipe.tracking"):
        backends = open_metric_logger(config, store).backends
    assert [type(b).__name__ for b in backends] == ["TensorBoardLogger"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "WANDB_MODE" in warnings[0] and "pip install" in warnings[0], warnings


def test_a_failing_backend_is_dropped_and_the_others_keep_logging(tmp_path: Path, caplog) -> None:
    class Broken:
        def log(self, metrics: Any) -> None:
            raise OSError("disk full")

        def close(self) -> None:
            raise AssertionError("a dropped backend is not closed")

    good = TensorBoardLogger(tmp_path / "tb")
    fan = FanOut([Broken(), good])
    fan.log(METRICS)
    fan.log({**METRICS, "step": 4})
    fan.close()
    assert "Broken failed (OSError: disk full)" in caplog.text
    assert read_scalars(tmp_path / "tb")["rows"] == {3: 16.0, 4: 16.0}


def test_wandb_offline_run_is_written_locally(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="wandb is optional; install it to check the real client offline")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger("offline-run")
    logger.log(METRICS)
    logger.close()
    assert list(tmp_path.glob("wandb/offline-run-*offline-run*"))


def test_a_resumed_learners_event_file_sorts_after_the_crashed_ones_in_the_same_second(tmp_path: Path) -> None:
    """TensorBoard reads a folder's event files in name order, and names them by the second, the pid and a counter
    that is not zero-padded: a file made in the same second as an earlier one can sort first (".9" > ".10") and
    the earlier file's steps then replace the retrained ones.  A new file is made only after every earlier second."""
    import os
    import socket
    import time

    from torch.utils.tensorboard import SummaryWriter  # noqa: F401  # imported now: the file opens at once below

    later_second = int(time.time()) + 1  # an earlier writer's file of the second to come (the same second, or later)
    earlier = tmp_path / f"events.out.tfevents.{later_second:010d}.{socket.gethostname()}.{os.getpid()}.99999"
    earlier.write_bytes(b"")
    logger = TensorBoardLogger(tmp_path)
    logger.log({"step": 3, "loss": 1.0})
    logger.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files[0] == earlier.name and len(files) == 2, files
