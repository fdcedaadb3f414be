"""Packing: the same work as 1, 2 and 3 runs, once as separate processes and once packed in one producer and one learner.

Every run plays the preset (default demo: CartPole) with a slow environment step
(``env.step_delay_s``, default 50 ms), and every level does the same total
learner work (``--steps`` shared out: 6 -> 6, 3, 2 steps per run).  Per level:

- **separate**: each run has its own ``rlpipe producer start`` and ``rlpipe
  learner start`` (its own sampler and its own copy of the base model), as
  concurrent ``rlpipe run`` s do;
- **packed**: one ``rlpipe producer start --run A --run B ...`` (one sampling
  engine, a rollout worker per run) and one ``rlpipe learner start --run A
  --run B ...`` (one base model, an adapter per run).

Both share one embedded stack (broker, store folder) started here.  Numbers per
level and arm, from the runs' step logs and producer heartbeats (the report's
lanes, as ``bench/async_vs_sync.py`` reads them): combined trained rows/s over
the union of the runs' work windows (first sample to last learner step), the
mean sampler and learner busy fractions of the runs over their own windows, and
each run's rows/s.  A run's sampler lane is its own worker's generate time, so
packed runs' lanes overlap on the one engine.  Also the machine's busy CPU in the
combined window (every process, ``bench/cpu.py``), and from 1 run's the **CPU bound**
on every level's combined rows/s over 1 run's: at 1 run's cost per row, the same
work cannot finish faster than the cores give its core-seconds.  A level above its
bound did the work more cheaply than 1 run does.

    python bench/packing.py                              # 1, 2, 3 runs; separate and packed
    python bench/packing.py --levels 1,2 --steps 2       # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project root, for `python bench/packing.py`

from bench.async_vs_sync import Bench, parse_levels, steps_per_run
from bench.children import Clock, built_tiny_model, rlpipe_argv, stop_children, wait_children
from bench.cpu import CpuMeter, cpu_bound
from bench.options import check_run_config
from bench.timelines import combined_numbers, to_json

ARMS = ("separate", "packed")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; incompatible ones are refused with the fix."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo", help="the preset every run plays (default demo: CartPole)")
    parser.add_argument("--steps", type=int, default=6, help="learner steps of the whole level, shared out among its runs")
    parser.add_argument("--levels", type=parse_levels, default=[1, 2, 3], help="runs per level (default 1,2,3)")
    parser.add_argument("--arms", default=",".join(ARMS), help="separate, packed or both (default both)")
    parser.add_argument("--step-delay-s", type=float, default=0.05, help="env.step_delay_s: seconds per env step")
    parser.add_argument("--batch-rows", type=int, default=96, help="learner.batch_rows of every run (default 96)")
    parser.add_argument("--backlog-steps", type=float, default=2.0, help="producer.max_backlog_steps of every run")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="override a config field for every run, e.g. --set learner.lora_rank=8")
    parser.add_argument("--home", type=Path, default=None, help="RLPIPE_HOME for the bench; default: a new temp folder")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up on one level and arm after this long")
    parser.add_argument("--json", dest="json_out", type=Path, default=None, help="write every number here")
    args = parser.parse_args(argv)
    args.arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    if not args.arms or any(arm not in ARMS for arm in args.arms):
        parser.error(f"--arms takes {', '.join(ARMS)} (comma-separated)")
    if args.steps < 1 or args.batch_rows < 1:
        parser.error("--steps and --batch-rows must be at least 1")
    if not 0.0 <= args.step_delay_s <= 60.0:
        parser.error("--step-delay-s must be within [0, 60] (the bounds of env.step_delay_s)")
    check_run_config(parser, args.preset, overrides(args, None))
    return args


def overrides(args: argparse.Namespace, tiny_dir: str | None) -> list[str]:
    """``--set`` items of every run: the slow step, the batch size, the backlog bound, 1 s heartbeats, the model."""
    items = [f"env.step_delay_s={args.step_delay_s}", f"learner.batch_rows={args.batch_rows}",
             f"producer.max_backlog_steps={args.backlog_steps:g}", "producer.heartbeat_interval_s=1"]
    if tiny_dir:
        items.append(f"model.tiny_dir={tiny_dir}")
    return items + list(args.overrides)


def level_commands(bench: Bench, arm: str, run_ids: list[str], steps: int) -> list[tuple[str, list[str], bool]]:
    """(name, argv, is a learner) of every process of one level and arm."""
    sets = [item for o in bench.overrides for item in ("--set", o)]
    common = ["--preset", bench.args.preset, *sets]
    learner = ["learner", "start", *common, "--max-steps", str(steps)]
    producer = ["producer", "start", *common]
    if arm == "packed":
        runs = [item for run_id in run_ids for item in ("--run", run_id)]
        return [(f"{run_ids[0]}-producer", rlpipe_argv(*producer, *runs), False),
                (f"{run_ids[0]}-learner", rlpipe_argv(*learner, *runs), True)]
    commands = []
    for run_id in run_ids:
        commands.append((f"{run_id}-producer", rlpipe_argv(*producer, "--run", run_id), False))
        commands.append((f"{run_id}-learner", rlpipe_argv(*learner, "--run", run_id), True))
    return commands


def run_level(bench: Bench, arm: str, count: int, meter: CpuMeter) -> dict[str, Any]:
    """One level and arm: start its processes, wait for the learners' ``max_steps``, stop the producers, measure."""
    steps = steps_per_run(bench.args.steps, count)
    run_ids = [f"{bench.tag}-{arm[0]}{count}-{index}" for index in range(count)]
    children = [(bench.start(name, argv), is_learner) for name, argv, is_learner in level_commands(bench, arm, run_ids,
                                                                                                    steps)]
    learners = [child for child, is_learner in children if is_learner]
    producers = [child for child, is_learner in children if not is_learner]
    bench.clock(f"{arm} x{count}: {len(children)} processes, {steps} learner steps per run ({', '.join(run_ids)})")
    started = time.monotonic()
    finished = wait_children(learners, bench.args.timeout_s, bench.clock, lambda: bench.pipeline_status(run_ids, steps))
    wall_s = time.monotonic() - started
    stop_children(producers)
    runs = [{"run_id": run_id, **bench.pipeline_numbers(run_id)} for run_id in run_ids]
    timelines = [run["timeline"] for run in runs if "timeline" in run]
    combined = combined_numbers(timelines)
    if timelines:
        window = (min(t.start for t in timelines), max(t.end for t in timelines))
        combined["cpu_busy_s"] = meter.busy_between(*window)
        combined["cpu_busy_fraction"] = combined["cpu_busy_s"] / ((os.cpu_count() or 1) * combined["window_s"])
    level = {
        "arm": arm, "runs": count, "steps_per_run": steps, "finished": finished and len(timelines) == count,
        "wall_s": wall_s, "combined": combined,
        "sampler_busy": 1.0 - combined["sampler_idle"], "learner_busy": 1.0 - combined["learner_idle"],
        "per_run_rows_per_s": [run.get("rows_per_s", math.nan) for run in runs], "each": runs,
    }
    bench.clock(f"{arm} x{count}: combined {level['combined']['rows_per_s']:.2f} rows/s, sampler busy "
                f"{level['sampler_busy']:.2f}, learner busy {level['learner_busy']:.2f}, CPU busy "
                f"{level['combined'].get('cpu_busy_fraction', math.nan):.2f}")
    return level


