"""The training engine's request data: datums, their validation, and their packing into ``TokenBatch`` es.

A ``Datum`` is one sequence in the Tinker layout (TINKER.md section 6):
position i of ``tokens`` (the model input) predicts ``target_tokens[i]``, and
every loss input has one value per target.  rlpipe's own rows (a sequence with a
loss mask) become datums by dropping the last token for the input and the first
for the targets.

Loss inputs, all per target token:
  weights     multiplies every loss's terms (Tinker's cross-entropy weights, any float); default 1
  logprobs    the sampler's logprob of the target (the ratio losses: importance_sampling, ppo, cispo, dro)
  advantages  the target's advantage (the ratio losses)
  mask        which targets are trained tokens (1) and which are context (0); by
              default the non-zero weights (cross_entropy) or non-zero advantages
              (importance_sampling, ppo, cispo, gspo), which changes no loss or gradient, only
              which tokens the statistics count; for dro, whose penalty also acts where
              the advantage is 0, the targets with a non-zero advantage or sampler logprob
              (context targets carry 0 for both); a target of weight 0 is never in it
  sequence_ratio_mask  the targets whose log-ratios gspo's sequence ratio averages
              (non-zero = in the mean); gspo needs it and refuses a datum that marks none
  temperature the row's sampling temperature (logits are divided by it; 0 = greedy = 1)

Everything is checked before the engine touches its model, so a bad request
fails in one line naming the datum and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from consumers.losses import TokenBatch

RATIO_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo")
PER_TOKEN = ("weights", "logprobs", "advantages", "mask", "sequence_ratio_mask")


class EngineError(ValueError):
    """A request the training engine refuses; nothing was changed."""


class AdapterShapeError(EngineError):
    """A saved state of another adapter shape (rank, alpha, dropout, modules) than the adapter it would load into."""

    def __init__(self, message: str, saved: dict, current: dict) -> None:
        super().__init__(message)
        self.saved, self.current = saved, current


def _as_tensor(values: Sequence[float] | torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if values is None else torch.as_tensor(values).detach().to("cpu", dtype).reshape(-1)


@dataclass(frozen=True)
class Datum:
    """One sequence: ``tokens`` in, ``target_tokens[i]`` predicted at position i (see the module docstring)."""

    tokens: torch.Tensor
    target_tokens: torch.Tensor
    weights: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    sequence_ratio_mask: torch.Tensor | None = None
    temperature: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", _as_tensor(self.tokens, torch.int64))
        object.__setattr__(self, "target_tokens", _as_tensor(self.target_tokens, torch.int64))
        for name in PER_TOKEN:
            object.__setattr__(self, name, _as_tensor(getattr(self, name), torch.float32))

    @classmethod
    def from_sequence(cls, sequence: Sequence[int], loss_mask: Sequence[float], **per_token: Sequence[float]) -> Datum:
        """From a whole sequence with per-token inputs aligned to it (rlpipe's rows): input drops the last token."""
        shifted = {name: list(values)[1:] for name, values in per_token.items() if name in PER_TOKEN}
        rest = {name: value for name, value in per_token.items() if name not in PER_TOKEN}
        return cls(list(sequence)[:-1], list(sequence)[1:], mask=list(loss_mask)[1:], **shifted, **rest)

    def __len__(self) -> int:
        return int(self.tokens.numel())


def _check_datum(datum: Datum, loss: str, input_vocab: int, output_vocab: int) -> None:
    """Raise EngineError (without the datum's index) if ``datum`` cannot be trained with ``loss``."""
    if not isinstance(datum, Datum):
        raise EngineError(f"expected a Datum, got {type(datum).__name__}")
    n = len(datum)
    if n < 1:
        raise EngineError("tokens is empty; a datum needs at least one input token")
    for name in ("target_tokens", *PER_TOKEN):
        tensor = getattr(datum, name)
        if tensor is not None and tensor.numel() != n:
            raise EngineError(f"{name} has {tensor.numel()} values, expected {n} (one per input token)")
        if tensor is not None and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise EngineError(f"{name} holds a NaN or infinite value")
    for name, vocab in (("tokens", input_vocab), ("target_tokens", output_vocab)):
        ids = getattr(datum, name)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise EngineError(f"{name} holds id {bad}, outside the model's vocabulary [0, {vocab})")
    if loss in RATIO_LOSSES and (datum.logprobs is None or datum.advantages is None):
        raise EngineError(f"loss {loss} needs logprobs (the sampler's) and advantages for every target")
    if loss == "gspo" and datum.sequence_ratio_mask is None:
        raise EngineError("loss gspo needs sequence_ratio_mask: 1 on the sampled targets whose log-ratios the "
                          "sequence ratio averages, 0 elsewhere")
    if loss == "gspo" and not bool((datum.sequence_ratio_mask != 0).any()):
        raise EngineError("sequence_ratio_mask marks no token; mark the sampled targets (1) whose log-ratios the "
                          "sequence ratio averages")
    if not (math.isfinite(datum.temperature) and datum.temperature >= 0):
        raise EngineError(f"temperature must be >= 0 (0 = greedy), got {datum.temperature}")


def validate_datums(datums: Sequence[Datum], loss: str, input_vocab: int, output_vocab: int,
                    max_length: int | None = None) -> None:
    """Check every datum of a request before anything runs; the error names the first bad datum."""
    if not datums:
        raise EngineError("no datums; send at least one")
    for index, datum in enumerate(datums):
        if max_length is not None and isinstance(datum, Datum) and len(datum) > max_length:
            raise EngineError(f"datum {index} has {len(datum)} tokens; the model takes at most {max_length} "
                              "(its max_position_embeddings): split or shorten it")
        try:
            _check_datum(datum, loss, input_vocab, output_vocab)
        except EngineError as exc:
            raise EngineError(f"datum {index}: {exc}") from None


def micro_batch_slices(datums: Sequence[Datum], max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive [start, stop) ranges whose padded size (count x longest) stays within ``max_tokens``."""
    slices, start, longest = [], 0, 0
    for index, datum in enumerate(datums):
        longest_with = max(longest, len(datum))
        if index > start and (index - start + 1) * longest_with > max_tokens:
            slices.append((start, index))
            start, longest_with = index, len(datum)
        longest = longest_with
    slices.append((start, len(datums)))
    return slices


def _padded(rows: list[torch.Tensor], width: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=dtype)
    for b, row in enumerate(rows):
        out[b, : row.numel()] = row
    return out


def collate(
    datums: Sequence[Datum], loss: str, device: torch.device
) -> tuple[torch.Tensor, TokenBatch, torch.Tensor]:
    """(input ids (B, T), a TokenBatch aligned with the targets, lengths (B,)) on ``device``, right-padded with 0.

    The TokenBatch's ``tokens_BT`` are the targets: the losses only read its
    shape, mask and inputs, position t of every tensor describes target t.
    """
    width = max(len(d) for d in datums)

    def column(name: str, default: float) -> torch.Tensor:
        rows = [getattr(d, name) if getattr(d, name) is not None else torch.full((len(d),), default) for d in datums]
        return _padded(rows, width, torch.float32)

    weights_BT = column("weights", 1.0)
    advantages_BT = column("advantages", 0.0)
    default_mask = [(d.weights if d.weights is not None else torch.ones(len(d))) if loss not in RATIO_LOSSES
                    else d.advantages for d in datums]
    if loss == "dro":
        default_mask = [d.advantages.abs() + d.logprobs.abs() for d in datums]
    if loss in RATIO_LOSSES:  # a target of weight 0 trains nothing, so the statistics leave it out too
        default_mask = [m if d.weights is None else m * (d.weights != 0) for d, m in zip(datums, default_mask,
                                                                                             strict=True)]
    masks = [d.mask if d.mask is not None else (m != 0).float() for d, m in zip(datums, default_mask, strict=True)]
    batch = TokenBatch(
        tokens_BT=_padded([d.target_tokens for d in datums], width, torch.int64),
        loss_mask_BT=_padded(masks, width, torch.float32),
        sampler_logprobs_BT=column("logprobs", 0.0),
        advantages_B=torch.zeros(len(datums)),
        weights_B=torch.ones(len(datums)),
        token_weights_BT=weights_BT,
        temperatures_B=torch.tensor([d.temperature for d in datums], dtype=torch.float32),
        token_advantages_BT=advantages_BT if loss in RATIO_LOSSES else None,
        sequence_ratio_mask_BT=column("sequence_ratio_mask", 0.0) if loss == "gspo" else None,
    )
    input_ids_BT = _padded([d.tokens for d in datums], width, torch.int64)
    lengths_B = torch.tensor([len(d) for d in datums])
    return input_ids_BT.to(device), batch.to(device), lengths_B.to(device)

