"""``rlpipe eval --run RUN``: evaluate an adapter version (or the base model) on held-out seeds."""

from __future__ import annotations

import os
import time
from typing import Annotated, Any

import typer
from rich.table import Table

from pipeline.cli.common import console, err_console, fail, handle_user_errors, print_json, reachable_store
from pipeline.cli.options import DeprecatedRunArg, RunOpt, chosen_run, setup_logging
from pipeline.config import deep_merge, env_layer, parse_overrides
from pipeline.io.registry import AdapterRegistry
from schemas.config import RunConfig, StoreConfig

app = typer.Typer(name="eval", add_completion=False)


def stored_run_config(run: str, store_cfg: StoreConfig, overrides: list[str]) -> RunConfig:
    """The run's own configuration (``run.json`` with its newest recorded change; secrets masked there) with
    environment and --set layers on top."""
    from pipeline.analysis.runs import NoRunConfigError, required_run_config
    from pipeline.runtime import refuse_case_twin

    store = reachable_store(store_cfg)
    refuse_case_twin(store, run)  # its results would go into the other run's folder
    try:
        data = required_run_config(store, run)
    except NoRunConfigError as exc:
        fail(f"{exc}; " + ("so its environment and model are unknown: evaluate a run started with rlpipe run"
                           if exc.listed else "check the run id, or --root for another store"), 2)
    data["bus"]["sasl_password"] = None
    data = deep_merge(deep_merge(data, env_layer()), parse_overrides(overrides))
    data["store"] = {**data.get("store", {}), **store_cfg.model_dump(exclude_defaults=True)}
    return RunConfig.model_validate(data)


def resolve_version(registry: AdapterRegistry, text: str) -> int:
    """'latest' (0 when nothing is published), '7' or 'v7' -> 7."""
    if text == "latest":
        latest = registry.latest()
        return latest.version if latest else 0
    if text.isascii() and text.lstrip("v").isdigit():
        return int(text.lstrip("v"))
    fail(f"--version must be a number, v<number> or 'latest', got {text!r}", 2)


