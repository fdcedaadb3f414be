"""Async versus sync: the same work as a sequential loop and through the pipeline, then 1-3 runs at once.

Both arms run the same preset with the same slow environment step
(``env.step_delay_s``, default 50 ms per step, as a remote reward would take),
the same number of learner steps and the same rule for samples per step (whole
batches of ``groups_per_batch`` groups until ``learner.batch_rows`` rows wait):

- **sync**: ``bench/sync_loop.py`` in its own process: sample, then train, then
  load the new adapter, one after the other;
- **async**: ``rlpipe run --max-steps N --no-dashboard``: the learner and the
  producer processes working at the same time over the broker and the store.

Both are timed over the same *work window*, from the first sample to the end of
the last learner step (start-up of engines and models is outside it and shown
separately as the process wall-clock).  Idle fractions are measured the same way
on both sides, with ``pipeline.analysis.report``'s lanes and ``busy_seconds``: the
sampler is busy while its engine generates (the sync loop's generate intervals;
the producers' heartbeats), the learner while it is inside a step (the step
log's ``started_at``..``finished_at``).  For the sync side the phase split is
printed too: the sampler waits while the loop trains (``train_s / wall``) and the
learner while it samples (``sample_s / wall``).

Then 1, 2 and 3 concurrent ``rlpipe run`` processes share one embedded stack
(one broker, one store folder) and the machine.  By default they share out the
comparison's learner steps (6, 3 and 2 steps each), so every level does the
same total work, and the level of one run is the async arm itself, not run
again.  Per level it prints the wall-clock and the combined throughput (rows
trained and learner steps per second over the union of the runs' work windows).

Everything runs under a private ``RLPIPE_HOME`` (a new temporary folder unless
``--home``), so it never touches a stack or runs of yours; the tiny model
already built under your ``RLPIPE_HOME`` is reused, not rebuilt.

    python bench/async_vs_sync.py                                  # comparison + 1, 2, 3 concurrent runs
    python bench/async_vs_sync.py --steps 2 --skip-concurrency     # a quick smoke run
    python bench/async_vs_sync.py --skip-comparison --concurrency 2 --concurrency-steps 1

It runs as a script (``python bench/async_vs_sync.py``; ``bench/`` is no package) with the
project root put on the path, as the other benches do, so it imports what they share
(``bench.options``, ``bench.timelines``, ``bench.children``) and the tests import its options as
``bench.async_vs_sync``.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.children import (
    Child,
    Clock,
    built_tiny_model,
    rlpipe_argv,
    start_child,
    stop_children,
    tail_text,
    wait_children,
)
from bench.options import check_run_config
from bench.timelines import (
    combined_numbers,
    overlap_bound,
    ratio,
    report_timeline,
    side_numbers,
    sync_phase_shares,
    sync_timeline,
    to_json,
)

BENCH_DIR = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------------------------------
# Options


def parse_levels(text: str) -> list[int]:
    """``"1,2,3"`` -> [1, 2, 3]: concurrent runs per level, each 1-8."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list like 1,2,3") from None
    if not levels or any(not 1 <= n <= 8 for n in levels):
        raise argparse.ArgumentTypeError(f"{text!r}: each level must be 1-8 runs, e.g. 1,2,3")
    return levels


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options; incompatible ones are refused with the fix."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo", help="the preset both arms run (default demo: CartPole)")
    parser.add_argument("--steps", type=int, default=6, help="learner steps of each arm of the comparison")
    parser.add_argument("--step-delay-s", type=float, default=0.05, help="env.step_delay_s: seconds per env step")
    parser.add_argument("--backlog-steps", type=float, default=2.0,
                        help="producer.max_backlog_steps of the pipeline runs (default 2: the step the learner is "
                             "training on counts until it commits, so 1 would stop sampling during every step)")
    parser.add_argument("--batch-rows", type=int, default=192,
                        help="learner.batch_rows of every run (default 192, under half the demo's 512, so that the "
                             "whole bench stays under 10 minutes on 2 cores)")
    parser.add_argument("--concurrency", type=parse_levels, default=[1, 2, 3],
                        help="concurrent runs per level, comma-separated (default 1,2,3)")
    parser.add_argument("--concurrency-steps", type=int, default=None,
                        help="learner steps of each concurrent run; default: --steps shared out (6 -> 6, 3, 2)")
    parser.add_argument("--skip-comparison", action="store_true", help="only the concurrency levels")
    parser.add_argument("--skip-concurrency", action="store_true", help="only the sync-versus-async comparison")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="override a config field for every run, e.g. --set learner.batch_rows=128")
    parser.add_argument("--home", type=Path, default=None, help="RLPIPE_HOME for the bench; default: a new temp folder")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up on one arm or level after this long")
    parser.add_argument("--json", dest="json_out", type=Path, default=None, help="write every number here")
    args = parser.parse_args(argv)
    if args.steps < 1 or (args.concurrency_steps is not None and args.concurrency_steps < 1):
        parser.error("--steps and --concurrency-steps must be at least 1")
    if not 0 < args.backlog_steps <= 1e6:
        parser.error("--backlog-steps must be within (0, 1000000] (producer.max_backlog_steps)")
    if not 1 <= args.batch_rows <= 1_000_000:
        parser.error("--batch-rows must be within [1, 1000000] (learner.batch_rows)")
    if not 0.0 <= args.step_delay_s <= 60.0:
        parser.error("--step-delay-s must be within [0, 60] (the bounds of env.step_delay_s)")
    if args.skip_comparison and args.skip_concurrency:
        parser.error("--skip-comparison and --skip-concurrency together leave nothing to run; drop one")
    if args.timeout_s <= 0:
        parser.error("--timeout-s must be positive")
    check_run_config(parser, args.preset, bench_overrides(args, None))
    return args


