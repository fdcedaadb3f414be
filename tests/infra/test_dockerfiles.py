"""Container files: pinned bases, non-root, no credentials, and every package copied in."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "infra" / "docker").glob("*.Dockerfile"))


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines if line and line[0] != "#"]


def test_both_images_exist():
    assert [p.name for p in DOCKERFILES] == ["learner.Dockerfile", "producer.Dockerfile"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_image_is_pinned(path):
    steps = instructions(path)
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)
    (base,) = [a for kind, a in steps if kind == "FROM"]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    name, _, tag = base.rpartition(":")
    assert name and tag and tag != "latest", base
    assert re.search(r"\d+\.\d+", tag), f"{base}: pin a release tag"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_runs_rlpipe_as_uid_10001(path):
    steps = instructions(path)
    users = [a for kind, a in steps if kind == "USER"]
    assert users and users[-1].split(":")[0] == "10001"  # numeric: runAsNonRoot can verify it
    assert [a for kind, a in steps if kind == "ENTRYPOINT"] == ['["rlpipe"]']
    run = " ".join(a for kind, a in steps if kind == "RUN")
    assert "--uid 10001" in run


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copies_every_package_and_no_credentials(path):
    steps = instructions(path)
    copied = {source for kind, a in steps if kind == "COPY" for source in a.split()[:-1]}  # last word: destination
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    # pip install . needs the packages, pyproject.toml and the readme it names.
    assert packages | {"pyproject.toml", pyproject["project"]["readme"]} <= copied
    for source in copied:
        assert (ROOT / source).exists(), source
    text = path.read_text()
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in text  # Workload Identity, never a key file
    assert not re.search(r"\.(json|pem|key|p12)\b", " ".join(a for kind, a in steps if kind in ("COPY", "ADD")))


def test_dockerignore_keeps_the_context_small_and_clean():
    patterns = {
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "tests", "**/__pycache__", ".pytest_cache"} <= patterns
    assert {"**/*.pem", "**/*.key"} <= patterns
    # Files the images copy must not be ignored.
    for path in DOCKERFILES:
        for kind, args in instructions(path):
            if kind == "COPY":
                for source in args.split()[:-1]:
                    assert source not in patterns, source
