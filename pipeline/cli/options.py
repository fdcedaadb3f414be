"""Options every command that takes a run configuration shares."""

from __future__ import annotations

from typing import Annotated

import typer

from pipeline.config import resolve_config
from schemas.config import RunConfig

PresetOpt = Annotated[str | None, typer.Option("--preset", "-p", help="A shipped preset (see `rlpipe config presets`).")]
ConfigOpt = Annotated[str | None, typer.Option("--config", "-c", help="A YAML/JSON run configuration file.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override one field, e.g. --set learner.learning_rate=1e-4 (repeatable)."),
]


def run_config(preset: str | None, config: str | None, overrides: list[str] | None) -> RunConfig:
    """The resolved configuration: defaults < preset < file < RLPIPE_ environment < --set."""
    return resolve_config(preset, config, overrides or ())


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
    # Its records still reach handlers on the "kafka" logger (pipeline.bus reads the reason from
    # them); they just do not propagate to the console unless --verbose.
    kafka = logging.getLogger("kafka")
    kafka.setLevel(logging.DEBUG if verbose else logging.WARNING)
    kafka.propagate = verbose
