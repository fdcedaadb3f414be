"""``rlpipe run``: a whole local run from a preset or a config file.

Every call starts a new run unless told to continue one: its id is the preset's
(or configuration's) ``run_id`` plus the time, as ``rlpipe demo`` names its runs,
so a second ``rlpipe run --preset cartpole`` never silently continues the first.
A run named explicitly (``--run NAME``, or ``run_id`` in ``--set``, a config file
or ``RLPIPE_RUN_ID``) must not exist yet.  ``--resume RUN`` continues a run from
its own stored configuration (``run.json`` with its newest recorded change, such as
an earlier resume's ``--max-steps``; the environment, ``--set``, ``--max-steps`` and
``--producers`` on top); a run whose learner already reached ``max_steps`` says so
and how to go on instead of starting processes that would stop at once.

``--runs N`` starts N new runs of the same configuration packed in one learner
process and one set of producer processes (``<name>-1`` ... ``<name>-N``); run
``i`` plays recipe seed ``i - 1``, as ``rlpipe demo --seed`` does (sampling, LoRA
initialisation and training seeds), so the runs differ; a ``--set`` of a seed
applies to every run.

Several ``--preset`` (or several ``--config``) start one new run of each, packed
the same way (``--runs N``: N of each).  A preset's run is named after the
preset and the time (one time for all), or ``<NAME>-<preset>`` with ``--run
NAME``; a file's run keeps the file's ``run_id`` when it names one.  The runs
must be able to share the engines (one base model, sampler and event log);
``--max-steps`` and ``--set`` apply to every run, and the producer processes,
which serve every run, are as many as the most any run asks for.
"""

from __future__ import annotations

import json
import shlex
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from pydantic import ValidationError

from pipeline.cli.common import EXIT_USAGE, console, fail, handle_user_errors, reachable_store
from pipeline.cli.demo_cmd import seed_overrides
from pipeline.cli.options import SetOpt, run_config, setup_logging
from pipeline.config import (
    ConfigError,
    check_env,
    check_value_run_settings,
    config_to_json,
    deep_merge,
    env_layer,
    load_file,
    load_yaml,
    parse_overrides,
    validation_message,
)
from pipeline.io.store import ObjectStore
from pipeline.models import check_same_tiny_build, recorded_tiny_dir
from schemas.config import RunConfig, check_packable, check_sampler_holds_rank, step_budget
from schemas.names import validate_name

app = typer.Typer(name="run", add_completion=False)

MAX_NAME = 64  # schemas.names: run ids are at most 64 characters
MAX_PACKED = 16  # runs one `rlpipe run --runs N` packs (the sampling engine holds every run's adapters)
_STAMP = "%Y%m%d-%H%M%S"
# what every packed run shares: the learner's engine and the producers' engine (consumers/ and producers/packed.py)
PACKED_SHARED = ("model.base_model", "model.dtype", "learner.device", "learner.gradient_checkpointing",
                 "sampler.backend", "sampler.max_model_len", "bus.bootstrap_servers",
                 "bus.namespace")  # what the packed learner's and producer's checks refuse to differ

PresetsOpt = Annotated[list[str] | None, typer.Option(
    "--preset", "-p", help="A shipped preset (see `rlpipe config presets`); repeat it to start one packed run of "
                           "each.")]
ConfigsOpt = Annotated[list[str] | None, typer.Option(
    "--config", "-c", help="A YAML/JSON run configuration file; repeat it to start one packed run of each.")]


@app.command(epilog="Examples: rlpipe run --preset cartpole --max-steps 20;  "
                    "rlpipe run --resume cartpole-20260101-120000 --max-steps 40;  "
                    "rlpipe run --preset cartpole --preset sokoban --max-steps 10 (two runs, packed)")
