"""``rlpipe run``: a whole local run from a preset or a config file.

Every call starts a new run unless told to continue one: its id is the preset's
(or configuration's) ``run_id`` plus the time, as ``rlpipe demo`` names its runs,
so a second ``rlpipe run --preset cartpole`` never silently continues the first.
A run named explicitly (``--run NAME``, or ``run_id`` in ``--set``, a config file
or ``RLPIPE_RUN_ID``) must not exist yet.  ``--resume RUN`` continues a run from
its own stored ``run.json`` (with the environment, ``--set``, ``--max-steps`` and
``--producers`` on top); a run whose learner already reached ``max_steps`` says so
and how to go on instead of starting processes that would stop at once.

``--runs N`` starts N new runs of the same configuration packed in one learner
process and one set of producer processes (``<name>-1`` ... ``<name>-N``); run
``i`` plays recipe seed ``i - 1``, as ``rlpipe demo --seed`` does (sampling, LoRA
initialisation and training seeds), so the runs differ; a ``--set`` of a seed
applies to every run.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

import typer
from pydantic import ValidationError

from pipeline.cli.common import EXIT_USAGE, console, fail, handle_user_errors
from pipeline.cli.demo_cmd import seed_overrides
from pipeline.cli.options import ConfigOpt, PresetOpt, SetOpt, run_config, setup_logging
from pipeline.config import ConfigError, deep_merge, env_layer, load_file, parse_overrides, validation_message
from pipeline.io.store import ObjectStore
from schemas.config import RunConfig
from schemas.names import validate_name

app = typer.Typer(name="run", add_completion=False)

MAX_NAME = 64  # schemas.names: run ids are at most 64 characters
MAX_PACKED = 16  # runs one `rlpipe run --runs N` packs (the sampling engine holds every run's adapters)
_STAMP = "%Y%m%d-%H%M%S"


@app.command(epilog="Examples: rlpipe run --preset cartpole --max-steps 20;  "
                    "rlpipe run --resume cartpole-20260101-120000 --max-steps 40")
@handle_user_errors
def run(
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    name: Annotated[str | None, typer.Option("--run", "-r", help="Name the new run (default: the preset's run_id "
                                                                  "plus the UTC time); it must not exist yet.")] = None,
    resume: Annotated[str | None, typer.Option(
        "--resume", help="Continue this existing run (its stored configuration; --set changes a field).")] = None,
    max_steps: Annotated[int | None, typer.Option(min=1, help="Learner steps before the run stops.")] = None,
    producers: Annotated[int | None, typer.Option(min=0, help="Producer processes to start.")] = None,
    dashboard: Annotated[bool, typer.Option("--dashboard/--no-dashboard", help="Live terminal dashboard.")] = True,
    runs: Annotated[int, typer.Option(
        "--runs", min=1, max=MAX_PACKED, help="Start this many runs packed in one learner and one set of producers "
                                              "(named <name>-1 ... <name>-N, run i with recipe seed i-1).")] = 1,
) -> None:
    """Start a new run (id: the preset's name plus the time) with its learner and N producers, or continue one
    with --resume RUN; the embedded stack is started if nothing is configured.

    Stops when the learner reaches its step budget or on Ctrl-C; the run stays inspectable with
    `rlpipe runs show --run RUN`, `rlpipe report --run RUN` and `rlpipe adapters list --run RUN`.
    """
    from pipeline.runtime import open_store

    if resume is not None:
        if preset or config or name:
            fail("--resume uses the run's stored configuration: drop --preset/--config/--run "
                 "(change a field with --set)", EXIT_USAGE)
        if runs > 1:
            fail("--runs starts new runs: drop --resume, or resume the packed runs' processes with "
                 "rlpipe learner start --run A --run B ... and rlpipe producer start --run A --run B ...", EXIT_USAGE)
        cfg = resumed_config(resume, overrides or [])
    else:
        cfg = run_config(preset, config, overrides)
    cfg = with_budget(cfg, max_steps, producers)
    store = open_store(cfg.store)
    if runs > 1:
        if cfg.value is not None:
            fail("value-based runs are not packed: start one rlpipe run per value run", EXIT_USAGE)
        stem = name or explicit_run_id(config, overrides or [])
        ids = packed_run_ids(store, cfg.run_id, stem, runs)
        configs = [with_budget(run_config(preset, config, [*seed_overrides(i), *(overrides or [])]), max_steps,
                               producers).model_copy(update={"run_id": run_id}) for i, run_id in enumerate(ids)]
        console.print(f"starting runs {', '.join(ids)}, packed in one learner and "
                      f"{cfg.num_producers} producer process(es)", markup=False)
        setup_logging()
        from pipeline.devstack.launcher import Launcher

        code = Launcher(configs, dashboard=dashboard).run()
        console.print(f"their packed report: rlpipe report {' '.join(f'--run {i}' for i in ids)}", markup=False)
        raise typer.Exit(code)
    if resume is not None:
        stop_if_finished(store, cfg)
    else:
        explicit = name or explicit_run_id(config, overrides or [])
        cfg = cfg.model_copy(update={"run_id": new_run_id(store, cfg.run_id, explicit)})
    console.print(f"{'resuming' if resume else 'starting'} run {cfg.run_id}", markup=False)
    setup_logging()
    if (cfg.value.learner if cfg.value is not None else cfg.learner).max_steps is None:
        typer.echo("note: learner.max_steps is not set: the run goes on until Ctrl-C")
    from pipeline.devstack.launcher import Launcher

    raise typer.Exit(Launcher(cfg, dashboard=dashboard).run())


def with_budget(config: RunConfig, max_steps: int | None, producers: int | None) -> RunConfig:
    """``config`` with ``--max-steps`` (a value run's budget is its value learner's) and ``--producers``."""
    if max_steps is not None and config.value is not None:
        config.value.learner.max_steps = max_steps
    elif max_steps is not None:
        config = config.model_copy(update={"learner": config.learner.model_copy(update={"max_steps": max_steps})})
    if producers is not None:
        config = config.model_copy(update={"num_producers": producers})
    return config


def packed_run_ids(store: ObjectStore, base: str, explicit: str | None, count: int) -> list[str]:
    """``<stem>-1`` ... ``<stem>-<count>``: the stem is ``explicit``, else ``<base>-<UTC time>``; none may exist."""
    from pipeline.analysis.runs import run_exists

    stem = validate_name(explicit, "run_id") if explicit is not None else new_run_id(store, base, None)
    ids = [validate_name(f"{stem}-{i}", "run_id") for i in range(1, count + 1)]
    taken = [run_id for run_id in ids if run_exists(store, run_id)]
    if taken:
        raise ConfigError(f"runs {', '.join(taken)} already exist in {store.root}; name the packed runs with "
                          "--run NAME (they become NAME-1 ... NAME-N), or drop --run for a fresh name")
    return ids


def explicit_run_id(config_file: str | None, overrides: list[str]) -> str | None:
    """The run id set by --set, RLPIPE_RUN_ID or a config file (a preset's is only a base name)."""
    for layer in (parse_overrides(overrides), env_layer(), load_file(config_file) if config_file else {}):
        if layer.get("run_id"):
            return str(layer["run_id"])
    return None


def new_run_id(store: ObjectStore, base: str, explicit: str | None) -> str:
    """``explicit`` if that run does not exist yet, else ``<base>-<UTC time>`` (``-2``, ``-3`` if taken)."""
    from pipeline.analysis.runs import run_exists

    if explicit is not None:
        validate_name(explicit, "run_id")
        if run_exists(store, explicit):
            raise ConfigError(f"run {explicit!r} already exists in {store.root}; continue it with --resume "
                              f"{explicit}, or name a new one (or drop --run/run_id for a fresh name)")
        return explicit
    stamp = datetime.now(UTC).strftime(_STAMP)
    stem = f"{base[: MAX_NAME - len(stamp) - 4].rstrip('-._')}-{stamp}"
    candidate, attempt = stem, 1
    while run_exists(store, candidate):
        attempt += 1
        candidate = f"{stem}-{attempt}"
    return validate_name(candidate, "run_id")


def resumed_config(run_id: str, overrides: list[str]) -> RunConfig:
    """The run's stored ``run.json`` with the ``RLPIPE_`` environment and ``--set`` on top."""
    from pipeline.analysis.runs import list_runs, stored_run_config
    from pipeline.runtime import open_store

    validate_name(run_id, "run_id")
    located = run_config(None, None, overrides)  # only where the store is: environment, --set, else embedded
    store = open_store(located.store)
    stored = stored_run_config(store, run_id)
    if stored is None:
        known = ", ".join(list_runs(store)[:10]) or "none"
        raise ConfigError(f"no run {run_id!r} to resume in {store.root} (runs there: {known}); "
                          "start a new one with rlpipe run --preset NAME")
    stored["bus"]["sasl_password"] = None  # stored as ***; the real one comes from the environment
    merged = deep_merge(deep_merge(stored, env_layer()), parse_overrides(overrides))
    try:
        return RunConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc)) from None


def stop_if_finished(store: ObjectStore, config: RunConfig) -> None:
    """Exit 0 with one line when the run's learner already reached ``max_steps``: nothing would train."""
    from pipeline.analysis.runs import learner_step
    from pipeline.config import preset_names

    preset_hint = config.env.name if config.env.name in preset_names() else "NAME"
    limit = config.learner.max_steps
    step = learner_step(store, config.run_id)
    if limit is not None and step >= limit:
        console.print(
            f"run {config.run_id} already reached its max_steps ({limit}): continue it with "
            f"`rlpipe run --resume {config.run_id} --max-steps {step + limit}`, or start a fresh run with "
            f"`rlpipe run --preset {preset_hint}`", markup=False, soft_wrap=True,
        )
        raise typer.Exit(0)


command = typer.main.get_command(app)
