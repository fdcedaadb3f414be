"""Per-turn advantages against a baseline of the environment's state (``advantage: gae``).

Long-horizon rows (one row per turn) judge a turn by its discounted return-to-go,
which mostly says how far the episode is from its end: on CartPole a push's
effect on the return is small next to the luck of the pushes after it. Where the
environment has a numeric state (the ``state`` column: the numbers the turn's
prompt showed), the learner fits a value baseline of that state on the step's own
rows and forms generalised advantage estimates (Schulman et al. 2016):

    delta_t = r_t + discount * V(s_{t+1}) - V(s_t)
    A_t     = delta_t + discount * lambda * A_{t+1}

``V`` is a ridge regression of the discounted return on quadratic features of
the standardised state (1, z, and z_i z_j; linear only beyond ``QUADRATIC_UP_TO``
numbers).  The return-to-go is computed here from the turn rewards at the same
``discount`` the advantages use, G_t = r_t + discount * G_{t+1}, not read from the
rows (producers write it undiscounted): a baseline of another return would bias
every advantage. After a terminal turn the future is 0; after a truncated
episode's last turn (cut by a time limit) it is the baseline of that turn's own
state, which stands in for the unrecorded state after the cut.  So are the
baseline's own targets: a turn k turns before the cut is fitted to

    G_t + discount^k * V(s_last)

and not to its k rewards alone, which would make V depend on how near the limit
a row was (the state does not show it) and bias it low for states often seen
near the limit.  V = x w is then the fixed point of the ridge fit of its own
targets, solved in closed form (``bootstrapped_values``).  At ``discount = 1`` an
endless task has no finite value and that fixed point does not exist, so there
the targets stop at the cut, as if the time limit were part of the task.  So
they do where the fixed point is ill-conditioned (a step of a few rows and many
features) and puts a value far outside what any state can be worth, min(0, min r)
/ (1 - discount) to max(0, max r) / (1 - discount).

The baseline is fitted per step from that step's rows and nothing else, by one
deterministic solve, so a step's advantages depend only on its rows: a step
trained again after a restart gets the same ones.

With ``lambda = 1`` the estimate is the return-to-go minus the baseline; with
``lambda = 0`` it is the one-step TD error, which leans most on the baseline.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from schemas.trajectory import discounted_returns

QUADRATIC_UP_TO = 16  # states with more numbers (board games' grids) get linear features
RIDGE = 1e-2  # on standardised features
OUT_OF_REACH = 0.25  # a bootstrapped baseline this far (of the reachable span) outside it is refused


def state_features(states_RS: np.ndarray) -> np.ndarray:
    """1, each standardised number, and (for small states) the products of their pairs, per row."""
    mean_S = states_RS.mean(axis=0)
    std_S = states_RS.std(axis=0)
    z_RS = (states_RS - mean_S) / np.where(std_S > 1e-8, std_S, 1.0)  # a constant number becomes 0
    parts = [np.ones((len(z_RS), 1)), z_RS]
    if z_RS.shape[1] <= QUADRATIC_UP_TO:
        i, j = np.triu_indices(z_RS.shape[1])
        parts.append(z_RS[:, i] * z_RS[:, j])
    return np.hstack(parts)


def fitted_values(states_RS: np.ndarray, targets_R: np.ndarray, ridge: float = RIDGE) -> np.ndarray:
    """The ridge regression of ``targets_R`` on ``state_features(states_RS)``, evaluated on the same rows."""
    x_RF = state_features(states_RS)
    weights_F = np.linalg.solve(x_RF.T @ x_RF + ridge * np.eye(x_RF.shape[1]), x_RF.T @ targets_R)
    return x_RF @ weights_F


def bootstrapped_values(states_RS: np.ndarray, returns_R: np.ndarray, cut_weight_R: np.ndarray,
                        last_row_R: np.ndarray, ridge: float = RIDGE) -> np.ndarray:
    """The ridge fit V = x w of the targets ``returns_R + cut_weight_R * V[last_row_R]``, on the same rows.

    V is in its own targets (a truncated episode's future is the baseline of its
    last state), so w is the fixed point w = (X'X + P)^-1 X'(g + C X_last w):

        (X'X + P - X' C X_last) w = X' g

    with C = diag(cut_weight_R), X_last the features of each row's ``last_row_R`` and
    P the ridge on every feature but the constant.  The constant is not shrunk so
    that a step whose every state has the same value (all turns rewarded alike, all
    episodes cut) gets exactly that value and advantages of 0, not a shrinkage
    residue that dividing by the step's std would blow up.  With every weight 0
    this is the ridge fit of ``returns_R`` with the constant unshrunk (``fitted_values`` shrinks it too).
    """
    cut_R = cut_weight_R != 0.0
    if not cut_R.any():
        return fitted_values(states_RS, returns_R, ridge)
    x_RF = state_features(states_RS)
    penalty_F = np.full(x_RF.shape[1], ridge)
    penalty_F[0] = 0.0  # column 0 is the constant 1
    normal_FF = x_RF.T @ x_RF + np.diag(penalty_F)
    normal_FF -= (x_RF[cut_R] * cut_weight_R[cut_R, None]).T @ x_RF[last_row_R[cut_R]]
    weights_F = np.linalg.solve(normal_FF, x_RF.T @ returns_R)
    return x_RF @ weights_F


def episode_gae(rewards: Sequence[float], values: Sequence[float], last_value: float, discount: float,
                lam: float) -> list[float]:
    """Generalised advantage estimates of one episode's turns (``last_value``: the future after the last one)."""
    out, running = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        following = values[t + 1] if t + 1 < len(rewards) else last_value
        running = rewards[t] + discount * following - values[t] + discount * lam * running
        out[t] = running
    return out


def state_baseline_gae(
    states_R: Sequence[Sequence[float] | None], turn_rewards_R: Sequence[Sequence[float]],
    episode_ids_R: Sequence[Hashable], turns_R: Sequence[int], terminated_R: Sequence[bool], discount: float,
    lam: float,
) -> np.ndarray:
    """GAE of every per-turn row of one step against a value baseline of its state fitted on the step's rows.

    Every row needs a state of the same length and one turn reward; an episode's
    turns must all be in the step (producers write an episode in one batch).
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"gae_lambda must be in [0, 1], got {lam}")
    if not 0.0 < discount <= 1.0:
        raise ValueError(f"discount must be in (0, 1], got {discount}")
    lengths = {len(s) if s is not None else 0 for s in states_R}
    if not states_R or 0 in lengths:
        raise ValueError("advantage 'gae' needs each row's state (per-turn rows of an environment with a numeric "
                         "state, such as cartpole); use advantage 'return_to_go' for this environment")
    if len(lengths) > 1:
        raise ValueError(f"rows' states have different lengths {sorted(lengths)}; one step must hold one environment")
    if any(len(r) != 1 for r in turn_rewards_R):
        raise ValueError("advantage 'gae' needs one row per turn (turn_rewards of one entry); whole-episode rows "
                         "have no per-turn state: use advantage 'group'")
    episodes = _whole_episodes(episode_ids_R, turns_R)
    rewards_R = np.array([float(r[0]) for r in turn_rewards_R], dtype=np.float64)
    targets_R = np.zeros(len(states_R), dtype=np.float64)
    cut_weight_R = np.zeros(len(states_R), dtype=np.float64)  # discount^(turns to the cut); 0 where it ended
    last_row_R = np.arange(len(states_R))
    for rows in episodes:
        targets_R[rows] = discounted_returns(rewards_R[rows].tolist(), discount)
        if not terminated_R[rows[-1]] and discount < 1.0:  # at discount 1 the fixed point does not exist
            cut_weight_R[rows] = discount ** np.arange(len(rows), 0, -1)
            last_row_R[rows] = rows[-1]
    states_RS = np.asarray(states_R, dtype=np.float64)
    values_R = None
    if cut_weight_R.any():
        try:
            values_R = _reachable(bootstrapped_values(states_RS, targets_R, cut_weight_R, last_row_R), rewards_R,
                                  discount)
        except np.linalg.LinAlgError:
            values_R = None
    if values_R is None:  # nothing cut, or an ill-conditioned fixed point (a few rows, many features): the plain fit
        values_R = fitted_values(states_RS, targets_R)
    out_R = np.zeros(len(states_R), dtype=np.float64)
    for rows in episodes:
        last = rows[-1]
        after = 0.0 if terminated_R[last] else float(values_R[last])  # cut short: its own state's baseline
        out_R[rows] = episode_gae(rewards_R[rows].tolist(), values_R[rows].tolist(), after, discount, lam)
    return out_R


def _reachable(values_R: np.ndarray, rewards_R: np.ndarray, discount: float) -> np.ndarray | None:
    """``values_R`` unless one is not finite or lies further than ``OUT_OF_REACH`` of the span outside what a
    state can be worth at ``discount``, min(0, min r) / (1 - discount) to max(0, max r) / (1 - discount).

    A fit overshoots that span a little wherever its features do not fit the values (CartPole's near the time
    limit, by a few per cent); an ill-conditioned fixed point misses it by far (17 times the span on a step of
    ten rows).
    """
    if discount >= 1.0:
        return values_R
    low = min(0.0, float(rewards_R.min(initial=0.0))) / (1.0 - discount)
    high = max(0.0, float(rewards_R.max(initial=0.0))) / (1.0 - discount)
    slack = OUT_OF_REACH * (high - low) + 1e-12
    if not np.isfinite(values_R).all() or values_R.min(initial=0.0) < low - slack \
            or values_R.max(initial=0.0) > high + slack:
        return None
    return values_R


def _whole_episodes(episode_ids_R: Sequence[Hashable], turns_R: Sequence[int]) -> list[list[int]]:
    """Each episode's rows in turn order; refuses an episode whose turns are not all present."""
    rows_by_episode: dict[Hashable, list[int]] = {}
    for row, episode in enumerate(episode_ids_R):
        rows_by_episode.setdefault(episode, []).append(row)
    episodes = []
    for episode, rows in rows_by_episode.items():
        rows = sorted(rows, key=lambda r: int(turns_R[r]))
        if [int(turns_R[r]) for r in rows] != list(range(len(rows))):
            raise ValueError(f"episode {episode} is not whole in this step; advantage 'gae' needs all its turns")
        episodes.append(rows)
    return episodes
