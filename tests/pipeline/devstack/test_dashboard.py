"""``rlpipe run``'s live view: what a panel shows of the learner and of each producer."""

from __future__ import annotations

from rich.console import Console

from pipeline.devstack import dashboard
from schemas.config import RunConfig
from schemas.events import LearnerCheckpointed, ProducerHeartbeat, RunStarted, RunStopped


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


def _progress(step: int) -> object:
    from schemas.events import LearnerProgress

    return LearnerProgress(step=step, version=step, positions={})


def _rewarded(step: int, reward: float) -> object:
    from schemas.events import LearnerCheckpointed

    return LearnerCheckpointed(step=step, version=step, path=f"runs/r/checkpoints/step-{step:06d}-a", offsets={},
                               metrics={"reward_mean": reward})


def _lines(stream: list, checkpoint_every: int) -> list[str]:
    """The plain lines a stand-in control stream gives, fed as the launcher feeds them: board first."""
    board = dashboard.Dashboard()
    lines = dashboard.StepLines("r", board, max_steps=4, checkpoint_every=checkpoint_every)
    shown = []
    for payload in stream:
        board.apply(payload)
        shown.append(lines(payload))
    return [line for line in shown if line is not None]


def test_without_a_live_view_each_learner_step_gets_one_line_with_its_checkpoints_reward() -> None:
    """The learner sends progress after a step (and again while it waits), then the step's checkpoint: one line per
    step, from the checkpoint, so it carries the reward; a checkpoint announced again adds none."""
    stream = [_progress(1), _rewarded(1, 0.25), _progress(1), _progress(2), _rewarded(2, 0.75),
              _rewarded(2, 0.75), _progress(2)]
    lines = _lines(stream, checkpoint_every=1)
    assert len(lines) == 2, lines
    assert "step 1/4" in lines[0] and "reward 0.250 (avg of last 1" in lines[0], lines
    assert "step 2/4" in lines[1] and "version v2" in lines[1] and "reward 0.500 (avg of last 2" in lines[1], lines
    assert all(line.startswith("run r ") for line in lines)


def test_a_step_without_a_checkpoint_gets_its_line_from_the_learners_progress() -> None:
    lines = _lines([_progress(1), _progress(1), _progress(2), _rewarded(2, 0.5), _progress(3)],
                   checkpoint_every=2)
    assert [line.split("  ")[1] for line in lines] == ["step 1/4", "step 2/4", "step 3/4"], lines
    assert "reward - " in lines[0] and "reward 0.500" in lines[1] and "reward 0.500" in lines[2], lines


def test_a_step_line_says_how_stale_the_most_stale_producer_is() -> None:
    from schemas.events import ProducerHeartbeat

    def beat(producer: str, version: int) -> ProducerHeartbeat:
        return ProducerHeartbeat(producer_id=producer, adapter_version=version, samples_total=8, batches_total=1,
                                 tokens_total=100, env_steps_total=8, samples_per_s=2.5, tokens_per_s=40.0,
                                 env_steps_per_s=2.5, busy_fraction=0.5, interval_s=5.0)

    (line,) = _lines([_rewarded(1, 0.0), _rewarded(2, 0.0), beat("p0", 2), beat("p1", 0), _progress(3)],
                     checkpoint_every=2)[2:]
    assert "step 3/4" in line and "producers 2 (most stale 3 behind)" in line, line  # v3 (its progress) - v0


def _started() -> RunStarted:
    return RunStarted(config_path="runs/run/run.json", config_sha256="0" * 64, env="cartpole", base_model="tiny")


def test_a_run_resumed_after_its_stop_shows_its_producers_silence_again() -> None:
    """``rlpipe runs stop`` then ``rlpipe runs resume``: the ``RunStarted`` after the stop ends it, so a producer
    that then stops beating reads silent (a hang), not stopped with its rates blanked."""
    board = dashboard.Dashboard(silent_after_s=15.0)
    for payload in (_beat("run-p0"), RunStopped(reason="stopped by rlpipe runs stop"), _started(), _beat("run-p0")):
        board.apply(payload)
    board.heard["run-p0"] -= 40.0
    row = _producer_rows(board, 10)["run-p0"]
    assert "silent 40s" in row and "stopped" not in row and "2.50" in row, row


def test_a_run_resumed_past_the_launchers_step_budget_is_not_shown_done() -> None:
    """A packed run stopped at its budget of 2, its budget raised and the run resumed while ``rlpipe run`` (whose
    budget is still 2) is open: it goes on, so its row shows its beats; its next stop ends it again."""
    board = dashboard.Dashboard(silent_after_s=15.0)
    for payload in (_beat("run-p0"), _checkpointed(2), RunStopped(reason="step budget reached", final_step=2)):
        board.apply(payload)
    assert "done" in _producer_rows(board, 2)["run-p0"]
    for payload in (_started(), _beat("run-p0"), _checkpointed(3)):
        board.apply(payload)
    row = _producer_rows(board, 2)["run-p0"]
    assert "done" not in row and "2.50" in row and "0s ago" in row, row
    board.apply(RunStopped(reason="step budget reached", final_step=4))
    assert "done" in _producer_rows(board, 2)["run-p0"]


def test_a_run_started_below_its_budget_is_done_when_its_learner_reaches_it() -> None:
    """The launch's own ``RunStarted`` (at step 0) does not hold the budget off: only a start at or past it does."""
    board = dashboard.Dashboard(silent_after_s=15.0)
    for payload in (_started(), _beat("run-p0"), _checkpointed(2)):
        board.apply(payload)
    assert "done" in _producer_rows(board, 2)["run-p0"]


def test_a_value_runs_step_lines_show_its_actors_episode_return_as_its_reward() -> None:
    """A value learner's checkpoint carries ``episode_return_mean`` (its actors' finished episodes), not
    ``reward_mean``: the line shows it as the reward, as ``rlpipe runs list`` does."""
    returned = LearnerCheckpointed(step=1, version=1, path="runs/r/checkpoints/step-000001-a", offsets={},
                                   metrics={"episode_return_mean": 28.2, "episodes": 3.0})
    (line,) = _lines([returned], checkpoint_every=1)
    assert "reward 28.200 (avg of last 1 checkpoints)" in line, line


def test_a_producer_ahead_of_the_newest_checkpoint_is_not_shown_negatively_stale() -> None:
    """A value learner publishes every step but checkpoints every few: a producer's version is measured against
    the newest version the learner announced (its progress), so a producer on it is 0 behind, not -2."""
    def beat(producer: str, version: int) -> ProducerHeartbeat:
        return ProducerHeartbeat(producer_id=producer, adapter_version=version, samples_total=8, batches_total=1,
                                 tokens_total=100, env_steps_total=8, samples_per_s=2.5, tokens_per_s=40.0,
                                 env_steps_per_s=2.5, busy_fraction=0.5, interval_s=5.0)

    stream = [_rewarded(5, 0.0), _progress(6), _progress(7), beat("p0", 7), beat("p1", 6), _progress(8)]
    (line,) = _lines(stream, checkpoint_every=5)[-1:]
    assert "producers 2 (most stale 2 behind)" in line, line  # v8 - v6
    (line,) = _lines([_rewarded(5, 0.0), beat("p0", 7), _progress(6)], checkpoint_every=5)[-1:]
    assert "most stale 0 behind" in line, line  # its v7 heard before the progress of step 7: the newest known