@app.command(epilog="Example: rlpipe eval --run demo --version 0 --version latest --episodes 32 --baseline random")
@handle_user_errors
def eval(
    run: RunOpt = None,
    version: Annotated[
        list[str] | None, typer.Option(help="Adapter version, 'latest', or 0 for the base model (repeatable).")
    ] = None,
    env: Annotated[str | None, typer.Option(help="Environment (default: the run's).")] = None,
    episodes: Annotated[int, typer.Option(min=1, max=100_000, help="Held-out episodes.")] = 32,
    greedy: Annotated[bool, typer.Option(help="Greedy decoding instead of the run's sampling temperature.")] = False,
    in_flight: Annotated[int, typer.Option(min=1, max=4096, help=(
        "Episodes played at once (one batched generation per turn); lower it when the model's memory is short."))
    ] = 32,  # producers.evaluation.IN_FLIGHT (imported only once a model is evaluated)
    baseline: Annotated[list[str] | None, typer.Option(help="Also evaluate heuristic and/or random.")] = None,
    root: Annotated[str | None, typer.Option(help=(
        "Store root URL (default: --set store.root, RLPIPE_STORE__ROOT, else the embedded stack's)."))] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", "-s", help="Override a config field.")] = None,
    validation: Annotated[bool, typer.Option(help=(
        "Play --episodes episodes after the held-out ones instead (building runs: the days after them), to "
        "choose between runs without touching those; never stored for the report, but the seeds played are, and a "
        "later held-out eval reaching them is refused."))] = False,
    held_out: Annotated[int | None, typer.Option(min=1, max=100_000, help=(
        "With --validation: how many held-out episodes to leave alone (default: --episodes, or further if the "
        "run's stored results reach further, or --episodes past the first seed of one stored with a raised "
        "env.eval_seed_offset; refused while one of them cannot be read; fewer than they reach is refused). "
        "Give runs you compare the same --held-out, so they are validated on the same seeds.  It is taken as "
        "given, without that --episodes margin: a later held-out eval reaching the seeds it validated is "
        "refused, naming the --episodes or env.eval_seed_offset that keeps off them."))] = None,
    save: Annotated[bool | None, typer.Option(help=(
        "Store the result under runs/RUN/eval/ for the report (default: yes, except with --validation)."))] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    run_arg: DeprecatedRunArg = None,
) -> None:
    """Play held-out episodes (seeds from env.eval_seed_offset) with each --version (0: the base model); print return and CI."""
    run = chosen_run(run, run_arg, "eval")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's start-up lines would bury the table
    setup_logging()
    from pipeline.analysis.runs import run_kind, shown_policy, version_zero
    from producers.evaluation import baseline_result, save_result

    wrong = [policy for policy in baseline or [] if policy not in ("heuristic", "random")]
    if wrong:  # before a model is loaded
        fail(f"--baseline must be heuristic or random, got {wrong[0]!r}", 2)
    if env:
        from producers.envs.registry import env_class

        try:
            env_class(env)
        except ValueError as exc:
            fail(str(exc), 2)
    located = deep_merge(env_layer(), parse_overrides(overrides or [])).get("store") or {}
    store_cfg = StoreConfig.model_validate({**located, **({"root": root} if root else {})})
    config = stored_run_config(run, store_cfg, overrides or [])
    offline_building = config.value is not None and config.value.offline is not None
    if env and offline_building and env != config.env.name:  # its network reads the building's telemetry
        fail(f"run {run!r} learned from a logged building dataset and plays {config.env.name} days only; "
             f"drop --env {env}", 2)
    if env:
        config = config.model_copy(update={"env": config.env.model_copy(update={"name": env})})
    store = reachable_store(config.store)
    registry = AdapterRegistry(store, run)
    kind = run_kind(config.model_dump())
    numbers = [resolve_version(registry, v) for v in (version or ["latest"])]
    published = registry.versions()
    missing = [n for n in numbers if n and n not in published]
    if missing:  # before a model is loaded
        have = f"versions {published[0]}-{published[-1]}" if published else "no versions yet"
        noun = "value-network" if kind == "value-network" else "adapter"
        fail(f"run {run!r} has no {noun} version {missing[0]} ({have}, 0 = {version_zero(kind)}); "
             f"see rlpipe adapters list --run {run}", 2)
    for number in numbers:
        reason = registry.retired_reason(number) if number else None
        if reason is not None:
            fail(f"run {run!r} version {number} was retired, its files deleted ({reason}); see rlpipe adapters list "
                 f"--run {run}", 2)
    building = offline_building  # offline CQL: held-out days
    if held_out is not None and not validation:
        fail("--held-out goes with --validation (the held-out episodes the validation ones come after)", 2)
    if validation and save:
        fail("--validation results are never stored (the report shows held-out results); drop --save", 2)
    skip = validation_skip(config, store, building, held_out, episodes) if validation else 0
    if not validation:
        refuse_validated_seeds(config, store, building, episodes)
    else:
        config = config.model_copy(update={"env": config.env.model_copy(
            update={"eval_seed_offset": config.env.eval_seed_offset + skip})})
    if building:
        from producers.offline.policy_eval import building_baseline, evaluate_building_version

        results = [evaluate_building_version(config, store, n, episodes, skip) for n in numbers]
    elif config.value is not None:  # a value run: greedy play with the Q-network, no language model
        from producers.value_eval import evaluate_value_version

        results = [evaluate_value_version(config, store, n, episodes) for n in numbers]
    else:
        results = evaluate_model_versions(config, store, numbers, episodes, greedy, in_flight)
    for policy in baseline or []:
        results.append(building_baseline(config, store, policy, episodes, skip) if building
                       else baseline_result(config, policy, episodes))
    if validation:  # after the play: the seeds are seen once its numbers are
        from producers.evaluation import save_validation
        from schemas.evaluation import ValidationPlayed

        save_validation(store, ValidationPlayed(run_id=config.run_id, env=config.env.name,
                                                seed_start=results[0].seed_start, episodes=episodes))
    keys = [save_result(store, r) for r in results] if save is not False and not validation else []
    if as_json:
        print_json({"results": [r.model_dump(mode="json") for r in results], "saved": keys})
        return
    slates = config.value is not None and config.value.slate is not None  # a return is a session's engagement
    mean_label = "engagement per session (min)" if slates else "mean return"
    first, last = results[0].seed_start, results[0].seed_start + episodes - 1
    unit = "days" if building else "seeds"
    played = f"held-out {unit} {first}-{last}" if not validation else \
        f"validation {unit} {first}-{last} (the {skip} held-out {unit} before them left alone)"
    from pipeline.analysis.report.metrics import wilson_interval

    table = Table("policy", "version", "episodes", mean_label, "95% CI", "success (95% Wilson CI)",
                  title=f"{run} on {config.env.name}, {played}")
    for r in results:
        version = "-" if r.policy in ("heuristic", "random") else f"v{r.version}"  # a baseline has no version
        policy = shown_policy(r.policy, r.version, kind)
        low, high = wilson_interval(sum(r.successes), r.episodes)
        table.add_row(policy, version, str(r.episodes), f"{r.mean_return:.3f}", f"± {r.ci95:.3f}",
                      f"{r.success_rate:.0%} ({low:.0%} to {high:.0%})")  # a value run's v0 plays no network
    console.print(table)
    if building:
        from producers.offline.policy_eval import breakdown_line

        for r in results:
            console.print(breakdown_line(r))


def first_held_out(config: RunConfig, store: Any, building: bool) -> int:
    """The run's first held-out seed: a building run's first day after its dataset's, else ``env.eval_seed_offset``."""
    if building:
        from producers.offline.policy_eval import first_held_out_day

        return first_held_out_day(config, store)
    return config.env.eval_seed_offset


