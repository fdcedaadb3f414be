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


def test_resume_keeps_the_earlier_runs_and_runs_only_the_missing_seeds(tmp_path, monkeypatch, capsys):
    import json
    import sys

    from bench import demo_reliability

    out = tmp_path / "runs.json"
    earlier = {"seed": 1, "failed": "exit 1", "minutes": 3.0}
    out.write_text(json.dumps([earlier]))
    ran: list[int] = []

    def fake_run(seed, steps, episodes, preset="demo"):
        ran.append(seed)
        return {"seed": seed, "failed": "exit 2", "minutes": 1.0}

    monkeypatch.setattr(demo_reliability, "one_run", fake_run)
    monkeypatch.setattr(demo_reliability.subprocess, "run", lambda *a, **k: None)
    monkeypatch.setattr(sys, "argv", ["demo_reliability.py", "--runs", "3", "--out", str(out), "--resume"])
    demo_reliability.main()
    assert ran == [2, 3]
    assert [o["seed"] for o in json.loads(out.read_text())] == [1, 2, 3]
    assert "met in 0 of 3 runs" in capsys.readouterr().out


def test_the_command_it_runs_is_rlpipe():
    import subprocess

    from bench import demo_reliability

    done = subprocess.run(demo_reliability.rlpipe_command("demo", "--help"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "--seed" in done.stdout


def test_a_demo_that_prints_no_report_is_a_failed_run(monkeypatch):
    import subprocess

    from bench import demo_reliability

    monkeypatch.setattr(demo_reliability.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a[0], 0, stdout="something else\n", stderr=""))
    outcome = demo_reliability.one_run(3, None, 32)
    assert outcome["seed"] == 3
    assert "no report" in outcome["failed"]
    assert not demo_reliability.met(outcome)


def test_a_run_records_the_configuration_variables_it_ran_with(monkeypatch):
    import subprocess

    from bench import demo_reliability

    monkeypatch.setenv("RLPIPE_SAMPLER__ENGINE", "async")
    monkeypatch.setenv("RLPIPE_HOME", "/somewhere")  # a process setting, not run configuration
    monkeypatch.setattr(demo_reliability.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a[0], 1, stdout="", stderr="boom\n"))
    outcome = demo_reliability.one_run(3, None, 32)
    assert outcome["settings"] == {"RLPIPE_SAMPLER__ENGINE": "async"}


def test_phase_seconds_are_read_from_the_demo_s_output():
    from bench.demo_reliability import phase_seconds

    stdout = ("──────── 1/6 tiny base model ────────\n$ rlpipe model init-tiny\ndone in 3s\n"
              "──── 4/6 online RL: learner + producer on the embedded stack ────\n$ rlpipe run\nnoise\ndone in 412s\n"
              "done in 9s\n")  # a line with no phase before it is nobody's
    assert phase_seconds(stdout) == {"1/6 tiny base model": 3,
                                     "4/6 online RL: learner + producer on the embedded stack": 412}