@handle_user_errors
def run(
    preset: PresetsOpt = None,
    config: ConfigsOpt = None,
    overrides: SetOpt = None,
    name: Annotated[str | None, typer.Option("--run", "-r", help="Name the new run (default: the preset's run_id "
                                                                  "plus the UTC time); it must not exist yet.")] = None,
    resume: Annotated[str | None, typer.Option(
        "--resume", help="Continue this existing run (its stored configuration; --set changes a field).")] = None,
    max_steps: Annotated[int | None, typer.Option(min=1, help="Learner steps before the run stops.")] = None,
    producers: Annotated[int | None, typer.Option(min=0, help="Producer processes to start.")] = None,
    dashboard: Annotated[bool, typer.Option("--dashboard/--no-dashboard", help="Live terminal dashboard (without it, or when standard output is not a "
                                                             "terminal: one line per learner step).")] = True,
    runs: Annotated[int, typer.Option(
        "--runs", min=1, max=MAX_PACKED, help="Start this many runs packed in one learner and one set of producers "
                                              "(named <name>-1 ... <name>-N, run i with recipe seed i-1).")] = 1,
) -> None:
    """Start a new run (id: the preset's name plus the time) with its learner and N producers, or continue one
    with --resume RUN; the embedded stack is started if nothing is configured.

    Stops when the learner reaches its step budget or on Ctrl-C; the run stays inspectable with
    `rlpipe runs show --run RUN`, `rlpipe report --run RUN` and `rlpipe adapters list --run RUN`.
    """

    kinds = run_kinds(preset or [], config or [])
    if resume is not None:
        if preset or config or name:
            fail("--resume uses the run's stored configuration: drop --preset/--config/--run "
                 "(change a field with --set)", EXIT_USAGE)
        if runs > 1:
            fail("--runs starts new runs: drop --resume, or resume packed runs with rlpipe runs resume --run A "
                 "(once per run), then start rlpipe learner start --run A --run B ... and rlpipe producer start "
                 "--run A --run B ...", EXIT_USAGE)
        cfg = resumed_config(resume, overrides or [])
    else:
        cfg = run_config(*kinds[0], overrides)
    cfg = with_budget(cfg, max_steps, producers)
    check_actors_environment(cfg)
    if runs > 1 or len(kinds) > 1:
        configs = packed_configs(kinds, overrides or [], name, runs, max_steps, producers)
        ids = [c.run_id for c in configs]
        console.print(f"starting runs {', '.join(ids)}, packed in one learner and "
                      f"{configs[0].num_producers} producer process(es)", markup=False)
        setup_logging()
        from pipeline.devstack.launcher import Launcher

        launcher = Launcher(configs, dashboard=dashboard)
        code = launcher.run()
        console.print(f"{_below(launcher.live)}their packed report: rlpipe report {' '.join(f'--run {i}' for i in ids)}",
                      markup=False)
        raise typer.Exit(code)
    store = reachable_store(cfg.store)
    if resume is not None:
        stop_if_finished(store, cfg)
    else:
        explicit = name or explicit_run_id(kinds[0][1], overrides or [])
        cfg = cfg.model_copy(update={"run_id": new_run_id(store, cfg.run_id, explicit)})
    console.print(f"{'resuming' if resume else 'starting'} run {cfg.run_id}", markup=False)
    if resume is None and not preset and not config:
        typer.echo("note: no --preset or --config: the built-in defaults (rlpipe config show), not the demo preset; "
                   "rlpipe config presets lists the presets")
    setup_logging()
    if step_budget(cfg) is None:
        typer.echo(f"note: {'value.' if cfg.value is not None else ''}learner.max_steps is not set: the run goes on "
                   "until Ctrl-C")
    if cfg.num_producers == 0:
        typer.echo(f"note: no producers (--producers 0): the learner waits for batches of producers started "
                   f"elsewhere, e.g. rlpipe producer start --run {cfg.run_id} --preset NAME")
    from pipeline.devstack.launcher import Launcher

    launcher = Launcher(cfg, dashboard=dashboard)
    code = launcher.run()
    console.print(f"{_below(launcher.live)}run {cfg.run_id}: rlpipe runs show --run {cfg.run_id}; "
                  f"rlpipe eval --run {cfg.run_id}; rlpipe report --run {cfg.run_id}; continue it with "
                  f"rlpipe run --resume {cfg.run_id} --max-steps N", markup=False, soft_wrap=True)
    raise typer.Exit(code)


def check_actors_environment(config: RunConfig) -> None:
    """A value run's environment against its network, as its actors check it once started: refused here in one
    line rather than as a producer's exit and a log to read (offline CQL plays no environment while it trains)."""
    if config.value is None or config.value.offline is not None:
        return
    from producers.envs.registry import env_from_spec
    from producers.value_actor import check_value_environment

    check_value_environment(env_from_spec(config.env), config.value)


def _below(live: bool) -> str:
    """What starts a closing line: a line break after the live dashboard, whose last frame ends without one."""
    return "\n" if live else ""


