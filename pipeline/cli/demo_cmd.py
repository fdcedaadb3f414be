"""``rlpipe demo``: the main job on the embedded default, start to finish, with its measured result.

Phases, each the command a user would type (so the demo shows the product, not
a special path): build the tiny model, ``rlpipe run`` the demo preset (embedded
broker and store, one producer, the learner), ``rlpipe eval`` the base model and
the last adapter version on held-out seeds (plus the random policy for scale),
``rlpipe report``.  It ends by printing the returns with their 95% confidence
intervals and the ratio, and writes them to ``demo-result.json`` in the report
folder.  Nothing is hard-coded: every number printed was measured by this run.
"""

from __future__ import annotations

import json
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from pipeline.cli.common import console, fail, handle_user_errors
from pipeline.launcher import rlpipe_command

app = typer.Typer(name="demo", add_completion=False)


def _phase(title: str, *args: str, capture: bool = False) -> subprocess.CompletedProcess[str]:
    console.rule(f"[bold]{title}")
    console.print(f"$ rlpipe {' '.join(args)}", style="dim")
    started = time.monotonic()
    result = subprocess.run(rlpipe_command(*args), text=True, capture_output=capture)
    if result.returncode != 0:
        tail = (result.stderr or "").strip().splitlines()[-1:] if capture else []
        fail(f"`rlpipe {' '.join(args)}` failed (exit {result.returncode}){': ' + tail[0] if tail else ''}")
    console.print(f"done in {time.monotonic() - started:.0f}s", style="dim")
    return result


def result_table(results: list[dict[str, Any]], run_id: str) -> Table:
    table = Table("policy", "version", "episodes", "mean return", "95% CI", "success rate",
                  title=f"held-out evaluation of {run_id}")
    for r in results:
        table.add_row(r["policy"], f"v{r['version']}", str(r["episodes"]), f"{r['mean_return']:.2f}",
                      f"± {r['ci95']:.2f}", f"{r['success_rate']:.0%}")
    return table


def verdict(base: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    """The learning result as numbers: ratio of mean returns and whether the intervals separate."""
    ratio = last["mean_return"] / base["mean_return"] if base["mean_return"] > 0 else float("nan")
    separated = last["mean_return"] - last["ci95"] > base["mean_return"] + base["ci95"]
    return {"base_mean": base["mean_return"], "base_ci95": base["ci95"], "last_version": last["version"],
            "last_mean": last["mean_return"], "last_ci95": last["ci95"], "ratio": ratio,
            "intervals_separate": separated, "doubled": bool(ratio >= 2.0)}


@app.command(epilog="Example: rlpipe demo --steps 30 --episodes 64")
@handle_user_errors
def demo(
    preset: Annotated[str, typer.Option(help="The preset to run.")] = "demo",
    steps: Annotated[int | None, typer.Option(min=1, help="Learner steps (default: the preset's).")] = None,
    episodes: Annotated[int, typer.Option(min=2, help="Held-out evaluation episodes per policy.")] = 64,
    dashboard: Annotated[bool, typer.Option("--dashboard/--no-dashboard", help="Live dashboard.")] = True,
) -> None:
    """Build the tiny model, run the demo preset, evaluate base vs last version, write the report."""
    run_id = f"{preset}-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    started = time.monotonic()
    _phase("1/4 tiny base model", "model", "init-tiny")
    run_args = ["run", "--preset", preset, "--set", f"run_id={run_id}"]
    run_args += ["--max-steps", str(steps)] if steps else []
    run_args += [] if dashboard else ["--no-dashboard"]
    _phase("2/4 the run: learner + producer on the embedded stack", *run_args)
    evaluated = _phase("3/4 held-out evaluation", "eval", run_id, "--version", "0", "--version", "latest",
                       "--episodes", str(episodes), "--baseline", "random", "--json", capture=True)
    # the engine logs to stdout too: the JSON document is the last thing printed
    results = json.loads(evaluated.stdout[evaluated.stdout.rindex('{\n  "results"'):])["results"]
    out = Path(f"rlpipe-report-{run_id}")
    _phase("4/4 report", "report", run_id, "--out", str(out))
    base, last = results[0], results[1]
    outcome = {"run_id": run_id, "preset": preset, "minutes": (time.monotonic() - started) / 60,
               **verdict(base, last), "results": results}
    out.mkdir(exist_ok=True)
    (out / "demo-result.json").write_text(json.dumps(outcome, indent=2))
    console.rule("[bold]result")
    console.print(result_table(results, run_id))
    console.print(
        f"last version v{last['version']}: mean return {last['mean_return']:.2f} ± {last['ci95']:.2f} vs base "
        f"{base['mean_return']:.2f} ± {base['ci95']:.2f} -> x{outcome['ratio']:.2f}"
        f"{' (95% intervals separate)' if outcome['intervals_separate'] else ' (95% intervals overlap)'}; "
        f"report: {out / 'report.html'}; {outcome['minutes']:.1f} min in all"
    )


command = typer.main.get_command(app)
