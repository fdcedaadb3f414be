"""Advantages and offline sample weights: pure functions over the rows of one optimizer step.

The learner forms advantages itself (ARCHITECTURE: off-policy control) so that a
producer never has to know the training objective.  Every function here takes
plain columns of the trajectory table (lists or numpy arrays; the ``_R`` suffix
means "one entry per row") and returns a float64 numpy array with one entry per
row.  Call them on ALL rows of an optimizer step at once, before the rows are
split into micro-batches: a group mean, or the top fraction of filtered
behaviour cloning, must see the whole group / step, not one micro-batch.

Pipeline on the learner: rows -> ``compute_advantages`` -> ``training_weights``
-> ``consumers.batching.micro_batches`` -> ``consumers.losses.compute_loss``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence, Sized
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa

from consumers.state_baseline import state_baseline_gae
from schemas.config import LearnerConfig
from schemas.trajectory import discounted_returns

AdvantageKind = Literal["group", "raw", "return_to_go", "gae"]
ADVANTAGE_KINDS: tuple[str, ...] = ("group", "raw", "return_to_go", "gae")

FloatRows = Sequence[float] | np.ndarray
KeyRows = Sequence[Hashable] | np.ndarray


def _float_rows(values_R: FloatRows, name: str) -> np.ndarray:
    """A 1-D float64 copy of ``values_R``; refuses NaN/inf, which would poison a whole group's mean."""
    array_R = np.array(values_R, dtype=np.float64, copy=True).reshape(-1)
    if not np.all(np.isfinite(array_R)):
        bad = int(np.flatnonzero(~np.isfinite(array_R))[0])
        raise ValueError(f"{name}[{bad}] is {array_R[bad]}; rewards and returns must be finite numbers")
    return array_R


def _same_length(name_a: str, a: Sized, name_b: str, b: Sized) -> None:
    if len(a) != len(b):
        raise ValueError(f"{name_a} has {len(a)} rows but {name_b} has {len(b)}; pass one entry per row")


def _cell_index(keys_R: Sequence[Hashable]) -> tuple[np.ndarray, int]:
    """Dense integer id per row for its key (first-seen order), and the number of distinct keys."""
    ids: dict[Hashable, int] = {}
    cell_R = np.fromiter((ids.setdefault(key, len(ids)) for key in keys_R), dtype=np.int64, count=len(keys_R))
    return cell_R, len(ids)


def _centre_by_cell(
    values_R: np.ndarray, cell_R: np.ndarray, n_cells: int, normalize_std: bool, eps: float
) -> np.ndarray:
    """value - mean(value over its cell), optionally / (std over its cell + eps).

    The std is the population std (ddof=0), so a normalised group has unit variance
    exactly (up to eps).  A cell of one row gets exactly 0: v - v/1 == v - v.
    """
    counts_C = np.bincount(cell_R, minlength=n_cells).astype(np.float64)
    means_C = np.bincount(cell_R, weights=values_R, minlength=n_cells) / counts_C
    centred_R = values_R - means_C[cell_R]
    if normalize_std:
        variances_C = np.bincount(cell_R, weights=centred_R**2, minlength=n_cells) / counts_C
        centred_R = centred_R / (np.sqrt(variances_C)[cell_R] + eps)
    return centred_R


def group_relative(
    rewards_R: FloatRows, group_ids_R: KeyRows, normalize_std: bool = False, eps: float = 1e-6
) -> np.ndarray:
    """GRPO advantages: A_i = r_i - mean(r over i's group), optionally / (group std + eps).

    Groups are the rows sharing a ``group_id`` (the samples of one environment seed);
    they need not be contiguous.  A group of one row has no baseline to compare with
    and gets 0.  With per-turn rows every turn of an episode carries the episode
    return as ``reward``; use ``return_to_go`` advantages for those instead.
    """
    values_R = _float_rows(rewards_R, "rewards_R")
    _same_length("rewards_R", values_R, "group_ids_R", group_ids_R)
    cell_R, n_cells = _cell_index(list(group_ids_R))
    return _centre_by_cell(values_R, cell_R, n_cells, normalize_std, eps)