def with_budget(config: RunConfig, max_steps: int | None, producers: int | None) -> RunConfig:
    """``config`` with ``--max-steps`` (a value run's budget is its value learner's) and ``--producers``."""
    if max_steps is not None and config.value is not None:
        config.value.learner.max_steps = max_steps
    elif max_steps is not None:
        config = config.model_copy(update={"learner": config.learner.model_copy(update={"max_steps": max_steps})})
    if producers is not None:
        config = config.model_copy(update={"num_producers": producers})
    return config


def run_kinds(presets: list[str], configs: list[str]) -> list[tuple[str | None, str | None]]:
    """The (preset, config file) of each kind of run asked for: one per repeated ``--preset`` or ``--config``
    (a single one of the other goes with each), else the one pair given."""
    if len(presets) > 1 and len(configs) > 1:
        raise ConfigError("several --preset and several --config: repeat one of them, not both (a single "
                          "--config then applies to every preset, a single --preset under every file)")
    if len(presets) > 1:
        return [(p, configs[0] if configs else None) for p in presets]
    if len(configs) > 1:
        return [(presets[0] if presets else None, c) for c in configs]
    return [(presets[0] if presets else None, configs[0] if configs else None)]


def packed_configs(kinds: list[tuple[str | None, str | None]], overrides: list[str],
                   name: str | None, count: int, max_steps: int | None, producers: int | None) -> list[RunConfig]:
    """``count`` new runs of each kind, run ``i`` of a kind with recipe seed ``i - 1``, named by ``packed_run_ids``;
    refused in one line when they cannot be packed (a value run, a run named twice, engines they cannot share, a
    run whose adapters the first run's sampler settings cannot load)."""
    by_preset = len({preset for preset, _ in kinds}) > 1
    stems = [run_stem(preset, config_file, overrides, name,
                      kind_label(preset, config_file, by_preset) if len(kinds) > 1 else None, by_preset)
             for preset, config_file in kinds]
    named = [stem for stem, _ in stems]
    if len(set(named)) != len(named):
        twice = sorted({stem for stem in named if named.count(stem) > 1})
        raise ConfigError(f"{', '.join(twice)} named twice: give each preset or file once (--runs N starts "
                          "several runs of one)")

    firsts = [run_config(*kind, overrides) for kind in kinds]
    if any(c.value is not None for c in firsts):
        raise ConfigError("value-based runs are not packed: start one rlpipe run per value run")
    ids = packed_run_ids([reachable_store(c.store) for c in firsts], stems, count)
    configs = [with_budget(run_config(*kinds[k], [*seed_overrides(i), *overrides]), max_steps, producers)
               .model_copy(update={"run_id": ids[k][i]}) for k in range(len(kinds)) for i in range(len(ids[k]))]
    try:
        check_packable(configs, PACKED_SHARED, "one base model, device, sampling engine and event log")
        check_one_tiny_build(configs)
        for config in configs[1:]:  # the producers' one engine takes the first run's sampler settings
            check_sampler_holds_rank(configs[0].sampler, config.learner.lora_rank, config.run_id,
                                     f"the shared engine's (run {configs[0].run_id}'s)")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    widest = max(c.num_producers for c in configs)
    return [c.model_copy(update={"num_producers": widest}) for c in configs]


def check_one_tiny_build(configs: list[RunConfig]) -> None:
    """Refuse, in one line, packed runs on two builds of the tiny model (model.base_model 'tiny' in each, so equal
    by name), as the packed producer and learner would each refuse them once started
    (``pipeline.models.check_same_tiny_build``).

    Each side has its own folder for a run naming no model.tiny_dir: the producers the default build's, which the
    launcher builds and records for the first run when it names none; the learner the folder recorded on this
    machine, which stays as it is when the first run names a folder of its own.
    """
    from producers.tiny_model import default_tiny_dir

    built = str(default_tiny_dir())
    recorded = recorded_tiny_dir() if configs[0].model.tiny_dir else built
    for default_dir in dict.fromkeys((built, recorded)):
        for config in configs[1:]:
            check_same_tiny_build(configs[0], config, default_dir,
                                  "packed runs share one base model: start one rlpipe run per tiny model build")


