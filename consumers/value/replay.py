"""A bounded replay memory of n-step transitions, sampled uniformly or by priority.

Steps tables (``schemas.steps``) -> ``add_steps_table`` -> transitions -> ``sample``.
A transition is (observation, action, reward, discount, next observation,
terminal): ``reward`` is the n-step return and ``discount`` the factor on the next
state's value (see ``targets.n_step_returns``).  Transitions are formed within one
episode and never across two; the steps table does not hold the observation after
an episode's last step, so a truncated episode's last n transitions (which would
bootstrap from it) are not formed.  An episode must arrive whole in one table.

Prioritized sampling (Schaul et al. 2016): P(i) = p_i^alpha / sum_k p_k^alpha with
a sum tree over p_i^alpha (O(log C) draws and updates); new transitions get the
largest priority seen so far, so each is sampled at least once soon.  Importance
weights w_i = (N P(i))^-beta / max_batch w, normalised by the batch's largest as
Dopamine does.  The whole state is numpy arrays (``to_state_dict``), ready for
safetensors; nothing is pickled.

A transition's action is one integer.  DQN and C51 read it from the one-value
``action`` column (``discrete_actions``); SlateQ's is the item the user consumed
(``consumed_items``: the candidate index the ``click_position`` feature points at in
the slate the ``action`` column holds, -1 for no click).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
import pyarrow as pa

from consumers.value.config import ValueLearnerConfig
from consumers.value.targets import n_step_returns
from schemas.steps import check_steps_table

Scheme = Literal["uniform", "prioritized"]
_FIELDS = ("observation", "action", "reward", "discount", "next_observation", "terminal")
CLICK_SLOT_FEATURE = "click_position"  # a slate environment's clicked slot (RecSim's feature), -1 for no click
ActionReader = Callable[[pa.Table], np.ndarray]


class SumTree:
    """A binary tree whose leaves are priorities and whose inner nodes hold the sums below them.

    Node 1 is the root; node k has children 2k and 2k+1; leaf i is node ``leaf0 + i``.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"sum tree capacity {capacity} must be at least 1")
        self.capacity = capacity
        self.leaf0 = 1 << max(capacity - 1, 0).bit_length()  # first power of two >= capacity
        self.nodes = np.zeros(2 * self.leaf0, dtype=np.float64)

    def total(self) -> float:
        return float(self.nodes[1])

    def leaves(self) -> np.ndarray:
        return self.nodes[self.leaf0 : self.leaf0 + self.capacity]

    def set(self, indices: np.ndarray, values: np.ndarray) -> None:
        """Set leaves and recompute their ancestors' sums (duplicates: the last value wins)."""
        nodes = np.asarray(indices, dtype=np.int64) + self.leaf0
        self.nodes[nodes] = values
        while nodes[0] > 1:
            nodes = np.unique(nodes // 2)
            self.nodes[nodes] = self.nodes[2 * nodes] + self.nodes[2 * nodes + 1]

    def find(self, prefix_B: np.ndarray) -> np.ndarray:
        """The leaf i each prefix sum falls in: sum_{k<i} p_k <= prefix < sum_{k<=i} p_k."""
        prefix_B = np.array(prefix_B, dtype=np.float64)
        node_B = np.ones(prefix_B.shape, dtype=np.int64)
        while node_B[0] < self.leaf0:
            left_B = 2 * node_B
            go_right_B = prefix_B >= self.nodes[left_B]
            prefix_B = np.where(go_right_B, prefix_B - self.nodes[left_B], prefix_B)
            node_B = np.where(go_right_B, left_B + 1, left_B)
        # Rounding can step onto an empty leaf past the end; fall back to the last filled one.
        return np.minimum(node_B - self.leaf0, self.capacity - 1)


class ReplayMemory:
    """A ring buffer of ``capacity`` transitions with observations of ``observation_size`` floats."""

    def __init__(
        self, capacity: int, observation_size: int, scheme: Scheme = "uniform", alpha: float = 0.5,
        n_step: int = 1, gamma: float = 0.99, read_actions: ActionReader | None = None,
        num_actions: int | None = None,
    ) -> None:
        if capacity < 1 or observation_size < 1 or n_step < 1:
            raise ValueError(f"capacity {capacity}, observation_size {observation_size}, n_step {n_step}: each >= 1")
        if scheme not in ("uniform", "prioritized"):
            raise ValueError(f"replay scheme {scheme!r}: use 'uniform' or 'prioritized'")
        self.capacity, self.observation_size = capacity, observation_size
        self.scheme, self.alpha, self.n_step, self.gamma = scheme, float(alpha), n_step, float(gamma)
        self.read_actions = read_actions or discrete_actions
        self.num_actions = num_actions  # actions (slateq: candidates) a stored one must be below; None: unchecked
        self.observation = np.zeros((capacity, observation_size), np.float32)
        self.action = np.zeros(capacity, np.int64)
        self.reward = np.zeros(capacity, np.float32)
        self.discount = np.zeros(capacity, np.float32)
        self.next_observation = np.zeros((capacity, observation_size), np.float32)
        self.terminal = np.zeros(capacity, np.bool_)
        self.tree = SumTree(capacity)
        self.size = self.cursor = self.add_count = 0
        self.max_priority = 1.0

    def __len__(self) -> int:
        return self.size

    # ---- adding ------------------------------------------------------------------------
    def add(self, transitions: dict[str, np.ndarray]) -> None:
        """Append a batch of transitions (arrays keyed like ``_FIELDS``), overwriting the oldest."""
        count = len(transitions["action"])
        if count == 0:
            return
        keep = min(count, self.capacity)  # a batch larger than the memory keeps its newest part
        slots = (self.cursor + np.arange(keep)) % self.capacity
        for name in _FIELDS:
            getattr(self, name)[slots] = transitions[name][count - keep :]
        self.tree.set(slots, np.full(keep, self.max_priority**self.alpha))
        self.cursor = int((self.cursor + keep) % self.capacity)
        self.size = min(self.size + keep, self.capacity)
        self.add_count += count

    def add_steps_table(self, table: pa.Table) -> int:
        """Form n-step transitions from a steps table's episodes and add them; return how many."""
        transitions = self.transitions_of(table)
        self.add(transitions)
        return len(transitions["action"])

    def transitions_of(self, table: pa.Table) -> dict[str, np.ndarray]:
        """The n-step transitions of a steps table, checked to fit this memory; a ``ValueError`` naming the first
        problem (observations of another width, an action outside ``0..num_actions-1``, a NaN or infinity)."""
        if table.num_rows == 0:
            return {name: getattr(self, name)[:0] for name in _FIELDS}
        transitions = steps_to_transitions(table, self.n_step, self.gamma, self.read_actions)
        if transitions["observation"].shape[1] != self.observation_size:
            raise ValueError(
                f"steps table observations have {transitions['observation'].shape[1]} values, "
                f"the memory holds {self.observation_size}; build the memory for this environment"
            )
        actions = transitions["action"]
        floor = -1 if self.read_actions is consumed_items else 0  # slateq's -1: the user clicked nothing
        upper = self.num_actions if self.num_actions is not None else np.iinfo(np.int64).max
        bad = (actions < floor) | (actions >= upper)
        if bad.any():
            allowed = f"{floor}..{upper - 1}" if self.num_actions is not None else f"{floor} or more"
            raise ValueError(f"steps table holds action {int(actions[bad][0])}, outside {allowed} for this run's "
                             "agent; the table is of another environment or action encoding")
        return transitions

    # ---- sampling ----------------------------------------------------------------------
    def sample(self, batch_size: int, rng: np.random.Generator, beta: float = 0.5) -> dict[str, np.ndarray]:
        """A batch of transitions plus ``indices``, ``probabilities`` and importance ``weights``."""
        if self.size == 0:
            raise ValueError("sample() on an empty replay memory; add steps first")
        if self.scheme == "uniform":
            indices = rng.integers(0, self.size, size=batch_size)
            probabilities = np.full(batch_size, 1.0 / self.size)
        else:
            total = self.tree.total()
            # Clamped: rounding may step past the last filled leaf of a memory not yet full.
            indices = np.minimum(self.tree.find(rng.random(batch_size) * total), self.size - 1)
            probabilities = self.tree.leaves()[indices] / total
        # w_i = (N P(i))^-beta / max_j w_j   (uniform: all 1)
        weights = (self.size * probabilities) ** -beta
        batch = {name: getattr(self, name)[indices] for name in _FIELDS}
        batch.update(indices=indices, probabilities=probabilities, weights=(weights / weights.max()).astype(np.float32))
        return batch

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """Set p_i for sampled transitions (e.g. |TD error| + epsilon); no-op when uniform."""
        priorities = np.asarray(priorities, dtype=np.float64)
        if not np.all(np.isfinite(priorities)):  # the batches are checked finite: the network's values are not
            raise ValueError("the TD errors are not finite: training diverged; lower value.learner.learning_rate "
                             "or scale the rewards down")
        if np.any(priorities <= 0):
            raise ValueError("priorities must be positive; add a small epsilon to |TD error|")
        if self.scheme == "prioritized":
            self.tree.set(indices, priorities**self.alpha)
            self.max_priority = max(self.max_priority, float(priorities.max()))

    # ---- state -------------------------------------------------------------------------
    def to_state_dict(self) -> dict[str, np.ndarray]:
        """Everything, as numpy arrays (safetensors-ready)."""
        state = {name: getattr(self, name).copy() for name in _FIELDS}
        state["priority"] = self.tree.leaves().copy()
        state["counters"] = np.array([self.size, self.cursor, self.add_count, self.n_step], np.int64)
        state["scalars"] = np.array([self.alpha, self.gamma, self.max_priority], np.float64)
        state["prioritized"] = np.array([self.scheme == "prioritized"], np.bool_)
        # [reader, num_actions]: the reader's index in _READERS (-1: one of the caller's), num_actions -1 for None
        reader = _READERS.index(self.read_actions) if self.read_actions in _READERS else -1
        state["actions"] = np.array([reader, -1 if self.num_actions is None else self.num_actions], np.int64)
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, np.ndarray], read_actions: ActionReader | None = None) -> ReplayMemory:
        """The memory ``to_state_dict`` described (capacity and sizes read off the arrays).

        The action reader is the one the memory had (``discrete_actions`` for a state written without it);
        a memory built with a reader of the caller's own needs it given back as ``read_actions``.
        """
        missing = {*_FIELDS, "priority", "counters", "scalars", "prioritized"} - set(state)
        if missing:
            raise ValueError(f"replay state lacks {sorted(missing)}; was it written by ReplayMemory.to_state_dict?")
        size, cursor, add_count, n_step = (int(v) for v in state["counters"])
        alpha, gamma, max_priority = (float(v) for v in state["scalars"])
        capacity, observation_size = state["observation"].shape
        scheme: Scheme = "prioritized" if bool(state["prioritized"][0]) else "uniform"
        reader, num_actions = (int(v) for v in state.get("actions", np.array([0, -1])))
        if read_actions is None and not 0 <= reader < len(_READERS):
            raise ValueError("this replay state's memory read actions with a reader of its own; pass it back: "
                             "ReplayMemory.from_state_dict(state, read_actions=...)")
        memory = cls(capacity, observation_size, scheme, alpha, n_step, gamma,
                     read_actions or _READERS[reader], None if num_actions < 0 else num_actions)
        for name in _FIELDS:
            getattr(memory, name)[:] = state[name]
        memory.tree.set(np.arange(capacity), state["priority"])
        memory.size, memory.cursor, memory.add_count, memory.max_priority = size, cursor, add_count, max_priority
        return memory


