"""Every ``rlpipe`` command that the code's messages and the docs name in backticks exists.

A hint such as "build the tiny model first (`rlpipe model init-tiny`)" is only
useful if the command it names is real; this reads every such mention in the
packages, the benchmarks, the examples and the docs and looks it up in the
command tree (``tests/pipeline/test_cli_tree.py``).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.pipeline.test_cli_tree import command_tree

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("pipeline", "consumers", "producers", "schemas", "bench", "examples", "infra", "docs")
MENTION = re.compile(r"`rlpipe ([a-z][a-z0-9-]*)(?: ([a-z][a-z0-9-]*))?")


def mentions() -> list[tuple[str, str, str | None]]:
    """(where, first word, second word) of every backticked ``rlpipe`` command in the sources and docs."""
    files = [ROOT / "README.md"] + [path for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*"))
                                    if path.suffix in (".py", ".md")]
    found = []
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in MENTION.finditer(line):
                found.append((f"{path.relative_to(ROOT)}:{number}", match.group(1), match.group(2)))
    return found


def unknown(tree: set[str], first: str, second: str | None) -> bool:
    groups = {path.split()[0] for path in tree if " " in path}
    if first not in groups:
        return first not in tree
    return second is not None and not any(p == f"{first} {second}" or p.startswith(f"{first} {second} ") for p in tree)


def test_every_backticked_rlpipe_command_exists() -> None:
    tree = set(command_tree())
    found = mentions()
    assert len(found) > 100  # the reading works: the docs name many commands
    wrong = [f"{where}: rlpipe {first} {second or ''}".strip() for where, first, second in found
             if unknown(tree, first, second)]
    assert not wrong, "commands named that do not exist:\n" + "\n".join(wrong)


def test_a_misnamed_command_is_found() -> None:
    tree = set(command_tree())
    assert unknown(tree, "model", "build-tiny") and unknown(tree, "launch", None)
    assert not unknown(tree, "model", "init-tiny") and not unknown(tree, "datasets", "import")
    assert not unknown(tree, "demo", None) and not unknown(tree, "runs", None)
