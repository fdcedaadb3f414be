"""The whole ``rlpipe`` command tree: every command that prints data can print it as JSON.

The tree is the root group (built-in commands and lazily loaded groups) plus every
group registered under ``[project.entry-points."rlpipe.commands"]`` in
pyproject.toml, read from the file itself so a group added there is checked even
before the package is reinstalled.
"""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from pipeline.cli.main import ENTRY_POINT_GROUP, app, load_group

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

# Commands that print no data, only progress, a prompt or a one-line confirmation of what they did.
# A command missing from here must have --json.
NO_DATA = {
    "run",  # a live dashboard while the run goes; the numbers are in `runs show` and `report`
    "demo",  # progress of six phases; its measured result is written to demo-result.json
    "adapters pull",  # downloads a version; prints where it landed
    "runs delete",  # deletes after a confirmation prompt; prints what it removed
    "runs create",  # writes run.json and announces RunStarted; prints one line of what it did
    "runs stop",  # announces RunStopped; prints one line of what it did
    "runs resume",  # announces RunStarted again; prints one line of what it did
    "producer start",  # long-running service: log lines only
    "learner start",  # long-running service: log lines only
    "replay",  # trains or re-announces; prints one line of what it did
    "envs play",  # interactive: observations and a prompt
    "envs record",  # writes Parquet; prints one line of what it wrote
    "model init-tiny",  # builds a model; prints where it is
    "datasets to-trajectories",  # writes Parquet; prints one line and the next command
    "serve",  # long-running service: its base URL, an SDK example, then log lines
}


def entry_point_groups() -> dict[str, str]:
    """name -> ``module:attribute`` as pyproject.toml registers them."""
    data = tomllib.loads(PYPROJECT.read_text())
    return dict(data["project"]["entry-points"][ENTRY_POINT_GROUP])


def leaves(command: Any, path: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """(space-separated path, command) of every command that runs something (groups are walked)."""
    if hasattr(command, "list_commands"):
        for name in command.list_commands(None):
            yield from leaves(command.get_command(None, name), (*path, name))
    else:
        yield " ".join(path), command


@functools.cache
def command_tree() -> dict[str, Any]:
    root = typer.main.get_command(app)
    tree = dict(leaves(root, ()))
    for name, target in entry_point_groups().items():
        tree.update(leaves(load_group(name, target), (name,)))
    return tree


def test_the_tree_holds_every_group_and_none_failed_to_load() -> None:
    tree = command_tree()
    for name in entry_point_groups():
        assert any(path == name or path.startswith(f"{name} ") for path in tree), name
    broken = [path for path, command in tree.items() if (command.help or "").startswith("(unavailable")]
    assert not broken, broken
    assert not NO_DATA - set(tree), f"stale entries in NO_DATA: {sorted(NO_DATA - set(tree))}"


@pytest.mark.parametrize("path", sorted(command_tree()))
def test_every_command_that_prints_data_has_json(path: str) -> None:
    if path in NO_DATA:
        pytest.skip("prints no data")
    command = command_tree()[path]
    options = {opt for param in command.params for opt in getattr(param, "opts", [])}
    assert "--json" in options, f"`rlpipe {path}` prints data but has no --json option"


# Commands that refer to one run: each names it with --run.
NAMES_A_RUN = {
    "run", "runs show", "runs delete", "report", "eval", "adapters list", "adapters show", "adapters pull",
    "topics tail", "learner start", "producer start", "replay", "envs record", "datasets to-trajectories",
    "datasets eval-building",
}


def test_a_run_is_named_with_run_everywhere() -> None:
    tree = command_tree()
    for path in sorted(NAMES_A_RUN):
        options = {opt for param in tree[path].params for opt in getattr(param, "opts", [])}
        assert "--run" in options, f"`rlpipe {path}` does not take --run"
    for path, command in tree.items():
        for param in command.params:
            if param.param_type_name == "argument" and "run" in (param.name or ""):
                assert "Deprecated" in (getattr(param, "help", "") or ""), f"`rlpipe {path}` takes the run as {param}"


def test_every_command_has_help_with_an_example() -> None:
    from typer.testing import CliRunner

    runner = CliRunner()
    for path in sorted(command_tree()):
        shown = runner.invoke(app, [*path.split(), "--help"], env={"COLUMNS": "200"})
        assert shown.exit_code == 0 and "Example" in shown.stdout, f"`rlpipe {path} --help`: {shown.output[-300:]}"


def test_every_example_is_an_rlpipe_command_line_and_every_option_says_what_it_does() -> None:
    for path, command in sorted(command_tree().items()):
        text = f"{command.help or ''}\n{command.epilog or ''}"
        example = text[text.index("Example"):].partition(":")[2].split()
        assert example[:1] == ["rlpipe"] or "rlpipe" in example[:3], f"`rlpipe {path}`'s example: {' '.join(example)}"
        for param in command.params:
            if param.param_type_name == "option" and param.name != "help":
                assert (param.help or "").strip(), f"`rlpipe {path}` option {param.opts} has no help text"
        assert (command.help or "").strip().splitlines()[0], f"`rlpipe {path}` has no one-line description"


def test_a_group_that_does_not_load_is_a_stub_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="pipeline.cli.main"):
        command = load_group("ghost", "no_such_package.cli:app")
    assert (command.help or "").startswith("(unavailable: ModuleNotFoundError")
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "no_such_package.cli:app" in caplog.text



def help_as_written() -> dict[str, str]:
    """path -> the help text as the source wrote it (the root group, which unwraps help, bypassed)."""
    from typer.core import TyperGroup

    from pipeline.cli.main import plugin_targets

    root, written = typer.main.get_command(app), {}
    for name in root.list_commands(None):
        group = TyperGroup.get_command(root, None, name) or load_group(name, plugin_targets()[name])
        written.update((path, command.help or "") for path, command in leaves(group, (name,)))
    return written


def test_help_texts_break_lines_only_where_the_terminal_does() -> None:
    """A help paragraph wrapped in the source (at 120 columns) reads as one paragraph, however wide the terminal:
    at 1,000 columns, the words either side of each of the source's line breaks stand on one line."""
    import inspect
    import itertools

    from typer.testing import CliRunner

    runner, written = CliRunner(), help_as_written()
    assert written.keys() == command_tree().keys()
    assert sum("\n" in text.strip().partition("\n\n")[2].strip() for text in written.values()) >= 5  # some to check
    for path, text in sorted(written.items()):
        shown = runner.invoke(app, [*path.split(), "--help"], env={"COLUMNS": "1000"})
        lines = [" ".join(line.strip(" │").split()) for line in shown.stdout.splitlines()]
        for paragraph in inspect.cleandoc(text).split("\n\n"):
            for before, after in itertools.pairwise(paragraph.splitlines()):
                joint = f"{before.split()[-1]} {after.split()[0]}"
                assert any(joint in line for line in lines), f"`rlpipe {path} --help` breaks the line at {joint!r}"
