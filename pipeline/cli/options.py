"""Options every command that takes a run configuration shares."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.config import check_env, resolve_config
from schemas.config import RunConfig

PresetOpt = Annotated[str | None, typer.Option("--preset", "-p", help="A shipped preset (see `rlpipe config presets`).")]
ConfigOpt = Annotated[str | None, typer.Option("--config", "-c", help="A YAML/JSON run configuration file.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override one field, e.g. --set learner.learning_rate=1e-4 (repeatable)."),
]


def run_config(
    preset: str | None, config: str | None, overrides: list[str] | None, run: str | None = None
) -> RunConfig:
    """The resolved configuration: defaults < preset < file < RLPIPE_ environment < --set (< --run RUN)."""
    return check_env(resolve_config(preset, config, [*(overrides or ()), *([f"run_id={run}"] if run else [])]))


# Several runs packed in one process (``rlpipe learner start`` / ``rlpipe producer start``).
PackedRunOpt = Annotated[list[str] | None, typer.Option(
    "--run", "-r", help="The run id; repeat it to serve several runs packed in this process.")]
PackedConfigOpt = Annotated[list[str] | None, typer.Option(
    "--config", "-c", help="A YAML/JSON run configuration file; repeat it (one per run) to pack several runs.")]
FollowRunsOpt = Annotated[str | None, typer.Option(
    "--follow-runs", metavar="PATTERN",
    help="Also serve runs announced later whose id matches this glob (rlpipe runs create), until each is stopped "
         "(rlpipe runs stop); the process then serves until it is stopped itself.")]


def run_configs(
    preset: str | None, configs: list[str] | None, overrides: list[str] | None, runs: list[str] | None
) -> list[RunConfig]:
    """The runs a packed process serves: one per ``--config`` file or ``--run`` id (paired when both repeat).

    One file for several ids gives each id that configuration; ``--set`` applies to every run.
    """
    configs, runs = configs or [], runs or []
    if len(configs) > 1 and len(runs) > 1 and len(configs) != len(runs):
        raise ValueError(f"{len(configs)} --config files and {len(runs)} --run ids: give one --config per --run, "
                         "or one --config for every run")
    count = max(len(configs), len(runs), 1)
    return [run_config(preset, configs[i] if len(configs) > 1 else next(iter(configs), None), overrides,
                       runs[i] if len(runs) > 1 else next(iter(runs), None)) for i in range(count)]


def setup_logging(verbose: bool = False) -> None:
    """Rich log lines with times for long-running processes."""
    import logging

    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(message)s",
        datefmt="[%X]",
        handlers=[RichHandler(show_path=False, rich_tracebacks=False)],
        force=True,
    )
    for noisy in ("urllib3", "google", "fsspec", "gcsfs", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # kafka-python logs every retry as an error; rlpipe reports the failure itself, in one line.
    # Its records still reach handlers on the "kafka" logger (pipeline.io.bus reads the reason from
    # them); they just do not propagate to the console unless --verbose.
    kafka = logging.getLogger("kafka")
    kafka.setLevel(logging.DEBUG if verbose else logging.WARNING)
    kafka.propagate = verbose


# One way to name a run in every command: ``--run RUN``.  Commands that took the run as a positional
# argument still accept it for one release, with a one-line deprecation note.
RunOpt = Annotated[str | None, typer.Option("--run", "-r", help="The run id, e.g. cartpole-20260101-120000.")]
DeprecatedRunArg = Annotated[
    str | None, typer.Argument(help="Deprecated: name the run with --run RUN.", show_default=False, metavar="[RUN]")
]


def chosen_run(option: str | None, positional: str | None, command: str) -> str:
    """The run named by ``--run`` or (deprecated) by the positional argument of ``rlpipe COMMAND``."""
    from pipeline.cli.common import EXIT_USAGE, err_console, fail

    if positional is not None:
        if option is not None and option != positional:
            fail(f"the run is named twice ({positional!r} and --run {option!r}); keep --run {option}", EXIT_USAGE)
        err_console.print(
            f"note: `rlpipe {command} RUN` is deprecated and goes in the next release; use `rlpipe {command} --run "
            f"{positional}`", style="yellow", markup=False, highlight=False,
        )
        return positional
    if option is None:
        fail(f"name the run: rlpipe {command} --run RUN (`rlpipe runs list` shows them)", EXIT_USAGE)
    return option
