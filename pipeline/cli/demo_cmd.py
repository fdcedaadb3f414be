"""``rlpipe demo``: the main job on the embedded default, start to finish, with its measured result.

Phases, each the command a user would type (so the demo shows the product, not
a special path): build the tiny model; record weighted noisy demonstrations of
CartPole to Parquet (``rlpipe envs record --weighted``); warm-start an adapter
from them offline (``rlpipe replay --train``, preset ``demo-warmstart``);
``rlpipe run`` the online RL phase from that adapter (preset ``demo``, embedded
broker and store, one producer, the learner); ``rlpipe eval`` the base model
(v0), the warm start (v1) and the last version on held-out seeds, plus the
random policy for scale; ``rlpipe report``.  It ends by printing the returns
with their 95% confidence intervals and the two ratios the demo is judged by
(last / base and last / warm start), and writes them to ``demo-result.json`` in
the report folder.  Nothing is hard-coded: every number printed was measured by
this run.

``--preset demo-sokoban`` and ``--preset demo-tetris`` run the same recipe shape
on those games (``RECIPES``: the scripted solver's answers as demonstrations,
their own warm-start preset), judged on the held-out success rate: x1.5 over
the base model and above the random policy, with separated 95% Wilson intervals.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from pipeline.cli.common import console, fail, handle_user_errors
from pipeline.devstack.launcher import rlpipe_command

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


SEED_STRIDE = 1000  # each recipe seed plays its own training episodes: [seed * stride, ...)


@dataclass(frozen=True)
class Recipe:
    """How the demo warm-starts and judges the online preset's environment (its defaults; options override)."""

    warm_preset: str  # the offline warm start's preset (its LoRA rank/alpha match the online preset's)
    demonstrations: int  # teacher episodes recorded
    noise: float  # the teacher's share of random answers
    weighted: bool  # one row per answer choice, weighted by the noisy teacher's probability
    episodes_per_batch: int  # episodes per stored batch: the warm start takes batches until batch_rows
    episodes: int  # held-out evaluation episodes per policy
    judge: str  # "return": mean return x2 over base and x1.5 over the warm start; "success": solved share


RECIPES: dict[str, Recipe] = {
    # CartPole: a weak, noisy teacher (0.62 on the heuristic's push), so online RL does the improving
    "cartpole": Recipe("demo-warmstart", 250, 0.76, True, 1, 32, "return"),
    # Sokoban 6x6, one box, positions in words: the BFS solver's moves, then online RL (docs/demo.md)
    "sokoban": Recipe("demo-sokoban-warmstart", 20_000, 0.0, False, 20, 64, "success"),
    # Tetris 4x4, single cells, GRL's grid: the same shape on the scripted heuristic's answers
    "tetris": Recipe("demo-tetris-warmstart", 4_000, 0.0, False, 16, 64, "success"),
}


def recipe_for(preset: str) -> tuple[str, dict[str, Any], Recipe]:
    """The online preset's environment name and overrides, and the demo recipe for that environment."""
    from pipeline.config import load_preset

    settings = load_preset(preset)
    if settings.get("value"):  # the phases warm-start and train a LoRA adapter; a value run has none
        fail(f"{preset} is value-based and rlpipe demo trains a language model's adapter; "
             f"run it with rlpipe run --preset {preset}", 2)
    env = settings.get("env") or {}
    name = env.get("name", "cartpole")
    if name not in RECIPES:
        fail(f"rlpipe demo has no recipe for {name!r} (preset {preset}); presets on {', '.join(RECIPES)} work", 2)
    return name, dict(env.get("overrides") or {}), RECIPES[name]


def seed_overrides(seed: int) -> list[str]:
    """``key=value`` settings that give a run the recipe seed ``seed`` (0 = the presets' own seeds)."""
    if seed == 0:
        return []
    pairs = {"sampler.seed": seed, "learner.seed": seed, "producer.seed_start": seed * SEED_STRIDE}
    return [f"{key}={value}" for key, value in pairs.items()]


def seed_settings(seed: int) -> list[str]:
    """``--set`` arguments that give a run the recipe seed ``seed`` (0 = the presets' own seeds)."""
    return [arg for setting in seed_overrides(seed) for arg in ("--set", setting)]


def result_table(results: list[dict[str, Any]], run_id: str) -> Table:
    table = Table("policy", "version", "episodes", "mean return", "95% CI", "success rate",
                  title=f"held-out evaluation of {run_id}")
    for r in results:
        table.add_row(r["policy"], f"v{r['version']}", str(r["episodes"]), f"{r['mean_return']:.2f}",
                      f"± {r['ci95']:.2f}", f"{r['success_rate']:.0%}")
    return table