def run_stem(preset: str | None, config_file: str | None, overrides: list[str], name: str | None,
             label: str | None, by_preset: bool = False) -> tuple[str, bool]:
    """The stem of one kind's run ids and whether the user named it (else the time is added).

    One kind (``label`` None): ``--run``, else the run id of ``--set``, the environment or the file; else the
    configuration's run id.  Several: ``label`` (``kind_label``) under ``--run NAME`` (or a ``run_id`` of
    ``--set`` or the environment) as ``NAME-<label>``; else, when the files differ (not ``by_preset``), a file's
    own ``run_id`` as it is; else the label.
    """
    if label is None:
        explicit = name or explicit_run_id(config_file, overrides)
        return (explicit, True) if explicit else (run_config(preset, config_file, overrides).run_id, False)
    explicit = name or explicit_run_id(None, overrides)
    if explicit:
        return f"{explicit}-{label}", True
    own = None if by_preset else own_run_id(config_file)
    return (own, True) if own else (label, False)


def kind_label(preset: str | None, config_file: str | None, by_preset: bool) -> str:
    """What tells one kind of run from the others: its preset's name when ``--preset`` repeats, else its file's
    own ``run_id`` or the file's name."""
    if by_preset and preset is not None:
        return preset
    return own_run_id(config_file) or Path(str(config_file)).stem


def own_run_id(config_file: str | None) -> str | None:
    """The ``run_id`` written in a config file (not the environment's or a preset's)."""
    value = (load_file(config_file) if config_file else {}).get("run_id")
    return str(value) if value else None


def packed_run_ids(stores: list[ObjectStore], stems: list[tuple[str, bool]], count: int) -> list[list[str]]:
    """Each stem's run ids: the stem for one run, ``<stem>-1`` ... ``<stem>-<count>`` for several.

    A stem the user named is taken as it is and none of its runs may exist in its store (``stores``, one per
    stem), nor differ only in case from a stored run; any other gets the UTC time (one for all), and ``-2``,
    ``-3`` when its runs are taken.
    """
    from pipeline.analysis.runs import run_exists
    from pipeline.runtime import refuse_new_run_case_twin

    stamp = datetime.now(UTC).strftime(_STAMP)

    def runs_of(stem: str) -> list[str]:
        return [validate_name(stem, "run_id")] if count == 1 else \
            [validate_name(f"{stem}-{i}", "run_id") for i in range(1, count + 1)]

    ids = []
    for store, (stem, named) in zip(stores, stems, strict=True):
        if named:
            for run_id in runs_of(stem):  # on a case-insensitive filesystem a twin's folder would be taken as it
                refuse_new_run_case_twin(store, run_id)
            ids.append(runs_of(stem))
            continue
        fresh = f"{stem[: MAX_NAME - len(stamp) - 8].rstrip('-._')}-{stamp}"
        candidate, attempt = fresh, 1
        while any(run_exists(store, run_id) for run_id in runs_of(candidate)):
            attempt += 1
            candidate = f"{fresh}-{attempt}"
        ids.append(runs_of(candidate))
    taken: dict[str, list[str]] = {}
    for store, group in zip(stores, ids, strict=True):
        taken.setdefault(store.root, []).extend(run_id for run_id in group if run_exists(store, run_id))
    if any(taken.values()):
        where = "; ".join(f"{', '.join(runs)} already exist in {root}" for root, runs in taken.items() if runs)
        raise ConfigError(f"runs {where}; name the packed runs with --run NAME (they become NAME-1 ... NAME-N), "
                          "or drop --run for a fresh name")
    return ids


def explicit_run_id(config_file: str | None, overrides: list[str]) -> str | None:
    """The run id set by --set, RLPIPE_RUN_ID or a config file (a preset's is only a base name)."""
    for layer in (parse_overrides(overrides), env_layer()):
        if layer.get("run_id"):
            return str(layer["run_id"])
    return own_run_id(config_file)


def new_run_id(store: ObjectStore, base: str, explicit: str | None) -> str:
    """``explicit`` if that run does not exist yet, else ``<base>-<UTC time>`` (``-2``, ``-3`` if taken)."""
    from pipeline.analysis.runs import run_exists
    from pipeline.runtime import refuse_new_run_case_twin

    if explicit is not None:
        validate_name(explicit, "run_id")
        refuse_new_run_case_twin(store, explicit)  # on a case-insensitive filesystem the twin's folder is its own
        if run_exists(store, explicit):
            raise ConfigError(f"run {explicit!r} already exists in {store.root}; continue it with `rlpipe run --resume "
                              f"{explicit}`, or name a new one (or drop --run/run_id for a fresh name)")
        return explicit
    return packed_run_ids([store], [(base, False)], 1)[0][0]


