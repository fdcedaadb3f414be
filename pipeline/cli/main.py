"""``rlpipe``: the command line root.

Built-in groups live in ``pipeline.cli`` (``topics``, ``adapters``, the stack's
``up``/``down``/``status``).  Groups that live in ``producers`` or ``consumers``
(which ``pipeline`` must never import) register themselves under the
``rlpipe.commands`` entry-point group in ``pyproject.toml``
(``envs = "producers.cli:app"``) and are found here by name.

They are loaded lazily, when their name is on the command line (or for
``rlpipe --help``), so ``rlpipe topics list`` does not import a sampler or a
trainer, and one group that fails to import only breaks itself: calling it
prints why in one line, everything else keeps working.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from importlib.metadata import entry_points
from typing import Annotated, Any

import typer
from rich.table import Table
from typer.core import TyperCommand, TyperGroup

from pipeline.cli.common import (
    EXIT_FAILURE,
    EXIT_NOT_RUNNING,
    JsonOpt,
    console,
    err_console,
    fail,
    handle_user_errors,
    print_json,
)
from pipeline.cli.topics import app as topics_app
from pipeline.devstack.broker import answers_kafka_metadata
from pipeline.devstack.reconnect import RECENT_LOG_S, choose_ports, runs_still_going
from pipeline.devstack.stack import (
    StackAlreadyRunningError,
    StackState,
    read_stack_state,
    rlpipe_home,
    serve,
    start_background,
    stop_background,
)

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rlpipe.commands"
# Built-in groups written in their own modules; optional so a missing one does not break the CLI.
BUILTIN_LAZY_GROUPS = {
    "adapters": "pipeline.cli.adapters:app",
    "config": "pipeline.cli.config_cmd:app",
    "run": "pipeline.cli.run_cmd:command",
    "runs": "pipeline.cli.runs:app",
    "report": "pipeline.cli.report_cmd:command",
    "demo": "pipeline.cli.demo_cmd:command",
    "serve": "pipeline.cli.serve_cmd:command",
    "sessions": "pipeline.cli.sessions_cmd:app",
    "plan": "pipeline.cli.plan_cmd:command",
    "sweep": "pipeline.cli.sweep_cmd:command",
}


def _module_exists(target: str) -> bool:
    module = target.partition(":")[0]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def plugin_targets() -> dict[str, str]:
    """Lazily loaded command groups: name -> ``module:attribute``."""
    targets = {name: target for name, target in BUILTIN_LAZY_GROUPS.items() if _module_exists(target)}
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        targets.setdefault(entry_point.name, entry_point.value)
    return targets


def _broken_group(name: str, target: str, exc: BaseException) -> Any:
    """A stand-in command that explains, in one line, why group ``name`` is unavailable."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    stub = typer.Typer(add_completion=False)
    anything = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}

    @stub.command(name=name, help=f"(unavailable: {reason})", context_settings=anything)
    def report(ctx: typer.Context) -> None:
        fail(f"the `{name}` commands could not be loaded from {target} ({reason}); reinstall rlpipe with its extras")

    return typer.main.get_command(stub)


def load_group(name: str, target: str) -> Any:
    """Import ``module:attribute`` (a Typer app) as the command group ``name``; a stub that explains if it fails."""
    module_name, _, attribute = target.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attribute or "app")
        if isinstance(obj, typer.Typer):
            command = typer.main.get_group(obj)
        elif isinstance(obj, TyperCommand | TyperGroup):
            command = obj
        else:
            raise TypeError(f"{target} is a {type(obj).__name__}, not a Typer app")
    except Exception as exc:  # any plugin's import may fail in any way; it must not break the other commands
        log.warning("command group %s (%s) could not be loaded: %s: %s", name, target, type(exc).__name__, exc)
        return _broken_group(name, target, exc)
    command.name = name
    return command


