"""DQN and C51 targets and losses against small cases computed by hand (arithmetic in the comments)."""

import math

import numpy as np
import pytest
import torch

from consumers.value.targets import (
    categorical_cross_entropy,
    categorical_targets,
    double_q_targets,
    huber_loss,
    n_step_returns,
    project_distribution,
    q_learning_targets,
)


def test_n_step_returns_stop_at_terminal_steps_and_window_ends():
    rewards_BK = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    discounts_BK = np.array([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    valid_BK = np.array([[True, True, True], [True, True, True], [True, True, False]])
    returns_B, bootstrap_B = n_step_returns(rewards_BK, discounts_BK, valid_BK, gamma=0.5)
    # row 0: 1 + 0.5*2 + 0.25*3 = 2.75, bootstrap 0.5^3 = 0.125
    # row 1: the second step is terminal (d=0): 1 + 0.5*2 = 2.0, nothing after it counts, bootstrap 0
    # row 2: two valid steps: 1 + 0.5*2 = 2.0, bootstrap 0.5^2 = 0.25
    np.testing.assert_allclose(returns_B, [2.75, 2.0, 2.0])
    np.testing.assert_allclose(bootstrap_B, [0.125, 0.0, 0.25])


def test_one_step_return_is_the_reward():
    returns_B, bootstrap_B = n_step_returns(np.array([[4.0]]), np.array([[1.0]]), np.array([[True]]), gamma=0.9)
    assert returns_B.tolist() == [4.0] and bootstrap_B.tolist() == pytest.approx([0.9])


REWARD_B = torch.tensor([1.0, 2.0])
BOOTSTRAP_B = torch.tensor([0.9, 0.5])
NEXT_TARGET_BA = torch.tensor([[1.0, 3.0], [5.0, 4.0]])
NEXT_ONLINE_BA = torch.tensor([[4.0, 2.0], [0.0, 1.0]])


def test_q_learning_target_takes_the_target_networks_max():
    # y = r + bootstrap * max_a Q_target: 1 + 0.9*3 = 3.7; 2 + 0.5*5 = 4.5
    y_B = q_learning_targets(REWARD_B, BOOTSTRAP_B, NEXT_TARGET_BA)
    torch.testing.assert_close(y_B, torch.tensor([3.7, 4.5]))


def test_double_q_target_scores_the_online_argmax_with_the_target_network():
    # online argmax: row 0 -> action 0, row 1 -> action 1
    # y = 1 + 0.9 * Q_target[0, 0] = 1 + 0.9*1 = 1.9;  2 + 0.5 * Q_target[1, 1] = 2 + 0.5*4 = 4.0
    y_B = double_q_targets(REWARD_B, BOOTSTRAP_B, NEXT_TARGET_BA, NEXT_ONLINE_BA)
    torch.testing.assert_close(y_B, torch.tensor([1.9, 4.0]))


def test_terminal_transitions_target_the_return_alone():
    y_B = double_q_targets(REWARD_B, torch.zeros(2), NEXT_TARGET_BA, NEXT_ONLINE_BA)
    torch.testing.assert_close(y_B, REWARD_B)


def test_huber_loss_is_quadratic_inside_delta_and_linear_outside():
    td_B = torch.tensor([0.5, -2.0, 3.0], requires_grad=True)
    loss_B = huber_loss(td_B, delta=1.0)
    # 0.5 * 0.5^2 = 0.125;  1 * (2 - 0.5) = 1.5;  1 * (3 - 0.5) = 2.5
    torch.testing.assert_close(loss_B, torch.tensor([0.125, 1.5, 2.5]))
    loss_B.sum().backward()
    # gradient: x inside, delta * sign(x) outside
    torch.testing.assert_close(td_B.grad, torch.tensor([0.5, -1.0, 1.0]))
    # delta 2: 3 is outside, 2 * (3 - 1) = 4;  -2 is on the edge, 0.5 * 4 = 2
    torch.testing.assert_close(huber_loss(torch.tensor([3.0, -2.0]), delta=2.0), torch.tensor([4.0, 2.0]))


SUPPORT_N = torch.tensor([-1.0, 0.0, 1.0])  # 3 atoms, dz = 1
PROBS_N = torch.tensor([0.2, 0.3, 0.5])


@pytest.mark.parametrize(
    ("reward", "bootstrap", "expected"),
    [
        # Tz = 0.5 + 0.5 z = [0, 0.5, 1]: 0.2 lands on 0; 0.3 at 0.5 splits 0.15/0.15 between 0 and 1;
        # 0.5 lands on 1  ->  [0, 0.2 + 0.15, 0.15 + 0.5] = [0, 0.35, 0.65]
        (0.5, 0.5, [0.0, 0.35, 0.65]),
        # Tz = 1.5 + z = [0.5, 1.5, 2.5], clipped to [0.5, 1, 1]: 0.2 splits 0.1/0.1 between 0 and 1;
        # the rest lands on 1  ->  [0, 0.1, 0.1 + 0.3 + 0.5] = [0, 0.1, 0.9]
        (1.5, 1.0, [0.0, 0.1, 0.9]),
        # terminal (bootstrap 0): every atom sits at -0.25, 1/4 of the way from -1 to 0 -> [0.25, 0.75, 0]
        (-0.25, 0.0, [0.25, 0.75, 0.0]),
        # Tz = -3 + z: everything below V_min is clipped onto it -> [1, 0, 0]
        (-3.0, 1.0, [1.0, 0.0, 0.0]),
    ],
)
def test_categorical_projection_on_three_atoms(reward, bootstrap, expected):
    target_BN = categorical_targets(torch.tensor([reward]), torch.tensor([bootstrap]), PROBS_N[None], SUPPORT_N)
    torch.testing.assert_close(target_BN, torch.tensor([expected]))


def reference_projection(atoms, probs, support):
    """The floor/ceil form of the same projection (Bellemare et al. 2017, Algorithm 1), one atom at a time."""
    v_min, v_max, n = support[0], support[-1], len(support)
    dz = (v_max - v_min) / (n - 1)
    out = [0.0] * n
    for z, p in zip(atoms, probs, strict=True):
        b = (min(max(z, v_min), v_max) - v_min) / dz
        low, high = math.floor(b), math.ceil(b)
        if low == high:
            out[low] += p
        else:
            out[low] += p * (high - b)
            out[high] += p * (b - low)
    return out


def test_projection_conserves_mass_and_matches_the_floor_ceil_algorithm():
    gen = torch.Generator().manual_seed(3)
    support_N = torch.linspace(-10.0, 10.0, 11, dtype=torch.float64)
    atoms_BN = torch.rand(16, 11, generator=gen, dtype=torch.float64) * 30.0 - 15.0  # some beyond the support
    probs_BN = torch.softmax(torch.randn(16, 11, generator=gen, dtype=torch.float64), dim=-1)
    projected_BN = project_distribution(atoms_BN, probs_BN, support_N)
    torch.testing.assert_close(projected_BN.sum(-1), torch.ones(16, dtype=torch.float64))
    assert bool((projected_BN >= 0).all())
    for b in range(16):
        expected = reference_projection(atoms_BN[b].tolist(), probs_BN[b].tolist(), support_N.tolist())
        torch.testing.assert_close(projected_BN[b], torch.tensor(expected, dtype=torch.float64))


def test_categorical_cross_entropy():
    # uniform prediction over 3 atoms, all target mass on one: -log(1/3) = log 3
    loss_B = categorical_cross_entropy(torch.tensor([[0.0, 1.0, 0.0]]), torch.zeros(1, 3))
    torch.testing.assert_close(loss_B, torch.tensor([math.log(3.0)]))
