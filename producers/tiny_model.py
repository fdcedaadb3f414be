"""The tiny local base model: built here, deterministically, because no model hub is reachable.

``build_tiny_model`` makes a small Qwen2-architecture causal LM in Hugging Face
format (loadable by both vLLM and transformers) from nothing:

1. transcripts of every registered environment (system prompt, observation as
   the user message, a heuristic or a random answer as the assistant message);
2. a byte-level BPE tokenizer trained on those transcripts (small vocabulary,
   so prompts are a few hundred tokens), with ChatML special tokens and a
   ChatML chat template, eos = ``<|im_end|>`` (both made by ``producers.tiny_corpus``);
3. a randomly initialised model, then a short full-parameter pre-training on the
   transcripts with the loss on assistant tokens only.

Why pre-train: a randomly initialised tiny model cannot be steered by LoRA alone
(its logits stay within about +/-3, see NOTES.md).  After a short full-parameter
pre-training it behaves like a real base model: it knows the answer format and
has a prior over actions, and LoRA does the task-specific learning.

The result is cached: it is built in a temporary folder next to the target and
renamed into place, and a marker file holding the hash of the build parameters
(written last) says a folder is complete and which parameters made it.

This module holds the build parameters, naming and caching, the model and its
pre-training; the transcripts and the tokenizer are ``producers.tiny_corpus``, and
what names a build (the marker, ``tiny-<hash>``, ``tiny_build``) is
``pipeline.models``, which the learner side reads too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.models import (  # the build identity (marker, naming) is shared with the learner side
    MARKER_FILE,
    check_model_path,
    read_marker,
    record_tiny_model,
    tiny_folder_name,
)
from producers.tiny_corpus import (
    ENDOFTEXT,
    IM_END,
    collect_corpus,
    encode_conversation,
    env_list,
    render_chat,
    train_tokenizer,
    wrap_tokenizer,
)
from schemas.config import ModelConfig

log = logging.getLogger(__name__)

TINY_FORMAT_VERSION = 1  # bump when the recipe changes: old caches then stop matching
LOSS_FILE = "pretrain_loss.json"

VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # vLLM's CPU attention kernels

ProgressFn = Callable[[int, int, float], None]  # (step done, total steps, loss); (0, total, nan) when a build starts


class TinyModelSpec(BaseModel):
    """Everything that determines the tiny model's weights; its hash names the cache folder."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(0, ge=0, le=2**31 - 1, description="seed for transcripts, initialisation and batches")
    vocab_size: int = Field(1024, ge=300, le=65_536, description="tokenizer vocabulary incl. special tokens")
    hidden_size: int = Field(128, ge=32, le=4096, description="model width")
    num_layers: int = Field(4, ge=1, le=64, description="transformer blocks")
    num_heads: int = Field(4, ge=1, le=64, description="attention heads")
    num_kv_heads: int = Field(2, ge=1, le=64, description="key/value heads (grouped-query attention)")
    intermediate_size: int = Field(384, ge=16, le=16_384, description="MLP width")
    max_position_embeddings: int = Field(2048, ge=128, le=131_072, description="longest context (rope)")
    rope_theta: float = Field(10_000.0, gt=0, le=1e8, description="rope base")
    pretrain: bool = Field(True, description="run the full-parameter pre-training on environment transcripts")
    steps: int = Field(150, ge=0, le=1_000_000, description="pre-training optimizer steps")
    batch_size: int = Field(8, ge=1, le=1024, description="sequences per pre-training step")
    learning_rate: float = Field(3e-3, gt=0, le=1.0, description="AdamW peak learning rate (cosine decay)")
    warmup_steps: int = Field(10, ge=0, le=100_000, description="linear warm-up steps")
    noisy_fraction: float = Field(0.5, ge=0.0, le=1.0, description="share of random (noisy) answers vs heuristic")
    examples_per_env: int = Field(96, ge=1, le=1_000_000, description="training conversations per environment")
    max_turns_per_episode: int = Field(12, ge=1, le=10_000, description="turns taken from one episode")
    max_seq_len: int = Field(1024, ge=64, le=131_072, description="pre-training sequences are cut to this")
    envs: tuple[str, ...] = Field((), description="environments to learn from; empty = every registered one")

    @model_validator(mode="after")
    def _shapes(self) -> TinyModelSpec:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        head_dim = self.hidden_size // self.num_heads
        if head_dim not in VLLM_HEAD_SIZES:
            raise ValueError(f"head size {head_dim} is not one vLLM supports {VLLM_HEAD_SIZES}; change num_heads")
        if self.max_seq_len > self.max_position_embeddings:
            raise ValueError("max_seq_len exceeds max_position_embeddings; lower max_seq_len")
        return self


