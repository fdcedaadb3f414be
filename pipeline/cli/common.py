"""What every ``rlpipe`` command shares: consoles, one-line errors, JSON output, bus settings.

A user mistake (a bad name, an unreachable broker, a missing file, an invalid
setting) ends the command with one red line on stderr naming the fix and a
non-zero exit code; only a bug in rlpipe shows a traceback.  Wrap a command in
``@handle_user_errors`` (or a block in ``with user_errors():``) to get that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Iterator
from datetime import date, datetime
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar
from uuid import UUID

import typer
from pydantic import BaseModel, ValidationError
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

from pipeline.devstack.broker import BrokerStartError
from pipeline.devstack.gcs_emulator import EmulatorError, probe_endpoint
from pipeline.devstack.s3_server import S3ServerError
from pipeline.devstack.stack import StackError
from pipeline.health import HealthPortError
from pipeline.io.bus import BusError
from pipeline.io.store import ObjectStore
from pipeline.runtime import StopFlag
from schemas.config import BusConfig, RunConfig, StoreConfig

# Options several commands take, spelled and explained the same everywhere.
StoreRootOpt = Annotated[
    str | None,
    typer.Option("--root", envvar="RLPIPE_STORE__ROOT",
                 help="Store root URL (file:///..., gs://bucket/prefix); default: the one `rlpipe up` recorded."),
]
GcsEndpointOpt = Annotated[
    str | None,
    typer.Option("--gcs-endpoint", envvar="RLPIPE_STORE__GCS_ENDPOINT",
                 help="GCS API endpoint for gs:// roots (an emulator); default: Google."),
]
BootstrapOpt = Annotated[
    str | None, typer.Option("--bootstrap", "-b", help="Kafka host:port; default: bus config, else `rlpipe up`.")
]
NamespaceOpt = Annotated[str | None, typer.Option("--namespace", help="Topic namespace; default: bus config (rlpipe).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]

console = Console(highlight=False, soft_wrap=True, emoji=False)  # a ":train:" in a Tinker id is no emoji
err_console = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)

EXIT_FAILURE = 1  # something outside the command failed (broker unreachable, stack would not start)
EXIT_USAGE = 2  # bad input: an unknown name, an invalid value (click uses 2 for usage errors too)
EXIT_NOT_RUNNING = 3  # `rlpipe status`: no stack runs (the LSB code of a service's status command)


class StoreUnreachableError(ConnectionError):
    """The GCS endpoint of the configured store does not answer."""


# Errors that are the user's to fix; anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,  # schemas' InvalidNameError, SchemaVersionError, EventDecodeError, ConfigError, pydantic errors
    BusError,
    StoreUnreachableError,
    StackError,
    BrokerStartError,  # the local broker, emulator or S3 server would not start: the message names the log
    EmulatorError,
    S3ServerError,
    HealthPortError,  # a learner's or producer's health_port is taken
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)

P = ParamSpec("P")
R = TypeVar("R")


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    """Print ``error: <first line of message>`` in red on stderr and exit with ``code``."""
    line = str(message).strip().splitlines()[0] if str(message).strip() else "failed"
    err_console.print(f"error: {line}", style="red", markup=False, highlight=False)
    raise typer.Exit(code)


def check_folder_option(path: Path | None, option: str) -> None:
    """Refuse, before any work, an output-folder ``option`` that names an existing file (exit 2)."""
    if path is not None and path.exists() and not path.is_dir():
        fail(f"{option} {path} is a file, not a folder; name a folder (it is made if missing)", EXIT_USAGE)


def error_line(exc: BaseException) -> str:
    """One line describing ``exc``: a pydantic error's first problem, else the first line of its message."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {first['msg']}" if where else str(first["msg"])
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.strerror}: {exc.filename}"
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def exit_code_for(exc: BaseException) -> int:
    """Bad input exits 2, a failure outside the command exits 1."""
    return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILURE


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn a user's mistake raised inside the block into one red line and an exit code."""
    try:
        yield
    except USER_ERRORS as exc:
        fail(error_line(exc), exit_code_for(exc))


def handle_user_errors(func: Callable[P, R]) -> Callable[P, R]:
    """Decorator form of ``user_errors`` for a command function (keeps its signature for Typer)."""

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with user_errors():
            return func(*args, **kwargs)
        raise AssertionError("unreachable")  # user_errors either returns the result or exits

    return wrapper


@contextlib.contextmanager
def store_failures(roots: list[str], again: str) -> Iterator[None]:
    """A store that fails under a running process (its GCS endpoint gone after gcsfs's retries, its disk full) as
    one line naming it, exit 1; ``again`` says what starting the process again does.  User errors go on to
    ``user_errors``; anything else keeps its traceback, an ``OSError`` not raised by the store's code too (a
    base model the hub does not know is an ``OSError`` from transformers)."""
    from pipeline.io.store import raised_by_store, remote_failures

    try:
        yield
    except USER_ERRORS:
        raise
    except (OSError, *remote_failures()) as exc:  # the second part is looked at only once something failed
        if not raised_by_store(exc):
            raise
        fail(f"the store {', '.join(sorted(set(roots)))} failed: {error_line(exc)}; once it answers, {again}")


