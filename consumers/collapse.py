"""Signs of policy collapse per optimizer step, the warning they raise, and the uncertain-group filter.

RL on games fails in a recognisable way (NOTES: RL collapse on games, RAGEN's
"Echo Trap"): the spread of rewards within a group shrinks first, then the
policy locks into one answer, every sample of a group is the same, every
advantage is 0 and the loss is exactly 0.  The learner records, per step:

- ``identical_group_share``: share of groups (with at least two episodes) whose
  episodes all generated the same tokens (per-turn rows: the same answer at
  every turn, so the same episode);
- ``zero_advantage_share``: share of trained rows whose advantage is 0;
- ``reward_spread``: mean over groups of the population std of the episode
  rewards within the group (the early warning: it falls before the mean does);
- ``entropy_mean``: the policy's entropy per generated token (``consumers.losses``).

They reach the step log, the report and ``/metrics`` as ordinary step metrics.
``CollapseMonitor`` logs one warning each time a sign crosses its threshold
(``LearnerConfig.warn_*``) and one line when it comes back, not one per step.
The two relative signs (entropy and spread below a fraction of the first
steps') are also what a policy that has *learned* the task shows: it samples
alike and scores alike.  So they count only while the step's mean reward has
not risen above the first steps' by more than the first steps' within-group
reward spread (with no spread to compare with, they always count).

Pure functions over the columns of one step's rows (``_R`` = one entry per row);
the monitor holds the only state (the first steps' entropy and spread, which the
relative thresholds compare with; a restarted learner takes them afresh).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.config import LearnerConfig

log = logging.getLogger("rlpipe.learner")

_ZERO_ADVANTAGE = 1e-8  # |A| below this counts as no learning signal


def episode_answers(
    tokens_R: Sequence[Sequence[int]], loss_mask_R: Sequence[Sequence[int]], episode_ids_R: Sequence[Hashable],
    turns_R: Sequence[int],
) -> dict[Hashable, tuple[tuple[int, ...], ...]]:
    """Each episode's generated tokens (loss mask 1), one tuple per row in turn order."""
    by_episode: dict[Hashable, list[tuple[int, tuple[int, ...]]]] = {}
    for tokens, mask, episode, turn in zip(tokens_R, loss_mask_R, episode_ids_R, turns_R, strict=True):
        answer = tuple(int(t) for t, m in zip(tokens, mask, strict=True) if m)
        by_episode.setdefault(episode, []).append((int(turn), answer))
    return {episode: tuple(answer for _, answer in sorted(rows)) for episode, rows in by_episode.items()}


def _episodes_by_group(group_ids_R: Sequence[Hashable], episode_ids_R: Sequence[Hashable]) -> dict[Hashable, list]:
    """group -> its distinct episodes, in first-seen order."""
    groups: dict[Hashable, dict[Hashable, None]] = {}
    for group, episode in zip(group_ids_R, episode_ids_R, strict=True):
        groups.setdefault(group, {})[episode] = None
    return {group: list(episodes) for group, episodes in groups.items()}


def identical_group_share(
    tokens_R: Sequence[Sequence[int]], loss_mask_R: Sequence[Sequence[int]], group_ids_R: Sequence[Hashable],
    episode_ids_R: Sequence[Hashable], turns_R: Sequence[int],
) -> float:
    """Share of groups with two or more episodes whose episodes all generated the same tokens (NaN: no such group)."""
    answers = episode_answers(tokens_R, loss_mask_R, episode_ids_R, turns_R)
    compared = identical = 0
    for episodes in _episodes_by_group(group_ids_R, episode_ids_R).values():
        if len(episodes) < 2:
            continue
        compared += 1
        identical += len({answers[episode] for episode in episodes}) == 1
    return identical / compared if compared else math.nan


def zero_advantage_share(advantages_R: Sequence[float] | np.ndarray) -> float:
    """Share of rows whose advantage is 0 (no learning signal); NaN for no rows."""
    advantages_R = np.asarray(advantages_R, dtype=np.float64)
    return float(np.mean(np.abs(advantages_R) < _ZERO_ADVANTAGE)) if advantages_R.size else math.nan


def group_reward_spreads(
    rewards_R: Sequence[float] | np.ndarray, group_ids_R: Sequence[Hashable], episode_ids_R: Sequence[Hashable]
) -> dict[Hashable, float]:
    """group -> population std of its episodes' rewards (one reward per episode: its first row's)."""
    episode_reward: dict[Hashable, float] = {}
    for reward, episode in zip(rewards_R, episode_ids_R, strict=True):
        episode_reward.setdefault(episode, float(reward))
    return {
        group: float(np.std([episode_reward[e] for e in episodes]))
        for group, episodes in _episodes_by_group(group_ids_R, episode_ids_R).items()
    }


def reward_spread(
    rewards_R: Sequence[float] | np.ndarray, group_ids_R: Sequence[Hashable], episode_ids_R: Sequence[Hashable]
) -> float:
    """Mean within-group reward std over the groups with two or more episodes (NaN: no such group)."""
    sizes = {g: len(e) for g, e in _episodes_by_group(group_ids_R, episode_ids_R).items()}
    spreads = [s for g, s in group_reward_spreads(rewards_R, group_ids_R, episode_ids_R).items() if sizes[g] >= 2]
    return float(np.mean(spreads)) if spreads else math.nan


