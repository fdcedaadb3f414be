"""``rlpipe config show|presets``: the resolved run configuration (secrets as ***)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from pipeline.cli.common import console, err_console, handle_user_errors, print_json
from pipeline.cli.options import ConfigOpt, PresetOpt, SetOpt, run_config
from pipeline.config import config_to_json, load_preset, preset_names

app = typer.Typer(name="config", help="Show resolved run configurations and shipped presets.", no_args_is_help=True)


@app.command(epilog="Example: RLPIPE_BUS__BOOTSTRAP_SERVERS=kafka:9092 rlpipe config show --preset cartpole")
@handle_user_errors
def show(
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (accepted for symmetry: the output is JSON).")] = False,
) -> None:
    """Print the configuration a process would run with, after every layer (secrets shown as ***), as JSON.

    An empty ``bus.bootstrap_servers`` or ``store.root`` is taken from the running local stack when a process
    starts; a note on stderr says what they resolve to now (the JSON stays the configuration as written).
    """
    from pipeline.devstack.stack import read_stack_state, resolve_store_root

    cfg = run_config(preset, config, overrides)
    typer.echo(config_to_json(cfg))
    state = read_stack_state()
    resolved = []
    if not cfg.bus.bootstrap_servers.strip():
        where = state.bootstrap_servers if state is not None else "none: no stack runs (rlpipe up)"
        resolved.append(f"bus.bootstrap_servers -> {where}")
    if not cfg.store.root:
        resolved.append(f"store.root -> {resolve_store_root()}")
    if resolved:
        err_console.print(f"note: empty fields resolve when a process starts: {'; '.join(resolved)}",
                          markup=False)


@app.command(epilog="Example: rlpipe config presets --json")
@handle_user_errors
def presets(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List the presets shipped with rlpipe."""
    rows = {name: load_preset(name) for name in preset_names()}
    if as_json:
        print_json(rows)
        return
    table = Table()
    table.add_column("preset", no_wrap=True)  # whole, to be copied into --preset
    table.add_column("environment", overflow="fold")
    table.add_column("settings")
    for name, data in rows.items():
        table.add_row(name, str(data.get("env", {}).get("name", "")), ", ".join(k for k in data if k != "env"))
    console.print(table)
