"""What the benchmarks' command lines share: argument types that refuse a bad value, and a scratch folder.

A benchmark may start a broker, build a model or train for minutes before it reads an option a second
time; a count of 0 or a missing model folder must stop it at the command line instead, in argparse's one
line (``error: argument --steps: must be a whole number of at least 1, got '0'``), not as a traceback later.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least {least}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a count of steps, rounds, seeds...)."""
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number of at least 0 (warm-up steps, a first index...)."""
    return _whole_number(text, 0)


def model_folder(text: str) -> str:
    """An argparse type: ``tiny`` (the locally built model) or a folder holding a model's ``config.json``."""
    if text != "tiny" and not (Path(text) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a model folder (no config.json); give one, or 'tiny'")
    return text


def check_run_config(parser: argparse.ArgumentParser, preset: str, overrides: list[str]) -> None:
    """Resolve ``preset`` with the ``--set`` items every run will get, so a bad one (an unknown field, a value
    out of bounds, an unknown preset) is the parser's one-line error before any stack or process starts."""
    from pipeline.config import ConfigError, resolve_config

    try:
        resolve_config(preset, overrides=overrides)
    except ConfigError as exc:
        parser.error(str(exc))


@contextlib.contextmanager
def scratch_folder(root: Path | None, prefix: str) -> Iterator[Path]:
    """``root`` if the user gave one (kept afterwards, to look at or to reuse), else a new temporary
    folder named ``prefix...``, removed on the way out however the benchmark ends."""
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
        yield root
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        yield Path(folder)