def validation_skip(config: RunConfig, store: Any, building: bool, held_out: int | None, episodes: int) -> int:
    """How many held-out episodes ``--validation`` leaves alone before its own: ``--held-out``, else as far as the
    run's stored held-out results reach and ``--episodes`` past the first seed of each of them and of
    ``env.eval_seed_offset`` (what a later ``eval --episodes N`` from there plays; ``validation_reach``): short of
    any would validate on seeds that are reported on.  A ``--held-out`` short of the stored
    results is refused: its validation episodes would replay their seeds; so is the default while a stored result
    cannot be read (how far it reaches is unknown; one a newer rlpipe wrote: upgrade to read it).  The default differs between runs with
    different stored results, so runs compared on validation need one shared ``--held-out``; that one is taken as
    given, without the ``--episodes`` margin from each stored start, so it may validate seeds a later held-out
    ``eval --episodes N`` from a stored start would play: the validation's record refuses that eval
    (``refuse_validated_seeds``), naming the ``--episodes`` that stays before them."""
    from pipeline.analysis.runs import read_evals
    from producers.evaluation import held_out_played, held_out_ranges, unreadable_refusal, validation_reach

    first = first_held_out(config, store, building)
    stored, unreadable = read_evals(store, config.run_id)
    if unreadable and held_out is None:  # its seeds are unknown: a validation may replay some of them
        refusal = unreadable_refusal(unreadable[0], "the held-out seeds that stored result played",
                                     "validation episodes might replay them", str(store.root))
        fail(f"{refusal}, or pass --held-out past every held-out seed evaluated", 2)
    for why in unreadable:
        err_console.print(f"note: a stored result not checked against --held-out: {why}", style="yellow",
                          markup=False)
    played = held_out_played(stored, config.env.name, first)
    if held_out is None:
        return validation_reach(stored, config.env.name, first, episodes)
    if held_out < played:
        unit = "days" if building else "seeds"
        ranges = " and ".join(f"{low}-{high}" for low, high in held_out_ranges(stored, config.env.name, first))
        fail(f"run {config.run_id!r} has stored held-out results on {unit} {ranges}: --held-out {played} or more "
             f"keeps the validation episodes off them (or leave --held-out out)", 2)
    return held_out


def refuse_validated_seeds(config: RunConfig, store: Any, building: bool, episodes: int) -> None:
    """Refuse held-out episodes on seeds a ``--validation`` of the run played (recorded under
    ``runs/RUN/validation/``): runs were chosen on those, so reporting on them would report on the choice.
    A validation skips the held-out episodes it knows of; a later held-out evaluation of more reaches its seeds."""
    from producers.evaluation import validated_overlap, validated_refusal
    from schemas.evaluation import validation_prefix

    first = first_held_out(config, store, building)
    overlap, past = validated_overlap(store, config.run_id, config.env.name, first, episodes)
    if not overlap:
        return
    fixes = [f"--episodes {overlap[0][0] - first} or fewer stays before them"] if overlap[0][0] > first else []
    if not building:  # a building run's held-out days start after its dataset's, whatever the offset
        fixes.append(f"--set env.eval_seed_offset={past} plays after every validated seed")
    if not fixes:  # a validation from the first held-out day on (a dataset's days changed since)
        fixes.append(f"delete {validation_prefix(config.run_id)}/ from {store.root} to report on them anyway")
    fail(validated_refusal(config.run_id, "days" if building else "seeds", overlap, fixes), 2)


def evaluate_model_versions(config: RunConfig, store: Any, numbers: list[int], episodes: int, greedy: bool,
                            in_flight: int) -> list:
    """Adapter versions (0 = the base model) played by the run's language model on held-out seeds."""
    from producers.samplers import sampler_for_run
    from producers.tiny_model import resolve_model

    model_path = resolve_model(config.model)
    sampler = sampler_for_run(config, model_path)
    try:
        return [_play_version(config, store, model_path, n, episodes, sampler, greedy, in_flight) for n in numbers]
    finally:
        sampler.close()


def _play_version(config: RunConfig, store: Any, model_path: str, version: int, episodes: int, sampler: Any,
                  greedy: bool, in_flight: int) -> Any:
    """One version's play (minutes on the CPU), between a line on stderr saying what plays and one when done."""
    from producers.evaluation import evaluate_version

    name = "the base model (v0)" if version == 0 else f"v{version}"
    err_console.print(f"playing {episodes} held-out episodes with {name}, {min(episodes, in_flight)} at once",
                      markup=False)
    started = time.monotonic()
    result = evaluate_version(config, store, model_path, version, episodes, sampler=sampler,
                              temperature=0.0 if greedy else None, in_flight=in_flight)
    err_console.print(f"{name}: done in {time.monotonic() - started:.0f} s", markup=False)
    return result


command = typer.main.get_command(app)
