"""Every link in the README and docs/ resolves inside the repository.

A user has the repository and nothing beside it, so a relative link that leaves
it (``../``) or names a missing file is broken for them.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
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
