"""The README's environment section agrees with ``rlpipe envs list``: its count and its table of baselines name
every registered environment, variants included."""

from __future__ import annotations

import re
from pathlib import Path

from producers.envs.registry import env_names

README = Path(__file__).resolve().parents[2] / "README.md"
COUNTS = {"seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}


def environment_section() -> str:
    text = README.read_text()
    start = text.index("## Environments and their baselines")
    return text[start:text.index("\n## ", start + 1)]


def test_the_readme_counts_and_tabulates_every_environment_envs_list_shows() -> None:
    section = environment_section()
    first_word = section.split("\n\n", 1)[1].split()[0].lower()
    assert COUNTS.get(first_word) == len(env_names()), (first_word, env_names())
    tabulated = re.findall(r"^\| ([a-z0-9-]+) \|", section, flags=re.MULTILINE)[2:]  # under the header and rule
    assert sorted(tabulated) == sorted(env_names())