def build_replay_memory(config: ValueLearnerConfig, observation_size: int,
                        num_actions: int | None = None) -> ReplayMemory:
    """The replay memory ``config`` describes, for observations of ``observation_size`` floats and actions below
    ``num_actions`` (slateq: the candidates)."""
    return ReplayMemory(
        config.replay_capacity, observation_size, config.replay_scheme, config.priority_alpha, config.n_step,
        config.gamma, consumed_items if config.agent == "slateq" else discrete_actions, num_actions,
    )


def steps_to_transitions(table: pa.Table, n_step: int, gamma: float,
                         read_actions: ActionReader | None = None) -> dict[str, np.ndarray]:
    """n-step transitions from a steps table, one per step whose window stays inside its episode.

    Rows must be grouped by episode in step order (as environments and importers write them).
    """
    check_steps_table(table)
    episode_R = table["episode_id"].to_numpy(zero_copy_only=False)
    step_R = table["step"].to_numpy()
    reward_R = table["reward"].to_numpy().astype(np.float64)
    discount_R = table["discount"].to_numpy().astype(np.float64)
    is_last_R = table["is_last"].to_numpy(zero_copy_only=False)
    is_terminal_R = table["is_terminal"].to_numpy(zero_copy_only=False)
    obs_RO = _vectors(table["observation"], "observation")
    for name, values in (("reward", reward_R), ("discount", discount_R), ("observation", obs_RO)):
        finite_R = np.isfinite(values.reshape(len(values), -1)).all(axis=1)
        if not finite_R.all():
            row = int(np.flatnonzero(~finite_R)[0])
            raise ValueError(f"steps column {name!r} holds a NaN or infinity (row {row}, episode "
                             f"{episode_R[row]}); the environment or importer that wrote it is at fault")
    action_R = (read_actions or discrete_actions)(table)
    n_rows = table.num_rows
    # An episode is a run of equal ids with consecutive steps; it ends at is_last or where the id changes.
    same_next_R = np.zeros(n_rows, bool)
    same_next_R[:-1] = (episode_R[1:] == episode_R[:-1]) & (step_R[1:] == step_R[:-1] + 1) & ~is_last_R[:-1]
    # Step k of row t's window is row t+k; it counts while rows t..t+k are one episode.
    index_RK = np.arange(n_rows)[:, None] + np.arange(n_step)
    rows_RK = np.minimum(index_RK, n_rows - 1)
    continues_RK = np.ones((n_rows, n_step), bool)
    continues_RK[:, 1:] = same_next_R[rows_RK[:, :-1]] & (index_RK[:, 1:] < n_rows)
    valid_RK = np.logical_and.accumulate(continues_RK, axis=1)
    returns_R, bootstrap_R = n_step_returns(reward_R[rows_RK], discount_R[rows_RK], valid_RK, gamma)
    steps_R = valid_RK.sum(axis=1)
    last_in_window_R = rows_RK[np.arange(n_rows), steps_R - 1]
    terminal_R = is_terminal_R[last_in_window_R] | (discount_R[last_in_window_R] == 0.0)
    # The next observation is the row after the window, if that row continues the episode.
    has_next_R = same_next_R[last_in_window_R] & (steps_R == n_step)
    keep_R = terminal_R | has_next_R
    next_rows_R = np.minimum(last_in_window_R + 1, n_rows - 1)
    next_obs_RO = np.where(has_next_R[:, None], obs_RO[next_rows_R], obs_RO)
    return {
        "observation": obs_RO[keep_R],
        "action": action_R[keep_R],
        "reward": returns_R[keep_R],
        "discount": np.where(terminal_R, 0.0, bootstrap_R)[keep_R].astype(np.float32),
        "next_observation": next_obs_RO[keep_R],
        "terminal": terminal_R[keep_R],
    }


