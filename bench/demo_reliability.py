"""How often does ``make demo`` learn?  The demo recipe run N times with different seeds.

Each run is ``rlpipe demo --seed <i> --no-dashboard`` (demonstrations, sampling,
LoRA initialisation and training seeds all follow the seed; the held-out
evaluation seeds are the same for every run); its output shows as it comes.  All
runs share one embedded stack (started by the first and stopped at the end, unless
one was already running: that one is left running) and one tiny model (built by the
first, cached for the rest).  Printed per run: the two ratios the demo is judged
by (last / base, last / warm start) with whether the 95% intervals separate, the
version at which the training return "took off" (the first version whose mean
training return is at least 1.5x the warm start's), and the minutes it took; then
the success count (both targets met).

    python bench/demo_reliability.py --runs 10            # seeds 1..10
    python bench/demo_reliability.py --runs 3 --first-seed 11 --steps 20
    python bench/demo_reliability.py --runs 10 --preset demo-gae   # the online phase of another preset
    python bench/demo_reliability.py --runs 5 --first-seed 0 --preset demo-sokoban   # Sokoban, judged on success
    python bench/demo_reliability.py --runs 10 --resume    # only the seeds not in --out, or FAILED there
    RLPIPE_SAMPLER__ENGINE=blocking python bench/demo_reliability.py --runs 3   # every phase with a setting

The records go to ``--out`` (default ``$RLPIPE_HOME/bench/demo-reliability.json``), rewritten after
every run.  Each run's record also holds the commit it ran on, the ``RLPIPE_`` variables that
configured it and the machine's load average before and after it, so runs collected over several sittings (``--resume``) can
be checked to be of the same recipe on a comparable machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.options import non_negative_int, positive_int
from pipeline.devstack.launcher import rlpipe_command
from pipeline.devstack.stack import read_stack_state, rlpipe_home

TAKE_OFF_FACTOR = 1.5


def take_off_version(reward_by_version: list[dict[str, Any]], warm_version: int = 1) -> int | None:
    """First version (after the warm start) whose mean training return is >= 1.5x the warm start's."""
    by_version = {int(p["version"]): p["reward_mean"] for p in reward_by_version if p.get("reward_mean") is not None}
    warm = by_version.get(warm_version)
    if warm is None or warm <= 0:
        return None
    return next((v for v in sorted(by_version) if v > warm_version and by_version[v] >= TAKE_OFF_FACTOR * warm), None)


def commit() -> str:
    """The checkout's commit (``+dirty`` when the code the demo runs differs from it), or ``unknown``."""
    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                            "schemas", "pipeline", "producers", "consumers"], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def one_run(seed: int, steps: int | None, episodes: int | None, preset: str = "demo") -> dict[str, Any]:
    """Run the demo with ``seed``; its ``demo-result.json`` plus the take-off version and the wall time."""
    load_before, ran_on = os.getloadavg(), commit()
    command = rlpipe_command("demo", "--seed", str(seed), "--no-dashboard", "--preset", preset,
                             *(["--episodes", str(episodes)] if episodes else []),
                             *(["--steps", str(steps)] if steps else []))
    started = time.monotonic()
    returncode, output = run_streaming(command)
    minutes = (time.monotonic() - started) / 60
    machine = {"commit": ran_on, "preset": preset, "load_before": [round(x, 2) for x in load_before],
               "load_after": [round(x, 2) for x in os.getloadavg()],
               "settings": configuration_variables()}
    if returncode != 0:
        tail = output.strip().splitlines()[-1:] or ["no output"]
        return {"seed": seed, "failed": tail[0], "minutes": minutes, **machine}
    report = next((line.split("report: ", 1)[1].split(";")[0] for line in output.splitlines()
                   if line.startswith("report: ")), None)
    if report is None:
        return {"seed": seed, "failed": "the demo printed no report line", "minutes": minutes, **machine}
    folder = Path(report).parent
    outcome = json.loads((folder / "demo-result.json").read_text())
    series = json.loads((folder / "report.json").read_text())["series"]
    outcome["take_off_version"] = take_off_version(series.get("reward_by_version") or [])
    outcome["phase_seconds"] = phase_seconds(output)
    outcome["minutes"] = minutes
    outcome["seed"] = seed
    return {**outcome, **machine}


def run_streaming(command: list[str]) -> tuple[int, str]:
    """Run ``command``, printing each line of its output (stdout and stderr together) as it comes, indented;
    its exit status and the whole output, for the report line, the phases and a failure's last line.
    The child writes unbuffered: into a pipe Python would otherwise hold its lines back in blocks."""
    lines: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          text=True, bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"}) as child:
        assert child.stdout is not None
        for line in child.stdout:
            lines.append(line)
            print(f"  {line}", end="", flush=True)
    return child.returncode, "".join(lines)


def stack_running() -> bool:
    """Whether an embedded stack already runs under this ``RLPIPE_HOME`` (the demo then uses it)."""
    return read_stack_state() is not None


def stop_stack() -> None:
    """``rlpipe down``: stop the embedded stack the demos started."""
    subprocess.run(rlpipe_command("down"), capture_output=True)


def phase_seconds(stdout: str) -> dict[str, int]:
    """Each phase's wall seconds, from the demo's output (a rule titled ``i/n name``, then ``done in Ns``)."""
    seconds: dict[str, int] = {}
    title = None
    for line in stdout.splitlines():
        heading = re.search(r"(\d+/\d+ [^─]*[^─\s])", line)
        if heading and "─" in line:
            title = heading.group(1)
        elif (done := re.fullmatch(r"\s*done in (\d+)s\s*", line)) and title is not None:
            seconds[title] = int(done.group(1))
            title = None
    return seconds