def steps_per_run(total_steps: int, runs: int, fixed: int | None = None) -> int:
    """Learner steps of each of ``runs`` concurrent runs: ``fixed``, else ``total_steps`` shared out (at least 1)."""
    return fixed if fixed is not None else max(1, math.ceil(total_steps / runs))


def bench_overrides(args: argparse.Namespace, tiny_dir: str | None) -> list[str]:
    """``--set`` items every run gets: the slow step, the batch size, the producer's backlog limit, 1 s heartbeats
    (finer producer lanes), the built model; the user's ``--set`` items last, so they win."""
    items = [f"env.step_delay_s={args.step_delay_s}", f"learner.batch_rows={args.batch_rows}",
             f"producer.max_backlog_steps={args.backlog_steps:g}", "producer.heartbeat_interval_s=1"]
    if tiny_dir:
        items.append(f"model.tiny_dir={tiny_dir}")
    return items + list(args.overrides)


# ---------------------------------------------------------------------------------------------------------------------
# The arms


@dataclass
class Bench:
    """What every arm shares: options, the private home, the stack's addresses, progress output."""

    args: argparse.Namespace
    home: Path
    overrides: list[str]
    bootstrap_servers: str
    store_root: str
    clock: Clock
    tag: str
    children: list[Child] = field(default_factory=list)  # everything started, stopped on the way out

    def start(self, name: str, argv: list[str]) -> Child:
        child = start_child(name, argv, self.home / "bench" / f"{name}.log")
        self.children.append(child)
        return child

    def run_sync(self, steps: int) -> dict[str, Any] | None:
        """``bench/sync_loop.py`` in its own process; its summary plus the process wall-clock."""
        json_path = self.home / "bench" / "sync.json"
        argv = [sys.executable, str(BENCH_DIR / "sync_loop.py"), "--preset", self.args.preset, "--steps", str(steps),
                "--json", str(json_path), *(item for o in self.overrides for item in ("--set", o))]
        child = self.start("sync", argv)
        self.clock(f"sync: sample-then-train loop, {steps} steps (log {child.log_path})")

        def status() -> str:
            done = sum(1 for line in tail_text(child.log_path, 200).splitlines() if line.startswith('{"iteration"'))
            return f"sync: {done}/{steps} steps done"

        if not wait_children([child], self.args.timeout_s, self.clock, status) or child.process.returncode != 0:
            self.clock(f"sync failed (exit {child.process.returncode}); last lines of {child.log_path}:\n"
                       f"{tail_text(child.log_path)}")
            return None
        summary = json.loads(json_path.read_text())["summary"]
        self.clock(f"sync: done in {child.wall_s:.1f}s ({summary['wall_s']:.1f}s of work)")
        return {**summary, "process_s": child.wall_s}

    def run_pipelines(self, name: str, count: int, steps: int) -> list[dict[str, Any]]:
        """``count`` concurrent ``rlpipe run`` processes of ``steps`` learner steps; one result per run."""
        run_ids = [f"{self.tag}-{name}-{index}" if count > 1 else f"{self.tag}-{name}" for index in range(count)]
        children = [
            self.start(run_id, rlpipe_argv("run", "--preset", self.args.preset, "--max-steps", str(steps),
                                           "--no-dashboard", "--set", f"run_id={run_id}",
                                           *(item for o in self.overrides for item in ("--set", o))))
            for run_id in run_ids
        ]  # fmt: skip
        self.clock(f"{name}: {count} x `rlpipe run --max-steps {steps}` ({', '.join(run_ids)})")
        ok = wait_children(children, self.args.timeout_s, self.clock, lambda: self.pipeline_status(run_ids, steps))
        results = []
        for child in children:
            if child.process.returncode != 0:
                self.clock(f"{child.name} exited {child.process.returncode}; last lines of {child.log_path}:\n"
                           f"{tail_text(child.log_path)}")
            results.append({"run_id": child.name, "process_s": child.wall_s, "exit_code": child.process.returncode,
                            "timed_out": not ok, **self.pipeline_numbers(child.name)})
        return results

    def pipeline_status(self, run_ids: list[str], steps: int) -> str:
        from pipeline.analysis.report import checkpoint_folders
        from pipeline.runtime import open_store
        from schemas.config import StoreConfig

        store = open_store(StoreConfig(root=self.store_root))
        done = [max((step for step, _ in checkpoint_folders(store, run_id)), default=0) for run_id in run_ids]
        return "learner steps: " + ", ".join(f"{run_id} {n}/{steps}" for run_id, n in zip(run_ids, done, strict=True))

    def pipeline_numbers(self, run_id: str) -> dict[str, Any]:
        """The run's timeline from ``gather_report`` (store + control topic), its numbers, the report's own busy shares."""
        from pipeline.analysis.report import UnknownRunError, gather_report
        from pipeline.runtime import open_store
        from schemas.config import BusConfig, StoreConfig

        try:
            report = gather_report(open_store(StoreConfig(root=self.store_root)), run_id,
                                   BusConfig(bootstrap_servers=self.bootstrap_servers), bus_timeout_s=10.0)
        except (UnknownRunError, OSError) as exc:  # a run that never started has no folder: report it, keep the others
            return {"error": f"{type(exc).__name__}: {exc}"}
        timeline = report_timeline(report.series["learner_steps"], report.series["duty_cycle"]["lanes"])
        if timeline is None:
            notes = "; ".join(n for notes in report.notes.values() for n in notes)
            return {"error": f"no learner step or no producer heartbeat in run {run_id} ({notes or 'no notes'})"}
        return {**side_numbers(timeline), "timeline": timeline,
                "report_busy_fraction": report.summary.get("busy_fraction")}


