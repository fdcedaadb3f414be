"""A bound on how far one optimizer step may move the policy (``learner.max_step_kl``).

Adam moves each LoRA parameter by about the learning rate per step, whatever the
size of its gradient, so one step can move a lot of probability, including to
answers nothing in the batch pushed up: in a seed-1 run of the demo the mean probability
of an empty answer went from 0.02 to 0.38 in one step (docs/demo.md, "Seed 1").  With
``learner.max_step_kl`` set, the learner checks each step after it is taken: the
KL divergence from the policy before the step to the policy after it, over the whole
next-token distribution at the answer positions of a sample of the step's rows
(``learner.trust_region_rows``), summed over each answer's positions and averaged
over the answers.  A step above the bound is shrunk, a backtracking line search on
the step's direction: the parameters go to ``before + s * (after - before)`` with
``s`` halved until the KL is within the bound, at most ``MAX_HALVINGS`` times.
Adam's moments keep the whole gradient's statistics; only the move is shortened.

The cost is two no-grad forwards of the sampled rows per trial (the policy before
the step and at the trial's scale, the parameters swapped in turn), one trial when the
step is within the bound; one probe micro-batch's distributions (its answer tokens x
the vocabulary) are held at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from consumers.token_batch import TokenBatch

MAX_HALVINGS = 8  # the smallest step kept is 1/256 of Adam's

# A batch's next-token log-distributions (N, V) at its answer positions, in row-major order, without gradients.
Distributions = Callable[[TokenBatch], torch.Tensor]


def take_rows(batch: TokenBatch, rows: Sequence[int]) -> TokenBatch:
    """The sub-batch of ``rows`` (every per-row tensor indexed by them)."""
    index = torch.as_tensor(list(rows), dtype=torch.long, device=batch.tokens_BT.device)
    taken = {f.name: None if getattr(batch, f.name) is None else getattr(batch, f.name).index_select(0, index)
             for f in fields(batch)}  # fmt: skip
    return TokenBatch(**taken)


def probe_batches(micro_batches: Sequence[TokenBatch], rows: int) -> list[TokenBatch]:
    """At most ``rows`` rows of the step, spread evenly over its micro-batches and over each one's rows."""
    total = sum(batch.num_sequences for batch in micro_batches)
    if total == 0 or rows <= 0:
        return []
    stride = -(-total // rows)  # ceil: never more than ``rows``
    probes, offset = [], 0
    for batch in micro_batches:
        first = (-offset) % stride  # keep one stride across micro-batch boundaries
        picked = list(range(first, batch.num_sequences, stride))
        offset += batch.num_sequences
        if picked:
            probes.append(take_rows(batch, picked))
    return probes


def answer_kl(before_NV: torch.Tensor, after_NV: torch.Tensor, answers: int) -> float:
    """KL(before || after) of log-distributions (N, V), summed over the N positions, per answer."""
    if answers <= 0:
        return 0.0
    kl_N = (before_NV.exp() * (before_NV - after_NV)).sum(dim=-1)
    return float(kl_N.sum()) / answers


@dataclass(frozen=True)
class TrustRegionResult:
    """What the bound did to one step."""

    step_kl: float  # KL per answer of the step as kept
    full_step_kl: float  # KL per answer of Adam's whole step
    step_scale: float  # the share of Adam's step kept (1 = all of it)


class TrustRegion:
    """Measure a step's KL on sampled rows and shrink the step into ``max_kl``."""

    def __init__(self, max_kl: float, rows: int, distributions: Distributions,
                 agree: Callable[[float], float] = lambda kl: kl) -> None:
        """``agree`` turns a measured KL into the one every process acts on (a torchrun group: rank 0's)."""
        if max_kl <= 0:
            raise ValueError(f"max_step_kl must be > 0, got {max_kl}")
        self.max_kl, self.rows, self.distributions, self.agree = max_kl, rows, distributions, agree

    @torch.no_grad()
    def bound(
        self,
        micro_batches: Sequence[TokenBatch],
        params: Sequence[torch.nn.Parameter],
        previous: Sequence[torch.Tensor],
        device: torch.device,
    ) -> TrustRegionResult:
        """After the optimizer step: shrink the move from ``previous`` to ``params`` until its KL is within bound.

        Each probe micro-batch is scored before and after the move in turn (the parameters swapped), so only
        one micro-batch's distributions are held at a time, whatever the vocabulary and the answers' length.
        """
        probes = [probe.to(device) for probe in probe_batches(micro_batches, self.rows)]
        answers = sum(probe.num_sequences for probe in probes)
        stepped = [p.detach().clone() for p in params]

        def place(scale: float) -> None:
            for p, old, new in zip(params, previous, stepped, strict=True):
                p.copy_(new if scale == 1.0 else old + scale * (new - old))

        def kl_at(scale: float) -> float:
            total = 0.0
            for probe in probes:
                place(0.0)
                before_NV = self.distributions(probe)
                place(scale)
                total += answer_kl(before_NV, self.distributions(probe), 1)
            return self.agree(total / answers if answers else 0.0)

        full = kl = kl_at(1.0)
        scale = 1.0
        for _ in range(MAX_HALVINGS):
            if kl <= self.max_kl:
                break
            scale /= 2
            kl = kl_at(scale)
        place(scale)
        return TrustRegionResult(kl, full, scale)
