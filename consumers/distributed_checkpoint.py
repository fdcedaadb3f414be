"""Checkpoints of a ``DistributedEngine`` adapter: torch.distributed.checkpoint in the Hugging Face safetensors layout.

Tensors go in safetensors, their index and the engine's metadata (with the sha256 of every
file) in JSON; nothing is pickled.  A checkpoint is committed by renaming its staging folder
into place, so a folder without ``engine_state.json`` was never committed.  ``train_batches``
(``consumers.distributed``) keeps one folder per committed step, ``step-<n>``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as load_safetensors

from consumers.engine_data import EngineError
from pipeline.io.tensors import save_tensors as save_safetensors

if TYPE_CHECKING:
    from consumers.distributed import DistributedEngine

CHECKPOINT_META = "engine_state.json"
STEP_PREFIX = "step-"  # train_batches' folder per committed step: step_folder / step_of

def save_checkpoint(engine: DistributedEngine, name: str, folder: str | Path, extra: dict[str, Any]) -> Path:
    """Adapter ``name``'s state (weights, AdamW, RNG) to ``folder`` with DCP; committed by renaming into place.

    Every rank calls it.  ``extra`` (JSON-able) is stored with the engine's
    metadata and the sha256 of every file, which ``load_checkpoint`` checks; a
    folder without ``engine_state.json`` was never committed.
    """
    folder = Path(folder)
    staging = folder.with_name(folder.name + ".partial")
    if engine.topology.is_main:
        shutil.rmtree(staging, ignore_errors=True)
    _barrier(engine)
    tensors, meta = _split_state(engine.save_state(name))
    with _single_process_quiet():
        dcp.save(tensors, storage_writer=dcp.HuggingFaceStorageWriter(str(staging), save_distributed=True))
    if engine.topology.is_main:
        files = {path.name: _sha256(path) for path in sorted(staging.iterdir()) if path.is_file()}
        (staging / CHECKPOINT_META).write_text(json.dumps({"engine": meta, "extra": extra, "files": files}))
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    _barrier(engine)
    return folder


def load_checkpoint(engine: DistributedEngine, name: str, folder: str | Path) -> dict[str, Any]:
    """Restore adapter ``name`` from a ``save_checkpoint`` folder (created if unknown); returns its ``extra``."""
    folder = Path(folder)
    meta_path = folder / CHECKPOINT_META
    if not meta_path.is_file():
        raise EngineError(f"{folder} is not a committed checkpoint (no {CHECKPOINT_META}); pick another")
    saved = json.loads(meta_path.read_text())
    for file_name, digest in saved.get("files", {}).items():  # (a checkpoint written before digests: none)
        path = folder / file_name
        if not path.is_file() or _sha256(path) != digest:
            raise EngineError(f"checkpoint file {path} is {'missing' if not path.is_file() else 'damaged'} "
                              "(sha256 differs from engine_state.json); it is not loaded: restore it or start over")
    reader = dcp.HuggingFaceStorageReader(str(folder))
    layout = reader.read_metadata().state_dict_metadata
    tensors = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in layout.items()}
    with _single_process_quiet():
        dcp.load(tensors, storage_reader=reader)
    engine.load_state(name, save_safetensors(tensors, metadata={"rlpipe": json.dumps(saved["engine"])}))
    return saved["extra"]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest committed ``step-<n>`` folder under ``root``, or None."""
    committed = [p for p in Path(root).glob(f"{STEP_PREFIX}*")
                 if step_of(p) is not None and (p / CHECKPOINT_META).is_file()]  # not a .partial one
    return max(committed, key=step_of, default=None)


def step_folder(root: str | Path, step: int, digits: int = 8) -> Path:
    """The folder of the checkpoint after ``step`` steps: ``step-<n>``, ``n`` zero-padded to ``digits``."""
    return Path(root) / f"{STEP_PREFIX}{step:0{digits}d}"


def step_of(folder: Path) -> int | None:
    """The step of a ``step-<n>`` folder (``n`` any ASCII digits, padded or not), or None for another name."""
    match = re.fullmatch(rf"{STEP_PREFIX}([0-9]+)", folder.name)
    return int(match[1]) if match else None


def _sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _split_state(blob: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    header_len = int.from_bytes(blob[:8], "little")
    meta = json.loads(json.loads(blob[8 : 8 + header_len])["__metadata__"]["rlpipe"])
    return load_safetensors(blob), meta


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP outside a process group (a group of one) works as intended; its warning says so at every call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(engine: DistributedEngine) -> None:
    if engine.distributed:
        dist.barrier()