def resumed_config(run_id: str, overrides: list[str]) -> RunConfig:
    """The run's stored configuration (``run.json`` with its newest recorded change) with the ``RLPIPE_``
    environment and ``--set`` on top."""
    from pipeline.analysis.runs import NoRunConfigError, required_run_config
    from pipeline.runtime import check_run_definition, config_differences, refuse_case_twin

    validate_name(run_id, "run_id")
    located = run_config(None, None, overrides)  # only where the store is: environment, --set, else embedded
    store = reachable_store(located.store)
    refuse_case_twin(store, run_id, "--resume ")
    try:
        stored = required_run_config(store, run_id)
    except NoRunConfigError as exc:
        raise ConfigError(f"{exc}, so there is nothing to resume; start a new run with rlpipe run --preset NAME") \
            from None
    stored["bus"]["sasl_password"] = None  # stored as ***; the real one comes from the environment
    changes = [env_layer(), parse_overrides(overrides)]
    merged = deep_merge(deep_merge(stored, changes[0]), changes[1])
    try:
        config = RunConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc)) from None
    check_value_run_settings(config, changes)
    # refused now, as the launcher's create_run would refuse it once the stack and the model had started
    check_run_definition(run_id, config_differences(stored, json.loads(config_to_json(config))))
    return check_env(config)


def stop_if_finished(store: ObjectStore, config: RunConfig) -> None:
    """Exit 0 with one line when the run's learner already reached ``max_steps``: nothing would train."""
    from pipeline.analysis.runs import learner_step

    limit = step_budget(config)
    step = learner_step(store, config.run_id)
    if limit is not None and step >= limit:
        console.print(
            f"run {config.run_id} already reached its max_steps ({limit}): continue it with "
            f"`rlpipe run --resume {config.run_id} --max-steps {step + limit}`, or start a fresh run with "
            f"`{fresh_run_command(config)}`", markup=False, soft_wrap=True,
        )
        raise typer.Exit(0)


def fresh_run_command(config: RunConfig) -> str:
    """``rlpipe run`` that starts a new run configured as ``config``: the preset it was most likely made from and a
    ``--set`` for every field that differs from what that preset resolves to here, name and placement left out (the
    new run gets its own name; bus and store come from where it is started).

    A run does not record its preset, so the one chosen is the shipped preset (or none: the built-in defaults)
    whose resolved configuration differs from ``config`` in the fewest fields: a value run made from
    ``dqn-cartpole`` gets that preset, not ``cartpole``, which its environment is named after.  A tie goes to the
    preset named after the environment, then to the first by name."""
    from pipeline.config import preset_names
    from pipeline.runtime import config_differences

    wanted = json.loads(config_to_json(config))
    named = [config.env.name] if config.env.name in preset_names() else []
    candidates: list[str | None] = [*named, *(p for p in preset_names() if p not in named), None]
    changes_by_preset = {preset: [c for c in config_differences(base, wanted) if c.field != "run_id"]
                         for preset in candidates if (base := _resolved_preset(preset)) is not None}
    preset = min(changes_by_preset, key=lambda name: len(changes_by_preset[name]))  # the first of the fewest
    words = ["rlpipe", "run", *(["--preset", preset] if preset else [])]
    for change in changes_by_preset[preset]:
        words += ["--set", f"{change.field}={_set_value(change.after)}"]
    return shlex.join(words)


def _resolved_preset(preset: str | None) -> dict[str, Any] | None:
    """What ``preset`` (None: the built-in defaults) resolves to here, as stored; None for a preset this
    environment's ``RLPIPE_`` settings do not fit (the defaults that do not are a ``ConfigError``)."""
    from pipeline.config import resolve_config

    try:
        return json.loads(config_to_json(resolve_config(preset)))
    except ConfigError:
        if preset is None:
            raise
        return None


def _set_value(value: object) -> str:
    """``value`` as ``--set`` reads it back (YAML): text as it is unless YAML would read it as something else."""
    try:
        if isinstance(value, str) and load_yaml(value) == value:
            return value
    except yaml.YAMLError:
        pass
    return json.dumps(value)


command = typer.main.get_command(app)
