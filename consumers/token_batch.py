"""The data the losses work on: one padded token micro-batch, and summable loss statistics.

``TokenBatch`` is what the learner and the training engine hand to every
objective in ``consumers.losses``; ``LossStats`` is what each objective returns
besides its loss, built so that statistics of micro-batches merge exactly into
those of the whole step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class TokenBatch:
    """One padded micro-batch: B sequences of T tokens (padding has loss_mask 0).

    ``sampler_logprobs_BT[b, t]`` is the sampler's logprob of ``tokens_BT[b, t]``
    (0 where loss_mask is 0).  ``weights_B`` is per sample (1 = plain);
    ``token_weights_BT``, if given, multiplies the loss mask in every loss.
    ``temperatures_B`` is each row's sampling temperature (None = 1 for every row).
    ``token_advantages_BT``, if given, replaces ``advantages_B`` with one advantage
    per token (the training engine's datums carry them so).
    ``sequence_ratio_mask_BT``, if given, marks the tokens whose log-ratios GSPO's
    sequence ratio averages (non-zero = in the mean).
    """

    tokens_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    sampler_logprobs_BT: torch.Tensor
    advantages_B: torch.Tensor
    weights_B: torch.Tensor
    token_weights_BT: torch.Tensor | None = None
    temperatures_B: torch.Tensor | None = None
    token_advantages_BT: torch.Tensor | None = None
    sequence_ratio_mask_BT: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.tokens_BT.dim() != 2 or self.tokens_BT.dtype != torch.int64:
            raise ValueError(
                f"tokens_BT must be a 2-D int64 tensor, got {self.tokens_BT.dtype} {self.shape_of('tokens_BT')}"
            )
        shape_BT = tuple(self.tokens_BT.shape)
        for name in ("loss_mask_BT", "sampler_logprobs_BT", "token_weights_BT", "token_advantages_BT",
                     "sequence_ratio_mask_BT"):
            tensor = getattr(self, name)
            if tensor is not None and tuple(tensor.shape) != shape_BT:
                raise ValueError(f"{name} has shape {self.shape_of(name)}, expected {shape_BT} like tokens_BT")
        for name in ("advantages_B", "weights_B", "temperatures_B"):
            tensor = getattr(self, name)
            if tensor is not None and tuple(tensor.shape) != shape_BT[:1]:
                raise ValueError(f"{name} has shape {self.shape_of(name)}, expected ({shape_BT[0]},): one per sequence")

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(getattr(self, name).shape)

    @property
    def num_sequences(self) -> int:
        return int(self.tokens_BT.shape[0])

    def to(self, device: torch.device | str) -> TokenBatch:
        """The same batch on ``device`` (non-blocking copies)."""
        moved = {
            f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device, non_blocking=True)
            for f in fields(self)
        }
        return TokenBatch(**moved)

    def weighted_mask_BT(self) -> torch.Tensor:
        """m_t = loss_mask * token_weight (float32)."""
        mask_BT = self.loss_mask_BT.float()
        return mask_BT if self.token_weights_BT is None else mask_BT * self.token_weights_BT.float()

    def advantages_BT(self) -> torch.Tensor:
        """A_t (float32): the per-token advantages if given, else each sequence's advantage (broadcast over T)."""
        if self.token_advantages_BT is not None:
            return self.token_advantages_BT.float()
        return self.advantages_B.float()[:, None]


@dataclass(frozen=True)
class LossStats:
    """Summable statistics of one or more micro-batches; ``merge`` combines them exactly.

    Ratios are counted over generated tokens (loss_mask > 0), before truncation
    and before the ratio mask, because they describe how far the data has
    drifted from the policy.  ``num_clipped`` counts tokens whose ratio was
    truncated at the cap (importance_sampling) or whose PPO clip was binding.
    ``cross_entropy`` records no ratios (offline data has no sampler).
    """

    num_sequences: int = 0
    num_tokens: int = 0
    loss_sum: float = 0.0
    ratio_count: int = 0
    ratio_sum: float = 0.0
    ratio_sq_sum: float = 0.0
    ratio_max: float = -math.inf
    ratio_min: float = math.inf
    num_clipped: int = 0
    num_masked: int = 0
    entropy_sum: float = 0.0
    kl_sum: float = 0.0

    def merge(self, other: LossStats) -> LossStats:
        """Statistics of both micro-batches together."""
        summed = {
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in fields(self)
            if f.name not in ("ratio_max", "ratio_min")
        }
        return LossStats(
            **summed, ratio_max=max(self.ratio_max, other.ratio_max), ratio_min=min(self.ratio_min, other.ratio_min)
        )

    @property
    def ratio_mean(self) -> float:
        return self.ratio_sum / self.ratio_count if self.ratio_count else math.nan

    @property
    def effective_sample_size(self) -> float:
        """(sum w)^2 / (n sum w^2) of the importance ratios: 1 on-policy, below ~0.3 means too much drift."""
        if not self.ratio_count or self.ratio_sq_sum == 0:
            return math.nan
        return self.ratio_sum**2 / (self.ratio_count * self.ratio_sq_sum)

    @property
    def clip_fraction(self) -> float:
        return self.num_clipped / self.num_tokens if self.num_tokens else math.nan

    @property
    def masked_fraction(self) -> float:
        return self.num_masked / self.num_tokens if self.num_tokens else math.nan

    @property
    def entropy_mean(self) -> float:
        """Mean policy entropy (nats) per generated token: a falling value is the first sign of collapse."""
        return self.entropy_sum / self.num_tokens if self.num_tokens else math.nan

    @property
    def kl_mean(self) -> float:
        """Mean k3 estimate of KL(policy || reference) per generated token (0 when no KL penalty is set)."""
        return self.kl_sum / self.num_tokens if self.num_tokens else math.nan

    def to_dict(self) -> dict[str, float]:
        """Flat numbers for metrics and events (raw sums plus the derived ratios)."""
        raw = {f.name: getattr(self, f.name) for f in fields(self)}
        derived = {
            "ratio_mean": self.ratio_mean,
            "effective_sample_size": self.effective_sample_size,
            "clip_fraction": self.clip_fraction,
            "masked_fraction": self.masked_fraction,
            "entropy_mean": self.entropy_mean,
            "kl_mean": self.kl_mean,
        }
        return {**raw, **derived}