def raw_returns(rewards_R: FloatRows) -> np.ndarray:
    """Advantage = the row's reward as is (no baseline): plain REINFORCE, or offline data ranked by return."""
    return _float_rows(rewards_R, "rewards_R")


BaselineKind = Literal["group_turn", "step", "none"]


def returns_to_go(
    returns_to_go_R: FloatRows,
    group_ids_R: KeyRows | None = None,
    turns_R: Sequence[int] | np.ndarray | None = None,
    baseline: bool | BaselineKind = True,
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> np.ndarray:
    """Per-turn advantages for long-horizon rows (one row per turn).

    Without a baseline: A = return_to_go (REINFORCE with reward-to-go).

    With ``baseline`` (the default): A = G_t - mean(G_t over the rows of the same
    ``(group_id, turn)``), i.e. each turn is compared with the other episodes of
    its group (same environment seed) at the same turn index, optionally divided
    by that cell's std.  The baseline averages only the rows that exist: an
    episode that already ended does not count as a 0 at later turns, so a turn
    that only one episode of the group reached gets advantage 0 (the same rule
    as a group of one in ``group_relative``).  Its earlier turns still carry the
    difference to the episodes that ended sooner.  Offline data whose group ids
    are unique per episode needs ``baseline=False``, or every advantage is 0.

    ``baseline="step"``: A = G_t - mean(G_t over every row of the step), optionally
    / the step's std.  Coarser than the per-(group, turn) mean, but its std comes
    from hundreds of rows: with a nearly deterministic policy the episodes of a
    group coincide, a (group, turn) cell's std is close to 0, and dividing by it
    turns tiny differences into advantages of +/-1 (LearnerConfig.return_to_go_baseline).
    ``True`` / ``False`` mean ``"group_turn"`` / ``"none"``.
    """
    values_R = _float_rows(returns_to_go_R, "returns_to_go_R")
    kind = ("group_turn" if baseline else "none") if isinstance(baseline, bool) else baseline
    if kind == "step":
        return _centre_by_cell(values_R, np.zeros(values_R.shape[0], dtype=np.int64), 1, normalize_std, eps)
    if kind not in ("group_turn", "none"):
        raise ValueError(f"unknown return_to_go baseline {baseline!r}; choose group_turn, step or none")
    if kind == "none":
        if normalize_std:
            raise ValueError("normalize_std needs a baseline; use baseline=True or normalize_std=False")
        return values_R
    if group_ids_R is None or turns_R is None:
        raise ValueError("a per-(group, turn) baseline needs group_ids_R and turns_R; or pass baseline=False")
    _same_length("returns_to_go_R", values_R, "group_ids_R", group_ids_R)
    _same_length("returns_to_go_R", values_R, "turns_R", turns_R)
    keys_R = [(group, int(turn)) for group, turn in zip(group_ids_R, turns_R, strict=True)]
    cell_R, n_cells = _cell_index(keys_R)
    return _centre_by_cell(values_R, cell_R, n_cells, normalize_std, eps)


@dataclass(frozen=True)
class EpisodeColumns:
    """What ``gae`` advantages read beyond the other kinds: per row its state, episode and turn reward."""

    states_R: Sequence[Sequence[float] | None]
    turn_rewards_R: Sequence[Sequence[float]]
    episode_ids_R: Sequence[Hashable]
    terminated_R: Sequence[bool]
    discount: float
    gae_lambda: float


def compute_advantages(
    kind: AdvantageKind,
    rewards_R: FloatRows,
    group_ids_R: KeyRows,
    *,
    returns_to_go_R: FloatRows | None = None,
    turns_R: Sequence[int] | np.ndarray | None = None,
    normalize_std: bool = False,
    return_to_go_baseline: bool | BaselineKind = True,
    episode: EpisodeColumns | None = None,
    eps: float = 1e-6,
) -> np.ndarray:
    """Advantages of ``kind`` (``LearnerConfig.advantage``) for every row of one optimizer step.

    ``group``: group_relative(reward); ``raw``: the reward itself; ``return_to_go``:
    per-turn return-to-go minus its per-(group, turn) mean (see ``returns_to_go``);
    ``gae``: generalised advantage estimates against a value baseline of the rows'
    state (``consumers.state_baseline``, from the ``episode`` columns, whose turn
    rewards give the return-to-go it is fitted to at ``episode.discount``; the
    ``return_to_go`` column is not read), centred over the step.  ``normalize_std`` (``LearnerConfig.normalize_advantage_std``) divides by the
    std of the baseline's cell (for ``gae``: the step's), so it is refused where there is no baseline.
    """
    if kind == "group":
        return group_relative(rewards_R, group_ids_R, normalize_std=normalize_std, eps=eps)
    if kind == "raw":
        if normalize_std:
            raise ValueError("normalize_advantage_std needs a baseline; use advantage='group' or set it to false")
        return raw_returns(rewards_R)
    if kind == "return_to_go":
        if returns_to_go_R is None:
            raise ValueError("advantage='return_to_go' needs the rows' return_to_go column")
        return returns_to_go(
            returns_to_go_R, group_ids_R, turns_R, return_to_go_baseline, normalize_std=normalize_std, eps=eps
        )
    if kind == "gae":
        if episode is None or turns_R is None:
            raise ValueError("advantage='gae' needs the rows' state, turn_rewards, episode_id, turn and terminated "
                             "columns")
        estimates_R = state_baseline_gae(episode.states_R, episode.turn_rewards_R, episode.episode_ids_R, turns_R,
                                         episode.terminated_R, episode.discount, episode.gae_lambda)
        return returns_to_go(estimates_R, baseline="step", normalize_std=normalize_std, eps=eps)  # centred over the step
    raise ValueError(f"unknown advantage kind {kind!r}; choose one of {', '.join(ADVANTAGE_KINDS)}")


def discounted_returns_to_go(
    turn_rewards_R: Sequence[Sequence[float]], episode_ids_R: KeyRows, turns_R: Sequence[int] | np.ndarray,
    num_turns_R: Sequence[int] | np.ndarray, discount: float,
) -> np.ndarray:
    """G_t = sum_k discount^k r_{t+k} over the rest of each row's episode.

    A row is either a whole episode (its ``turn_rewards`` hold every turn's reward)
    or one turn of a per-turn episode (``turn_rewards`` = [r_t]).  A per-turn
    episode must be whole (turns 0 .. num_turns - 1 all present): producers write
    an episode's turns in one batch, so a batch always qualifies; offline data cut
    into windows does not, and is refused rather than given returns that silently
    stop at the window's edge.
    """
    if not 0.0 < discount <= 1.0:
        raise ValueError(f"discount must be in (0, 1], got {discount}")
    _same_length("turn_rewards_R", turn_rewards_R, "episode_ids_R", episode_ids_R)
    _same_length("turn_rewards_R", turn_rewards_R, "turns_R", turns_R)
    rows_by_episode: dict[Hashable, list[int]] = {}
    for row, episode in enumerate(episode_ids_R):
        rows_by_episode.setdefault(episode, []).append(row)
    out_R = np.zeros(len(turn_rewards_R), dtype=np.float64)
    for episode, rows in rows_by_episode.items():
        rewards = [_float_rows(turn_rewards_R[r], "turn_rewards_R") for r in rows]
        if len(rows) == 1 and len(rewards[0]) == int(num_turns_R[rows[0]]):  # a whole episode in one row
            out_R[rows[0]] = discounted_returns(list(rewards[0]), discount)[0]
            continue
        order = sorted(range(len(rows)), key=lambda i: int(turns_R[rows[i]]))
        turns = [int(turns_R[rows[i]]) for i in order]
        if turns != list(range(int(num_turns_R[rows[0]]))) or any(len(r) != 1 for r in rewards):
            raise ValueError(
                f"episode {episode} is not whole in this batch (turns {turns[:6]}...); a discount below 1 "
                "needs every turn of an episode in one batch: set learner.discount=1"
            )
        returns = discounted_returns([float(rewards[i][0]) for i in order], discount)
        out_R[[rows[i] for i in order]] = returns
    return out_R

def awr_weights(advantages_R: FloatRows, beta: float, max_weight: float) -> np.ndarray:
    """Advantage-weighted regression weights: w = min(exp(A / beta), max_weight).

    Computed as exp(min(A / beta, log max_weight)) so a huge advantage cannot overflow.
    """
    if beta <= 0 or max_weight <= 0:
        raise ValueError(f"awr needs beta > 0 and max_weight > 0 (got beta={beta}, max_weight={max_weight})")
    scaled_R = _float_rows(advantages_R, "advantages_R") / beta
    return np.exp(np.minimum(scaled_R, math.log(max_weight)))


def filtered_bc_mask(returns_R: FloatRows, fraction: float) -> np.ndarray:
    """Boolean mask of the top ``fraction`` of rows by return (filtered behaviour cloning).

    Exactly k = ceil(fraction * n) rows are kept (at least one when there are rows).
    Ties at the threshold are broken deterministically: the earlier row wins
    (a stable sort on descending return), so the same input always keeps the same rows.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"filtered_bc fraction must be in (0, 1], got {fraction}")
    values_R = _float_rows(returns_R, "returns_R")
    n_rows = values_R.shape[0]
    # round() first: 0.3 * 10 is 3.0000000000000004 in floating point, which must keep 3 rows, not 4.
    n_keep = min(n_rows, math.ceil(round(fraction * n_rows, 9)))
    order_R = np.argsort(-values_R, kind="stable")
    keep_R = np.zeros(n_rows, dtype=bool)
    keep_R[order_R[:n_keep]] = True
    return keep_R


def _sample_weights(weights_R: Sequence[float | None] | np.ndarray | None, n_rows: int) -> np.ndarray:
    """Per-row weights from the optional ``weight`` column: missing (None) means 1."""
    if weights_R is None:
        return np.ones(n_rows, dtype=np.float64)
    _same_length("weights_R", weights_R, "advantages_R", range(n_rows))
    filled_R = [1.0 if w is None else w for w in weights_R]
    return _float_rows(filled_R, "weights_R")


def training_weights(
    config: LearnerConfig,
    advantages_R: FloatRows,
    weights_R: Sequence[float | None] | np.ndarray | None = None,
) -> np.ndarray:
    """Per-row loss weights for one optimizer step: the row's own weight times what the loss asks for.

    ``awr``: weight * awr_weights(A); ``filtered_bc``: weight * [row in the top
    fraction by advantage] (use ``advantage='raw'`` to rank by return, the classic
    recipe); any other loss: the row's weight.  The result goes into
    ``TokenBatch.weights_B``; ``compute_loss`` trains awr and filtered_bc as
    weighted cross-entropy with exactly those weights.  It must be computed over
    the whole step, because the top fraction of a micro-batch is not the top
    fraction of the step.
    """
    advantages = _float_rows(advantages_R, "advantages_R")
    base_R = _sample_weights(weights_R, advantages.shape[0])
    if config.loss == "awr":
        return base_R * awr_weights(advantages, config.awr_beta, config.awr_max_weight)
    if config.loss == "filtered_bc":
        return base_R * filtered_bc_mask(advantages, config.filtered_bc_fraction)
    return base_R


def with_discounted_returns(table: pa.Table, discount: float) -> pa.Table:
    """``table`` with ``return_to_go`` recomputed at ``discount`` (whole batch, before any row is dropped)."""
    cols = table.select(["turn_rewards", "episode_id", "turn", "num_turns"]).to_pydict()
    returns_R = discounted_returns_to_go(cols["turn_rewards"], cols["episode_id"], cols["turn"], cols["num_turns"],
                                         discount)
    index = table.schema.get_field_index("return_to_go")
    return table.set_column(index, table.schema.field(index), pa.array(returns_R, type=pa.float32()))
