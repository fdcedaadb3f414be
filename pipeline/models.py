"""Which base model a run uses, as both sides see it.

``base_model: tiny`` means the project's own tiny model, built on this machine
by the producer side (``rlpipe model init-tiny``; it needs the environments to
pre-train on).  The builder records the folder it built in
``$RLPIPE_HOME/models/tiny.json`` so the learner, which must not import the
producer side, finds the very same weights.  Anything else is a local path or a
hub id and is returned as it is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from schemas.config import ModelConfig

POINTER_NAME = "tiny.json"


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


def resolve_base_model(model: ModelConfig) -> str:
    """The path or hub id to load: ``tiny`` -> the recorded (or configured) tiny model folder."""
    if model.base_model != "tiny":
        return check_model_path(model.base_model)
    if model.tiny_dir:
        return model.tiny_dir
    try:
        path = json.loads(tiny_pointer().read_text())["path"]
    except (OSError, ValueError, KeyError):
        raise ModelNotBuiltError(
            "the tiny model is not built on this machine yet; run `rlpipe model init-tiny` "
            "(or set model.tiny_dir / model.base_model)"
        ) from None
    if not Path(path, "config.json").is_file():
        raise ModelNotBuiltError(f"the recorded tiny model {path} is gone; run `rlpipe model init-tiny` again")
    return path