def verdict(base: dict[str, Any], last: dict[str, Any], warm: dict[str, Any] | None = None) -> dict[str, Any]:
    """The learning result as numbers: ratios of mean returns and whether the 95% intervals separate."""
    def ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
        return a["mean_return"] / b["mean_return"] if b["mean_return"] > 0 else float("nan")

    def separate(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return bool(a["mean_return"] - a["ci95"] > b["mean_return"] + b["ci95"])

    out = {"base_mean": base["mean_return"], "base_ci95": base["ci95"], "last_version": last["version"],
           "last_mean": last["mean_return"], "last_ci95": last["ci95"], "ratio": ratio(last, base),
           "intervals_separate": separate(last, base), "doubled": bool(ratio(last, base) >= 2.0)}
    if warm is not None:
        out.update({"warm_version": warm["version"], "warm_mean": warm["mean_return"], "warm_ci95": warm["ci95"],
                    "ratio_rl": ratio(last, warm), "rl_intervals_separate": separate(last, warm),
                    "rl_raised_1_5x": bool(ratio(last, warm) >= 1.5)})
    return out


def success_verdict(base: dict[str, Any], last: dict[str, Any], random_: dict[str, Any]) -> dict[str, Any]:
    """Success rates with 95% Wilson intervals: last x1.5 over the base model and above the random policy."""
    from pipeline.analysis.report.metrics import wilson_interval

    def rate(r: dict[str, Any]) -> tuple[float, tuple[float, float]]:
        return r["success_rate"], wilson_interval(round(r["success_rate"] * r["episodes"]), r["episodes"])

    (b, b_ci), (la, la_ci), (ra, ra_ci) = rate(base), rate(last), rate(random_)
    ratio = la / b if b > 0 else math.inf if la > 0 else math.nan
    return {"base_success": b, "base_success_ci": b_ci, "last_success": la, "last_success_ci": la_ci,
            "random_success": ra, "random_success_ci": ra_ci, "success_ratio": ratio,
            "success_x1_5": bool(ratio >= 1.5) and la_ci[0] > b_ci[1], "success_above_random": la_ci[0] > ra_ci[1]}


def targets_line(outcome: dict[str, Any]) -> str:
    """One line: each learning target met or missed, and what to try when one is missed."""
    if "success_ratio" in outcome:
        judged = {"success x1.5 over the base model": outcome["success_x1_5"],
                  "success above random": outcome["success_above_random"]}
        hint = "the warm start may not have learned the moves yet: try more demonstrations, e.g. --demonstrations 30000"
    else:
        judged = {"x2 over the base model": outcome["doubled"] and outcome["intervals_separate"]}
        if "ratio_rl" in outcome:
            judged["x1.5 over the warm start"] = outcome["rl_raised_1_5x"] and outcome["rl_intervals_separate"]
        hint = "the return may not have taken off yet: try more online steps, e.g. rlpipe demo --steps 30"
    line = "targets: " + "; ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in judged.items())
    return line if all(judged.values()) else f"{line} ({hint})"


@app.command(epilog="Example: rlpipe demo --steps 30 --episodes 32")
@handle_user_errors
def demo(
    preset: Annotated[str, typer.Option(help="The preset of the online RL phase.")] = "demo",
    steps: Annotated[int | None, typer.Option(min=1, help="Online learner steps (default: the preset's).")] = None,
    episodes: Annotated[int | None, typer.Option(
        min=2, help="Held-out evaluation episodes per policy (default: the recipe's, 32 CartPole, 64 Sokoban).")
    ] = None,
    warm_start: Annotated[bool, typer.Option(
        "--warm-start/--no-warm-start", help="Warm-start from (noisy) demonstrations first.")] = True,
    demonstrations: Annotated[int | None, typer.Option(
        min=1, help="Demonstration episodes to record (default: the recipe's, 250 CartPole, 20,000 Sokoban).")
    ] = None,
    noise: Annotated[float | None, typer.Option(
        min=0.0, max=1.0, help="The demonstrator's share of random answers (default: the recipe's, 0.76 CartPole).")
    ] = None,
    dashboard: Annotated[bool, typer.Option("--dashboard/--no-dashboard", help="Live dashboard.")] = True,
    seed: Annotated[int, typer.Option(min=0, max=999, help=(
        "Seed of the whole recipe: demonstrations, sampling, LoRA initialisation and training seeds "
        "(held-out evaluation seeds stay the same)."))] = 0,
) -> None:
    """Build the tiny model, warm-start offline, run online RL, evaluate base / warm start / last, report."""
    env_name, env_overrides, recipe = recipe_for(preset)
    episodes = episodes or recipe.episodes
    demonstrations = demonstrations or recipe.demonstrations
    noise = recipe.noise if noise is None else noise
    run_id = f"{preset}-{datetime.now(UTC):%Y%m%d-%H%M%S}" + (f"-s{seed}" if seed else "")
    started = time.monotonic()
    total = 6 if warm_start else 4
    phase = iter(range(1, total + 1))
    _phase(f"{next(phase)}/{total} tiny base model", "model", "init-tiny")
    run_args = ["run", "--preset", preset, "--run", run_id, *seed_settings(seed)]
    if warm_start:
        demos, warm = f"{run_id}-demos", f"{run_id}-warm"
        _phase(f"{next(phase)}/{total} demonstrations to Parquet", "envs", "record", env_name, "--run", demos,
               "--episodes", str(demonstrations), "--noise", str(noise), *(["--weighted"] if recipe.weighted else []),
               "--episodes-per-batch", str(recipe.episodes_per_batch), "--overrides", json.dumps(env_overrides),
               "--seed-start", str(seed * SEED_STRIDE))
        _phase(f"{next(phase)}/{total} offline warm start (supervised, replayed from Parquet)", "replay", "--run",
               demos, "--train", "--preset", recipe.warm_preset, "--set", f"run_id={warm}", *seed_settings(seed))
        run_args += ["--set", f"learner.init_from={warm}@latest"]
    run_args += ["--max-steps", str(steps)] if steps else []
    run_args += [] if dashboard else ["--no-dashboard"]
    _phase(f"{next(phase)}/{total} online RL: learner + producer on the embedded stack", *run_args)
    versions = ["0", "1", "latest"] if warm_start else ["0", "latest"]
    evaluated = _phase(f"{next(phase)}/{total} held-out evaluation", "eval", run_id,
                       *[arg for v in versions for arg in ("--version", v)],
                       "--episodes", str(episodes), "--baseline", "random", "--json", capture=True)
    # the engine logs to stdout too: the JSON document is the last thing printed
    results = json.loads(evaluated.stdout[evaluated.stdout.rindex('{\n  "results"'):])["results"]
    out = Path(f"rlpipe-report-{run_id}")
    _phase(f"{next(phase)}/{total} report", "report", "--run", run_id, "--out", str(out))
    base, last = results[0], results[len(versions) - 1]
    warm_result = results[1] if warm_start else None
    outcome = {"run_id": run_id, "preset": preset, "minutes": (time.monotonic() - started) / 60,
               **verdict(base, last, warm_result), "results": results}
    if recipe.judge == "success":
        outcome.update(success_verdict(base, last, results[len(versions)]))
    out.mkdir(exist_ok=True)
    (out / "demo-result.json").write_text(json.dumps(outcome, indent=2))
    console.rule("[bold]result")
    console.print(result_table(results, run_id))
    console.print(
        f"last version v{last['version']}: mean return {last['mean_return']:.2f} ± {last['ci95']:.2f} vs base "
        f"{base['mean_return']:.2f} ± {base['ci95']:.2f} -> x{outcome['ratio']:.2f}"
        f"{' (95% intervals separate)' if outcome['intervals_separate'] else ' (95% intervals overlap)'}"
    )
    if warm_result is not None:
        console.print(
            f"online RL from the warm start v{warm_result['version']} ({warm_result['mean_return']:.2f} ± "
            f"{warm_result['ci95']:.2f}) -> x{outcome['ratio_rl']:.2f}"
            f"{' (95% intervals separate)' if outcome['rl_intervals_separate'] else ' (95% intervals overlap)'}"
        )
    if "success_ratio" in outcome:
        console.print(
            f"success rate v{last['version']} {outcome['last_success']:.0%} {_pct(outcome['last_success_ci'])} vs "
            f"base {outcome['base_success']:.0%} {_pct(outcome['base_success_ci'])} -> x{outcome['success_ratio']:.2f};"
            f" random {outcome['random_success']:.0%} {_pct(outcome['random_success_ci'])}"
        )
    console.print(targets_line(outcome))
    console.print(f"report: {out / 'report.html'}; {outcome['minutes']:.1f} min in all")


def _pct(interval: tuple[float, float]) -> str:
    return f"[{interval[0]:.0%}, {interval[1]:.0%}]"


command = typer.main.get_command(app)