# ---------------------------------------------------------------------------------------------------------------------
# Output


def comparison_table(sync: dict[str, Any], pipe: dict[str, Any], bound: float = math.nan) -> Any:
    from rich.table import Table

    table = Table(title="sync (one process) versus async (pipeline): the same work")
    table.add_column("")
    table.add_column("sync", justify="right")
    table.add_column("async", justify="right")
    table.add_column("sync / async", justify="right")
    rows = [
        ("work wall-clock s (first sample to last step)", "window_s", "{:.1f}"),
        ("process wall-clock s (with start-up)", "process_s", "{:.1f}"),
        ("learner steps", "steps", "{}"),
        ("rows trained", "rows", "{}"),
        ("rows trained / s", "rows_per_s", "{:.2f}"),
        ("mean learner step s", "step_s", "{:.1f}"),
        ("sampler idle (engine not generating)", "sampler_idle", "{:.0%}"),
        ("learner idle (not in a step)", "learner_idle", "{:.0%}"),
    ]
    for label, key, fmt in rows:
        a, b = sync.get(key, math.nan), pipe.get(key, math.nan)
        shown_ratio = f"{ratio(a, b):.2f}x" if key in ("window_s", "process_s") else ""
        table.add_row(label, _fmt(fmt, a), _fmt(fmt, b), shown_ratio)
    shares = sync.get("phases", {})
    table.add_row("sampler waits on training (train_s / wall)", _fmt("{:.0%}", shares.get("sampler_waits_on_training")),
                  "-", "")
    table.add_row("learner waits on sampling (sample_s / wall)", _fmt("{:.0%}", shares.get("learner_waits_on_sampling")),
                  "-", "")
    table.add_row("overlap bound (wall / longer phase)", _fmt("{:.2f}x", bound), "-", "")
    return table


