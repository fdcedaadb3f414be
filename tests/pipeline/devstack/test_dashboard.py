"""``rlpipe run``'s live view: what a panel shows of the learner and of each producer."""

from __future__ import annotations

from pipeline.devstack import dashboard
from schemas.config import RunConfig


def test_the_dashboard_shows_a_producer_that_stopped_heart_beating_as_silent() -> None:
    """A hung producer keeps its process alive but sends no heartbeat: its row says how long it has been silent
    instead of showing its last rates as if they were current."""
    from rich.console import Console

    from schemas.events import ProducerHeartbeat

    def beat(producer: str) -> ProducerHeartbeat:
        return ProducerHeartbeat(producer_id=producer, adapter_version=0, samples_total=8, batches_total=1,
                                 tokens_total=100, env_steps_total=8, samples_per_s=2.5, tokens_per_s=40.0,
                                 env_steps_per_s=2.5, busy_fraction=0.5, interval_s=5.0)

    board = dashboard.Dashboard(silent_after_s=15.0)
    board.apply(beat("run-p0"))
    board.apply(beat("run-p1"))
    board.heard["run-p1"] -= 40.0  # its last beat 40 s ago
    console = Console(width=200, record=True)
    console.print(board.render("run", 10))
    rows = {line.split()[1]: line for line in console.export_text().splitlines() if "run-p" in line}
    assert "silent 40s" in rows["run-p1"], rows
    assert "silent" not in rows["run-p0"] and "0s ago" in rows["run-p0"], rows


def test_a_launchers_dashboards_call_a_producer_silent_after_three_of_its_heartbeat_intervals() -> None:
    config = RunConfig.model_validate({"producer": {"heartbeat_interval_s": 20.0}})
    assert dashboard.silent_after_s(config) == 60.0
    assert dashboard.silent_after_s(RunConfig.model_validate({"producer": {"heartbeat_interval_s": 1.0}})) == 30.0


def test_a_checkpoint_announced_again_or_late_neither_moves_the_learner_back_nor_counts_its_reward_twice() -> None:
    """A learner's start announces again the checkpoint it resumes from (``consumers.reannounce``): the board keeps
    the newest checkpoint, and averages each checkpoint's reward once."""
    from schemas.events import LearnerCheckpointed

    def checkpointed(step: int, reward: float) -> LearnerCheckpointed:
        return LearnerCheckpointed(step=step, version=step, path=f"runs/r/checkpoints/step-{step:06d}-a", offsets={},
                                   metrics={"reward_mean": reward})

    board = dashboard.Dashboard()
    for payload in (checkpointed(1, 0.25), checkpointed(2, 0.75), checkpointed(2, 0.75), checkpointed(1, 0.25)):
        board.apply(payload)
    assert board.learner == checkpointed(2, 0.75)
    assert list(board.rewards) == [0.25, 0.75]  # (0.25 + 0.75) / 2, not pulled towards either by a repeat
