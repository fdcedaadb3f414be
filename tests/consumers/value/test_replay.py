"""Replay memory: the sum tree, prioritized sampling and weights, state round trips, n-step steps tables."""

import numpy as np
import pyarrow as pa
import pytest
import safetensors.numpy
from scipy.stats import chisquare

from consumers.value.replay import ReplayMemory, SumTree, consumed_items, discrete_actions, steps_to_transitions
from schemas.steps import steps_to_table


def transitions(actions, observation_size=2):
    count = len(actions)
    obs = np.arange(count * observation_size, dtype=np.float32).reshape(count, observation_size)
    return {
        "observation": obs, "action": np.asarray(actions, np.int64), "reward": np.ones(count, np.float32),
        "discount": np.full(count, 0.99, np.float32), "next_observation": obs + 1.0,
        "terminal": np.zeros(count, np.bool_),
    }


# ---- sum tree ------------------------------------------------------------------------------


def test_sum_tree_totals_follow_updates():
    tree = SumTree(5)  # 8 leaves, 3 unused
    tree.set(np.arange(5), np.array([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert tree.total() == 15.0
    assert tree.nodes[2] == 1 + 2 + 3 + 4 and tree.nodes[3] == 5.0
    tree.set(np.array([2]), np.array([10.0]))  # 15 - 3 + 10 = 22
    assert tree.total() == 22.0
    tree.set(np.array([0, 0]), np.array([7.0, 0.5]))  # a repeated index keeps its last value: 22 - 1 + 0.5
    assert tree.total() == 21.5


def test_sum_tree_find_walks_to_the_leaf_holding_the_prefix():
    tree = SumTree(5)
    tree.set(np.arange(5), np.array([1.0, 2.0, 10.0, 4.0, 5.0]))  # cumulative sums 1, 3, 13, 17, 22
    prefixes = np.array([0.0, 0.99, 1.0, 2.99, 3.0, 12.99, 13.0, 21.99])
    assert tree.find(prefixes).tolist() == [0, 0, 1, 1, 2, 2, 3, 4]


# ---- sampling ------------------------------------------------------------------------------

PRIORITIES = np.array([1.0, 2.0, 3.0, 4.0])


def prioritized_memory(alpha=0.5):
    memory = ReplayMemory(8, 2, scheme="prioritized", alpha=alpha)
    memory.add(transitions([0, 1, 2, 3]))
    memory.update_priorities(np.arange(4), PRIORITIES)
    return memory


def test_prioritized_sampling_frequencies_follow_priorities_to_the_alpha():
    memory = prioritized_memory(alpha=0.5)
    draws = memory.sample(200_000, np.random.default_rng(0))["indices"]
    # P(i) = p_i^0.5 / sum_k p_k^0.5 = [1, 1.414, 1.732, 2] / 6.146 = [0.163, 0.230, 0.282, 0.325]
    expected_P = np.sqrt(PRIORITIES) / np.sqrt(PRIORITIES).sum()
    counts = np.bincount(draws, minlength=4)
    assert counts[4:].sum() == 0  # empty slots are never drawn
    assert chisquare(counts[:4], expected_P * len(draws)).pvalue > 1e-3
    np.testing.assert_allclose(counts[:4] / len(draws), expected_P, atol=0.005)


def test_importance_weights_are_n_p_to_the_minus_beta_over_the_batch_max():
    memory = prioritized_memory(alpha=0.5)
    batch = memory.sample(64, np.random.default_rng(1), beta=0.5)
    assert set(batch["indices"].tolist()) == {0, 1, 2, 3}  # every transition drawn at least once
    # The batch max is at the least likely transition (index 0), so
    # w_i = (N P_i)^-beta / (N P_0)^-beta = (p_i^alpha / p_0^alpha)^-beta = (sqrt(p_i))^-0.5
    #     = [1, 2^-0.25, 3^-0.25, 4^-0.25] = [1, 0.8409, 0.7598, 0.7071]
    hand_W = np.array([1.0, 0.8409, 0.7598, 0.7071])
    np.testing.assert_allclose(batch["weights"], hand_W[batch["indices"]], atol=1e-4)
    np.testing.assert_allclose(batch["probabilities"], (np.sqrt(PRIORITIES) / np.sqrt(PRIORITIES).sum())[batch["indices"]])


def test_beta_zero_and_uniform_sampling_give_unit_weights():
    assert np.all(prioritized_memory().sample(32, np.random.default_rng(2), beta=0.0)["weights"] == 1.0)
    memory = ReplayMemory(8, 2)
    memory.add(transitions([0, 1, 0]))
    batch = memory.sample(32, np.random.default_rng(2), beta=1.0)
    assert np.all(batch["weights"] == 1.0) and np.all(batch["probabilities"] == 1 / 3)
    assert set(batch["indices"].tolist()) <= {0, 1, 2}


def test_new_transitions_enter_at_the_largest_priority_seen():
    memory = prioritized_memory(alpha=1.0)
    memory.add(transitions([1]))
    assert memory.tree.leaves()[4] == 4.0  # max(1, 2, 3, 4)^1


def test_priorities_must_be_positive():
    with pytest.raises(ValueError, match="epsilon"):
        prioritized_memory().update_priorities(np.array([0]), np.array([0.0]))
    with pytest.raises(ValueError, match="training diverged"):  # the batches were finite
        prioritized_memory().update_priorities(np.array([0]), np.array([np.nan]))


def test_the_ring_overwrites_the_oldest_transitions():
    memory = ReplayMemory(3, 2)
    memory.add(transitions([0, 1]))
    memory.add(transitions([2, 3, 4]))
    assert len(memory) == 3 and memory.add_count == 5 and memory.cursor == 2
    assert sorted(memory.action.tolist()) == [2, 3, 4]


def test_sampling_an_empty_memory_names_the_fix():
    with pytest.raises(ValueError, match="add steps"):
        ReplayMemory(4, 2).sample(1, np.random.default_rng(0))


# ---- state ---------------------------------------------------------------------------------


def test_state_round_trips_through_safetensors_bytes():
    memory = prioritized_memory()
    memory.add(transitions([1, 0, 1, 1, 0, 1]))  # wraps around the 8 slots
    memory.update_priorities(np.array([5, 6]), np.array([9.0, 0.1]))
    blob = safetensors.numpy.save(memory.to_state_dict())
    restored = ReplayMemory.from_state_dict(safetensors.numpy.load(blob))
    for name, array in memory.to_state_dict().items():
        np.testing.assert_array_equal(restored.to_state_dict()[name], array, err_msg=name)
    assert (restored.size, restored.cursor, restored.add_count, restored.scheme) == (8, 2, 10, "prioritized")
    assert restored.tree.total() == pytest.approx(memory.tree.total())
    before = memory.sample(16, np.random.default_rng(5))
    after = restored.sample(16, np.random.default_rng(5))
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)


def test_state_keeps_the_action_reader_and_the_action_bound():
    """A SlateQ memory (actions read as the consumed item, -1 for no click, below 5 candidates) comes back as one."""
    slate = ReplayMemory.from_state_dict(ReplayMemory(4, 2, read_actions=consumed_items, num_actions=5).to_state_dict())
    assert slate.read_actions is consumed_items and slate.num_actions == 5
    plain = ReplayMemory.from_state_dict(ReplayMemory(4, 2).to_state_dict())
    assert plain.read_actions is discrete_actions and plain.num_actions is None


def test_a_state_of_a_memory_with_its_own_action_reader_needs_it_given_back():
    def first_column(table: pa.Table) -> np.ndarray:
        return np.zeros(table.num_rows, np.int64)

    state = ReplayMemory(4, 2, read_actions=first_column).to_state_dict()
    with pytest.raises(ValueError, match="read_actions="):
        ReplayMemory.from_state_dict(state)
    assert ReplayMemory.from_state_dict(state, read_actions=first_column).read_actions is first_column


def test_a_state_missing_arrays_is_refused():
    state = ReplayMemory(4, 2).to_state_dict()
    del state["priority"]
    with pytest.raises(ValueError, match="priority"):
        ReplayMemory.from_state_dict(state)


# ---- steps tables --------------------------------------------------------------------------


def episode_rows(episode_id, rewards, terminal, first_obs, actions):
    """Rows as an environment writes them: observation before the action, discount 0 on a terminal step."""
    last = len(rewards) - 1
    return [
        {
            "episode_id": episode_id, "step": t, "is_first": t == 0, "is_last": t == last,
            "is_terminal": terminal and t == last, "observation": [first_obs + t], "action": [float(actions[t])],
            "reward": rewards[t], "discount": 0.0 if terminal and t == last else 1.0,
        }
        for t in range(len(rewards))
    ]


def two_episodes():
    # episode a: 3 steps ending in a terminal state; episode b: 4 steps cut off by a time limit.
    return steps_to_table(
        episode_rows("a", [1.0, 2.0, 3.0], True, 0.0, [0, 1, 0])
        + episode_rows("b", [10.0, 20.0, 30.0, 40.0], False, 10.0, [1, 1, 0, 1])
    )


def test_n_step_transitions_stop_at_episode_ends():
    out = steps_to_transitions(two_episodes(), n_step=2, gamma=0.5)
    # a0: 1 + 0.5*2 = 2,      bootstrap 0.25 from a2 (obs 2)
    # a1: 2 + 0.5*3 = 3.5,    a2 is terminal -> discount 0
    # a2: 3 alone (the window does not run into episode b), terminal
    # b0: 10 + 0.5*20 = 20,   bootstrap 0.25 from b2 (obs 12)
    # b1: 20 + 0.5*30 = 35,   bootstrap 0.25 from b3 (obs 13)
    # b2, b3: would bootstrap from the observation after b3, which a truncated episode does not hold: dropped
    np.testing.assert_allclose(out["reward"], [2.0, 3.5, 3.0, 20.0, 35.0])
    np.testing.assert_allclose(out["discount"], [0.25, 0.0, 0.0, 0.25, 0.25])
    assert out["terminal"].tolist() == [False, True, True, False, False]
    assert out["observation"][:, 0].tolist() == [0.0, 1.0, 2.0, 10.0, 11.0]
    assert out["action"].tolist() == [0, 1, 0, 1, 1]
    np.testing.assert_allclose(out["next_observation"][[0, 3, 4], 0], [2.0, 12.0, 13.0])


def test_one_step_transitions_keep_all_but_a_truncated_episodes_last_step():
    memory = ReplayMemory(16, 1, n_step=1, gamma=0.5)
    assert memory.add_steps_table(two_episodes()) == 6  # a0 a1 a2 b0 b1 b2
    np.testing.assert_allclose(memory.reward[:6], [1.0, 2.0, 3.0, 10.0, 20.0, 30.0])
    np.testing.assert_allclose(memory.discount[:6], [0.5, 0.5, 0.0, 0.5, 0.5, 0.5])
    np.testing.assert_allclose(memory.next_observation[[0, 1, 3, 4, 5], 0], [1.0, 2.0, 11.0, 12.0, 13.0])


def test_tables_of_another_shape_are_refused():
    with pytest.raises(ValueError, match="observations have 1 values"):
        ReplayMemory(16, 4).add_steps_table(two_episodes())
    rows = episode_rows("c", [1.0, 2.0], True, 0.0, [0, 1])
    rows[0]["action"] = [0.5]
    with pytest.raises(ValueError, match="integer action"):
        ReplayMemory(16, 1).add_steps_table(steps_to_table(rows))


def test_an_episode_cut_by_the_table_end_bootstraps_only_inside_the_table():
    rows = episode_rows("x", [1.0, 2.0, 3.0], False, 0.0, [0, 1, 0])
    rows[-1]["is_last"] = False  # the episode goes on beyond this table
    out = steps_to_transitions(steps_to_table(rows + episode_rows("y", [5.0], True, 9.0, [1])), n_step=1, gamma=0.5)
    # x0 -> x1, x1 -> x2; x2's next observation is not in the table (y0 belongs to another episode): dropped
    assert out["observation"][:, 0].tolist() == [0.0, 1.0, 9.0]
    assert out["next_observation"][:2, 0].tolist() == [1.0, 2.0]
    assert out["terminal"].tolist() == [False, False, True]


def test_a_table_in_several_chunks_gives_the_same_transitions():
    table = two_episodes()
    chunked = pa.concat_tables([table.slice(0, 4), table.slice(4)])  # as a Parquet file read in row groups
    whole, pieces = steps_to_transitions(table, 2, 0.5), steps_to_transitions(chunked, 2, 0.5)
    for name in whole:
        np.testing.assert_array_equal(whole[name], pieces[name], err_msg=name)


def slate_rows(click_positions):
    """One RecSim-like episode: slates of 2 of 3 candidates, the clicked slot as the click_position feature."""
    last = len(click_positions) - 1
    return [
        {
            "episode_id": "s", "step": t, "is_first": t == 0, "is_last": t == last, "is_terminal": t == last,
            "observation": [float(t)], "action": [2.0, 0.0], "reward": 1.0, "discount": 0.0 if t == last else 1.0,
            "features": {"click_position": slot},
        }
        for t, slot in enumerate(click_positions)
    ]


def test_consumed_items_are_the_clicked_slots_candidates_or_minus_one():
    table = steps_to_table(slate_rows([1.0, -1.0, 0.0]), ["click_position"])
    assert consumed_items(table).tolist() == [0, -1, 2]  # slate (2, 0): slot 1 is candidate 0, slot 0 candidate 2


@pytest.mark.parametrize("slot", [None, float("nan"), 0.5, -2.0])
def test_a_click_position_that_names_no_slot_is_refused_not_read_as_no_click(slot):
    table = steps_to_table(slate_rows([1.0, slot, 0.0]), ["click_position"])
    with pytest.raises(ValueError, match="click_position"):
        consumed_items(table)
