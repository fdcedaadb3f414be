"""Which base model a run uses, as both sides see it.

``base_model: tiny`` means the project's own tiny model, built on this machine
by the producer side (``rlpipe model init-tiny``; it needs the environments to
pre-train on).  The builder records the folder it built in
``$RLPIPE_HOME/models/tiny.json`` so the learner, which must not import the
producer side, finds the very same weights.  Anything else is a local path or a
hub id and is returned as it is.

Which build a tiny model folder holds is shared too: a complete folder carries a
marker (``MARKER_FILE``) with the hash of the parameters that built it, and the
default folder is named ``tiny-<hash>``.  Both sides compare tiny models by that
build (``tiny_build``, ``serves_base_model``), since the same build lies in
another folder on another machine.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from schemas.config import ModelConfig, RunConfig

POINTER_NAME = "tiny.json"
MARKER_FILE = "rlpipe_tiny_model.json"  # in a complete tiny model folder: its build record, written last


class ModelNotBuiltError(FileNotFoundError):
    """The tiny model was asked for but has not been built on this machine."""


def _home() -> Path:
    return Path(os.environ.get("RLPIPE_HOME") or Path.home() / ".rlpipe").expanduser()


def tiny_pointer() -> Path:
    """``$RLPIPE_HOME/models/tiny.json``: where the default tiny model was built."""
    return _home() / "models" / POINTER_NAME


def record_tiny_model(folder: str | Path) -> None:
    """Remember ``folder`` as the default tiny model (written atomically)."""
    pointer = tiny_pointer()
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"path": str(Path(folder).resolve())}))
    os.replace(tmp, pointer)


class ModelPathError(ValueError):
    """A base model named by a path that is not a model folder."""


def check_model_path(name: str) -> str:
    """``name`` itself, if it is a model folder (with config.json) or a hub id; ``ModelPathError`` naming the fix.

    A name that exists here, or reads as a path (absolute, ``./``, ``../``, ``~``, or more than one ``/``), is a
    path; anything else (``org/name``, ``gpt2``) is a hub id, left to the loader.  URLs pass unchanged.
    """
    if "://" in name:
        return name
    path = Path(name).expanduser()
    looks_like_path = name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
    if not path.exists():
        if looks_like_path:
            raise ModelPathError(f"base model {name}: no such folder; give a model folder (with config.json), a hub "
                                 "id, or tiny")
        return name
    if not path.is_dir():
        raise ModelPathError(f"base model {name} is a file; give the folder that holds its config.json")
    if not (path / "config.json").is_file():
        raise ModelPathError(f"base model {name} has no config.json; give a model folder (saved with "
                             "save_pretrained), a hub id, or tiny")
    return name


def recorded_tiny_dir() -> str | None:
    """The tiny model folder recorded on this machine (``tiny_pointer``), or None when none is recorded."""
    try:
        return str(json.loads(tiny_pointer().read_text())["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolve_base_model(model: ModelConfig) -> str:
    """The path or hub id to load: ``tiny`` -> the recorded (or configured) tiny model folder."""
    if model.base_model != "tiny":
        return check_model_path(model.base_model)
    if model.tiny_dir:
        return model.tiny_dir
    path = recorded_tiny_dir()
    if path is None:
        raise ModelNotBuiltError(
            "the tiny model is not built on this machine yet; run `rlpipe model init-tiny` "
            "(or set model.tiny_dir / model.base_model)"
        )
    if not Path(path, "config.json").is_file():
        raise ModelNotBuiltError(f"the recorded tiny model {path} is gone; run `rlpipe model init-tiny` again")
    return path


# ---- tiny model builds ------------------------------------------------------------------------------------------


def tiny_folder_name(build: str) -> str:
    """The name of the default folder of tiny model build ``build`` (its spec hash): ``tiny-<hash>``."""
    return f"tiny-{build}"


def read_marker(folder: str | Path) -> dict[str, Any] | None:
    """The build record of a complete tiny-model folder, or None when it is missing or unreadable."""
    try:
        return json.loads((Path(folder) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def tiny_build(name: str) -> str | None:
    """The spec hash of the tiny model in folder ``name``: from its marker when the folder is here, else from the
    name of a default folder (``tiny-<hash>``, as a learner under another $RLPIPE_HOME records it); None when
    ``name`` is no tiny model's folder.  Two folders of one hash hold the same build."""
    marker = read_marker(name)
    if marker is not None and marker.get("spec_hash"):
        return str(marker["spec_hash"])
    found = re.fullmatch(tiny_folder_name(r"([0-9a-f]{16})"), Path(name).name)
    return found[1] if found else None


def serves_base_model(name: str, base_models: Collection[str]) -> bool:
    """Whether a model trained on ``name`` (a version's base model) fits one of ``base_models``: the same
    name, or, for the tiny model, whose folder differs between machines, the same build (``tiny_build``)."""
    if name in base_models:
        return True
    build = tiny_build(name)
    return build is not None and any(tiny_build(model) == build for model in base_models)


def check_same_tiny_build(first: RunConfig, cfg: RunConfig, default_dir: str | None, fix: str) -> None:
    """Refuse, in one line ending in ``fix``, run ``cfg`` whose tiny model (model.base_model 'tiny', equal by name)
    is another build than ``first``'s, the one a packed process's shared engine holds.

    A run's tiny model is its model.tiny_dir folder, else ``default_dir`` (where this side finds the tiny model of
    a run that names no folder); the two are compared as a version's base model is (``serves_base_model``): the
    same folder, or the same build in another folder, as a run created on another machine records it.  A run
    whose folder this side cannot name (``default_dir`` None) is not compared: loading the engine's model says
    what is missing.
    """
    if first.model.base_model != "tiny" or cfg.model.base_model != "tiny":
        return  # other base models are compared by name (model.base_model)
    ours, theirs = first.model.tiny_dir or default_dir, cfg.model.tiny_dir or default_dir
    if ours is None or theirs is None or serves_base_model(theirs, {ours}):
        return
    raise ValueError(f"run {cfg.run_id}'s base model is the tiny model in {theirs} (build "
                     f"{tiny_build(theirs) or 'unknown'}), not the shared engine's (run {first.run_id}'s: {ours}, "
                     f"build {tiny_build(ours) or 'unknown'}); {fix}")
