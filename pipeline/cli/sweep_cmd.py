"""``rlpipe sweep SCRIPT --grid KEY=V1,V2 ...``: a grid of experiments in parallel against one server.

Every combination of the ``--grid`` values, times every ``--seeds`` seed, is one
run of ``SCRIPT`` (a loop written against the Tinker SDK), ``--parallel`` at a
time; all of them talk to the same ``rlpipe serve``, whose engines pack them.
Each writes its held-out scores to the file given by ``--result-file`` (the
contract: ``pipeline.sweeps.plan``); the leaderboard (table and plot, with 95%
intervals) is written into the sweep's folder and printed.

The folder is the sweep's state: ``rlpipe sweep --resume DIR`` (or the same
command with the same ``--dir``) runs the experiments that have not finished,
after a crash, a Ctrl-C or a failed experiment.  Exit status 0 when every
experiment finished, 1 when one failed, 2 on a bad option.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Column, Table

from pipeline.cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    JsonOpt,
    check_folder_option,
    console,
    err_console,
    fail,
    print_json,
    user_errors,
)
from pipeline.sweeps.leaderboard import FIGURE, Entry, interval, shown, write_leaderboard
from pipeline.sweeps.plan import SweepDir, SweepSpec, experiments, parse_fixed, parse_grid
from pipeline.sweeps.runner import Event, pending, run_sweep

app = typer.Typer(name="sweep", add_completion=False, pretty_exceptions_enable=False)


@app.command(
    "sweep",
    epilog="Example: rlpipe sweep examples/tinker_cartpole.py --set base-url=http://127.0.0.1:8000 "
    "--set base-model=PATH --grid rl-lr=1e-3,3e-4 --grid loss=importance_sampling,ppo --seeds 0,1 --parallel 4;  "
    "after a crash: rlpipe sweep --resume DIR",
)
def sweep(
    script: Annotated[Path | None, typer.Argument(help="the loop to run: a Python script that takes --seed and "
                                                       "--result-file")] = None,
    grid: Annotated[list[str] | None, typer.Option(
        "--grid", "-g", help="KEY=V1,V2,...: the script's --KEY takes each value (repeat for more keys)")] = None,
    fixed: Annotated[list[str] | None, typer.Option(
        "--set", "-s", help="KEY=VALUE passed to every experiment as --KEY VALUE (KEY alone: a flag)")] = None,
    seeds: Annotated[str | None, typer.Option(
        help="seeds, comma-separated: each grid point runs once per seed [default: 0]")] = None,
    parallel: Annotated[int, typer.Option(min=1, max=64, help="experiments running at once")] = 4,
    folder: Annotated[Path | None, typer.Option(
        "--dir", help="the sweep's folder (default: ./rlpipe-sweep-SCRIPT-TIME); the same folder resumes it")] = None,
    resume: Annotated[Path | None, typer.Option(
        help="continue the sweep in this folder with its recorded plan (its unfinished experiments)")] = None,
    python: Annotated[str | None, typer.Option(
        help="the interpreter that runs the script [default: this one; on --resume, the recorded one]")] = None,
    progress_every: Annotated[float, typer.Option(min=1.0, help="seconds between progress lines")] = 30.0,
    as_json: JsonOpt = False,
) -> None:
    """Run a grid of experiments in parallel against one server and rank them on their held-out scores."""
    check_folder_option(folder, "--dir")
    with user_errors():
        if resume is not None:
            if script is not None or grid or fixed or seeds is not None:
                fail("--resume continues the plan recorded in its folder: drop SCRIPT, --grid, --set and --seeds",
                     EXIT_USAGE)
            sweep_dir = SweepDir(resume)
            spec = sweep_dir.plan()
            if python is not None:
                spec = spec.model_copy(update={"python": python})
        else:
            if script is None or not grid:
                fail("name the script and at least one --grid KEY=V1,V2 (or --resume DIR)", EXIT_USAGE)
            if not script.is_file():
                fail(f"no script at {script}: give the path of a Python file", EXIT_USAGE)
            spec = SweepSpec(script=str(script.resolve()), grid=parse_grid(grid), fixed=parse_fixed(fixed or []),
                             seeds=_seeds(seeds or "0"), python=python or sys.executable)
            sweep_dir = SweepDir(folder or Path(f"rlpipe-sweep-{script.stem}-{time.strftime('%Y%m%d-%H%M%S')}"))
        with sweep_dir.lock():
            sweep_dir.create_or_check(spec)  # resuming: records a new --python
            counts = _run(sweep_dir, spec, parallel, progress_every, err_console if as_json else console)
            entries = write_leaderboard(sweep_dir, spec)
    if as_json:  # progress went to stderr; stdout is the leaderboard alone
        print_json({"folder": str(sweep_dir.path), "html": str(sweep_dir.path / "leaderboard.html"),
                    "failed_now": counts["failed"],
                    **json.loads((sweep_dir.path / "leaderboard.json").read_text())})
        if counts["failed"]:
            raise typer.Exit(EXIT_FAILURE)
        return
    console.print(_table(entries))
    console.print(f"leaderboard: {sweep_dir.path / 'leaderboard.html'} ({sweep_dir.path / FIGURE}, "
                  f"{sweep_dir.path / 'leaderboard.md'})")
    if counts["failed"]:
        console.print(f"{counts['failed']} experiment(s) failed: see their failed.json, log.txt and stderr.txt; "
                      f"run them again with: rlpipe sweep --resume {sweep_dir.path}")
        raise typer.Exit(EXIT_FAILURE)


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: give integers separated by commas, e.g. --seeds 0,1,2") from None


def _run(sweep_dir: SweepDir, spec: SweepSpec, parallel: int, progress_every: float, out: Console) -> dict[str, int]:
    total, todo = len(experiments(spec)), len(pending(sweep_dir, spec))
    points = total // len(spec.seeds)
    done = total - todo
    out.print(f"sweep of {total} experiments ({points} grid points x {len(spec.seeds)} seed(s)) in "
                  f"{sweep_dir.path}: {todo} to run, {min(parallel, max(todo, 1))} at a time"
                  + (f" ({done} already finished)" if done else ""), markup=False)
    finished = done

    def report(event: Event) -> None:
        nonlocal finished
        if event.kind == "progress":
            for experiment, seconds, line in event.running:
                out.print(f"  ... {experiment.name} ({seconds:.0f} s): {line[:120]}", markup=False)
            return
        assert event.experiment is not None
        what = f"{event.experiment.name} {event.experiment.label} seed {event.experiment.seed}"
        if event.kind == "started":
            out.print(f"started {what}", markup=False)
        elif event.kind == "finished" and event.result is not None:
            finished += 1
            mean, half = interval(event.result["samples"])
            out.print(f"[{finished}/{total}] finished {what} in {event.seconds:.0f} s: "
                          f"{event.result.get('metric', 'score')} {shown(mean, half)}", markup=False)
        else:
            out.print(f"failed {what} after {event.seconds:.0f} s: {event.reason}", markup=False)

    try:
        return run_sweep(sweep_dir, spec, parallel, report, progress_every_s=progress_every)
    except KeyboardInterrupt:
        out.print(f"stopped; continue with: rlpipe sweep --resume {sweep_dir.path}")
        raise typer.Exit(130) from None


def _table(entries: list[Entry]) -> Table:
    labels = sorted({label for e in entries for label in e.evaluations})
    metric = next((e.metric for e in entries if e.finished), "score")
    table = Table("rank", Column("configuration", no_wrap=True), Column(f"{metric} (95%)", no_wrap=True), "seeds",
                  "failed", *labels, title="leaderboard")
    for rank, entry in enumerate(entries, 1):
        table.add_row(str(rank) if entry.finished else "-", entry.label, shown(entry.mean, entry.half),
                      f"{entry.finished} of {entry.seeds}", str(entry.failed),
                      *[f"{entry.evaluations[label]:.2f}" if label in entry.evaluations else "-" for label in labels])
    return table


# ``rlpipe``'s loader registers a click command as-is.
command = typer.main.get_command(app)
