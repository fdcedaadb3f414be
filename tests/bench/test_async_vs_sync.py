"""The async-versus-sync benchmark's pure parts: options, timelines, idle fractions, combined throughput."""

from __future__ import annotations

import math

import pytest

from bench.async_vs_sync import bench_overrides, parse_args, parse_levels, steps_per_run
from bench.timelines import (
    Timeline,
    combined_numbers,
    overlap_bound,
    report_timeline,
    side_numbers,
    sync_phase_shares,
    sync_timeline,
    to_json,
)

# A sync loop of two steps over 10 s starting at t=100: generate 100-102 and 105-106,
# train 103-105 and 107-110 (the step log's started_at..finished_at), 40 + 60 rows.
SYNC_SUMMARY = {
    "started_at": 100.0, "wall_s": 10.0, "sample_s": 5.0, "train_s": 5.0, "rows": 100,
    "sampler_intervals": [[100.0, 102.0], [105.0, 106.0]],
    "learner_intervals": [[103.0, 105.0], [107.0, 110.0]],
}  # fmt: skip


def test_defaults_and_levels():
    args = parse_args([])
    assert (args.preset, args.steps, args.step_delay_s, args.concurrency) == ("demo", 6, 0.05, [1, 2, 3])
    assert not args.skip_concurrency and not args.skip_comparison and args.json_out is None
    assert args.concurrency_steps is None
    assert parse_levels("2, 3") == [2, 3]


def test_concurrent_runs_share_out_the_steps():
    assert [steps_per_run(6, n) for n in (1, 2, 3)] == [6, 3, 2]  # the same total work per level
    assert [steps_per_run(5, n) for n in (1, 2, 3, 8)] == [5, 3, 2, 1]  # rounded up, at least one
    assert steps_per_run(6, 3, fixed=1) == 1


@pytest.mark.parametrize("argv", [
    ["--steps", "0"], ["--concurrency-steps", "0"], ["--step-delay-s", "-1"], ["--concurrency", "0,2"], ["--concurrency", "two"],
    ["--skip-comparison", "--skip-concurrency"], ["--timeout-s", "0"], ["--batch-rows", "0"], ["--backlog-steps", "0"],
])  # fmt: skip
def test_bad_options_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_overrides_carry_the_delay_the_model_and_the_users_last():
    args = parse_args(["--step-delay-s", "0.1", "--set", "learner.batch_rows=64"])
    assert bench_overrides(args, "/m/tiny") == [
        "env.step_delay_s=0.1", "learner.batch_rows=192", "producer.max_backlog_steps=2",
        "producer.heartbeat_interval_s=1", "model.tiny_dir=/m/tiny", "learner.batch_rows=64",
    ]  # fmt: skip
    assert "learner.batch_rows=128" in bench_overrides(parse_args(["--batch-rows", "128"]), None)
    assert "producer.max_backlog_steps=1.5" in bench_overrides(parse_args(["--backlog-steps", "1.5"]), None)
    assert "model.tiny_dir" not in " ".join(bench_overrides(args, None))


def test_sync_side_idle_fractions_from_its_intervals():
    numbers = side_numbers(sync_timeline(SYNC_SUMMARY))
    assert numbers["window_s"] == pytest.approx(10.0)  # 100 .. end of the last step (110)
    assert numbers["steps"] == 2 and numbers["rows"] == 100
    assert numbers["rows_per_s"] == pytest.approx(10.0)
    assert numbers["step_s"] == pytest.approx(2.5)  # (2 + 3) / 2
    assert numbers["sampler_idle"] == pytest.approx(1 - 3 / 10)  # generating 2 + 1 s of 10
    assert numbers["learner_idle"] == pytest.approx(1 - 5 / 10)  # training 2 + 3 s of 10


def test_sync_phase_shares():
    shares = sync_phase_shares({**SYNC_SUMMARY, "sample_s": 6.0, "train_s": 3.0})
    assert shares == {"sampler_waits_on_training": pytest.approx(0.3), "learner_waits_on_sampling": pytest.approx(0.6)}
    assert math.isnan(sync_phase_shares({**SYNC_SUMMARY, "wall_s": 0.0})["sampler_waits_on_training"])


def test_overlap_bound_is_the_wall_over_the_longer_phase():
    assert overlap_bound(SYNC_SUMMARY) == pytest.approx(2.0)  # 5 s sampling, 5 s training: at best 10 s -> 5 s
    assert overlap_bound({**SYNC_SUMMARY, "sample_s": 6.8, "train_s": 3.2}) == pytest.approx(10.0 / 6.8)
    assert math.isnan(overlap_bound({**SYNC_SUMMARY, "sample_s": 0.0, "train_s": 0.0}))


def test_pipeline_timeline_from_report_series():
    steps = [
        {"step": 1, "started_at": 12.0, "finished_at": 14.0, "rows": 30},
        {"step": 2, "started_at": 16.0, "finished_at": 20.0, "rows": None},  # a skipped step trains no rows
        {"step": 3, "started_at": None, "finished_at": None, "rows": 5},  # no times: not on the timeline
    ]
    lanes = [
        {"name": "learner", "kind": "learner", "intervals": [[12.0, 14.0, 1.0], [16.0, 20.0, 1.0]]},
        # heartbeats: 10-15 busy half the time, 15-25 busy 0.2 (prorated to 15-20 inside the window)
        {"name": "p0", "kind": "producer", "intervals": [[10.0, 15.0, 0.5], [15.0, 25.0, 0.2]]},
    ]
    timeline = report_timeline(steps, lanes)
    assert timeline is not None
    assert (timeline.start, timeline.end, timeline.rows, timeline.steps) == (10.0, 20.0, 30, 2)
    numbers = side_numbers(timeline)
    assert numbers["sampler_idle"] == pytest.approx(1 - (2.5 + 1.0) / 10)
    assert numbers["learner_idle"] == pytest.approx(1 - 6 / 10)
    assert report_timeline(steps, [lanes[0]]) is None  # no heartbeat read: no window start


def test_combined_throughput_over_the_union_of_windows():
    a = Timeline(start=0.0, learner=[(5.0, 10.0, 1.0)], samplers=[[(0.0, 10.0, 1.0)]], rows=40)
    b = Timeline(start=5.0, learner=[(10.0, 15.0, 1.0), (15.0, 20.0, 1.0)], samplers=[[(5.0, 20.0, 0.0)]], rows=60)
    combined = combined_numbers([a, b])
    assert combined["window_s"] == 20.0 and combined["rows"] == 100 and combined["steps"] == 3
    assert combined["rows_per_s"] == pytest.approx(5.0) and combined["steps_per_s"] == pytest.approx(0.15)
    assert combined["sampler_idle"] == pytest.approx((0.0 + 1.0) / 2)  # each run over its own window
    assert combined["learner_idle"] == pytest.approx((0.5 + 1 / 3) / 2)
    assert math.isnan(combined_numbers([])["rows_per_s"])


def test_json_has_no_nan_and_keeps_timelines():
    timeline = sync_timeline(SYNC_SUMMARY)
    data = to_json({"x": math.nan, "t": timeline, "tuple": (1, 2)})
    assert data["x"] is None and data["tuple"] == [1, 2]
    assert data["t"]["end"] == 110.0 and data["t"]["learner"][0] == [103.0, 105.0, 1.0]
