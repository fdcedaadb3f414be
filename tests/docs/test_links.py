"""Every link in the README, docs/ and the examples' and infra's docs resolves inside the repository.

A user has the repository and nothing beside it, so a relative link that leaves
it (``../``) or names a missing file is broken for them, and so is a ``#section``
that names no heading of the page (as GitHub names them).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.md")),
        *sorted((ROOT / "infra").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(markdown: str) -> list[str]:
    """The link targets of ``markdown`` that point into the repository (web links and anchors aside)."""
    targets = [m.group(1) for m in LINK.finditer(markdown)]
    return [t.split("#", 1)[0] for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_relative_links_are_found():
    text = "see [a](docs/a.md), ![fig](img/x.png), [web](https://example.com), [here](#top), [s](b.md#part)"
    assert relative_links(text) == ["docs/a.md", "img/x.png", "b.md"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repository(doc: Path):
    broken = []
    for target in relative_links(doc.read_text()):
        resolved = (doc.parent / target).resolve()
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links outside the repository or to missing files: {broken}"


def anchors(markdown: str) -> set[str]:
    """The ``#anchor`` of every heading of ``markdown`` outside code blocks, as GitHub makes them: lower case,
    punctuation but ``-`` and ``_`` dropped, spaces as ``-``, a repeated heading's given ``-1``, ``-2``, ..."""
    found: set[str] = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6} +(.*?)[ #]*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            found.add(next(f"{slug}-{n}" if n else slug for n in range(len(found) + 1)
                           if (f"{slug}-{n}" if n else slug) not in found))
    return found


def test_anchors_are_made_as_github_makes_them():
    page = "# Two commands\n```\n# not a heading\n```\n## How a call travels (`app.py`)\n## Two commands\n"
    assert anchors(page) == {"two-commands", "how-a-call-travels-apppy", "two-commands-1"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_section_links_name_a_heading(doc: Path):
    broken = []
    for target in (m.group(1) for m in LINK.finditer(doc.read_text())):
        path, _, anchor = target.partition("#")
        page = (doc.parent / path).resolve() if path else doc
        local = not re.match(r"^[a-z][a-z0-9+.-]*:", target) and page.suffix == ".md" and page.exists()
        if anchor and local and anchor not in anchors(page.read_text()):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to sections that no heading makes: {broken}"
