"""``rlpipe producer start``: run a rollout producer."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.cli.common import (
    err_console,
    fail,
    handle_user_errors,
    reachable_store,
    serve_until_run_stopped,
    store_failures,
)
from pipeline.cli.options import (
    FollowRunsOpt,
    PackedConfigOpt,
    PackedRunOpt,
    PresetOpt,
    SetOpt,
    run_configs,
    setup_logging,
)
from pipeline.runtime import StopFlag, new_run_note, refuse_case_twin
from schemas.config import RunConfig

app = typer.Typer(name="producer", help="Rollout producers: sample the policy against an environment.",
                  no_args_is_help=True)


@app.command(epilog="Example: rlpipe producer start --preset cartpole --set producer.max_groups=8")
@handle_user_errors
def start(
    preset: PresetOpt = None,
    config: PackedConfigOpt = None,
    overrides: SetOpt = None,
    run: PackedRunOpt = None,
    max_groups: Annotated[int | None, typer.Option(min=1, help="Stop after this many groups.")] = None,
    follow_runs: FollowRunsOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Sample groups of episodes with the newest adapter and write them as Parquet batches + events.

    Several runs (--run A --run B, or one --config per run) are served packed by one process and one
    sampling engine, each run writing its own batches and events.  With --follow-runs PATTERN, runs created
    (rlpipe runs create) join and stopped ones leave; with no --run or --config as well, the process
    starts with no run, its engine set up from the configuration.  A packed run stopped (rlpipe runs stop)
    is not served, even named, until rlpipe runs resume.
    SIGTERM or Ctrl-C finishes cleanly: complete groups are flushed, unfinished ones dropped.  A producer
    of one run stops so on the run's stop too (rlpipe runs stop after it started).
    """
    setup_logging(verbose)
    cfgs = run_configs(preset, config, overrides, run)
    roots = []
    for cfg in cfgs:
        store = reachable_store(cfg.store)
        roots.append(store.root)
        if run or config or follow_runs is None:  # else the configuration is only the engine's template
            refuse_case_twin(store, cfg.run_id)  # its batches would go into the other run's folder
            if note := new_run_note(store, cfg.run_id):
                err_console.print(note, markup=False)
    if max_groups is not None:
        cfgs = [cfg.model_copy(update={"producer": cfg.producer.model_copy(update={"max_groups": max_groups})})
                for cfg in cfgs]
    with store_failures(roots, "start the producer again (`rlpipe producer start`): the batches it stored are kept "
                        "and announced, the groups it had not stored are dropped"):
        _start(cfgs, follow_runs, named=bool(run or config))


def _start(cfgs: list[RunConfig], follow_runs: str | None, named: bool) -> None:
    """The producer process ``start`` asked for: one run, a value run's actor, or packed runs (``named``: runs
    were named, else the process waits for runs to join)."""
    if len(cfgs) > 1 or follow_runs is not None:
        if any(cfg.value is not None for cfg in cfgs):
            fail("value-based runs are not packed: start one producer per value run")
        from pipeline.membership import RunsFailedError
        from producers.packed import run_packed_producer

        try:
            run_packed_producer(cfgs if named or follow_runs is None else [], StopFlag().install(),
                                follow_runs=follow_runs, template=cfgs[0])
        except RunsFailedError as exc:  # stopped while a run waited to come back from an error: one line, exit 1
            fail(str(exc))
        return
    cfg = cfgs[0]
    if cfg.value is not None:  # a value-based run: a numeric actor plays with the published Q-network
        from producers.value_actor import run_value_actor

        serve_until_run_stopped(cfg, run_value_actor)
        return
    from producers.service import run_producer

    serve_until_run_stopped(cfg, run_producer)


if __name__ == "__main__":  # vLLM spawns processes: keep the entry point guarded
    app()