def configuration_variables() -> dict[str, str]:
    """The ``RLPIPE_`` variables that set run configuration for every phase (e.g. ``RLPIPE_SAMPLER__ENGINE``)."""
    from pipeline.config import PROCESS_ENV

    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("RLPIPE_") and k not in PROCESS_ENV}


def met(outcome: dict[str, Any]) -> bool:
    """The recipe's targets: x2 over the base and x1.5 over the warm start, each with separated 95% intervals;
    for a recipe judged on success (Sokoban), success x1.5 over the base and above random, intervals separated."""
    if "success_ratio" in outcome:
        return bool(outcome.get("success_x1_5") and outcome.get("success_above_random"))
    return bool(outcome.get("doubled") and outcome.get("intervals_separate")
                and outcome.get("rl_raised_1_5x") and outcome.get("rl_intervals_separate"))


def success_line(outcome: dict[str, Any]) -> str:
    def rate(key: str) -> str:
        low, high = outcome[f"{key}_ci"]
        return f"{outcome[key]:4.0%} [{low:.0%}, {high:.0%}]"

    return (f"seed {outcome['seed']:>3}: success base {rate('base_success')}  last (v{outcome['last_version']}) "
            f"{rate('last_success')}  random {rate('random_success')}  x{outcome['success_ratio']:.2f} over base  "
            f"return warm {outcome['warm_mean']:.2f} -> last {outcome['last_mean']:.2f}  "
            f"{outcome['minutes']:.1f} min  {'MET' if met(outcome) else 'missed'}"
            + (f"  load {outcome['load_before'][0]:.1f}->{outcome['load_after'][0]:.1f}" if "load_before" in outcome else ""))


def line(outcome: dict[str, Any]) -> str:
    if "failed" in outcome:
        return f"seed {outcome['seed']:>3}: FAILED after {outcome['minutes']:.1f} min: {outcome['failed']}"
    if "success_ratio" in outcome:
        return success_line(outcome)
    return (f"seed {outcome['seed']:>3}: base {outcome['base_mean']:6.2f}  warm {outcome['warm_mean']:6.2f}  "
            f"last {outcome['last_mean']:6.2f} (v{outcome['last_version']})  "
            f"x{outcome['ratio']:.2f}{'' if outcome['intervals_separate'] else ' (overlap)'} over base, "
            f"x{outcome['ratio_rl']:.2f}{'' if outcome['rl_intervals_separate'] else ' (overlap)'} over warm  "
            f"take-off v{outcome['take_off_version'] if outcome['take_off_version'] is not None else '-'}  "
            f"{outcome['minutes']:.1f} min  {'MET' if met(outcome) else 'missed'}"
            + (f"  load {outcome['load_before'][0]:.1f}->{outcome['load_after'][0]:.1f}" if "load_before" in outcome else ""))


def check_preset(parser: argparse.ArgumentParser, preset: str) -> None:
    """Refuse a preset ``rlpipe demo`` cannot run (unknown, or no demo recipe for its environment, as
    ``pipeline.cli.demo_cmd.recipe_for`` decides) in one line, before any run is started or recorded."""
    from pipeline.cli.demo_cmd import RECIPES
    from pipeline.config import ConfigError, load_preset

    try:
        env = (load_preset(preset).get("env") or {}).get("name", "cartpole")
    except ConfigError as exc:
        parser.error(str(exc))
    if env not in RECIPES:
        parser.error(f"--preset {preset}: rlpipe demo has no recipe for {env!r}; presets on {', '.join(RECIPES)} work")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=positive_int, default=10)
    parser.add_argument("--first-seed", type=non_negative_int, default=1)
    parser.add_argument("--steps", type=positive_int, default=None, help="online steps (default: the demo preset's)")
    parser.add_argument("--episodes", type=positive_int, default=None,
                        help="held-out evaluation episodes per policy (default: the recipe's)")
    parser.add_argument("--preset", default="demo", help="the preset of the online phase (demo, demo-gae)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the records, rewritten after every run (default: $RLPIPE_HOME/bench/demo-reliability.json)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in --out and run only the seeds missing there or FAILED there")
    args = parser.parse_args(argv)
    check_preset(parser, args.preset)
    if args.out is None:
        args.out = rlpipe_home() / "bench" / "demo-reliability.json"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.out
    outcomes: list[dict[str, Any]] = json.loads(out.read_text()) if args.resume and out.exists() else []
    done_seeds = {o["seed"] for o in outcomes if "failed" not in o}  # a FAILED seed runs again
    for outcome in outcomes:
        print(line(outcome) + "  (earlier)", flush=True)
    print(f"records: {out}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    stack_was_up = stack_running()
    try:
        for seed in range(args.first_seed, args.first_seed + args.runs):
            if seed in done_seeds:
                continue
            print(f"seed {seed}: rlpipe demo --preset {args.preset}", flush=True)
            outcome = one_run(seed, args.steps, args.episodes, args.preset)
            outcomes = sorted([o for o in outcomes if o["seed"] != seed] + [outcome], key=lambda o: o["seed"])
            print(line(outcome), flush=True)
            out.write_text(json.dumps(outcomes, indent=2))
    finally:
        if not stack_was_up:  # the stack the first demo started; one that ran before stays up
            stop_stack()
    if not outcomes:
        return
    print(f"targets met in {sum(met(o) for o in outcomes)} of {len(outcomes)} runs; "
          f"median {statistics.median(o['minutes'] for o in outcomes):.1f} min per run; details: {out}")


if __name__ == "__main__":
    main()
