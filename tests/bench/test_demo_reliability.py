"""bench/demo_reliability.py: the take-off version and the success rule (pure arithmetic)."""

from __future__ import annotations

from bench.demo_reliability import met, take_off_version


def _series(means: dict[int, float]) -> list[dict[str, float]]:
    return [{"version": v, "reward_mean": m} for v, m in means.items()]


def test_take_off_is_the_first_version_at_1_5x_the_warm_start():
    assert take_off_version(_series({0: 20.0, 1: 24.0, 2: 30.0, 3: 36.0, 4: 50.0})) == 3
    assert take_off_version(_series({1: 24.0, 2: 30.0})) is None
    assert take_off_version(_series({0: 20.0, 2: 40.0})) is None  # no warm start to compare with


def test_both_targets_with_separated_intervals_are_needed():
    good = {"doubled": True, "intervals_separate": True, "rl_raised_1_5x": True, "rl_intervals_separate": True}
    assert met(good)
    for key in good:
        assert not met({**good, key: False})
    assert not met({"seed": 1, "failed": "exit 1"})


def test_a_recipe_judged_on_success_needs_both_success_targets():
    good = {"success_ratio": 3.0, "success_x1_5": True, "success_above_random": True,
            "doubled": False, "intervals_separate": False}  # the return ratios do not count for it
    assert met(good)
    assert not met({**good, "success_x1_5": False}) and not met({**good, "success_above_random": False})


def test_resume_keeps_the_earlier_runs_and_runs_the_missing_and_failed_seeds(tmp_path, monkeypatch, capsys):
    import json

    from bench import demo_reliability

    out = tmp_path / "runs.json"
    finished = {"seed": 1, "base_mean": 20.0, "warm_mean": 30.0, "last_mean": 35.0, "last_version": 9, "ratio": 1.75,
                "intervals_separate": True, "ratio_rl": 1.17, "rl_intervals_separate": False, "take_off_version": None,
                "minutes": 3.0}
    earlier = [finished, {"seed": 2, "failed": "exit 1", "minutes": 3.0}]
    out.write_text(json.dumps(earlier))
    ran: list[int] = []

    def fake_run(seed, steps, episodes, preset="demo"):
        ran.append(seed)
        return {"seed": seed, "failed": "exit 2", "minutes": 1.0}

    monkeypatch.setattr(demo_reliability, "one_run", fake_run)
    monkeypatch.setattr(demo_reliability, "stack_running", lambda: False)
    monkeypatch.setattr(demo_reliability, "stop_stack", lambda: None)
    demo_reliability.main(["--runs", "3", "--out", str(out), "--resume"])
    assert ran == [2, 3]  # seed 1 is kept, seed 2 failed before and runs again
    records = json.loads(out.read_text())
    assert [o["seed"] for o in records] == [1, 2, 3] and records[1]["failed"] == "exit 2"
    assert "met in 0 of 3 runs" in capsys.readouterr().out


def test_a_stack_running_before_the_bench_is_left_running(tmp_path, monkeypatch):
    from bench import demo_reliability

    stopped: list[bool] = []
    monkeypatch.setattr(demo_reliability, "one_run", lambda seed, *a: {"seed": seed, "failed": "x", "minutes": 1.0})
    monkeypatch.setattr(demo_reliability, "stop_stack", lambda: stopped.append(True))
    for running, expected in ((True, []), (False, [True])):
        monkeypatch.setattr(demo_reliability, "stack_running", lambda running=running: running)
        demo_reliability.main(["--runs", "1", "--out", str(tmp_path / f"{running}.json")])
        assert stopped == expected  # only the stack the demo started for the bench is stopped


def test_the_records_go_under_rlpipe_home_unless_out_says(tmp_path, monkeypatch):
    from bench.demo_reliability import parse_args

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path))
    assert parse_args([]).out == tmp_path / "bench" / "demo-reliability.json"
    assert parse_args(["--out", "x.json"]).out.name == "x.json"


def test_the_demo_s_output_shows_while_it_runs_and_its_report_is_read(tmp_path, monkeypatch, capsys):
    import json
    import sys

    from bench import demo_reliability

    (tmp_path / "demo-result.json").write_text(json.dumps({"ratio": 2.5}))
    (tmp_path / "report.json").write_text(json.dumps({"series": {"reward_by_version": [
        {"version": 1, "reward_mean": 10.0}, {"version": 2, "reward_mean": 20.0}]}}))
    script = (f"print('──── 4/6 online RL ────', flush=True); print('done in 7s');"
              f"print('report: {tmp_path}/report.html; figures')")
    monkeypatch.setattr(demo_reliability, "rlpipe_command", lambda *args: [sys.executable, "-c", script])
    outcome = demo_reliability.one_run(3, None, None)
    assert outcome["ratio"] == 2.5 and outcome["take_off_version"] == 2 and outcome["seed"] == 3
    assert outcome["phase_seconds"] == {"4/6 online RL": 7}
    shown = capsys.readouterr().out
    assert "4/6 online RL" in shown and "done in 7s" in shown  # the child's lines, printed as they came


def test_the_command_it_runs_is_rlpipe():
    import subprocess

    from bench import demo_reliability

    done = subprocess.run(demo_reliability.rlpipe_command("demo", "--help"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "--seed" in done.stdout


def test_a_demo_that_prints_no_report_is_a_failed_run(monkeypatch):
    from bench import demo_reliability

    monkeypatch.setattr(demo_reliability, "run_streaming", lambda command: (0, "something else\n"))
    outcome = demo_reliability.one_run(3, None, 32)
    assert outcome["seed"] == 3
    assert "no report" in outcome["failed"]
    assert not demo_reliability.met(outcome)


def test_a_run_records_the_configuration_variables_it_ran_with(monkeypatch):
    from bench import demo_reliability

    monkeypatch.setenv("RLPIPE_SAMPLER__ENGINE", "async")
    monkeypatch.setenv("RLPIPE_HOME", "/somewhere")  # a process setting, not run configuration
    monkeypatch.setattr(demo_reliability, "run_streaming", lambda command: (1, "boom\n"))
    outcome = demo_reliability.one_run(3, None, 32)
    assert outcome["settings"] == {"RLPIPE_SAMPLER__ENGINE": "async"}
    assert outcome["failed"] == "boom"  # the last line the demo printed


def test_phase_seconds_are_read_from_the_demo_s_output():
    from bench.demo_reliability import phase_seconds

    stdout = ("──────── 1/6 tiny base model ────────\n$ rlpipe model init-tiny\ndone in 3s\n"
              "──── 4/6 online RL: learner + producer on the embedded stack ────\n$ rlpipe run\nnoise\ndone in 412s\n"
              "done in 9s\n")  # a line with no phase before it is nobody's
    assert phase_seconds(stdout) == {"1/6 tiny base model": 3,
                                     "4/6 online RL: learner + producer on the embedded stack": 412}


def test_the_median_minutes_of_an_even_number_of_runs_is_the_mean_of_the_middle_two(tmp_path, monkeypatch, capsys):
    from bench import demo_reliability

    minutes = {1: 9.0, 2: 10.0, 3: 12.0, 4: 20.0}  # sorted 9, 10, 12, 20: median (10 + 12) / 2 = 11.0
    monkeypatch.setattr(demo_reliability, "one_run",
                        lambda seed, *a: {"seed": seed, "failed": "x", "minutes": minutes[seed]})
    monkeypatch.setattr(demo_reliability, "stack_running", lambda: True)
    demo_reliability.main(["--runs", "4", "--out", str(tmp_path / "runs.json")])
    assert "median 11.0 min per run" in capsys.readouterr().out
