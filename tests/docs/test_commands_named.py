"""Every ``rlpipe`` command that the code's messages and the docs name in backticks exists, with its options.

A hint such as "build the tiny model first (`rlpipe model init-tiny`)" is only
useful if the command it names is real; this reads every such mention in the
packages, the benchmarks, the examples and the docs and looks it up in the
command tree (``tests/pipeline/test_cli_tree.py``). The options of every command
line shown (``rlpipe eval --run R --episodes 64``) must be options of that command.
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


# A command line in the docs: a backticked `rlpipe ...` span, or a code-block line that starts with `rlpipe `
# (a shell comment after ` #` is prose, not options).
COMMAND_LINE = re.compile(r"`(rlpipe [^`]*)`")
SHELL_END = {"|", "||", "&&", ";", "&", ">", ">>", "2>&1"}


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command line) of every ``rlpipe`` command line in ``text``; backslash-continued lines are
    joined and counted at their first line."""
    found = []
    lines = text.splitlines()
    number = 0
    while number < len(lines):
        first, line = number + 1, lines[number]
        while line.endswith("\\") and number + 1 < len(lines):
            number += 1
            line = line[:-1] + " " + lines[number].strip()
        number += 1
        found += [(first, m.group(1)) for m in COMMAND_LINE.finditer(line)]
        if line.lstrip().startswith("rlpipe ") and "`" not in line:
            found.append((first, re.split(r"\s#", line.strip())[0].rstrip()))
    return found


def unknown_options(tree: dict, line: str) -> list[str]:
    """The options of ``line`` (an ``rlpipe`` command line) that its command does not take."""
    words = line.split()[1:]
    for length in (3, 2, 1):
        path = " ".join(words[:length])
        if len(words) >= length and path in tree:
            break
    else:
        return []  # no such command: test_every_backticked_rlpipe_command_exists reports it
    taken = {"--help"} | {opt for param in tree[path].params
                          for opt in (*param.opts, *getattr(param, "secondary_opts", ()))}
    wrong = []
    for word in words[length:]:
        if word in SHELL_END:
            break
        option = word.split("=", 1)[0]
        if re.fullmatch(r"--?[A-Za-z][\w-]*", option) and option not in taken:
            wrong.append(f"rlpipe {path} {option}")
    return wrong


def test_every_option_of_a_documented_rlpipe_command_line_exists() -> None:
    tree = command_tree()
    files = [ROOT / "README.md"] + [path for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*"))
                                    if path.suffix in (".py", ".md")]
    checked, wrong = 0, []
    for path in files:
        for number, line in command_lines(path.read_text(errors="replace")):
            checked += "--" in line
            wrong += [f"{path.relative_to(ROOT)}:{number}: {found}" for found in unknown_options(tree, line)]
    assert checked > 150  # the reading works: the docs show many command lines with options
    assert not wrong, "options shown that their command does not take:\n" + "\n".join(wrong)


def test_a_misspelt_option_is_found() -> None:
    tree = command_tree()
    text = ("rlpipe run --preset cartpole --max-step 30   # --anything in a comment\n"
            "`rlpipe eval --run r --episodes 8 | head`\n"
            "rlpipe runs show --run r \\\n    --jsn\n")
    assert command_lines(text)[0] == (1, "rlpipe run --preset cartpole --max-step 30")
    wrong = [found for _, line in command_lines(text) for found in unknown_options(tree, line)]
    assert wrong == ["rlpipe run --max-step", "rlpipe runs show --jsn"]
    assert not unknown_options(tree, "rlpipe run --preset cartpole --runs 3 -s learner.max_steps=3")
