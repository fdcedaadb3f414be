"""``envs``: list, play and evaluate the registered text environments from the command line.

Thin by design: it resolves names through the registry, runs episodes through
``producers.envs.evaluate`` and only formats what comes back.  User mistakes
(an unknown environment, a bad option value) end with one line on stderr and a
non-zero exit code, never a traceback.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from pipeline.cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    GcsEndpointOpt,
    StoreRootOpt,
    console,
    error_line,
    fail,
    reachable_store,
    user_errors,
)
from pipeline.config import setting_error
from producers.envs.base import StepResult, TextEnv
from producers.envs.evaluate import EvalSummary, Policy, evaluate, make_policy, run_episode
from producers.envs.registry import env_class, env_names
from schemas.names import validate_name

app = typer.Typer(name="envs", help="List, play and evaluate rlpipe's text environments.", no_args_is_help=True)


class EvalPolicy(StrEnum):
    """Scripted policies ``envs eval`` can run."""

    heuristic = "heuristic"
    random = "random"


class PlayPolicy(StrEnum):
    """Who answers in ``envs play``."""

    human = "human"
    heuristic = "heuristic"
    random = "random"


class _InputEnded(Exception):
    """stdin closed while the human policy waited for an answer."""


def _check_name(name: str) -> None:
    if name not in env_names():
        fail(f"unknown environment {name!r}; choose one of: {', '.join(env_names())}", EXIT_USAGE)


OverridesOpt = Annotated[str, typer.Option(
    "--overrides", help='Environment settings as JSON, e.g. \'{"split": "test"}\' (see `envs show NAME`).')]
SeedOpt = Annotated[int, typer.Option("--seed", "-s", min=0, help="Episode seed; the same seed gives the same episode.")]


def _build_env(name: str, overrides: dict | None = None) -> TextEnv:
    """The named environment, or a one-line error: exit 2 for bad input, 1 if the env module is broken."""
    _check_name(name)
    try:
        cls = env_class(name)
    except (ImportError, AttributeError) as exc:  # its module does not import, or lacks the registered class
        fail(f"environment {name!r} failed to load: {type(exc).__name__}: {exc}", EXIT_FAILURE)
    try:
        return cls(cls.Config.model_validate(overrides or {}))
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        problem = setting_error(exc, cls.Config, listing=f"rlpipe envs show {name}")
        fail(f"invalid settings for {name}: {problem}", EXIT_USAGE)


def _overrides(text: str) -> dict:
    """``--overrides`` as a dict, or a one-line error naming the option."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        fail(f"--overrides is not JSON ({exc.msg}); give an object, e.g. --overrides '{{\"max_turns\": 5}}'",
             EXIT_USAGE)
    if not isinstance(value, dict):
        fail("--overrides must be a JSON object, e.g. --overrides '{\"max_turns\": 5}'", EXIT_USAGE)
    return value


def _defaults_text(name: str) -> tuple[str, str | Text, str]:
    """(name, description, defaults) for the list table; an import failure shows up in the row instead."""
    try:
        cls = env_class(name)
        cfg = cls.Config()
    except (ImportError, AttributeError) as exc:  # one env that does not load must not hide the others
        return name, Text(f"failed to load: {type(exc).__name__}: {exc}", style="red"), ""
    defaults = (
        f"turns {cfg.max_turns}, actions/turn {cfg.max_actions_per_turn}, "
        f"actions {cfg.max_actions_total}, env steps {cfg.max_env_steps}"
    )
    return name, cls.description, defaults


def _env_record(name: str) -> dict:
    """One environment as JSON: its description and default limits, or why it failed to load."""
    try:
        cls = env_class(name)
        cfg = cls.Config()
    except (ImportError, AttributeError) as exc:  # one env that does not load must not hide the others
        return {"name": name, "error": f"{type(exc).__name__}: {exc}"}
    return {"name": name, "description": cls.description, "defaults": cfg.model_dump(mode="json")}


@app.command("list")
def list_envs(as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False) -> None:
    """List the registered environments with their default limits.

    Example: rlpipe envs list --json
    """
    if as_json:
        typer.echo(json.dumps([_env_record(name) for name in env_names()], indent=2))
        return
    table = Table(title="rlpipe environments")
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("description")
    table.add_column("defaults")
    for name in env_names():
        row_name, description, defaults = _defaults_text(name)
        table.add_row(row_name, description, defaults)
    console.print(table)


