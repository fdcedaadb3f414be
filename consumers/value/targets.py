"""Bootstrapped targets and losses of the DQN family, as pure functions.

Shapes are named by suffix: ``_B`` per transition, ``_K`` per step of an n-step
window, ``_A`` per action, ``_N`` per atom.  ``bootstrap_B`` is the factor that
multiplies the next state's value: gamma^m times the environment's discounts over
the m steps summed, and 0 once the episode terminated (so no value leaks across a
terminal state).  The n-step sums run on numpy (they are computed once, when steps
enter the replay memory); the rest is torch and differentiable where it must be.
"""

from __future__ import annotations

import numpy as np
import torch


def n_step_returns(
    rewards_BK: np.ndarray, discounts_BK: np.ndarray, valid_BK: np.ndarray, gamma: float
) -> tuple[np.ndarray, np.ndarray]:
    """Discounted sums over windows of up to K steps, and the bootstrap factor after them.

    ``discounts_BK`` is the environment's per-step discount (0 on a terminal step);
    ``valid_BK`` is a prefix mask (False once the window runs past the episode).
    With c_0 = 1 and c_{k+1} = c_k * gamma * d_k over the m valid steps:
      G_B         = sum_{k<m} c_k r_k
      bootstrap_B = c_m            (0 if a terminal step is inside the window)
    """
    factors_BK = np.where(valid_BK, gamma * discounts_BK, 1.0)
    # Exclusive cumulative product: c_k = prod_{j<k} factor_j.
    cum_BK = np.cumprod(np.concatenate([np.ones_like(factors_BK[:, :1]), factors_BK[:, :-1]], axis=1), axis=1)
    returns_B = np.where(valid_BK, cum_BK * rewards_BK, 0.0).sum(axis=1)
    bootstrap_B = factors_BK.prod(axis=1)
    return returns_B.astype(np.float32), bootstrap_B.astype(np.float32)


def q_learning_targets(rewards_B: torch.Tensor, bootstrap_B: torch.Tensor, next_q_target_BA: torch.Tensor) -> torch.Tensor:
    """DQN (Mnih et al. 2015): y = G + bootstrap * max_a Q_target(s', a)."""
    return rewards_B + bootstrap_B * next_q_target_BA.max(dim=-1).values


def double_q_targets(
    rewards_B: torch.Tensor, bootstrap_B: torch.Tensor, next_q_target_BA: torch.Tensor, next_q_online_BA: torch.Tensor
) -> torch.Tensor:
    """Double DQN (van Hasselt et al. 2016): the online network picks, the target network scores.

      a* = argmax_a Q_online(s', a);   y = G + bootstrap * Q_target(s', a*)
    """
    best_B = next_q_online_BA.argmax(dim=-1, keepdim=True)
    return rewards_B + bootstrap_B * next_q_target_BA.gather(-1, best_B).squeeze(-1)


def huber_loss(td_B: torch.Tensor, delta: float = 1.0) -> torch.Tensor:
    """Per-transition Huber loss of the TD error x:

      0.5 x^2                  if |x| <= delta
      delta (|x| - delta / 2)  otherwise
    """
    abs_B = td_B.abs()
    quadratic_B = torch.clamp(abs_B, max=delta)
    return 0.5 * quadratic_B**2 + delta * (abs_B - quadratic_B)


def project_distribution(atoms_BN: torch.Tensor, probs_BN: torch.Tensor, support_N: torch.Tensor) -> torch.Tensor:
    """Project mass ``probs_BN`` sitting at ``atoms_BN`` onto the evenly spaced ``support_N``.

    Equation (7) of Bellemare, Dabney & Munos (2017), as Dopamine's rainbow agent
    computes it: with dz = (V_max - V_min) / (N - 1) and Tz_j clipped to [V_min, V_max],
      (Phi T Z)_i = sum_j [1 - |clip(Tz_j) - z_i| / dz]_0^1  p_j
    Each atom's mass is split between the two support points around it in
    proportion to closeness, so total mass is conserved.
    """
    v_min, v_max = support_N[0], support_N[-1]
    delta_z = (v_max - v_min) / (support_N.shape[0] - 1)
    clipped_BN = atoms_BN.clamp(v_min, v_max)
    # weight_BIJ = [1 - |clip(Tz_j) - z_i| / dz]_0^1, I the target atom, J the source atom.
    distance_BIJ = (clipped_BN[:, None, :] - support_N[None, :, None]).abs()
    weight_BIJ = (1.0 - distance_BIJ / delta_z).clamp(0.0, 1.0)
    return (weight_BIJ * probs_BN[:, None, :]).sum(dim=-1)


def categorical_targets(
    rewards_B: torch.Tensor, bootstrap_B: torch.Tensor, next_probs_BN: torch.Tensor, support_N: torch.Tensor
) -> torch.Tensor:
    """C51's target: the next distribution shifted by the Bellman operator, then projected.

      Tz_j = G + bootstrap * z_j;   m = Phi(Tz, p(s', a*))
    With bootstrap 0 (terminal) every atom lands on G, so all mass goes to the points around G.
    """
    atoms_BN = rewards_B[:, None] + bootstrap_B[:, None] * support_N[None, :]
    return project_distribution(atoms_BN, next_probs_BN, support_N)


def categorical_cross_entropy(target_BN: torch.Tensor, logits_BN: torch.Tensor) -> torch.Tensor:
    """Per-transition cross-entropy -sum_i m_i log p_i, p = softmax(logits) (the C51 loss)."""
    return -(target_BN * torch.log_softmax(logits_BN, dim=-1)).sum(dim=-1)
