"""``rlpipe run``: a whole local run from a preset or a config file.

Every call starts a new run unless told to continue one: its id is the preset's
(or configuration's) ``run_id`` plus the time, as ``rlpipe demo`` names its runs,
so a second ``rlpipe run --preset cartpole`` never silently continues the first.
A run named explicitly (``--run NAME``, or ``run_id`` in ``--set``, a config file
or ``RLPIPE_RUN_ID``) must not exist yet.  ``--resume RUN`` continues a run from
its own stored ``run.json`` (with the environment, ``--set``, ``--max-steps`` and
``--producers`` on top); a run whose learner already reached ``max_steps`` says so
and how to go on instead of starting processes that would stop at once.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

import typer
from pydantic import ValidationError

from pipeline.cli.common import EXIT_USAGE, console, fail, handle_user_errors
from pipeline.cli.options import ConfigOpt, PresetOpt, SetOpt, run_config, setup_logging
from pipeline.config import ConfigError, deep_merge, env_layer, load_file, parse_overrides, validation_message
from pipeline.io.store import ObjectStore
from schemas.config import RunConfig
from schemas.names import validate_name

app = typer.Typer(name="run", add_completion=False)

MAX_NAME = 64  # schemas.names: run ids are at most 64 characters
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
        cfg = resumed_config(resume, overrides or [])
    else:
        cfg = run_config(preset, config, overrides)
    if max_steps is not None and cfg.value is not None:  # a value run's budget is its value learner's
        cfg.value.learner.max_steps = max_steps
    elif max_steps is not None:
        cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"max_steps": max_steps})})
    if producers is not None:
        cfg = cfg.model_copy(update={"num_producers": producers})
    store = open_store(cfg.store)
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