def _vectors(column: pa.ChunkedArray, name: str) -> np.ndarray:
    """A list<float32> column of equal-length rows as a (rows, width) array."""
    flat = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    lengths = flat.value_lengths().to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths != lengths[0]).any():
        raise ValueError(f"steps column {name!r} has rows of different lengths; one environment per table")
    width = int(lengths[0]) if len(lengths) else 0
    return flat.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(len(flat), width)


def discrete_actions(table: pa.Table) -> np.ndarray:
    """Discrete actions from the one-value ``action`` vectors."""
    values = _vectors(table["action"], "action")
    if values.shape[1] != 1 or not np.all(values == np.round(values)):
        raise ValueError("value agents need one integer action per step; this table holds continuous actions "
                         "or slates (a slate table trains agent slateq)")
    return values[:, 0].astype(np.int64)


def consumed_items(table: pa.Table) -> np.ndarray:
    """The candidate each step's user consumed: slate[click_position], or -1 for no click.

    ``action`` holds the slate (candidate indices, in slate order), the ``click_position``
    feature the clicked slot (-1: no click), as RecSim's environment records them.
    """
    if CLICK_SLOT_FEATURE not in table.schema.names:
        raise ValueError(f"steps table has no {CLICK_SLOT_FEATURE!r} feature: not a slate environment's table; "
                         "slateq trains on recsim-interest-evolution")
    slate_RK = np.rint(_vectors(table["action"], "action")).astype(np.int64)
    slot_values_R = table[CLICK_SLOT_FEATURE].to_numpy(zero_copy_only=False).astype(np.float64)  # null: NaN
    named_R = np.isfinite(slot_values_R) & (slot_values_R == np.round(slot_values_R)) & (slot_values_R >= -1)
    if not named_R.all():
        row = int(np.flatnonzero(~named_R)[0])
        raise ValueError(f"steps feature {CLICK_SLOT_FEATURE!r} is {slot_values_R[row]} in row {row} (episode "
                         f"{table['episode_id'][row]}): not a slot nor -1 for no click; the table is malformed")
    slot_R = slot_values_R.astype(np.int64)
    if (slate_RK < 0).any():
        raise ValueError("steps table holds a slate with a negative candidate index; the table is malformed")
    if slate_RK.shape[1] == 0 or (slot_R >= slate_RK.shape[1]).any():
        raise ValueError(f"click_position beyond the slate of {slate_RK.shape[1]} items; the table is malformed")
    consumed_R = slate_RK[np.arange(len(slot_R)), np.maximum(slot_R, 0)]
    return np.where(slot_R >= 0, consumed_R, -1)


_READERS: tuple[ActionReader, ...] = (discrete_actions, consumed_items)  # what a state's reader index means
