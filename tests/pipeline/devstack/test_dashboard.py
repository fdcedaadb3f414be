"""``rlpipe run``'s live view: what a panel shows of the learner and of each producer."""

from __future__ import annotations

from rich.console import Console

from pipeline.devstack import dashboard
from schemas.config import RunConfig
from schemas.events import LearnerCheckpointed, ProducerHeartbeat, RunStopped


def _beat(producer: str, busy: float = 0.5) -> ProducerHeartbeat:
    return ProducerHeartbeat(producer_id=producer, adapter_version=0, samples_total=8, batches_total=1,
                             tokens_total=100, env_steps_total=8, samples_per_s=2.5, tokens_per_s=40.0,
                             env_steps_per_s=2.5, busy_fraction=busy, interval_s=5.0)


def _checkpointed(step: int) -> LearnerCheckpointed:
    return LearnerCheckpointed(step=step, version=step, path=f"runs/r/checkpoints/step-{step:06d}-a", offsets={},
                               metrics={})


def _producer_rows(board: dashboard.Dashboard, max_steps: int | None) -> dict[str, str]:
    console = Console(width=200, record=True)
    console.print(board.render("run", max_steps))
    return {line.split()[1]: line for line in console.export_text().splitlines() if "run-p" in line}


def test_the_dashboard_shows_a_producer_that_stopped_heart_beating_as_silent() -> None:
    """A hung producer keeps its process alive but sends no heartbeat: its row says how long it has been silent
    instead of showing its last rates as if they were current."""
    board = dashboard.Dashboard(silent_after_s=15.0)
    board.apply(_beat("run-p0"))
    board.apply(_beat("run-p1"))
    board.heard["run-p1"] -= 40.0  # its last beat 40 s ago
    rows = _producer_rows(board, 10)
    assert "silent 40s" in rows["run-p1"], rows
    assert "silent" not in rows["run-p0"] and "0s ago" in rows["run-p0"], rows


def test_a_launchers_dashboards_call_a_producer_silent_after_three_of_its_heartbeat_intervals() -> None:
    config = RunConfig.model_validate({"producer": {"heartbeat_interval_s": 20.0}})
    assert dashboard.silent_after_s(config) == 60.0
    assert dashboard.silent_after_s(RunConfig.model_validate({"producer": {"heartbeat_interval_s": 1.0}})) == 30.0


def test_a_checkpoint_announced_again_or_late_neither_moves_the_learner_back_nor_counts_its_reward_twice() -> None:
    """A learner's start announces again the checkpoint it resumes from (``consumers.reannounce``): the board keeps
    the newest checkpoint, and averages each checkpoint's reward once."""
    def checkpointed(step: int, reward: float) -> LearnerCheckpointed:
        return LearnerCheckpointed(step=step, version=step, path=f"runs/r/checkpoints/step-{step:06d}-a", offsets={},
                                   metrics={"reward_mean": reward})

    board = dashboard.Dashboard()
    for payload in (checkpointed(1, 0.25), checkpointed(2, 0.75), checkpointed(2, 0.75), checkpointed(1, 0.25)):
        board.apply(payload)
    assert board.learner == checkpointed(2, 0.75)
    assert list(board.rewards) == [0.25, 0.75]  # (0.25 + 0.75) / 2, not pulled towards either by a repeat


def test_a_producer_of_a_run_at_its_step_budget_is_shown_done_not_silent() -> None:
    """A packed run that reached its step budget is let go while the others go on: its producer row stops beating,
    which is its end, not a hang (no ``silent`` and no last busy share as if it still worked)."""
    board = dashboard.Dashboard(silent_after_s=15.0)
    board.apply(_beat("run-p0", busy=1.0))
    board.apply(_checkpointed(1))
    board.heard["run-p0"] -= 86.0
    row = _producer_rows(board, 1)["run-p0"]
    assert "done" in row and "silent" not in row and "100%" not in row and "2.50" not in row, row
    assert "silent 86s" in _producer_rows(board, 2)["run-p0"]  # one step short of its budget: still silent


def test_a_producer_of_a_stopped_run_is_shown_stopped_not_silent() -> None:
    """``RunStopped`` (``rlpipe runs stop``, a Ctrl-C) ends the run before its budget: its producers' rows say so."""
    board = dashboard.Dashboard(silent_after_s=15.0)
    board.apply(_beat("run-p0"))
    board.apply(RunStopped(reason="stopped by rlpipe runs stop"))
    board.heard["run-p0"] -= 40.0
    row = _producer_rows(board, 10)["run-p0"]
    assert "stopped" in row and "silent" not in row, row