def _settings(name: str) -> list[dict]:
    """Each setting of an environment: name, default, bounds or choices, description."""
    import typing

    from annotated_types import Ge, Gt, Le, Lt

    config_class = env_class(name).Config
    # Defaults as the environment runs with them: a validator may derive some from others
    # (the building's limits from its episode length), which the fields' own defaults do not show.
    defaults = config_class()
    rows = []
    for field_name, field in config_class.model_fields.items():
        low = next((f"{m.ge} ≤ " for m in field.metadata if isinstance(m, Ge)), "") or next(
            (f"{m.gt} < " for m in field.metadata if isinstance(m, Gt)), "")
        high = next((f" ≤ {m.le}" for m in field.metadata if isinstance(m, Le)), "") or next(
            (f" < {m.lt}" for m in field.metadata if isinstance(m, Lt)), "")
        choices = list(typing.get_args(field.annotation)) if typing.get_origin(field.annotation) is typing.Literal \
            else None
        rows.append({"name": field_name, "default": getattr(defaults, field_name), "bounds": f"{low}x{high}" if low or high else None,
                     "choices": choices, "description": field.description or ""})
    return rows


@app.command("show")
def show_env(
    name: Annotated[str, typer.Argument(help="Environment name (see `envs list`).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Show every setting of one environment: its default, bounds or choices, and what it does.

    A run sets them under env.overrides (--set env.overrides.NAME=VALUE); play, eval and record
    take them as --overrides JSON.
    Example: rlpipe envs show sokoban
    """
    env = _build_env(name)  # one-line errors for a bad name or a broken module
    rows = _settings(name)
    if as_json:
        typer.echo(json.dumps({"name": name, "description": env.description, "settings": rows}, indent=2,
                              default=str))
        return
    table = Table(title=f"{name}: {env.description}")
    for column in ("setting", "default", "allowed", "description"):
        table.add_column(column, no_wrap=column == "setting", overflow="fold")
    for row in rows:
        allowed = " | ".join(map(str, row["choices"])) if row["choices"] else row["bounds"] or ""
        table.add_row(row["name"], json.dumps(row["default"], default=str), allowed, row["description"])
    console.print(table)


def _human_policy(env: TextEnv) -> str:
    """Read one answer line from stdin; bare action text is wrapped in <answer> tags."""
    console.print("your answer> ", end="", markup=False)
    line = sys.stdin.readline()
    if not line:
        raise _InputEnded
    text = line.strip()
    return text if "<answer>" in text else f"<answer>{text}</answer>"


def _rejected(env: TextEnv, info: dict[str, Any]) -> str:
    """Why an answer that parsed was no action: the action text, and what the environment would take."""
    help_text = env.action_help()
    return f"{info['rejected_action']!r} is not an action here; {help_text[:1].lower()}{help_text[1:]}"


def _show_first(env: TextEnv, observation: str) -> None:
    console.print(observation, markup=False)


def _show_turn(env: TextEnv, answer: str, result: StepResult) -> None:
    info = result.info
    status = "" if info["action_is_valid"] else f" (invalid: {info['format_error'] or _rejected(env, info)})"
    notes = "".join(f" ({note})" for note in info["notes"])
    console.print(f"turn {env.turn}: answer {answer!r} -> reward {result.reward:+.3f}{status}{notes}", markup=False)
    if result.terminated or result.truncated:
        end = "terminated" if result.terminated else "truncated"
        console.print(f"episode {end}; success: {result.info['success']}", markup=False)
    else:
        console.print(result.observation, markup=False)


@app.command("play")
def play(
    name: Annotated[str, typer.Argument(help="Environment name (see `envs list`).")],
    seed: SeedOpt = 0,
    policy: Annotated[PlayPolicy, typer.Option("--policy", "-p", help="Who answers.")] = PlayPolicy.human,
    max_turns: Annotated[int | None, typer.Option("--max-turns", min=1, help="Override the env's max_turns.")] = None,
    overrides: OverridesOpt = "{}",
) -> None:
    """Play one episode, printing each observation and the reward per turn.

    As a human, type an action (e.g. `left`) or a full `<answer>...</answer>`.
    Example: rlpipe envs play cartpole --seed 3 --policy heuristic --max-turns 20
    """
    settings = _overrides(overrides) | ({"max_turns": max_turns} if max_turns is not None else {})
    env = _build_env(name, settings)
    chosen: Policy = _human_policy if policy is PlayPolicy.human else make_policy(policy.value, seed)
    console.print(env.system_prompt(), markup=False)
    console.print(f"--- {name}, seed {seed} ---", markup=False)
    try:
        result = run_episode(env, chosen, seed, on_step=_show_turn, on_reset=_show_first)
    except _InputEnded:
        console.print(f"\ninput ended after {env.turn} turns; return so far {env.episode_return:+.3f}", markup=False)
        return
    console.print(
        f"final return {result.episode_return:+.3f} over {result.turns} turns ({result.env_steps} env steps)",
        markup=False,
    )


def _print_summary(summary: EvalSummary) -> None:
    table = Table(title=f"{summary.env}: {summary.policy} policy, {summary.episodes} episodes")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("mean return", f"{summary.mean_return:.3f} ± {summary.ci95:.3f} (95% CI)")
    table.add_row("std / min / max", f"{summary.std_return:.3f} / {summary.min_return:.3f} / {summary.max_return:.3f}")
    table.add_row("success rate", f"{summary.success_rate:.3f}")
    table.add_row("mean env steps", f"{summary.mean_env_steps:.1f}")
    table.add_row("env steps / s", f"{summary.env_steps_per_second:,.0f}")
    console.print(table)


@app.command("eval")
def eval_env(
    name: Annotated[str, typer.Argument(help="Environment name (see `envs list`).")],
    policy: Annotated[
        EvalPolicy, typer.Option("--policy", "-p", help="Scripted policy to run.")
    ] = EvalPolicy.heuristic,
    episodes: Annotated[
        int, typer.Option("--episodes", "-n", min=1, max=100_000, help="Episodes to run.")
    ] = 20,
    seed_start: Annotated[
        int, typer.Option("--seed-start", min=0, help="Seed of the first episode (then +1 each).")
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object.")] = False,
    overrides: OverridesOpt = "{}",
) -> None:
    """Evaluate a scripted policy: mean return (95% CI), success rate and env steps per second.

    Example: rlpipe envs eval acrobot --policy heuristic --episodes 10 --json
    """
    settings = _overrides(overrides)
    _build_env(name, settings)  # one-line errors for a bad name, a bad setting or a broken module
    try:
        summary = evaluate(name, policy.value, episodes, seed_start, settings)
    except NotImplementedError as exc:
        fail(str(exc), EXIT_FAILURE)
    if as_json:
        typer.echo(json.dumps(summary.to_dict()))
    else:
        _print_summary(summary)


@app.command("record")
def record(
    name: Annotated[str, typer.Argument(help="Environment name.")],
    run: Annotated[str, typer.Option("--run", help="Run id the demonstration batches are written under.")],
    episodes: Annotated[int, typer.Option(min=1, help="Episodes to record.")] = 64,
    noise: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of turns answered by the random policy.")] = 0.5,
    seed_start: Annotated[int, typer.Option(min=0, help="First episode seed.")] = 0,
    model: Annotated[str, typer.Option(help="Model whose tokenizer and chat template build the tokens.")] = "tiny",
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    overrides: OverridesOpt = "{}",
    weighted: Annotated[bool, typer.Option(
        "--weighted", help="One row per answer choice, weighted by the noisy teacher's probability of it.")] = False,
    episodes_per_batch: Annotated[int, typer.Option(min=1, help="Episodes per stored batch (a replayed step reads "
                                                                "whole batches until learner.batch_rows).")] = 16,
) -> None:
    """Record the heuristic policy (with --noise random turns) as token trajectories for warm starts.

    Example: rlpipe envs record cartpole --run cp-demos --episodes 64 --noise 0.5 [--weighted]
    """
    env_overrides = _overrides(overrides)
    _build_env(name, env_overrides)  # a bad setting or run name is one line before the tokenizer loads
    try:
        validate_name(run, "run")
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    from transformers import AutoTokenizer

    from pipeline.analysis.runs import refuse_training_run
    from pipeline.io.archive import TrajectoryArchive
    from pipeline.runtime import refuse_new_run_case_twin
    from producers.demonstrations import record_demonstrations
    from producers.tiny_model import resolve_model
    from schemas.config import ModelConfig, StoreConfig

    with user_errors():  # an unreachable store exits 1, a bad URL 2
        archive = TrajectoryArchive(reachable_store(StoreConfig(root=root or "", gcs_endpoint=gcs_endpoint)))
        refuse_new_run_case_twin(archive.store, run)  # its batches would go into the other run's folder
        refuse_training_run(archive.store, run, f"record demonstrations under a run of their own "
                                                f"(--run {run}-demos) and warm start from it")
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(ModelConfig(base_model=model)))
        infos = record_demonstrations(archive, run, name, env_overrides, tokenizer, episodes, noise, seed_start,
                                      episodes_per_batch, weighted=weighted)
    except (ValueError, OSError) as exc:
        fail(error_line(exc), EXIT_USAGE)
    rows = sum(i.num_rows for i in infos)
    mean = sum(i.reward_mean * i.num_rows for i in infos) / max(1, rows)
    console.print(f"recorded {episodes} episodes ({rows} rows, {len(infos)} batches) of {name} under run {run}; "
               f"row-weighted mean return {mean:.2f}")


if __name__ == "__main__":
    app()
