"""``rlpipe report --run RUN``: write a self-contained HTML report of one run (or print it as JSON).

``rlpipe report --run A --run B ...`` is the report of runs packed in one process:
each run's own report in ``OUT/<run>/``, and the packed duty cycle (one trainer and
one sampler lane, each run in its own colour, per-run busy fractions) in
``OUT/packed_duty_cycle.png`` and ``OUT/packed.json`` (``pipeline.analysis.report.packed``).

``rlpipe report --server [--last MINUTES | --since T --until T]`` is the duty cycle of
a Tinker-compatible server's engines, read from the activity they record in the store:
one lane per engine, each session in its own colour, busy fractions overall and by
session, in ``OUT/server_duty_cycle.png`` and ``OUT/server.json``
(``pipeline.analysis.report.server``).

Reads the store (trajectories, adapters, the newest checkpoint, evaluations) and,
unless ``--no-bus``, the run's events on ``<ns>.control`` with a bounded wait; a
missing piece leaves its section empty with a note, never a failure.  An unknown
run or a bad option exits 2 with one line; a store that cannot be read exits 1.

``app`` is a one-command Typer app; ``command`` is the same as a click command,
which is what ``rlpipe``'s lazy loader should register (``report =
"pipeline.cli.report_cmd:command"``) so the call reads ``rlpipe report --run RUN``
rather than ``rlpipe report report --run RUN``.
"""

from __future__ import annotations

import logging
import math
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from pipeline.analysis.report import DEFAULT_BUS_TIMEOUT_S, RunReport, gather_report, summary_lines, write_report
from pipeline.analysis.report.packed import PACKED_FIGURE, write_packed_report
from pipeline.analysis.report.server import SERVER_FIGURE, write_server_report
from pipeline.cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    BootstrapOpt,
    GcsEndpointOpt,
    NamespaceOpt,
    StoreRootOpt,
    bus_config_from_cli,
    check_folder_option,
    console,
    error_line,
    fail,
    print_json,
    reachable_store,
    user_errors,
)
from pipeline.cli.options import DeprecatedRunArg, chosen_run
from pipeline.io.store import ObjectStore
from pipeline.runtime import refuse_case_twin
from pipeline.timefmt import utc_text
from schemas.config import StoreConfig

app = typer.Typer(
    name="report",
    help="Write an HTML report of a run: rewards, evaluations, staleness, ratios, throughput, duty cycle.",
    add_completion=False,
    pretty_exceptions_enable=False,
)

OutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out", "-o", help="output folder; default ./rlpipe-report-RUN/ (several runs: ./rlpipe-report-A-B/)"
    ),
]
RunsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--run", "-r", help="The run id; repeat it for runs packed in one process (adds their packed duty cycle)."
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the summary and every series as JSON")]
NoBusOpt = Annotated[
    bool, typer.Option("--no-bus", help="do not read the event log (no throughput, no producer lanes)")
]
TimeoutOpt = Annotated[
    float, typer.Option("--bus-timeout", min=0.5, max=120.0, help="seconds to wait for the broker before giving up")
]
ServerOpt = Annotated[
    bool, typer.Option("--server", help="the duty cycle of a Tinker-compatible server's engines, by session")
]
SinceOpt = Annotated[
    str | None, typer.Option("--since", help="--server: from this time (unix seconds or ISO 8601, e.g. 2026-01-31T14:00; "
                                      "UTC unless it names its zone, e.g. 2026-01-31T14:00+01:00)")
]
UntilOpt = Annotated[str | None, typer.Option(
    "--until", help="--server: up to this time (unix seconds or ISO 8601, UTC unless it names its zone)")]
LastOpt = Annotated[
    float | None, typer.Option("--last", min=0.01, help="--server: the last N minutes (instead of --since)")
]