def concurrency_table(levels: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(title="concurrent runs sharing one stack and the machine")
    for column in ("runs", "steps each", "finished", "wall-clock s", "work window s", "learner steps", "rows trained",
                   "combined rows/s", "combined steps/min", "sampler idle", "learner idle"):
        table.add_column(column, justify="right")
    for level in levels:
        c = level["combined"]
        table.add_row(str(level["runs"]), str(level["steps_per_run"]), f"{level['finished']}/{level['runs']}", _fmt("{:.1f}", level["wall_s"]),
                      _fmt("{:.1f}", c["window_s"]), str(c["steps"]), str(c["rows"]), _fmt("{:.2f}", c["rows_per_s"]),
                      _fmt("{:.2f}", c["steps_per_s"] * 60), _fmt("{:.0%}", c["sampler_idle"]),
                      _fmt("{:.0%}", c["learner_idle"]))
    return table


def _fmt(fmt: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt.format(value)


# ---------------------------------------------------------------------------------------------------------------------
# Entry point


def run_comparison(bench: Bench) -> dict[str, Any]:
    steps = bench.args.steps
    result: dict[str, Any] = {"steps": steps}
    summary = bench.run_sync(steps)
    if summary is not None:
        timeline = sync_timeline(summary)
        result["sync"] = {**side_numbers(timeline), "process_s": summary["process_s"],
                          "setup_s": summary["setup_s"], "sample_s": summary["sample_s"],
                          "train_s": summary["train_s"], "generate_s": summary["generate_s"],
                          "phases": sync_phase_shares(summary), "timeline": timeline}  # fmt: skip
    pipe = bench.run_pipelines("async", 1, steps)[0]
    result["async"] = pipe
    if "sync" in result and "error" not in pipe and pipe["exit_code"] == 0:
        result["ratio_sync_over_async"] = ratio(result["sync"]["window_s"], pipe["window_s"])
        result["ratio_sync_over_async_process"] = ratio(result["sync"]["process_s"], pipe["process_s"])
        result["overlap_bound"] = overlap_bound(summary)
        result["share_of_bound"] = result["ratio_sync_over_async"] / result["overlap_bound"]
    return result


def run_concurrency(bench: Bench, async_arm: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each level's runs at once; one run of the comparison's length is the async arm again, so it is reused."""
    levels = []
    for count in bench.args.concurrency:
        steps = steps_per_run(bench.args.steps, count, bench.args.concurrency_steps)
        if count == 1 and async_arm is not None and "timeline" in async_arm and steps == bench.args.steps:
            bench.clock("c1: one run of the comparison's length: the async arm above")
            runs = [async_arm]
        else:
            runs = bench.run_pipelines(f"c{count}", count, steps)
        timelines = [r["timeline"] for r in runs if "timeline" in r]
        finished = sum(1 for r in runs if r["exit_code"] == 0 and "timeline" in r)
        # The runs start together: the level's wall-clock is its slowest process's.
        level = {"runs": count, "steps_per_run": steps, "finished": finished, "wall_s": max(r["process_s"] for r in runs),
                 "combined": combined_numbers(timelines), "each": runs}
        bench.clock(f"c{count}: {finished}/{count} runs finished in {level['wall_s']:.1f}s, combined "
                    f"{_fmt('{:.2f}', level['combined']['rows_per_s'])} rows/s")
        levels.append(level)
    return levels


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console

    from pipeline.devstack.stack import start_background, stop_background

    args = parse_args(argv)
    clock = Clock()
    tiny_dir = built_tiny_model()  # before RLPIPE_HOME moves to the bench's own folder
    home = (args.home or Path(tempfile.mkdtemp(prefix="rlpipe-bench-"))).expanduser().resolve()
    os.environ["RLPIPE_HOME"] = str(home)
    clock(f"RLPIPE_HOME={home}; tiny model {tiny_dir or '(not built yet: the runs build it)'}; "
          f"load average {os.getloadavg()[0]:.2f}")
    state = start_background(home=home, with_gcs=False)
    # Every child (and the report code here) uses this broker and store folder: the runs share them.
    os.environ["RLPIPE_BUS__BOOTSTRAP_SERVERS"] = state.bootstrap_servers
    os.environ["RLPIPE_STORE__ROOT"] = state.store_root
    clock(f"stack up: broker {state.bootstrap_servers}, store {state.store_root}")
    bench = Bench(args, home, bench_overrides(args, tiny_dir), state.bootstrap_servers, state.store_root, clock,
                  tag=f"avs{time.strftime('%H%M%S')}")
    results: dict[str, Any] = {"preset": args.preset, "step_delay_s": args.step_delay_s, "overrides": bench.overrides,
                               "cpus": os.cpu_count(), "load_average_start": os.getloadavg()}
    console = Console() if sys.stdout.isatty() else Console(width=160)  # a log file should get whole tables
    try:
        if not args.skip_comparison:
            results["comparison"] = run_comparison(bench)
            comparison = results["comparison"]
            if "sync" in comparison and "error" not in comparison["async"]:
                console.print(comparison_table(comparison["sync"], comparison["async"],
                                               comparison.get("overlap_bound", math.nan)))
                clock(f"RESULT: sync/async wall-clock ratio {comparison['ratio_sync_over_async']:.2f}x over the work "
                      f"window ({comparison['ratio_sync_over_async_process']:.2f}x with start-up); the overlap bound "
                      f"{comparison.get('overlap_bound', math.nan):.2f}x, so {comparison.get('share_of_bound', math.nan):.2f} "
                      "of it")
        if not args.skip_concurrency:
            results["concurrency"] = run_concurrency(bench, results.get("comparison", {}).get("async"))
            console.print(concurrency_table(results["concurrency"]))
    finally:
        stop_children(bench.children)  # they run in their own sessions: Ctrl-C here does not reach them
        stop_background(home)
        results["load_average_end"] = os.getloadavg()
        clock(f"stack down; load average {os.getloadavg()[0]:.2f}; logs under {home / 'bench'}")
        if args.json_out:
            args.json_out.write_text(json.dumps(to_json(results), indent=2))
            clock(f"numbers written to {args.json_out}")
    comparison_ok = args.skip_comparison or "ratio_sync_over_async" in results.get("comparison", {})
    levels_ok = args.skip_concurrency or all(lv["finished"] == lv["runs"] for lv in results.get("concurrency", []))
    return 0 if comparison_ok and levels_ok else 1


if __name__ == "__main__":
    sys.exit(main())
