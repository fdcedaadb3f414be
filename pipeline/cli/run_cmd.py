"""``rlpipe run``: a whole local run from a preset or a config file."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.cli.common import handle_user_errors
from pipeline.cli.options import ConfigOpt, PresetOpt, SetOpt, run_config, setup_logging

app = typer.Typer(name="run", add_completion=False)


@app.command(epilog="Example: rlpipe run --preset cartpole --set learner.max_steps=20 --set num_producers=2")
@handle_user_errors
def run(
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    max_steps: Annotated[int | None, typer.Option(min=1, help="Learner steps before the run stops.")] = None,
    producers: Annotated[int | None, typer.Option(min=0, help="Producer processes to start.")] = None,
    dashboard: Annotated[bool, typer.Option("--dashboard/--no-dashboard", help="Live terminal dashboard.")] = True,
) -> None:
    """Start the learner and N producers for one run (and the embedded stack if nothing is configured).

    Stops when the learner reaches its step budget or on Ctrl-C; the run stays inspectable with
    `rlpipe report RUN`, `rlpipe adapters list --run RUN` and `rlpipe topics tail control --run RUN`.
    """
    setup_logging()
    cfg = run_config(preset, config, overrides)
    if max_steps is not None:
        cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"max_steps": max_steps})})
    if producers is not None:
        cfg = cfg.model_copy(update={"num_producers": producers})
    if cfg.learner.max_steps is None:
        typer.echo("note: learner.max_steps is not set: the run goes on until Ctrl-C")
    from pipeline.launcher import Launcher

    raise typer.Exit(Launcher(cfg, dashboard=dashboard).run())


command = typer.main.get_command(app)
