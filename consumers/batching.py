"""From trajectory rows to padded micro-batches, and the staleness gate in front of them.

Pure functions: rows in (token lists, masks, sampler logprobs, one advantage and
weight per row), ``TokenBatch`` tensors out.  Rows keep their order (no sorting
by length), so a run is reproducible from its batch ids alone.  A micro-batch
costs about (rows x longest row) tokens of activation memory, which is what the
``micro_batch_tokens`` budget bounds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from consumers.advantages import with_discounted_returns
from consumers.losses import TokenBatch, check_behaviour_policy
from consumers.sources import BatchRef
from schemas.config import IMPORTANCE_LOSSES, LearnerConfig
from schemas.trajectory import check_trajectory_values

IntRows = Sequence[Sequence[int]] | Sequence[np.ndarray]
FloatRows = Sequence[Sequence[float]] | Sequence[np.ndarray]


def pack_by_token_budget(lengths_R: Sequence[int], micro_batch_tokens: int) -> list[list[int]]:
    """Row indices per micro-batch, in order, so that rows x longest row <= ``micro_batch_tokens``.

    Greedy and order-preserving: a row joins the current micro-batch if the padded
    size stays within the budget, otherwise it starts the next one.  A row longer
    than the budget on its own cannot be split (its tokens attend to each other),
    so it travels alone.
    """
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be positive, got {micro_batch_tokens}")
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in enumerate(lengths_R):
        widest = max(longest, int(length))
        if current and (len(current) + 1) * widest > micro_batch_tokens:
            groups.append(current)
            current, widest = [], int(length)
        current.append(index)
        longest = widest
    if current:
        groups.append(current)
    return groups


def _check_row(index: int, tokens: Sequence[int], loss_mask: Sequence[int], logprobs: Sequence[float]) -> None:
    """Lengths agree and the first token is not trained on (no earlier position predicts it)."""
    if not (len(tokens) == len(loss_mask) == len(logprobs)) or len(tokens) == 0:
        raise ValueError(
            f"row {index}: tokens ({len(tokens)}), loss_mask ({len(loss_mask)}) and logprobs ({len(logprobs)}) "
            "must have the same non-zero length"
        )
    if loss_mask[0]:
        raise ValueError(
            f"row {index}: loss_mask[0] is 1, but the first token has no context to predict it; "
            "rows must start with at least one prompt token"
        )


def check_trainable_rows(table: pa.Table, vocab_size: int) -> None:
    """Refuse a trajectory table holding a row ``pad_rows`` would refuse (``_check_row``), a loss mask other than
    0 or 1, or a token id outside ``[0, vocab_size)`` (the embedding lookup would fail): all rows at once, before
    any reaches a step."""
    if not table.num_rows:
        return
    columns = [table.column(name) for name in ("tokens", "loss_mask", "logprobs")]
    lengths = [pc.list_value_length(column) for column in columns]
    malformed = pc.or_(pc.or_(pc.not_equal(lengths[0], lengths[1]), pc.not_equal(lengths[0], lengths[2])),
                       pc.equal(lengths[0], 0))
    if not pc.any(malformed).as_py():
        malformed = pc.not_equal(pc.list_element(columns[1], 0), 0)
    if pc.any(malformed).as_py():
        index = pc.index(malformed, True).as_py()
        _check_row(index, *(column[index].as_py() for column in columns))
    masks = pc.list_flatten(columns[1])
    not_binary = pc.and_(pc.not_equal(masks, 0), pc.not_equal(masks, 1))  # every loss multiplies by the mask
    if pc.any(not_binary).as_py():
        first = pc.index(not_binary, True).as_py()
        row = pc.list_parent_indices(columns[1])[first].as_py()
        raise ValueError(f"row {row}: loss_mask holds {masks[first].as_py()}; a loss mask is 0 (context) or 1 "
                         "(a generated token to train on): rewrite the batch with 0/1 masks (weigh whole rows with the weight column)")
    flat = pc.list_flatten(columns[0])
    outside = pc.or_(pc.less(flat, 0), pc.greater_equal(flat, vocab_size))
    if pc.any(outside).as_py():
        first = pc.index(outside, True).as_py()
        row = pc.list_parent_indices(columns[0])[first].as_py()
        raise ValueError(f"row {row}: token id {flat[first].as_py()} is outside the model's vocabulary (0 to "
                         f"{vocab_size - 1}); the batch was sampled with another tokenizer than the base model's")


def check_sampler_scored(table: pa.Table, loss: str) -> None:
    """Refuse, for a ``loss`` with importance ratios, a trajectory table whose every generated token has logprob 0:
    no sampler scored its rows (demonstrations, logged data), and a ratio over them would be the policy's
    probability itself."""
    if loss not in IMPORTANCE_LOSSES:
        return
    generated = pc.filter(pc.list_flatten(table.column("logprobs")),
                          pc.equal(pc.list_flatten(table.column("loss_mask")), 1))
    if len(generated) and not pc.any(pc.not_equal(generated, 0.0)).as_py():
        raise ValueError(f"learner.loss {loss} needs the sampler's logprobs, and no sampler scored these rows (every "
                         "generated token's logprob is 0: demonstrations or logged data); train them with "
                         "cross_entropy, awr or filtered_bc")


def pad_rows(
    tokens_R: IntRows,
    loss_mask_R: IntRows,
    logprobs_R: FloatRows,
    advantages_R: Sequence[float] | np.ndarray,
    weights_R: Sequence[float] | np.ndarray | None = None,
    token_weights_R: FloatRows | None = None,
    pad_token_id: int = 0,
    temperatures_R: Sequence[float] | np.ndarray | None = None,
) -> TokenBatch:
    """Right-pad rows into one ``TokenBatch`` on the CPU (padding: token ``pad_token_id``, mask 0, logprob 0).

    ``weights_R`` defaults to 1 per row; ``token_weights_R``, if given, is one list per row like ``tokens_R``;
    ``temperatures_R`` is each row's sampling temperature (None: 1 for every row).
    """
    n_rows = len(tokens_R)
    per_row = [loss_mask_R, logprobs_R, advantages_R, *([] if temperatures_R is None else [temperatures_R])]
    if any(len(values) != n_rows for values in per_row):
        raise ValueError("tokens_R, loss_mask_R, logprobs_R, advantages_R and temperatures_R need one entry per row")
    if n_rows == 0:
        raise ValueError("cannot pad an empty list of rows; skip empty micro-batches")
    for index in range(n_rows):
        _check_row(index, tokens_R[index], loss_mask_R[index], logprobs_R[index])
    width = max(len(tokens) for tokens in tokens_R)
    tokens_BT = np.full((n_rows, width), pad_token_id, dtype=np.int64)
    mask_BT = np.zeros((n_rows, width), dtype=np.float32)
    logprobs_BT = np.zeros((n_rows, width), dtype=np.float32)
    token_weights_BT = None if token_weights_R is None else np.zeros((n_rows, width), dtype=np.float32)
    for index in range(n_rows):
        length = len(tokens_R[index])
        tokens_BT[index, :length] = tokens_R[index]
        mask_BT[index, :length] = loss_mask_R[index]
        logprobs_BT[index, :length] = logprobs_R[index]
        if token_weights_BT is not None:
            token_weights_BT[index, :length] = token_weights_R[index]
    weights_B = np.ones(n_rows, dtype=np.float32) if weights_R is None else np.asarray(weights_R, dtype=np.float32)
    return TokenBatch(
        tokens_BT=torch.from_numpy(tokens_BT),
        loss_mask_BT=torch.from_numpy(mask_BT),
        sampler_logprobs_BT=torch.from_numpy(logprobs_BT),
        advantages_B=torch.from_numpy(np.asarray(advantages_R, dtype=np.float32)),
        weights_B=torch.from_numpy(weights_B),
        token_weights_BT=None if token_weights_BT is None else torch.from_numpy(token_weights_BT),
        temperatures_B=None if temperatures_R is None else torch.from_numpy(np.asarray(temperatures_R, np.float32)),
    )


def micro_batches(
    tokens_R: IntRows,
    loss_mask_R: IntRows,
    logprobs_R: FloatRows,
    advantages_R: Sequence[float] | np.ndarray,
    micro_batch_tokens: int,
    weights_R: Sequence[float] | np.ndarray | None = None,
    token_weights_R: FloatRows | None = None,
    temperatures_R: Sequence[float] | np.ndarray | None = None,
) -> list[TokenBatch]:
    """The rows of one optimizer step as padded micro-batches within the token budget, in row order."""

    def pick(values: Sequence | np.ndarray | None, indices: list[int]) -> list | None:
        return None if values is None else [values[i] for i in indices]

    batches = []
    for indices in pack_by_token_budget([len(tokens) for tokens in tokens_R], micro_batch_tokens):
        batches.append(
            pad_rows(
                pick(tokens_R, indices),
                pick(loss_mask_R, indices),
                pick(logprobs_R, indices),
                pick(advantages_R, indices),
                pick(weights_R, indices),
                pick(token_weights_R, indices),
                temperatures_R=pick(temperatures_R, indices),
            )
        )
    return batches


def drop_stale(
    rows_versions: Sequence[int] | np.ndarray, current_version: int, max_staleness: int
) -> tuple[np.ndarray, int, dict[int, int]]:
    """Which rows are fresh enough to train on: (keep mask, rows dropped, staleness -> row count).

    staleness = current_version - policy_version.  Rows with staleness above
    ``max_staleness`` are dropped and counted (never trained silently).  A row
    from a newer version than the learner's (negative staleness, e.g. the learner
    restarted from a checkpoint older than its last publish) is kept: the
    sampler's logprobs still correct for the gap, and the histogram shows it.
    The histogram covers every row, kept or dropped, sorted by staleness.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    staleness_R = current_version - np.asarray(rows_versions, dtype=np.int64).reshape(-1)
    keep_R = staleness_R <= max_staleness
    histogram = dict(sorted(Counter(int(s) for s in staleness_R).items()))
    return keep_R, int((~keep_R).sum()), histogram


def checked_for_training(table: pa.Table, input_vocab: int, cfg: LearnerConfig) -> pa.Table:
    """A batch's rows as training takes them, or the refusal (one of ``POISON_BATCH_ERRORS``) of a batch training
    could never take: a value out of range or NaN (which would poison the weights), a token the model lacks, a
    behaviour policy or a sampler's scores the loss cannot use.  Every row is checked, stale or not, so whether a
    batch is refused does not depend on the learner's version.  Below discount 1 the returns-to-go are discounted
    here (``with_discounted_returns``)."""
    check_trajectory_values(table)
    check_trainable_rows(table, input_vocab)
    check_behaviour_policy(cfg.loss, *(table.column(name).to_pylist() for name in ("temperature", "top_p", "top_k")))
    check_sampler_scored(table, cfg.loss)
    if cfg.discount < 1.0 and table.num_rows:
        table = with_discounted_returns(table, cfg.discount)
    return table


@dataclass
class PendingBatch:
    """A batch read from the store, its fresh rows, and what was dropped."""

    ref: BatchRef
    table: pa.Table
    dropped: int
    staleness: dict[int, int]
    quarantined: bool = False  # unreadable: dead-lettered, never trained, its position still advances