def to_jsonable(obj: Any) -> Any:
    """Models, dataclasses, datetimes, paths, bytes and containers -> plain JSON values."""
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(to_jsonable(k)) if not isinstance(k, str) else k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, datetime | date):
        return obj.isoformat()
    if isinstance(obj, bytes):
        return obj.decode("utf-8", errors="replace")
    if isinstance(obj, Path | UUID):
        return str(obj)
    if isinstance(obj, Enum):
        return obj.value
    return obj


def print_json(obj: Any, indent: int | None = 2) -> None:
    """Print ``obj`` as JSON on stdout (plain text, safe to pipe into ``jq``)."""
    typer.echo(json.dumps(to_jsonable(obj), indent=indent))


def bus_config_from_cli(bootstrap: str | None = None, namespace: str | None = None) -> BusConfig:
    """``BusConfig`` from ``RLPIPE_BUS__*`` variables, with ``--bootstrap`` and ``--namespace`` on top."""
    from pipeline.config import env_layer

    values: dict[str, Any] = dict(env_layer().get("bus", {}))
    if bootstrap:
        values["bootstrap_servers"] = bootstrap
    if namespace:
        values["namespace"] = namespace
    return BusConfig.model_validate(values)


def reachable_store(config: StoreConfig, quiet: bool = False) -> ObjectStore:
    """The store ``config`` names (default: the embedded stack's), once its GCS endpoint answers.

    gcsfs would fail the first read with a connection traceback, or retry for half a minute; this says in
    seconds which endpoint does not answer (``StoreUnreachableError``, one line and exit 1 in a command).
    ``quiet``: silence gcsfs's own logging for the rest of the process (a short listing command; a
    long-running process keeps its warnings).
    """
    from pipeline.runtime import open_store

    if quiet:
        logging.getLogger("gcsfs").setLevel(logging.CRITICAL)  # it logs whole tracebacks while retrying
    store = open_store(config)
    if store.gcs_endpoint:
        reason = probe_endpoint(store.gcs_endpoint)
        if reason is not None:
            raise StoreUnreachableError(
                f"cannot reach the GCS endpoint {store.gcs_endpoint} of the store {store.root}: {reason}; is the "
                "emulator running? (store.gcs_endpoint, RLPIPE_STORE__GCS_ENDPOINT)")
    return store


def shown_model(base_model: str | None) -> str:
    """A base model for a table: a model folder by its name (the whole path is in --json), a hub id as it is."""
    if not base_model:
        return "-"
    return Path(base_model).name if base_model.startswith(("/", "~", ".")) else base_model


def fitted_table(title: str, rows: list[dict[str, Any]], droppable: list[str],
                 right: tuple[str, ...] = (), whole: tuple[str, ...] = ()) -> tuple[Table, list[str]]:
    """A table of ``rows`` (column -> cell: text or rich ``Text``) with every cell whole, leaving out the ``droppable``
    columns in that order while it is wider than the terminal; (the table, the columns left out).  What still does
    not fit wraps or folds over lines, never cut short, except in the ``whole`` columns (ids that are copied), which
    keep each cell on one line.  ``right``: the right-justified columns."""
    columns, left_out = list(rows[0]), []
    widths = {column: max(cell_width(row[column]) for row in rows) for column in whole}

    def build() -> Table:
        table = Table(title=title)
        for column in columns:
            table.add_column(column, overflow="fold", justify="right" if column in right else "left",
                             no_wrap=column in whole, min_width=widths.get(column))
        for row in rows:
            table.add_row(*(row[column] for column in columns))
        return table

    table = build()
    for column in droppable:
        if console.measure(table, options=console.options.update_width(10**6)).maximum <= console.width:
            break
        columns.remove(column)
        left_out.append(column)
        table = build()
    return table, left_out


def cell_width(cell: Any) -> int:
    """The columns a table cell (text or rich ``Text``) takes on one line."""
    return cell_len(cell) if isinstance(cell, str) else cell.cell_len


def left_out_note(left_out: list[str]) -> str:
    """The line under a table that left columns out to fit the terminal."""
    named = " and ".join([", ".join(left_out[:-1]), left_out[-1]] if len(left_out) > 1 else left_out)
    return f"({named} left out to fit {console.width} columns: widen the terminal, or see --json)"


def serve_until_run_stopped(config: RunConfig, serve: Callable[[RunConfig, StopFlag], object]) -> None:
    """``serve`` the one run of ``config`` (a single-run learner or producer) until SIGTERM, Ctrl-C or the run's
    ``RunStopped`` sent after it started (``rlpipe runs stop``), which stops it alike; a line says so when the run's
    stop ended it."""
    from pipeline.run_stop import following_run_stop, stopped_by_line

    stop = StopFlag().install()
    with following_run_stop(config, stop) as follower:
        serve(config, stop)
    if follower is not None and follower.stopped is not None:
        console.print(stopped_by_line(config.run_id, follower.stopped), markup=False, soft_wrap=True)
