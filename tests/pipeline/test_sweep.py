"""``rlpipe sweep``: the plan, the parallel runner, resuming after a failure or a kill, and the leaderboard.

The experiments here run a small script (it scores itself from its options);
the sweep against a real server runs in ``tests/integration/test_tinker_sampling.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from pipeline.cli.main import app
from pipeline.sweeps.leaderboard import gather, interval
from pipeline.sweeps.plan import SweepDir, SweepSpec, experiments, parse_fixed, parse_grid

SCRIPT = textwrap.dedent("""
    import argparse, json, os, pathlib, sys, time
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--loss", default="is")
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--result-file", required=True)
    args = parser.parse_args()
    folder = pathlib.Path(__file__).parent
    with open(folder / "calls.txt", "a") as calls:  # one line per attempt: experiment, pid
        calls.write(f"{os.environ['RLPIPE_SWEEP_EXPERIMENT']} {os.getpid()}\\n")
    if (folder / f"fail-{args.loss}").exists():
        raise SystemExit(f"cannot run loss {args.loss}")
    if (folder / f"hang-{args.lr}").exists():
        time.sleep(600)
    if (folder / f"no-result-{args.loss}").exists():
        raise SystemExit(0)
    print(f"step 0 of lr {args.lr}", flush=True)
    if (folder / "slow").exists():
        print("Retrying request because of try_again", file=sys.stderr, flush=True)
        time.sleep(2.5)
    score = 1000 * args.lr + (5 if args.loss == "ppo" else 0) + args.seed
    samples = [score + d for d in (-1.0, 0.0, 1.0, 0.5)][:args.episodes]
    pathlib.Path(args.result_file).write_text(json.dumps(
        {"metric": "held-out return", "samples": samples, "evaluations": {"base model": [1.0, 3.0]}}))