@app.command(
    "report",
    epilog="Example: rlpipe report --run demo --root file:///tmp/rlpipe/store --out ./demo-report; "
    "runs packed in one process: rlpipe report --run a --run b (adds the packed duty cycle); "
    "a Tinker-compatible server's engines by session: rlpipe report --server --last 30",
)
def report(
    run: RunsOpt = None,
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    out: OutOpt = None,
    as_json: JsonOpt = False,
    bootstrap: BootstrapOpt = None,
    namespace: NamespaceOpt = None,
    no_bus: NoBusOpt = False,
    bus_timeout: TimeoutOpt = DEFAULT_BUS_TIMEOUT_S,
    server: ServerOpt = False,
    since: SinceOpt = None,
    until: UntilOpt = None,
    last: LastOpt = None,
    run_arg: DeprecatedRunArg = None,
) -> None:
    """Gather a run's numbers from the store and the event log and write report.html, PNGs and report.json."""
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)  # it logs whole tracebacks while retrying
    check_folder_option(out, "--out")
    if server:
        if run or run_arg is not None:
            fail("--server reports a server's engines, not runs; drop --run (or drop --server)", EXIT_USAGE)
        server_report(root, gcs_endpoint, out, as_json, since, until, last)
        return
    if since is not None or until is not None or last is not None:
        fail("--since, --until and --last choose the window of --server; add --server", EXIT_USAGE)
    if run and len(run) > 1:
        if run_arg is not None:
            fail(f"name the packed runs with --run only; drop the positional {run_arg!r}", EXIT_USAGE)
        packed_report(run, root, gcs_endpoint, out, as_json, None if no_bus else (bootstrap, namespace), bus_timeout)
        return
    run = chosen_run(run[0] if run else None, run_arg, "report")
    with user_errors():
        store = _store(root, gcs_endpoint)
        refuse_case_twin(store, run)
        bus_config = None if no_bus else bus_config_from_cli(bootstrap, namespace)
        try:
            gathered = gather_report(store, run, bus_config, bus_timeout_s=bus_timeout)
        except OSError as exc:  # the store itself failed (network, permissions): not the user's input
            fail(f"cannot read run {run!r} from {store.root}: {error_line(exc)}", EXIT_FAILURE)
        html_path = write_report(gathered, out if out is not None else Path(f"rlpipe-report-{run}"))
    if as_json:
        print_json({**gathered.to_json(), "html": str(html_path)})
    else:
        _print_summary(gathered, html_path)


def packed_report(
    runs: list[str],
    root: str | None,
    gcs_endpoint: str | None,
    out: Path | None,
    as_json: bool,
    bus: tuple[str | None, str | None] | None,
    bus_timeout: float,
) -> None:
    """Each run's report in OUT/<run>/, then the packed duty cycle of them all in OUT/."""
    if len(set(runs)) != len(runs):
        fail(f"a run is named twice in --run {' --run '.join(runs)}; name each once", EXIT_USAGE)
    with user_errors():
        store = _store(root, gcs_endpoint)
        for run in runs:
            refuse_case_twin(store, run)
        bus_config = None if bus is None else bus_config_from_cli(*bus)
        folder = out if out is not None else Path(f"rlpipe-report-{'-'.join(runs)}")
        gathered = []
        for run in runs:
            try:
                gathered.append(gather_report(store, run, bus_config, bus_timeout_s=bus_timeout))
            except OSError as exc:
                fail(f"cannot read run {run!r} from {store.root}: {error_line(exc)}", EXIT_FAILURE)
            write_report(gathered[-1], folder / run)
        json_path, body = write_packed_report(gathered, folder)
    if as_json:
        print_json({**body, "packed": str(json_path), "figure": str(folder / PACKED_FIGURE)})
        return
    for lane, by_run in body["summary"]["busy_fraction_by_run"].items():
        shares = ", ".join(f"{run} {_shown(f)}" for run, f in by_run.items())
        console.print(f"{lane}: busy {_shown(body['summary']['busy_fraction'][lane])} ({shares})", markup=False)
    console.print(f"packed report written to {folder / PACKED_FIGURE} and {json_path}")


