"""The several-clients benchmark's pure parts: options, intervals, the duty per kind and the table."""

import math

import pytest

from bench.tinker_clients import (
    Level,
    busy_by_kind,
    intervals_overlap,
    level_cpu_bound,
    mean_interval,
    parse_args,
    report_lines,
)


def test_options_need_the_baseline_and_leave_the_seed_to_the_bench():
    args = parse_args([])
    assert args.levels == [1, 2, 3] and "--rl-steps" in args.loop_args
    for bad in (["--levels", "2", "3"], ["--levels", "0", "1"], ["--loop-args", "--seed 3"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_mean_and_interval():
    mean, half = mean_interval([1.0, 3.0])  # sd sqrt(2); half t(0.975, 1) * sqrt(2) / sqrt(2), not a normal 1.96
    assert (mean, half) == pytest.approx((2.0, 12.706205))
    assert math.isnan(mean_interval([4.0])[1])
    assert intervals_overlap((2.0, 1.0), (3.5, 0.5)) and not intervals_overlap((2.0, 1.0), (3.6, 0.5))
    assert intervals_overlap((2.0, math.nan), (9.0, 0.1))


def test_busy_by_kind_and_the_table():
    lanes = [{"name": "trainer-a", "kind": "trainer"}, {"name": "sampler-b", "kind": "sampler"}]
    assert busy_by_kind({"busy_fraction": {"trainer-a": 0.5, "sampler-b": 0.25}}, lanes) == {
        "trainer": 0.5, "sampler": 0.25}
    result = {"samples": [10.0, 12.0], "tokens": {"trained": 100, "sampled": 10}}
    one = Level(1, 10.0, 100, 10, 0.5, 0.2, [result])
    three = Level(3, 12.0, 300, 30, 0.9, 0.5, [result, result, {**result, "samples": [30.0, 31.0]}])
    lines = report_lines([one, three], {0: result, 2: result})
    assert "1 | 10 | 10.0 | 1.0 | 11.0 | 50% | 20% | -" in lines
    assert "3 | 2 | 30.5 +/- 6.4 | 11.0 +/- 12.7 | NO" in lines and "3 | 1 | 11.0 +/- 12.7 | - | -" in lines
    assert lines[-1].startswith("3 clients vs 1: x2.50 all tokens/s") and lines[-1].endswith("goal x2.0: met")


def test_the_cpu_bound_is_what_the_cores_give_at_level_one_cost():
    result = {"samples": [10.0, 12.0], "tokens": {"trained": 100, "sampled": 10}}
    one = Level(1, 10.0, 100, 10, 0.5, 0.2, [result], cpu_busy_s=8.0, cores=2)  # 40% of 2 cores
    assert level_cpu_bound(one, 3) == pytest.approx(2.5)  # 3 x 8 core-s on 2 cores: 12 s for 3x the work of 10 s
    assert level_cpu_bound(one, 2) == 2.0  # never more than one client's pace each
    three = Level(3, 15.0, 300, 30, 0.9, 0.5, [result] * 3, cpu_busy_s=24.0, cores=2)
    lines = report_lines([one, three], {0: result})
    assert "1 | 10 | 10.0 | 1.0 | 11.0 | 50% | 20% | 40% of 2 cores" in lines
    assert "3 | 15 | 20.0 | 2.0 | 22.0 | 90% | 50% | 80% of 2 cores" in lines
    assert lines[-1] == ("CPU bound on this machine: x2.50 (8 busy core-seconds per client alone, 2 cores); "
                         "reached 0.80 of it")


def test_the_goal_is_judged_at_three_clients_only():
    result = {"samples": [10.0, 12.0], "tokens": {"trained": 100, "sampled": 10}}
    one, two = Level(1, 10.0, 100, 10, 0.5, 0.2, [result]), Level(2, 10.0, 300, 30, 0.9, 0.5, [result] * 2)
    assert not any("goal" in line for line in report_lines([one, two], {0: result}))  # x3.0 at 2 clients: no verdict
    three = Level(3, 10.0, 150, 15, 0.9, 0.5, [result] * 3)
    four = Level(4, 10.0, 500, 50, 0.9, 0.5, [result] * 4)
    lines = report_lines([one, three, four], {0: result})
    assert [line for line in lines if "goal" in line] == [
        "3 clients vs 1: x1.50 all tokens/s (trained x1.50, sampled x1.50); goal x2.0: not met"]
    assert any(line.startswith("4 clients vs 1: x5.00") for line in lines)


def test_the_server_store_and_logs_go_to_a_new_temporary_folder_unless_out_says(tmp_path, monkeypatch):
    import tempfile

    from bench.tinker_clients import output_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert parse_args([]).out is None
    made = output_folder(None)
    assert made.is_dir() and made.parent == tmp_path and made.name.startswith("rlpipe-bench-clients-")
    assert output_folder(tmp_path / "mine") == tmp_path / "mine" and (tmp_path / "mine").is_dir()