def collapse_signs(rows: pa.Table) -> dict[str, float]:
    """The signs read from the rows themselves (every row of the step, before any group filter)."""
    cols = rows.select(["tokens", "loss_mask", "group_id", "episode_id", "turn", "reward"]).to_pydict()
    return {
        "identical_group_share": identical_group_share(
            cols["tokens"], cols["loss_mask"], cols["group_id"], cols["episode_id"], cols["turn"]
        ),
        "reward_spread": reward_spread(cols["reward"], cols["group_id"], cols["episode_id"]),
    }


def keep_uncertain_groups(rows: pa.Table, fraction: float) -> pa.Table:
    """The rows of the top ``fraction`` of groups by reward spread (StarPO-S), at least one group; 1 keeps all.

    ceil(fraction x groups) groups are kept; ties in spread go to the group seen
    first, so the choice is deterministic.  Filtering whole groups leaves every
    kept row's group baseline unchanged.
    """
    if fraction >= 1.0 or rows.num_rows == 0:
        return rows
    cols = rows.select(["group_id", "episode_id", "reward"]).to_pydict()
    spreads = group_reward_spreads(cols["reward"], cols["group_id"], cols["episode_id"])
    ranked = sorted(spreads, key=lambda group: -spreads[group])  # a stable sort: ties keep first-seen order
    kept = set(ranked[: max(1, math.ceil(fraction * len(ranked)))])
    return rows.filter(pa.array([group in kept for group in cols["group_id"]]))


@dataclass
class CollapseMonitor:
    """Warns once when a sign of collapse crosses its threshold, and once when it recovers."""

    config: LearnerConfig
    baseline_samples: dict[str, list[float]] = field(default_factory=lambda: {"entropy_mean": [], "reward_spread": [], "reward_mean": []})
    crossed: set[str] = field(default_factory=set)

    def check(self, metrics: dict[str, Any]) -> list[str]:
        """Compare one step's metrics with the thresholds; log and return the newly crossed signs."""
        for name, samples in self.baseline_samples.items():
            value = metrics.get(name)
            if len(samples) < self.config.collapse_baseline_steps and _finite(value):
                samples.append(float(value))
        newly = []
        for sign, (crossing, why) in self.crossings(metrics).items():
            if crossing and sign not in self.crossed:
                self.crossed.add(sign)
                newly.append(sign)
                log.warning("signs of collapse at step %s: %s; remedies: learner.entropy_coef, learner.kl_coef, "
                            "learner.keep_uncertain_groups, a lower learning_rate", metrics.get("step", "?"), why)
            elif crossing is False and sign in self.crossed:
                self.crossed.discard(sign)
                log.info("collapse sign %s back within its threshold at step %s", sign, metrics.get("step", "?"))
        return newly

    def crossings(self, metrics: dict[str, Any]) -> dict[str, tuple[bool | None, str]]:
        """sign -> (crossed?, the sentence that says so); None when the step cannot tell (no value, no baseline)."""
        cfg = self.config
        out: dict[str, tuple[bool | None, str]] = {}
        share = metrics.get("identical_group_share")
        out["identical_group_share"] = (
            share > cfg.warn_identical_group_share if _finite(share) else None,
            f"{_pct(share)} of groups sampled identical answers (threshold {_pct(cfg.warn_identical_group_share)})",
        )
        zero = metrics.get("zero_advantage_share")
        out["zero_advantage_share"] = (
            zero > cfg.warn_zero_advantage_share if _finite(zero) else None,
            f"{_pct(zero)} of rows have advantage 0 (threshold {_pct(cfg.warn_zero_advantage_share)})",
        )
        improved, stalled = self.improved(metrics)
        for sign, fraction, what in (("entropy_mean", cfg.warn_entropy_fraction, "policy entropy"),
                                     ("reward_spread", cfg.warn_reward_spread_fraction, "within-group reward spread")):
            value, reference = metrics.get(sign), self.reference(sign)
            known = _finite(value) and reference is not None and reference > 0
            out[sign] = (
                value < fraction * reference and not improved if known else None,
                f"{what} {_num(value)} is below {fraction:g} x its first steps' {_num(reference)}{stalled}",
            )
        return out

    def improved(self, metrics: dict[str, Any]) -> tuple[bool, str]:
        """(has the mean reward risen above the first steps' by more than their reward spread?, why not)."""
        reward, first, spread = metrics.get("reward_mean"), self.reference("reward_mean"), self.reference("reward_spread")
        if not (_finite(reward) and first is not None and spread is not None and spread > 0):
            return False, ""
        return reward > first + spread, f" and the mean reward {_num(reward)} has not risen above its first steps' " \
            f"{_num(first)} + {_num(spread)}"

    def reference(self, sign: str) -> float | None:
        """Mean of the first ``collapse_baseline_steps`` values of ``sign``; None until all of them are in."""
        samples = self.baseline_samples[sign]
        return float(np.mean(samples)) if len(samples) >= self.config.collapse_baseline_steps else None


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _pct(value: Any) -> str:
    return f"{100 * value:.0f}%" if _finite(value) else "n/a"


def _num(value: Any) -> str:
    return f"{value:.3g}" if _finite(value) else "n/a"