def unwrapped_help(text: str) -> str:
    """``text`` with each paragraph on one line, for the terminal to wrap.

    Typer's rich help keeps the single line breaks of every paragraph after the first, so a docstring wrapped
    at the source's 120 columns would break its sentences there at any terminal width.  A paragraph that starts
    with ``\\b`` (click's mark for a preformatted paragraph) keeps its lines."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(part if part.startswith("\b") else " ".join(line.strip() for line in part.split("\n"))
                       for part in paragraphs)


def _unwrap_help_texts(command: Any) -> None:
    """``unwrapped_help`` on the help of ``command`` and, for a group, of every command under it."""
    if command.help:
        command.help = unwrapped_help(command.help)
    for sub in getattr(command, "commands", {}).values():
        _unwrap_help_texts(sub)


class _PluginGroup(TyperGroup):
    """The root group: built-in commands first, then the lazily loaded groups."""

    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        return names + sorted(name for name in plugin_targets() if name not in names)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is None:
            target = plugin_targets().get(cmd_name)
            if target is None:
                return None
            command = load_group(cmd_name, target)
            self.commands[cmd_name] = command
        _unwrap_help_texts(command)
        return command


app = typer.Typer(
    name="rlpipe",
    cls=_PluginGroup,
    help="Self-hosted, event-sourced pipeline for RL post-training of language models.",
    epilog="Example: rlpipe up && rlpipe topics list && rlpipe down",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(topics_app, name="topics")


def _state_table(state: StackState, title: str) -> Table:
    table = Table("part", title=title, show_header=False)
    table.add_column("where", overflow="fold")  # a long path folds onto more lines, never cut short with "…"
    table.add_row("Kafka (bus.bootstrap_servers)", state.bootstrap_servers)
    if state.s3_endpoint:
        table.add_row("broker log (kept across restarts)", f"{state.log_storage} on {state.s3_endpoint}")
    else:
        table.add_row("broker log", f"{state.log_storage} (lost when the stack stops)")
    if state.gcs_endpoint:
        table.add_row("GCS emulator (store.gcs_endpoint)", f"{state.gcs_endpoint}  bucket gs://{state.gcs_bucket}")
    table.add_row("local store (store.root)", state.store_root)
    table.add_row("logs", state.log_dir)
    table.add_row("pid", str(state.pid))
    return table


@app.command(epilog="Example: rlpipe up   (stop it with: rlpipe down)")
@handle_user_errors
def up(
    kafka_port: Annotated[int | None, typer.Option(
        min=1, max=65535, help="Broker port; default: the home's previous one if free, else a free one.")] = None,
    gcs_port: Annotated[int | None, typer.Option(
        min=1, max=65535, help="GCS emulator port; default: the previous one if free, else a free one.")] = None,
    gcs: Annotated[bool, typer.Option("--gcs/--no-gcs", help="Also start the GCS emulator.")] = True,
    foreground: Annotated[bool, typer.Option(help="Run in this terminal until Ctrl-C instead of detaching.")] = False,
    timeout: Annotated[float, typer.Option(min=1.0, help="Seconds to wait for the stack to be ready.")] = 30.0,
    as_json: JsonOpt = False,
) -> None:
    """Start the embedded stack (Kafka broker, GCS emulator, local store) in the background.

    Its addresses are recorded in $RLPIPE_HOME/stack.json (default ~/.rlpipe), where every
    other rlpipe command finds them.  The broker's log (the events) and the store stay across
    `rlpipe down` and `rlpipe up`, and so do the ports ($RLPIPE_HOME/ports.json) where still free:
    processes that outlived `rlpipe down` reconnect.
    """
    if foreground:
        home = rlpipe_home().resolve()
        ports = choose_ports(home, kafka_port, gcs_port, with_gcs=gcs)
        _print_notes(ports.notes)
        raise typer.Exit(serve(home, kafka_port=ports.kafka_port, gcs_port=ports.gcs_port, with_gcs=gcs))
    try:
        state = start_background(kafka_port=kafka_port, gcs_port=gcs_port, with_gcs=gcs, timeout_s=timeout,
                                 on_note=lambda note: _print_notes([note]))
        title = "rlpipe stack started"
    except StackAlreadyRunningError as exc:
        state, title = exc.state, "rlpipe stack already running"
        asked = {"Kafka": (kafka_port, state.bootstrap_servers), "the GCS emulator": (gcs_port, state.gcs_endpoint)}
        for part, (port, address) in asked.items():
            if port is not None and (address is None or not address.endswith(f":{port}")):
                fail(f"the rlpipe stack is already running with {part} at {address or 'nothing'}, not port {port}; "
                     "stop it with rlpipe down, then start it on that port")
    if as_json:
        print_json({"status": "started" if title.endswith("started") else "already running", **state.model_dump()})
    else:
        console.print(_state_table(state, title))


@app.command(epilog="Example: rlpipe down")
@handle_user_errors
def down(
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to wait before killing it.")] = 10.0,
    as_json: JsonOpt = False,
) -> None:
    """Stop the embedded stack started by `rlpipe up` or `rlpipe run`, listing each part it stops.

    The broker's log (the events, kept by the local S3 server under $RLPIPE_HOME/s3),
    the store folder and the logs stay, so `rlpipe up` carries on where it stopped, on the
    same ports where free.  Runs whose processes still go are named (those `rlpipe run` started
    on the home's run configurations, or started by hand naming their runs with this home; without /proc,
    those that logged lately): they wait for the broker and reconnect when `rlpipe up` starts it again.
    """
    state = stop_background(timeout_s=timeout)
    recent = runs_still_going(rlpipe_home()) if state is not None else {}
    if recent and state is not None:
        _warn_still_used(recent, state)
    if as_json:
        print_json({"status": "stopped", **state.model_dump(), "recent_runs": recent} if state
                   else {"status": "not running"})
    elif state is None:
        console.print("no rlpipe stack is running")
    else:
        console.print(f"rlpipe stack stopped (pid {state.pid}):")
        for part in _stopped_parts(state):
            console.print(f"  {part}", markup=False)


def _print_notes(notes: list[str]) -> None:
    """Lines about the start on stderr, so that ``--json`` keeps stdout parseable."""
    for note in notes:
        err_console.print(f"note: {note}", style="yellow", markup=False)


def _warn_still_used(recent: dict[str, list[str]], state: StackState) -> None:
    """One line naming the runs whose processes still go (``runs_still_going``), and what happens to them now."""
    runs = "; ".join(f"{run}: {', '.join(names)}" for run, names in recent.items())
    err_console.print(
        f"warning: processes of {'runs' if len(recent) > 1 else 'run'} {runs} (running, or without /proc logging "
        f"in the last {RECENT_LOG_S:g} s) will wait for the broker at {state.bootstrap_servers} and reconnect when `rlpipe up` "
        "starts it again on the same ports; one still connecting for the first time gives up after "
        "bus.connect_timeout_s", style="yellow", markup=False)


def _stopped_parts(state: StackState) -> list[str]:
    """What stopping the stack ended, and what it left in place."""
    parts = [f"stopped the Kafka broker at {state.bootstrap_servers}"]
    if state.s3_endpoint:
        parts.append(f"stopped the local S3 server at {state.s3_endpoint} (it keeps the broker's log)")
    if state.gcs_endpoint:
        parts.append(f"stopped the GCS emulator at {state.gcs_endpoint} (bucket gs://{state.gcs_bucket})")
    parts.append(f"kept the local store at {state.store_root} and the logs in {state.log_dir}")
    return parts


@app.command(epilog="Example: rlpipe status --json")
@handle_user_errors
def status(as_json: JsonOpt = False) -> None:
    """Say whether the embedded stack runs, where it listens, and whether the broker answers.

    Exit status, for scripts: 0 when the stack runs and its broker answers, 1 when it runs but the broker does
    not answer, 3 when no stack runs (as service `status` commands do).
    """
    state = read_stack_state()
    if state is None:
        if as_json:
            print_json({"running": False, "home": str(rlpipe_home())})
        else:
            console.print(f"no rlpipe stack is running (RLPIPE_HOME={rlpipe_home()}); start one with `rlpipe up`")
        raise typer.Exit(EXIT_NOT_RUNNING)
    host, _, port = state.bootstrap_servers.rpartition(":")
    answers = answers_kafka_metadata(host, int(port), timeout_s=2.0)
    if as_json:
        print_json({"running": True, "kafka_answers": answers, **state.model_dump()})
        if not answers:
            raise typer.Exit(EXIT_FAILURE)
        return
    console.print(_state_table(state, "rlpipe stack running"))
    if not answers:
        fail(f"the broker at {state.bootstrap_servers} does not answer; restart with `rlpipe down && rlpipe up`")


def main() -> None:
    """Console-script entry point (``rlpipe``)."""
    app()


if __name__ == "__main__":
    main()