""")


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "loop.py"
    path.write_text(SCRIPT)
    return path


def _calls(script: Path) -> list[str]:
    path = script.parent / "calls.txt"
    return [line.split()[0] for line in path.read_text().splitlines()] if path.exists() else []


def _sweep(*args: str) -> object:
    return CliRunner().invoke(app, ["sweep", *args])


def test_a_grid_expands_to_every_combination_times_every_seed(script):
    spec = SweepSpec(script=str(script), grid=parse_grid(["lr=1e-3,3e-4", "loss=is,ppo"]),
                     fixed=parse_fixed(["episodes=3", "verbose"]), seeds=[0, 1])
    planned = experiments(spec)
    assert len(planned) == 8 and len({e.name for e in planned}) == 8
    assert [(e.config, e.seed) for e in planned[:3]] == [
        ({"lr": "1e-3", "loss": "is"}, 0), ({"lr": "1e-3", "loss": "is"}, 1), ({"lr": "1e-3", "loss": "ppo"}, 0)]
    argv = planned[2].argv(spec, Path("/r.json"))
    assert argv[1:] == [str(script), "--episodes", "3", "--verbose", "--lr", "1e-3", "--loss", "ppo", "--seed", "0",
                        "--result-file", "/r.json"]
    assert planned[2].label == "lr=1e-3 loss=ppo"


@pytest.mark.parametrize(("grid", "fixed", "error"), [
    (["lr=1e-3"], ["seed=3"], "--seeds"),
    (["result-file=x"], [], "drop --result-file"),
    (["lr=1e-3"], ["lr=3"], "both swept"),
    (["LR=1"], [], "not an option name"),
    (["lr=1,1"], [], "given twice"),
    (["lr=1,"], [], "non-empty"),
])
def test_a_plan_that_cannot_run_is_refused_with_the_fix(script, grid, fixed, error):
    with pytest.raises(ValueError, match=error):
        SweepSpec(script=str(script), grid=parse_grid(grid), fixed=parse_fixed(fixed))
    with pytest.raises(ValueError, match="KEY=V1,V2"):
        parse_grid(["lr"])


def test_a_sweep_runs_in_parallel_and_ranks_its_grid_points(script, tmp_path):
    folder = tmp_path / "sweep"
    done = _sweep(str(script), "--grid", "lr=1e-3,3e-3", "--grid", "loss=is,ppo", "--set", "episodes=4",
                  "--seeds", "0,1", "--parallel", "3", "--dir", str(folder))
    assert done.exit_code == 0, done.output
    assert sorted(_calls(script)) == [f"exp-{i:03d}" for i in range(8)]  # each experiment ran once
    board = json.loads((folder / "leaderboard.json").read_text())
    labels = [e["label"] for e in board["entries"]]
    assert labels == ["lr=3e-3 loss=ppo", "lr=1e-3 loss=ppo", "lr=3e-3 loss=is", "lr=1e-3 loss=is"]
    best = board["entries"][0]
    # two seeds: the mean of their means (3 + 5 + seed + 0.125), the interval over the two seed means
    assert best["mean"] == pytest.approx(8.625) and best["seed_means"] == {"0": 8.125, "1": 9.125}
    assert best["half"] == pytest.approx(interval([8.125, 9.125])[1]) and best["finished"] == 2
    assert best["evaluations"] == {"base model": 2.0}
    assert (folder / "leaderboard.png").read_bytes()[:4] == b"\x89PNG"
    assert "lr=3e-3 loss=ppo" in (folder / "leaderboard.html").read_text()
    assert "| 1 | lr=3e-3 loss=ppo | 8.62 ± " in (folder / "leaderboard.md").read_text()
    assert "leaderboard" in done.output and "[8/8] finished" in done.output


def test_one_seed_gets_the_interval_of_its_evaluation_episodes(script, tmp_path):
    done = _sweep(str(script), "--grid", "lr=1e-3", "--dir", str(tmp_path / "s"))
    assert done.exit_code == 0, done.output
    entry = gather(SweepDir(tmp_path / "s"), SweepDir(tmp_path / "s").plan())[0]
    samples = [0.0, 1.0, 2.0, 1.5]
    mean, half = interval(samples)
    assert entry.mean == pytest.approx(mean) and entry.half == pytest.approx(half)
    assert half == pytest.approx(3.182446 * np.std(samples, ddof=1) / 2, rel=1e-5)  # t(0.975, 3)


def test_a_failed_experiment_is_reported_and_runs_again_on_resume(script, tmp_path):
    folder = tmp_path / "sweep"
    (script.parent / "fail-ppo").touch()
    args = [str(script), "--grid", "lr=1e-3,2e-3", "--grid", "loss=is,ppo", "--dir", str(folder)]
    done = _sweep(*args)
    assert done.exit_code == 1, done.output
    assert "cannot run loss ppo" in done.output and "rlpipe sweep --resume" in done.output
    failed = json.loads((folder / "exp-001" / "failed.json").read_text())
    assert failed["returncode"] == 1 and "cannot run loss ppo" in failed["reason"]
    board = {e["label"]: e for e in json.loads((folder / "leaderboard.json").read_text())["entries"]}
    assert board["lr=1e-3 loss=ppo"]["failed"] == 1 and board["lr=1e-3 loss=ppo"]["mean"] is None

    (script.parent / "fail-ppo").unlink()
    again = _sweep("--resume", str(folder))
    assert again.exit_code == 0, again.output
    assert "2 to run" in again.output and "(2 already finished)" in again.output
    assert sorted(_calls(script)) == ["exp-000", "exp-001", "exp-001", "exp-002", "exp-003", "exp-003"]
    assert not (folder / "exp-001" / "failed.json").exists()
    # the same command on the same folder resumes too: nothing is left to run
    assert _sweep(*args).exit_code == 0 and len(_calls(script)) == 6


def test_a_script_that_writes_no_result_fails_with_the_contract(script, tmp_path):
    (script.parent / "no-result-is").touch()
    done = _sweep(str(script), "--grid", "lr=1e-3", "--dir", str(tmp_path / "s"))
    assert done.exit_code == 1
    assert "wrote no result file" in json.loads((tmp_path / "s" / "exp-000" / "failed.json").read_text())["reason"]


def test_a_folder_holding_another_plan_is_refused(script, tmp_path):
    folder = tmp_path / "sweep"
    assert _sweep(str(script), "--grid", "lr=1e-3", "--dir", str(folder)).exit_code == 0
    other = _sweep(str(script), "--grid", "lr=2e-3", "--dir", str(folder))
    assert other.exit_code == 2 and "--resume" in other.output
    missing = _sweep("--resume", str(tmp_path / "nothing"))
    assert missing.exit_code != 0 and "holds no sweep" in missing.output


def test_a_wrong_interpreter_is_corrected_on_resume_and_seeds_are_not_silently_ignored(script, tmp_path):
    folder = tmp_path / "sweep"
    first = _sweep(str(script), "--grid", "lr=1e-3", "--dir", str(folder), "--python", str(tmp_path / "nope"))
    assert first.exit_code == 1
    seeds = _sweep("--resume", str(folder), "--seeds", "0,1")
    assert seeds.exit_code == 2 and "--seeds" in seeds.output
    fixed = _sweep("--resume", str(folder), "--python", sys.executable)
    assert fixed.exit_code == 0, fixed.output
    assert SweepDir(folder).plan().python == sys.executable  # recorded: a later plain resume uses it too
    other = _sweep(str(script), "--grid", "lr=1e-3", "--seeds", "0,1", "--dir", str(folder))
    assert other.exit_code == 2 and "differs in seeds" in other.output


def test_an_evaluation_is_averaged_over_the_seeds_that_report_it(tmp_path):
    spec = SweepSpec(script=str(tmp_path / "x.py"), grid={"lr": ["1"]}, seeds=[0, 1])
    sweep = SweepDir(tmp_path / "s")
    for experiment in experiments(spec):
        sweep.folder(experiment).mkdir(parents=True)
        evaluations = {"base": [4.0, 4.0]} if experiment.seed == 0 else {"base": []}
        (sweep.folder(experiment) / "result.json").write_text(
            json.dumps({"samples": [1.0, 2.0], "evaluations": evaluations}))
    (entry,) = gather(sweep, spec)
    assert entry.finished == 2 and entry.evaluations == {"base": 4.0}


def test_a_killed_sweep_takes_its_experiments_with_it_and_resumes_the_unfinished(script, tmp_path):
    folder = tmp_path / "sweep"
    (script.parent / "hang-0.003").touch()  # the third experiment hangs until it is killed
    command = [sys.executable, "-c", "from pipeline.cli.main import main; main()", "sweep", str(script),
               "--grid", "lr=0.001,0.002,0.003,0.004", "--parallel", "1", "--dir", str(folder)]
    sweep = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while "exp-002" not in _calls(script):
        assert time.monotonic() < deadline and sweep.poll() is None
        time.sleep(0.1)
    sweep.send_signal(signal.SIGKILL)
    sweep.wait()
    hung = int((script.parent / "calls.txt").read_text().splitlines()[-1].split()[1])
    deadline = time.monotonic() + 10
    while _alive(hung):  # the hanging experiment died with the sweep
        assert time.monotonic() < deadline, "the experiment outlived its sweep"
        time.sleep(0.1)
    assert [(folder / f"exp-{i:03d}" / "result.json").exists() for i in range(4)] == [True, True, False, False]

    (script.parent / "hang-0.003").unlink()
    again = _sweep("--resume", str(folder))
    assert again.exit_code == 0, again.output
    assert _calls(script) == ["exp-000", "exp-001", "exp-002", "exp-002", "exp-003"]  # nothing trained twice


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split()[2] == "Z")


def test_progress_lines_are_the_scripts_own_output_not_its_logging(script, tmp_path):
    (script.parent / "slow").touch()
    done = _sweep(str(script), "--grid", "lr=1e-3", "--progress-every", "1", "--dir", str(tmp_path / "s"))
    assert done.exit_code == 0, done.output
    assert "... exp-000" in done.output and "step 0 of lr 0.001" in done.output
    assert "Retrying" not in done.output  # stderr goes to stderr.txt, not into progress
    assert "Retrying" in (tmp_path / "s" / "exp-000" / "stderr.txt").read_text()


def test_json_output_is_the_leaderboard_alone_with_progress_on_stderr(script, tmp_path):
    done = _sweep(str(script), "--grid", "lr=1e-3,2e-3", "--dir", str(tmp_path / "s"), "--json")
    assert done.exit_code == 0, done.output
    board = json.loads(done.stdout)
    assert [e["label"] for e in board["entries"]] == ["lr=2e-3", "lr=1e-3"] and board["failed_now"] == 0
    assert board["folder"] == str(tmp_path / "s") and "finished exp-000" in done.stderr


def test_a_dir_that_is_a_file_is_refused_in_one_line(script, tmp_path):
    taken = tmp_path / "notes.txt"
    taken.write_text("kept")
    result = _sweep(str(script), "--grid", "lr=1e-3", "--dir", str(taken))
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"--dir {taken} is a file, not a folder" in result.output and taken.read_text() == "kept"
