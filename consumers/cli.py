"""``rlpipe learner start`` and ``rlpipe replay``: train from the event log or from the store."""

from __future__ import annotations

import shlex
from datetime import date
from typing import Annotated

import typer

from pipeline.cli.common import (
    console,
    err_console,
    fail,
    handle_user_errors,
    reachable_store,
    serve_until_run_stopped,
    store_failures,
)
from pipeline.cli.options import (
    ConfigOpt,
    FollowRunsOpt,
    PackedConfigOpt,
    PackedRunOpt,
    PresetOpt,
    SetOpt,
    run_config,
    run_configs,
    setup_logging,
)
from pipeline.runtime import StopFlag, new_run_note, refuse_case_twin, refuse_new_run_case_twin
from schemas.config import RunConfig

app = typer.Typer(name="learner", help="The off-policy learner: LoRA training from trajectories.", no_args_is_help=True)
replay_app = typer.Typer(name="replay", add_completion=False)


@app.command(epilog="Example: rlpipe learner start --preset cartpole --set learner.max_steps=20\n\n"
             "Packed: rlpipe learner start -c cartpole.yaml -c gsm8k.yaml (or --preset cartpole --run a --run b)")
@handle_user_errors
def start(
    preset: PresetOpt = None,
    config: PackedConfigOpt = None,
    overrides: SetOpt = None,
    run: PackedRunOpt = None,
    max_steps: Annotated[int | None, typer.Option(min=1, help="Stop after this many optimizer steps.")] = None,
    follow_runs: FollowRunsOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Consume the run's trajectory batches, train LoRA, publish versions, checkpoint; resumes where it stopped.

    Several runs (--run A --run B, or one --config per run) train packed in one process: one base model,
    one LoRA adapter per run, each run with its own offsets, checkpoints and versions.  With
    --follow-runs PATTERN, runs created (rlpipe runs create) join and stopped ones leave; with no
    --run or --config as well, the process starts with no run, its engine set up from the configuration.
    A packed run stopped (rlpipe runs stop) is not trained, even named, until rlpipe runs resume.
    SIGTERM or Ctrl-C trains what is waiting, writes a checkpoint, commits offsets and exits 0 (1 when a
    packed run was at that moment stopped on an error, waiting to come back).  A learner of one run stops
    so on the run's stop too (rlpipe runs stop after it started; not under torchrun).
    """
    setup_logging(verbose)
    cfgs = run_configs(preset, config, overrides, run)
    roots = []
    for cfg in cfgs:
        store = reachable_store(cfg.store)
        roots.append(store.root)
        if run or config or follow_runs is None:  # else the configuration is only the engine's template
            refuse_case_twin(store, cfg.run_id)
            if note := new_run_note(store, cfg.run_id):
                err_console.print(note, markup=False)
    if max_steps is not None:
        cfgs = [cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"max_steps": max_steps})})
                for cfg in cfgs]
    with store_failures(roots, "`rlpipe learner start` resumes from the run's newest checkpoint (what it trained "
                        "since is trained again from the same batches)"):
        _start(cfgs, max_steps, follow_runs, named=bool(run or config))


def _start(cfgs: list[RunConfig], max_steps: int | None, follow_runs: str | None, named: bool) -> None:
    """The learner process ``start`` asked for: one run, a run on a torchrun group, a value run or packed runs."""
    from consumers.lease import LeaseLostError
    from consumers.service import run_learner
    from pipeline.membership import RunsFailedError

    if any(cfg.value is not None for cfg in cfgs) and (len(cfgs) > 1 or follow_runs is not None):
        fail("value-based runs are not packed: start one learner per value run")
    cfg = cfgs[0]
    if cfg.value is not None:  # a value-based run (e.g. --preset dqn-cartpole): DQN/C51, not LoRA
        from consumers.value.service import run_value_learner

        if max_steps is not None:
            cfg.value.learner.max_steps = max_steps
        try:
            serve_until_run_stopped(cfg, run_value_learner)
        except LeaseLostError as exc:
            fail(str(exc))
        return
    try:
        from consumers.distributed_learner import launched_by_torchrun, run_on_group

        if launched_by_torchrun():  # rank 0 runs the learner, the other ranks follow its steps
            if len(cfgs) > 1 or follow_runs is not None:
                fail("packed runs do not run under torchrun: start one torchrun learner per run")
            stop = StopFlag().install()
            run_on_group(cfg, lambda policy: run_learner(cfg, stop, policy=policy))
        elif len(cfgs) == 1 and follow_runs is None:
            serve_until_run_stopped(cfgs[0], run_learner)
        else:
            from consumers.packed_service import run_packed_learner

            run_packed_learner(cfgs if named or follow_runs is None else [], StopFlag().install(),
                               follow_runs=follow_runs, template=cfgs[0])
    except (LeaseLostError, RunsFailedError) as exc:  # another learner took over, a packed run failing: one line
        fail(str(exc))


@replay_app.command(epilog="Example: rlpipe replay --run demo --train --preset cartpole --set run_id=demo-offline")
@handle_user_errors
def replay(
    run: Annotated[str, typer.Option("--run", help="The run whose batches are replayed (offline CQL: the dataset).")],
    train: Annotated[bool, typer.Option("--train", help="Train the configured run from the batches.")] = False,
    to_topic: Annotated[bool, typer.Option("--to-topic", help="Re-announce the batches on the event log.")] = False,
    date_from: Annotated[str | None, typer.Option(help="First date (YYYY-MM-DD) to include.")] = None,
    date_to: Annotated[str | None, typer.Option(help="Last date (YYYY-MM-DD) to include.")] = None,
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
) -> None:
    """Replay Parquet trajectories of --run: into training (--train, no broker) or onto the topic (--to-topic).

    With --to-topic the batches are announced for the configured run_id (seed a new run from an old one);
    the learner trains each batch_id once, so re-announcing is harmless.  A damaged batch (rewritten, or its
    commit record missing or corrupt) refuses the replay in one line before anything is trained or announced.
    """
    if train == to_topic:
        fail("choose exactly one of --train or --to-topic", 2)
    for option, value in (("--date-from", date_from), ("--date-to", date_to)):
        try:  # compared with the store's date= folders as text, so only this spelling ranges right
            if value is not None and (len(value) != 10 or date.fromisoformat(value).isoformat() != value):
                raise ValueError(value)
        except ValueError:
            fail(f"{option} {value!r} is not a date; write it YYYY-MM-DD", 2)
    if date_from is not None and date_to is not None and date_from > date_to:  # nothing lies between: say why
        fail(f"--date-from {date_from} is after --date-to {date_to}; swap them", 2)
    setup_logging()
    cfg = run_config(preset, config, overrides)
    store = reachable_store(cfg.store)
    if cfg.value is None or cfg.value.offline is None:  # offline CQL's --run names a dataset, not a run
        refuse_case_twin(store, run)
    refuse_new_run_case_twin(store, cfg.run_id)  # the run it trains or announces the batches for
    if train and cfg.run_id == run:  # its adapters, checkpoints and step log would mix with the run it replays
        fail(f"replay --train would train into run {run}, the run it reads from; name the run it trains, "
             f"e.g. --set run_id={run}-offline", 2)
    if train:
        _refuse_a_sampling_run(cfg, run)
    if train and cfg.value is not None:  # a value run: the value learner over the stored steps batches
        _replay_train_value(cfg, run, date_from, date_to)
        return
    _require_batches(cfg, run, date_from, date_to, steps=False)
    before = _step_now(cfg)
    if train:
        from consumers.distributed_learner import launched_by_torchrun, run_on_group
        from consumers.service import replay_train

        if launched_by_torchrun():  # rank 0 replays, the other ranks follow its steps
            learner = run_on_group(cfg, lambda policy: replay_train(cfg, run, date_from, date_to, policy=policy))
            if learner is None:
                return
        else:
            learner = replay_train(cfg, run, date_from, date_to)
        console.print(_trained(cfg, before, learner.state.step, f"adapter version {learner.state.version}"))
        return
    from consumers.replay import announce_batches

    _require_intact_batches(cfg, run, date_from, date_to)
    count = announce_batches(cfg, run, date_from, date_to)
    console.print(f"announced {count} batches of run {run} for run {cfg.run_id}; train them with "
                  f"{_learner_command(preset, config, overrides or [], cfg.run_id)} (run {cfg.run_id} is created "
                  "when its learner starts)", markup=False, soft_wrap=True)


def _learner_command(preset: str | None, config: str | None, overrides: list[str], run_id: str) -> str:
    """``rlpipe learner start`` for the run a replay announced batches for, configured as the replay was (its
    ``--set`` of ``run_id`` becomes ``--run``)."""
    words = ["rlpipe", "learner", "start", *(["--preset", preset] if preset else []),
             *(["--config", config] if config else []), "--run", run_id]
    for change in overrides:
        if change.partition("=")[0].strip() != "run_id":
            words += ["--set", change]
    return shlex.join(words)


def _step_now(cfg) -> int:  # type: ignore[no-untyped-def]
    """The step the trained run has reached (its newest checkpoint; 0 for a new run)."""
    from pipeline.analysis.runs import learner_step
    from pipeline.runtime import open_store

    return learner_step(open_store(cfg.store), cfg.run_id)


def _trained(cfg, before: int, after: int, version: str) -> str:  # type: ignore[no-untyped-def]
    """What a replay did: the steps it trained now, from which step to which (none when the run had them)."""
    if after <= before:
        return (f"run {cfg.run_id} was already at step {before}: nothing left to train (its max_steps reached, or "
                f"every batch trained); {version}")
    return f"trained {after - before} steps (run {cfg.run_id}, step {before} to {after}); {version}"


def _require_batches(cfg, run: str, date_from: str | None, date_to: str | None, steps: bool) -> None:  # type: ignore[no-untyped-def]
    """Exit 2 in one line, before anything is written, when ``run`` has no batches to replay in the date range."""
    from consumers.sources import in_date_range
    from pipeline.analysis.runs import list_runs, runs_there
    from pipeline.io.archive import TrajectoryArchive
    from pipeline.io.archive_layout import unfinished_conversions
    from pipeline.runtime import open_store
    from schemas.names import validate_name

    store = open_store(cfg.store)
    archive = TrajectoryArchive(store)
    validate_name(run, "run_id")
    keys = archive.list_steps(run) if steps else archive.list_batches(run)
    if any(in_date_range(key, date_from, date_to) for key in keys):
        if unfinished := unfinished_conversions(store, run):
            fail(f"run {run!r} holds a conversion of dataset {', '.join(unfinished)} that did not finish; delete the "
                 f"run with `rlpipe runs delete --run {run} --yes` (its other datasets too) and convert again "
                 "(rlpipe datasets to-trajectories)", 2)
        return
    what = "steps batches (a value run's)" if steps else "trajectory batches"
    if run not in list_runs(store):
        fail(f"nothing to replay: no run {run!r} in {store.root} ({runs_there(store)}); "
             "check --run, or the store (RLPIPE_STORE__ROOT)", 2)
    span = f" between {date_from or 'the first day'} and {date_to or 'the last'}" if date_from or date_to else ""
    if not span and (archive.list_batches(run) if steps else archive.list_steps(run)):  # the other kind of run
        fix = ("it holds trajectory batches (a language-model run's): replay it with that run's preset" if steps
               else "it holds steps batches (a value run's): replay it with its value preset, e.g. "
                    "--preset dqn-cartpole")
        fail(f"nothing to replay: run {run!r} has no {what}; {fix}", 2)
    fail(f"nothing to replay: run {run!r} has no {what}{span} in {store.root}; "
         "replay a run that has sampled some" + (", or widen --date-from/--date-to" if span else ""), 2)


def _refuse_a_sampling_run(cfg, source: str) -> None:  # type: ignore[no-untyped-def]
    """Exit 2 in one line when the run ``replay --train`` would train holds batches of its own: an online run, whose
    versions and steps the replay would mix with data from elsewhere (most of it too stale to train)."""
    from pipeline.io.archive import TrajectoryArchive
    from pipeline.runtime import open_store

    archive = TrajectoryArchive(open_store(cfg.store))
    if archive.list_batches(cfg.run_id) or archive.list_steps(cfg.run_id):
        fail(f"run {cfg.run_id} holds batches of its own (its producers'); replay --train trains a run of its own: "
             f"name a new one, e.g. --set run_id={source}-offline", 2)


def _require_intact_batches(cfg, run: str, date_from: str | None, date_to: str | None) -> None:  # type: ignore[no-untyped-def]
    """Exit 2 in one line, before anything is announced, when a batch of ``run`` in the date range is damaged
    (``replay_train`` checks the same before it trains)."""
    from consumers.sources import in_date_range
    from pipeline.io.archive import TrajectoryArchive
    from pipeline.runtime import open_store

    archive = TrajectoryArchive(open_store(cfg.store))
    archive.check_digests(run, [c for c in archive.commits(run) if in_date_range(c.key, date_from, date_to)])


def _replay_train_value(cfg, run: str, date_from: str | None, date_to: str | None) -> None:  # type: ignore[no-untyped-def]
    """Offline DQN/C51 from ``run``'s steps batches, or offline CQL (``value.offline``) from dataset ``run``."""
    before = _step_now(cfg)
    from consumers.value.service import CONTINUOUS_ACTION_ENVS, replay_train_value

    if cfg.value.offline is not None:  # --run names a logged building dataset (rlpipe datasets generate ...)
        from consumers.value.offline_service import replay_train_offline

        if date_from or date_to:
            fail("offline CQL trains on every day of the dataset; drop --date-from/--date-to", 2)
        offline = replay_train_offline(cfg, run)
        console.print(_trained(cfg, before, offline.state.step, f"value-network version {offline.state.version}"))
        return
    if cfg.env.name in CONTINUOUS_ACTION_ENVS:
        fail(f"the value learner needs discrete actions and {cfg.env.name} has none; for offline CQL on logged "
             f"building days use --preset cql-building (--run names the dataset)", 2)
    _require_batches(cfg, run, date_from, date_to, steps=True)

    learner = replay_train_value(cfg, run, date_from, date_to)
    console.print(_trained(cfg, before, learner.state.step, f"value-network version {learner.state.version}"))


replay_command = typer.main.get_command(replay_app)