def level_bounds(levels: list[dict[str, Any]], cores: int) -> dict[int, float]:
    """Per level, the CPU bound on its combined rows/s over 1 run's (from the first 1-run level measured).

    Every level does the same work: at 1 run's cost, ``busy core-seconds`` of it, it needs at
    least ``busy / cores`` seconds, and no run goes faster than 1 run alone.
    """
    alone = next((lv["combined"] for lv in levels if lv["runs"] == 1 and "cpu_busy_s" in lv["combined"]), None)
    if alone is None:
        return {}
    return {lv["runs"]: cpu_bound(lv["runs"], cores, alone["window_s"], alone["cpu_busy_s"]) for lv in levels}


def table(levels: list[dict[str, Any]], cores: int) -> Any:
    from rich.table import Table

    bounds = level_bounds(levels, cores)
    alone = next((lv["combined"]["rows_per_s"] for lv in levels if lv["runs"] == 1), math.nan)
    out = Table(title="Packing: the same work as separate processes and packed")
    for column in ("runs", "arm", "steps/run", "wall s", "combined rows/s", "x 1 run", "CPU bound", "sampler busy",
                   "learner busy", "CPU busy", "per-run rows/s"):
        out.add_column(column, justify="right")
    for lv in levels:
        out.add_row(str(lv["runs"]), lv["arm"], str(lv["steps_per_run"]), f"{lv['wall_s']:.1f}",
                    f"{lv['combined']['rows_per_s']:.2f}", f"x{lv['combined']['rows_per_s'] / alone:.2f}",
                    f"x{bounds.get(lv['runs'], math.nan):.2f}", f"{lv['sampler_busy']:.2f}",
                    f"{lv['learner_busy']:.2f}", f"{lv['combined'].get('cpu_busy_fraction', math.nan):.2f}",
                    ", ".join(f"{r:.2f}" for r in lv["per_run_rows_per_s"]))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console

    from pipeline.devstack.stack import start_background, stop_background

    args = parse_args(argv)
    clock = Clock()
    tiny_dir = built_tiny_model()
    if tiny_dir is None:
        clock("build the tiny model first (e.g. `make demo` or `rlpipe model init-tiny`): the runs start at once")
        return 2
    home = (args.home or Path(tempfile.mkdtemp(prefix="rlpipe-packing-"))).expanduser().resolve()
    os.environ["RLPIPE_HOME"] = str(home)
    clock(f"RLPIPE_HOME={home}; tiny model {tiny_dir}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    state = start_background(home=home, with_gcs=False)
    os.environ["RLPIPE_BUS__BOOTSTRAP_SERVERS"] = state.bootstrap_servers
    os.environ["RLPIPE_STORE__ROOT"] = state.store_root
    bench = Bench(args, home, overrides(args, tiny_dir), state.bootstrap_servers, state.store_root, clock,
                  tag=f"pk{time.strftime('%H%M%S')}")
    results: dict[str, Any] = {"preset": args.preset, "steps": args.steps, "overrides": bench.overrides,
                               "cpus": os.cpu_count(), "load_average_start": os.getloadavg(), "levels": []}
    try:
        with CpuMeter() as meter:
            for count in args.levels:
                for arm in args.arms:
                    results["levels"].append(run_level(bench, arm, count, meter))
        results["cpu_bounds"] = level_bounds(results["levels"], os.cpu_count() or 1)
        Console(width=180).print(table(results["levels"], os.cpu_count() or 1))
    finally:
        stop_children(bench.children)
        stop_background(home)
        results["load_average_end"] = os.getloadavg()
        clock(f"stack down; load average {os.getloadavg()[0]:.2f}; logs under {home / 'bench'}")
        if args.json_out:
            args.json_out.write_text(json.dumps(to_json(results), indent=2))
    return 0 if all(level["finished"] for level in results["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
