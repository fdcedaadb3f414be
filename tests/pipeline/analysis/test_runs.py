"""A run's status after a stop (``pipeline.analysis.runs``): its learner winding it down does not make it go again."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from pipeline.analysis.runs import RunActivity, RunSummary, run_status, summarize
from pipeline.io.store import ObjectStore
from pipeline.membership import membership_key
from pipeline.runtime import create_run
from schemas.config import RunConfig
from schemas.events import (
    LearnerCheckpointed,
    LearnerLeft,
    LearnerProgress,
    RunStarted,
    RunStopped,
    encode_event,
    make_event,
)

NOW = 1_000_000.0


def _started(run_id: str) -> RunStarted:
    return RunStarted(config_path=f"runs/{run_id}/run.json", config_sha256="0" * 64, env="cartpole", base_model="tiny")


def test_a_recorded_stop_still_reads_stopped_after_the_learner_trained_the_rows_waiting(
        memory_store: ObjectStore, tmp_path: Path) -> None:
    """`runs stop --run pk-2`: the stop is recorded and on the topic; its learner then trains step 1 from rows already
    waiting (no LearnerLeft read).  The run stays stopped, at once and an hour on, not running and then idle."""
    create_run(memory_store, RunConfig.model_validate({"run_id": "pk-2", "learner": {"max_steps": 5}}), "tiny")
    stop = RunStopped(reason="stopped by rlpipe runs stop")
    memory_store.put(membership_key("pk-2"), encode_event(
        make_event("pk-2", stop).model_copy(update={"time": datetime.fromtimestamp(NOW - 30, UTC)})))
    topic = RunActivity()
    topic.add(NOW - 30, stop)
    topic.add(NOW - 20, LearnerProgress(step=1, version=1, positions={}))
    topic.add(NOW - 19, LearnerCheckpointed(step=1, version=1, path="runs/pk-2/checkpoints/1", offsets={}))
    for later in (NOW, NOW + 3600):
        summary = summarize(memory_store, "pk-2", topic, log_read=True, now_s=later)
        assert (summary.status, summary.stop_reason, summary.steps) == ("stopped", stop.reason, 1), later


def test_learner_events_after_a_stop_are_its_wind_down_until_a_newer_start() -> None:
    """Whatever a learner sends after a stop (a step trained from rows waiting, its checkpoint, with or without its
    LearnerLeft) is the run winding down; only a newer RunStarted (rlpipe runs resume) makes its events the run
    going again."""
    stopped = RunActivity()
    stopped.add(NOW - 30, RunStopped(reason="stopped by rlpipe runs stop"))
    stopped.add(NOW - 5, LearnerProgress(step=2, version=2, positions={}))
    assert run_status(RunSummary("a", "unknown", steps=2, max_steps=9), stopped, log_read=True, now_s=NOW) == "stopped"
    stopped.add(NOW - 4, _started("a"))
    stopped.add(NOW - 3, LearnerProgress(step=3, version=3, positions={}))
    assert run_status(RunSummary("a", "unknown", steps=3, max_steps=9), stopped, log_read=True, now_s=NOW) == "running"


def test_a_learner_reporting_after_its_predecessor_left_a_stopped_run_is_the_run_going() -> None:
    """After a stop the learner winds the run down and leaves (its LearnerLeft); a learner that reports after that
    was started on the run again without `runs resume` and trains it: the run is going, not stopped (so `runs
    delete` refuses it)."""
    activity = RunActivity()
    activity.add(NOW - 60, RunStopped(reason="stopped by rlpipe runs stop"))
    activity.add(NOW - 50, LearnerCheckpointed(step=2, version=2, path="runs/a/checkpoints/2", offsets={}))
    activity.add(NOW - 49, LearnerLeft(step=2, version=2))
    assert run_status(RunSummary("a", "unknown", steps=2, max_steps=9), activity, log_read=True, now_s=NOW) == "stopped"
    activity.add(NOW - 5, LearnerProgress(step=3, version=3, positions={}))
    assert run_status(RunSummary("a", "unknown", steps=3, max_steps=9), activity, log_read=True, now_s=NOW) == "running"


def test_a_learner_still_reporting_long_after_a_stop_without_leaving_is_the_run_going() -> None:
    """A learner that never sends LearnerLeft (one under torchrun, or one whose stop follower could not start) and
    still reports its progress well after the stop trains the run: it is going, not stopped."""
    from pipeline.analysis.runs import LEARNER_WIND_DOWN_S

    activity = RunActivity()
    activity.add(NOW - 3 * LEARNER_WIND_DOWN_S, RunStopped(reason="stopped by rlpipe runs stop"))
    activity.add(NOW - 3 * LEARNER_WIND_DOWN_S + 30, LearnerProgress(step=4, version=4, positions={}))
    assert run_status(RunSummary("a", "unknown", steps=4, max_steps=9), activity, log_read=True, now_s=NOW) == "stopped"
    activity.add(NOW - 5, LearnerProgress(step=4, version=4, positions={}))
    assert run_status(RunSummary("a", "unknown", steps=4, max_steps=9), activity, log_read=True, now_s=NOW) == "running"