# ---- naming and caching -------------------------------------------------------


def rlpipe_home() -> Path:
    """Where rlpipe keeps local state: $RLPIPE_HOME, default ~/.rlpipe."""
    return Path(os.environ.get("RLPIPE_HOME") or Path.home() / ".rlpipe").expanduser()


def spec_hash(spec: TinyModelSpec) -> str:
    """A short digest of everything that determines the build (recipe version, parameters, environment list)."""
    payload = {"format": TINY_FORMAT_VERSION, "spec": spec.model_dump(mode="json"), "envs": env_list(spec)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def default_tiny_dir(spec: TinyModelSpec | None = None) -> Path:
    """The cache folder for ``spec`` (default parameters when None): $RLPIPE_HOME/models/tiny-<hash>."""
    return rlpipe_home() / "models" / tiny_folder_name(spec_hash(spec or TinyModelSpec()))


def _marker_matches(folder: Path, key: str) -> bool:
    marker = read_marker(folder)
    return marker is not None and marker.get("spec_hash") == key


def _is_empty_dir(folder: Path) -> bool:
    return folder.is_dir() and not any(folder.iterdir())


# ---- public entry points ------------------------------------------------------


def build_tiny_model(
    out_dir: str | Path | None = None,
    seed: int = 0,
    pretrain: bool = True,
    *,
    force: bool = False,
    progress: ProgressFn | None = None,
    **overrides: Any,
) -> Path:
    """Build (or reuse) the tiny model in ``out_dir`` and return its path.

    ``overrides`` are :class:`TinyModelSpec` fields (``steps=5`` for a quick test).
    A folder whose marker matches the parameters is reused as is; one holding
    something else is refused unless ``force`` (then it is replaced); a file is refused (``NotADirectoryError``).
    """
    spec = TinyModelSpec(seed=seed, pretrain=pretrain, **overrides)
    key = spec_hash(spec)
    target = Path(out_dir).expanduser() if out_dir is not None else default_tiny_dir(spec)
    if target.exists() and not target.is_dir():  # never replaced, even with force: it is not a model's folder
        raise NotADirectoryError(f"{target} is a file: the tiny model is built into a folder; name a folder "
                                 "(new or empty) with --out")
    if not force and _marker_matches(target, key):
        _warn_if_partial(target)
        return target
    if target.exists() and not force and not _is_empty_dir(target):
        raise FileExistsError(
            f"{target} exists and is not a tiny model built with these parameters; "
            "pass --force (force=True) to replace it, or choose another folder"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        _build_into(tmp, spec, key, progress)
        _install(tmp, target, key, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(config: ModelConfig) -> str:
    """The path or hub id to load for ``config``: 'tiny' builds or reuses the local tiny model."""
    if config.base_model != "tiny":
        return check_model_path(config.base_model)
    folder = build_tiny_model(config.tiny_dir or None)
    record_tiny_model(folder)  # so the learner side finds the same weights
    return str(folder)


# ---- the build ----------------------------------------------------------------


def _build_into(folder: Path, spec: TinyModelSpec, key: str, progress: ProgressFn | None) -> None:
    """Write a complete tiny model to ``folder``; the marker goes last."""
    started = time.monotonic()
    folder.mkdir(parents=True)  # first: a folder that cannot be made fails now, not after the pre-training
    log.info("building tiny model %s in %s", key, folder)
    if progress is not None:
        progress(0, spec.steps if spec.pretrain else 0, float("nan"))
    corpus = collect_corpus(spec)
    texts = [render_chat(c) for c in corpus.conversations]
    tokenizer = train_tokenizer(texts, spec.vocab_size)
    model = init_model(spec, tokenizer)
    losses: list[dict[str, float]] = []
    if spec.pretrain and spec.steps > 0:
        encoded = [encode_conversation(tokenizer, c, spec.max_seq_len) for c in corpus.conversations]
        sequences = [(ids, mask) for ids, mask in encoded if any(mask)]  # cut before any answer: nothing to learn
        losses = pretrain(model, sequences, spec, tokenizer.token_to_id(ENDOFTEXT), progress)
    _save_model(folder, model, tokenizer)
    (folder / LOSS_FILE).write_text(json.dumps({"spec_hash": key, "curve": losses}, indent=1))
    marker = {
        "format_version": TINY_FORMAT_VERSION,
        "spec_hash": key,
        "spec": spec.model_dump(mode="json"),
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": tokenizer.get_vocab_size(),
        "final_loss": _final_loss(losses),
        "envs": corpus.envs,
        "skipped_envs": corpus.skipped,
        "conversations": len(corpus.conversations),
        "corpus_sha256": hashlib.sha256("\x00".join(texts).encode()).hexdigest(),
        "build_seconds": round(time.monotonic() - started, 1),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (folder / MARKER_FILE).write_text(json.dumps(marker, indent=1))


def _final_loss(curve: Sequence[dict[str, float]], window: int = 10) -> float | None:
    """Mean loss of the last ``window`` steps: one step's loss swings with the batch's environment mix."""
    tail = [point["loss"] for point in curve[-window:]]
    return sum(tail) / len(tail) if tail else None


def _install(tmp: Path, target: Path, key: str, force: bool) -> None:
    """Rename the finished build into place; a concurrent builder that finished first wins."""
    old: Path | None = None
    if target.exists() and (force or _is_empty_dir(target)):
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        target.rename(old)
    try:
        tmp.rename(target)
    except OSError:
        if not _marker_matches(target, key):
            raise
        log.info("another process finished %s first; using its build", target)
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _warn_if_partial(folder: Path) -> None:
    skipped = (read_marker(folder) or {}).get("skipped_envs") or {}
    if skipped:
        warnings.warn(
            f"tiny model {folder} was built without environments {sorted(skipped)}; "
            "rebuild with `rlpipe model init-tiny --force` once they import",
            stacklevel=3,
        )


# ---- model and pre-training -----------------------------------------------------


def init_model(spec: TinyModelSpec, tokenizer: Any) -> Any:
    """A randomly initialised Qwen2 causal LM sized by ``spec`` (float32, tied embeddings)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(ENDOFTEXT),
        eos_token_id=tokenizer.token_to_id(IM_END),
        pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    return Qwen2ForCausalLM(config).to(torch.float32)


def pretrain(
    model: Any,
    sequences: Sequence[tuple[list[int], list[int]]],
    spec: TinyModelSpec,
    pad_id: int,
    progress: ProgressFn | None = None,
) -> list[dict[str, float]]:
    """Full-parameter training on assistant tokens; returns the loss curve (one point per step)."""
    import torch

    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, spec))
    model.train()
    curve: list[dict[str, float]] = []
    for step in range(spec.steps):
        picks = torch.randint(len(sequences), (spec.batch_size,), generator=generator).tolist()
        loss = _train_step(model, optimizer, [sequences[i] for i in picks], pad_id)
        curve.append({"step": step + 1, "loss": loss, "lr": schedule.get_last_lr()[0]})
        schedule.step()
        if progress is not None:
            progress(step + 1, spec.steps, loss)
    model.eval()
    return curve


def _lr_factor(step: int, spec: TinyModelSpec) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _train_step(model: Any, optimizer: Any, batch: Sequence[tuple[list[int], list[int]]], pad_id: int) -> float:
    import torch

    input_ids_BT, attention_BT, labels_BT = _collate(batch, pad_id)
    out = model(input_ids=input_ids_BT, attention_mask=attention_BT, labels=labels_BT)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(out.loss.detach())


def _collate(batch: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    """Right-padded ids, attention mask and labels (-100 off the assistant tokens)."""
    import torch

    length = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), length), dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    for row, (ids, mask) in enumerate(batch):
        n = len(ids)
        input_ids[row, :n] = torch.tensor(ids)
        attention[row, :n] = 1
        labels[row, :n] = torch.where(torch.tensor(mask) == 1, torch.tensor(ids), -100)
    return input_ids, attention, labels


def _save_model(folder: Path, model: Any, tokenizer: Any) -> None:
    """Weights (safetensors), config, generation config and tokenizer, as save_pretrained writes them."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.token_to_id(IM_END),
        pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
        bos_token_id=tokenizer.token_to_id(ENDOFTEXT),
    )
    model.save_pretrained(folder, safe_serialization=True)
    wrap_tokenizer(tokenizer).save_pretrained(folder)