def server_report(root: str | None, gcs_endpoint: str | None, out: Path | None, as_json: bool, since: str | None,
                  until: str | None, last: float | None) -> None:
    """The duty cycle of a server's engines over the window, one colour per session, in OUT/."""
    if last is not None and since is not None:
        fail("give --last MINUTES or --since TIME, not both", EXIT_USAGE)
    start = time.time() - 60.0 * last if last is not None else _moment(since, "--since")
    end = _moment(until, "--until")
    if start is not None and end is not None and end <= start:
        fail(f"--until ({until}) is not after the window's start; widen the window", EXIT_USAGE)
    with user_errors():
        store = _store(root, gcs_endpoint)
        folder = out if out is not None else Path("rlpipe-report-server")
        try:
            json_path, body = write_server_report(store, folder, start, end)
        except OSError as exc:
            fail(f"cannot read the engines' activity from {store.root}: {error_line(exc)}", EXIT_FAILURE)
    summary = body["summary"]
    if not summary["busy_fraction"]:
        fail(f"no engine activity in {store.root} in that window; is this the store rlpipe serve uses "
             "(--root), and has a client called it?", EXIT_USAGE)
    if as_json:
        print_json({**body, "server": str(json_path), "figure": str(folder / SERVER_FIGURE)})
        return
    console.print(_window_line(summary), markup=False)
    for lane, by_session in summary["busy_fraction_by_session"].items():
        shares = ", ".join(f"{session} {_shown(f)}" for session, f in by_session.items())
        console.print(f"{lane}: busy {_shown(summary['busy_fraction'][lane])} ({shares})", markup=False)
    console.print(f"server report written to {folder / SERVER_FIGURE} and {json_path}")


def _moment(value: str | None, option: str) -> float | None:
    """Unix seconds of ``value`` (unix seconds, or an ISO 8601 time: UTC unless it names its zone, as rlpipe prints
    times in UTC and a server's activity is usually read from another machine)."""
    if value is None:
        return None
    try:
        seconds = float(value)
        if math.isfinite(seconds):  # 'nan', 'inf' and '1e999' parse as floats but name no moment
            return seconds
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        fail(f"{option} {value!r} is neither unix seconds nor an ISO 8601 time (e.g. 2026-01-31T14:00)", EXIT_USAGE)
    return (moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)).timestamp()


def _window_line(summary: dict[str, Any]) -> str:
    """The window the fractions are of, in UTC (rlpipe prints every time in UTC)."""
    start, end = summary.get("start"), summary.get("end")
    if start is None or end is None:
        return "window: the whole activity recorded"
    return f"window {utc_text(start)} to {utc_text(end)} ({end - start:.0f} s)"


def _shown(fraction: float | None) -> str:
    return f"{fraction:.1%}" if fraction is not None and math.isfinite(fraction) else "-"


# ``rlpipe``'s loader registers a click command as-is (see the module docstring).
command = typer.main.get_command(app)


def _store(root: str | None, gcs_endpoint: str | None) -> ObjectStore:
    """The store ``--root`` names (default: the embedded stack's), failing fast if the emulator is down."""
    return reachable_store(StoreConfig(root=root or "", gcs_endpoint=gcs_endpoint))


def _print_summary(gathered: RunReport, html_path: Path) -> None:
    table = Table(title=f"run {gathered.run_id}", show_header=False)
    table.add_column("what", no_wrap=True)
    table.add_column("value", overflow="fold")
    for label, value in summary_lines(gathered.summary):
        table.add_row(label, value)
    console.print(table)
    for lane in gathered.series["duty_cycle"]["lanes"]:
        fraction = lane["busy_fraction"]
        shown = f"{fraction:.1%}" if math.isfinite(fraction) else "-"
        label = lane["name"] if lane["kind"] == "learner" else f"producer {lane['name']}"
        console.print(f"{label}: busy {shown} of the run", markup=False)
    for section, notes in gathered.notes.items():
        for text in notes:
            console.print(f"note ({section}): {text}", style="yellow", markup=False)
    console.print(f"report written to {html_path}")
