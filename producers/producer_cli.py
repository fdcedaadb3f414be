"""``rlpipe producer start``: run a rollout producer."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.cli.common import handle_user_errors
from pipeline.cli.options import ConfigOpt, PresetOpt, RunOpt, SetOpt, run_config, setup_logging
from pipeline.runtime import StopFlag

app = typer.Typer(name="producer", help="Rollout producers: sample the policy against an environment.",
                  no_args_is_help=True)


@app.command(epilog="Example: rlpipe producer start --preset cartpole --set producer.max_groups=8")
@handle_user_errors
def start(
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    run: RunOpt = None,
    max_groups: Annotated[int | None, typer.Option(min=1, help="Stop after this many groups.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Sample groups of episodes with the newest adapter and write them as Parquet batches + events.

    SIGTERM or Ctrl-C finishes cleanly: complete groups are flushed, unfinished ones dropped.
    """
    setup_logging(verbose)
    cfg = run_config(preset, config, overrides, run)
    if max_groups is not None:
        cfg = cfg.model_copy(update={"producer": cfg.producer.model_copy(update={"max_groups": max_groups})})
    if cfg.value is not None:  # a value-based run: a numeric actor plays with the published Q-network
        from producers.value_actor import run_value_actor

        run_value_actor(cfg, StopFlag().install())
        return
    from producers.service import run_producer

    run_producer(cfg, StopFlag().install())


if __name__ == "__main__":  # vLLM spawns processes: keep the entry point guarded
    app()
