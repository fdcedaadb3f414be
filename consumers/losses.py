"""Token-level training objectives of the off-policy learner (plain torch, no model code).

Tinker-style losses (NOTES: reinforcement-learning details): every loss is a SUM
over generated tokens, divided by a ``normaliser`` the caller chooses for the
whole optimizer step (e.g. the number of sequences in it).  Because the sum is
not divided by anything that depends on the micro-batch, back-propagating each
micro-batch and adding the gradients gives exactly the gradient of one big batch.

Notation per token t of sequence b (all masks are 0 on prompt and padding):
  logp_t  current policy's log-probability of token t      (``token_logprobs``)
          at the row's sampling temperature T_b: log softmax(logits / T_b)
  q_t     sampler's log-probability of the same token        (``sampler_logprobs_BT``)
          under the same processed distribution
  r_t     = exp(logp_t - q_t), the importance ratio
  m_t     = loss_mask_t * token_weight_t
  w_b     per-sample weight; A_b the sequence's advantage

``importance_sampling`` (truncated IS policy gradient):
  grad = -(1/N) sum_bt k_t m_t w_b min(r_t, cap) A_b grad logp_t
  where k_t = 1 if ratio_mask_low <= r_t <= ratio_mask_high else 0 (far-off tokens dropped).
  The truncated ratio is a constant (no gradient flows through it); tokens above
  the cap still learn, with weight cap.  With the current policy equal to the
  sampler policy every r_t = 1 and this is on-policy REINFORCE.  The loss VALUE
  is -(1/N) sum k m w min(r, cap) A (the truncated-IS surrogate), obtained as
  min(r, cap).detach() * exp(logp - logp.detach()), whose value is the ratio
  term and whose gradient is exactly the one above.

``ppo`` (clipped surrogate, same ratio mask k_t):
  loss = -(1/N) sum_bt k_t m_t w_b min(r_t A_b, clip(r_t, 1-eps_low, 1+eps_high) A_b)
  (eps_low = eps_high = ``ppo_clip`` unless ``ppo_clip_low`` / ``ppo_clip_high`` say otherwise;
  a higher upper clip lets rare good tokens grow faster, against entropy collapse)

``cispo`` (clipped importance-sampling policy optimisation, as the Tinker API defines it):
  loss = -(1/N) sum_bt m_t w_b sg(clip(r_t, c_low, c_high)) A_t logp_t
  (absolute ratio thresholds, default [0, 4]: the clipped ratio is a constant
  coefficient, so no token's gradient is ever zeroed, only bounded)

``gspo`` (group sequence policy optimisation, the token-level variant, as the Tinker API defines it):
  s_b   = exp(mean of (logp_t - q_t) over the tokens of row b that sequence_ratio_mask marks)
  s_t   = sg(s_b) exp(logp_t - sg(logp_t))  (the value of s_b, the gradient of its own logp_t)
  loss = -(1/N) sum_bt m_t w_b min(s_t A_t, clip(s_t, c_low, c_high) A_t)
  (absolute thresholds on the ratio itself, like cispo's; whole sequences are kept or clipped;
  log s_b is clamped to [-20, 20], so an absurd sequence is clipped instead of overflowing)

``dro`` (direct reward optimisation with a quadratic penalty, as the Tinker API defines it):
  loss = -(1/N) sum_bt m_t w_b (A_t logp_t - beta/2 (logp_t - q_t)^2)

``cross_entropy`` (supervised; also awr and filtered_bc, whose per-row weights
``consumers.advantages.training_weights`` folds into ``weights_B`` beforehand):
  loss = -(1/N) sum_bt m_t w_b logp_t

Regularisers against collapse, added to any of the losses above (both off by default):
  entropy bonus   - (c_H/N) sum_bt m_t H_t, H_t the entropy of the policy's tempered
                  distribution at the position that predicts token t
  KL penalty      + (c_KL/N) sum_bt m_t k3_t, k3_t = exp(d_t) - d_t - 1 with
                  d_t = logref_t - logp_t (Schulman's k3: its value is unbiased for
                  KL(policy || ref) on tokens the policy sampled, always >= 0; here the
                  tokens come from the sampler, a close off-policy approximation).  Its
                  gradient in expectation is that of KL(ref || policy), the mass-covering
                  direction, not of KL(policy || ref): both hold the policy near its
                  reference, and both are 0 there
  They use m_t but not the sample weight w_b: a row that awr or filtered_bc weighs 0
  still keeps the policy near its reference and its entropy up.

The behaviour policy: producers sample from softmax(logits / T) and record its
logprobs, so every loss trains that tempered distribution, the one the producers
will sample next.  Greedy rows (T = 0) record and are scored at temperature 1.
Nucleus and top-k truncation are not reproduced, so the ratio losses refuse rows
sampled with them (``check_behaviour_policy``); cross-entropy needs no ratio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from consumers.token_batch import LossStats, TokenBatch
from schemas.config import IMPORTANCE_LOSSES, LearnerConfig
from schemas.trajectory import behaviour_policy_problem

# Log-ratios are clamped to this range for the statistics only, so one absurd
# token cannot turn the ESS into inf/inf = NaN (exp(40) ~ 2e17 still reads as absurd).
_STATS_LOG_RATIO_LIMIT = 40.0
# GSPO's sequence log-ratio is clamped to this (a ratio of 5e8, far outside any clip): its exp stays finite
_MAX_LOG_RATIO = 20.0



def logit_divisors(temperatures_B: torch.Tensor) -> torch.Tensor:
    """What each row's logits are divided by: its sampling temperature, 1 for greedy rows (temperature 0)."""
    temperatures_B = temperatures_B.float()
    return torch.where(temperatures_B > 0, temperatures_B, torch.ones_like(temperatures_B))


def token_logprobs(
    logits_BTV: torch.Tensor, tokens_BT: torch.Tensor, temperatures_B: torch.Tensor | None = None
) -> torch.Tensor:
    """logp[b, t] = log_softmax(logits[b, t-1] / T_b)[tokens[b, t]] in float32; logp[b, 0] = 0 (no context).

    ``temperatures_B`` None means temperature 1 for every row (see ``logit_divisors``).
    Computed as gathered logit minus logsumexp, in float32 whatever the model's
    dtype, because bf16 log-probabilities are too coarse for importance ratios.
    """
    if logits_BTV.dim() != 3 or tuple(logits_BTV.shape[:2]) != tuple(tokens_BT.shape):
        raise ValueError(
            f"logits {tuple(logits_BTV.shape)} and tokens {tuple(tokens_BT.shape)} disagree; "
            "expected (B, T, V) and (B, T)"
        )
    logits_BtV = logits_BTV[:, :-1].float()
    if temperatures_B is not None:
        logits_BtV = logits_BtV / logit_divisors(temperatures_B.to(logits_BtV.device))[:, None, None]
    picked_Bt = logits_BtV.gather(-1, tokens_BT[:, 1:].unsqueeze(-1)).squeeze(-1)
    logprobs_Bt = picked_Bt - torch.logsumexp(logits_BtV, dim=-1)
    return torch.nn.functional.pad(logprobs_Bt, (1, 0))


def entropy_of_logprobs(logprobs_NV: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v along the last axis of a log-softmax (differentiable)."""
    return -(logprobs_NV.exp() * logprobs_NV).sum(-1)


def entropy_of_logits(logits_NV: torch.Tensor) -> torch.Tensor:
    """H of softmax(logits) along the last axis, in float32 (differentiable)."""
    return entropy_of_logprobs(torch.log_softmax(logits_NV.float(), dim=-1))


def token_entropies(logits_BTV: torch.Tensor, temperatures_B: torch.Tensor | None = None) -> torch.Tensor:
    """H[b, t]: entropy of log_softmax(logits[b, t-1] / T_b), the distribution token t was drawn from; H[b, 0] = 0."""
    logits_BtV = logits_BTV[:, :-1].float()
    if temperatures_B is not None:
        logits_BtV = logits_BtV / logit_divisors(temperatures_B.to(logits_BtV.device))[:, None, None]
    return torch.nn.functional.pad(entropy_of_logits(logits_BtV), (1, 0))


def check_behaviour_policy(
    loss: str, temperatures_R: Sequence[float], top_ps_R: Sequence[float], top_ks_R: Sequence[int]
) -> None:
    """Refuse rows whose sampling distribution ``loss`` cannot divide by (see ``behaviour_policy_problem``)."""
    if loss not in IMPORTANCE_LOSSES:
        return
    for temperature, top_p, top_k in set(zip(temperatures_R, top_ps_R, top_ks_R, strict=True)):
        problem = behaviour_policy_problem(float(temperature), float(top_p), int(top_k))
        if problem:
            raise ValueError(
                f"learner.loss {loss} cannot train on rows sampled with temperature {temperature:g}, top_p "
                f"{top_p:g}, top_k {top_k}: {problem}; train them with cross_entropy, awr or filtered_bc"
            )


def _check_normaliser(normaliser: float) -> None:
    if not (math.isfinite(normaliser) and normaliser > 0):
        raise ValueError(f"normaliser must be a positive number (e.g. sequences per optimizer step), got {normaliser}")


def _ratio_stats(
    log_ratio_BT: torch.Tensor, generated_BT: torch.Tensor, clipped_BT: torch.Tensor, kept_BT: torch.Tensor
) -> dict[str, float]:
    """Ratio sums over generated tokens, fetched from the device in one transfer."""
    log_ratio = log_ratio_BT.detach().double().clamp(-_STATS_LOG_RATIO_LIMIT, _STATS_LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)[generated_BT]
    empty = ratio.numel() == 0
    values = torch.stack(
        [
            ratio.sum(),
            (ratio**2).sum(),
            ratio.max() if not empty else ratio.new_tensor(-math.inf),
            ratio.min() if not empty else ratio.new_tensor(math.inf),
            (clipped_BT & generated_BT).sum().double(),
            (generated_BT & ~kept_BT).sum().double(),
        ]
    ).tolist()
    return {
        "ratio_count": int(ratio.numel()),
        "ratio_sum": values[0],
        "ratio_sq_sum": values[1],
        "ratio_max": values[2],
        "ratio_min": values[3],
        "num_clipped": int(values[4]),
        "num_masked": int(values[5]),
    }


def _ratio_mask(log_ratio_BT: torch.Tensor, generated_BT: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """k_t: generated tokens whose ratio lies in [low, high] (compared in log space, no overflow)."""
    log_ratio = log_ratio_BT.detach()
    log_low = math.log(low) if low > 0 else -math.inf  # low 0 = no lower bound
    return generated_BT & (log_ratio >= log_low) & (log_ratio <= math.log(high))


def _check_thresholds(loss: str, low: float, high: float) -> None:
    if not 0 <= low <= high:
        raise ValueError(f"{loss} needs 0 <= clip_low_threshold <= clip_high_threshold, got {low} and {high}")


def _outside(log_ratio_BT: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Where the ratio lies outside the absolute thresholds [low, high] (compared in log space; 0 = no bound)."""
    log_low = math.log(low) if low > 0 else -math.inf
    log_high = math.log(high) if high > 0 else -math.inf  # an upper bound of 0 clips everything
    return (log_ratio_BT < log_low) | (log_ratio_BT > log_high)


def _finish(
    loss_sum: torch.Tensor, normaliser: float, batch: TokenBatch, generated_BT: torch.Tensor, **ratio: float
) -> tuple[torch.Tensor, LossStats]:
    """Normalised loss and its statistics (the sum is kept un-normalised so micro-batches add up)."""
    stats = LossStats(
        num_sequences=batch.num_sequences,
        num_tokens=int(generated_BT.sum()),
        loss_sum=float(loss_sum.detach()),
        **ratio,
    )
    return loss_sum / normaliser, stats


def importance_sampling_loss(
    logprobs_BT: torch.Tensor,
    batch: TokenBatch,
    normaliser: float,
    *,
    is_cap: float = 2.0,
    ratio_mask_low: float = 0.125,
    ratio_mask_high: float = 8.0,
) -> tuple[torch.Tensor, LossStats]:
    """Truncated importance-sampling policy gradient (see the module docstring for the estimator)."""
    _check_normaliser(normaliser)
    generated_BT = batch.loss_mask_BT > 0
    log_ratio_BT = (logprobs_BT - batch.sampler_logprobs_BT).detach()
    kept_BT = _ratio_mask(log_ratio_BT, generated_BT, ratio_mask_low, ratio_mask_high)
    # where() before exp(): a masked-out ratio may overflow, and inf * 0 would be NaN.
    safe_log_ratio_BT = torch.where(kept_BT, log_ratio_BT, torch.zeros_like(log_ratio_BT))
    truncated_BT = torch.exp(safe_log_ratio_BT).clamp(max=is_cap)
    # value 1, gradient grad logp: the surrogate's gradient is truncated_ratio * grad logp.
    unit_BT = torch.exp(logprobs_BT - logprobs_BT.detach())
    coef_BT = batch.weighted_mask_BT() * kept_BT * batch.weights_B.float()[:, None] * batch.advantages_BT()
    loss_sum = -(coef_BT * truncated_BT * unit_BT).sum()
    clipped_BT = kept_BT & (log_ratio_BT > math.log(is_cap))
    return _finish(
        loss_sum, normaliser, batch, generated_BT, **_ratio_stats(log_ratio_BT, generated_BT, clipped_BT, kept_BT)
    )


def ppo_loss(
    logprobs_BT: torch.Tensor,
    batch: TokenBatch,
    normaliser: float,
    *,
    clip_eps: float = 0.2,
    ratio_mask_low: float = 0.125,
    ratio_mask_high: float = 8.0,
    clip_low: float | None = None,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """PPO clipped surrogate, -min(r A, clip(r, 1-eps_low, 1+eps_high) A), summed over kept generated tokens.

    ``clip_low`` / ``clip_high`` default to ``clip_eps`` (the symmetric clip).
    The ratio mask applies here too: it drops tokens whose ratio is far out on the
    side PPO's clip does not bound (e.g. r = 50 with A < 0).
    """
    eps_low = clip_eps if clip_low is None else clip_low
    eps_high = clip_eps if clip_high is None else clip_high
    _check_normaliser(normaliser)
    generated_BT = batch.loss_mask_BT > 0
    log_ratio_BT = logprobs_BT - batch.sampler_logprobs_BT
    kept_BT = _ratio_mask(log_ratio_BT, generated_BT, ratio_mask_low, ratio_mask_high)
    advantages_BT = batch.advantages_BT()
    # Where the clip binds (A > 0 above 1+eps_high, A < 0 below 1-eps_low) min() is the constant clip(r) A.  It is
    # found in log space and taken without a gradient: exp() of a log-ratio past ~88 is inf in float32, and its
    # backward would turn the clip's zero gradient into 0 * inf = NaN for every weight of the adapter.
    log_ratio = log_ratio_BT.detach()
    log_low = math.log(1.0 - eps_low) if eps_low < 1.0 else -math.inf
    binding_BT = kept_BT & (((advantages_BT > 0) & (log_ratio > math.log(1.0 + eps_high)))
                            | ((advantages_BT < 0) & (log_ratio < log_low)))  # the clip zeroed this token's gradient
    ratio_BT = torch.exp(torch.where(kept_BT & ~binding_BT, log_ratio_BT, torch.zeros_like(log_ratio_BT)))
    clipped_ratio_BT = torch.exp(torch.where(kept_BT, log_ratio, torch.zeros_like(log_ratio))).clamp(
        1.0 - eps_low, 1.0 + eps_high)
    token_loss_BT = -torch.where(binding_BT, clipped_ratio_BT * advantages_BT, ratio_BT * advantages_BT)
    loss_sum = (token_loss_BT * batch.weighted_mask_BT() * kept_BT * batch.weights_B.float()[:, None]).sum()
    return _finish(
        loss_sum, normaliser, batch, generated_BT, **_ratio_stats(log_ratio_BT, generated_BT, binding_BT, kept_BT)
    )


def cispo_loss(
    logprobs_BT: torch.Tensor,
    batch: TokenBatch,
    normaliser: float,
    *,
    clip_low_threshold: float = 0.0,
    clip_high_threshold: float = 4.0,
) -> tuple[torch.Tensor, LossStats]:
    """CISPO: -sum sg(clip(r, low, high)) A logp over generated tokens (thresholds on the ratio itself).

    ``num_clipped`` counts tokens whose ratio lay outside [low, high]; no token is masked.
    """
    _check_normaliser(normaliser)
    _check_thresholds("cispo", clip_low_threshold, clip_high_threshold)
    generated_BT = batch.loss_mask_BT > 0
    log_ratio_BT = (logprobs_BT - batch.sampler_logprobs_BT).detach()
    coefficient_BT = torch.exp(log_ratio_BT).clamp(clip_low_threshold, clip_high_threshold)
    weight_BT = batch.weighted_mask_BT() * batch.weights_B.float()[:, None]
    loss_sum = -(weight_BT * coefficient_BT * batch.advantages_BT() * logprobs_BT).sum()
    clipped_BT = _outside(log_ratio_BT, clip_low_threshold, clip_high_threshold)
    return _finish(
        loss_sum, normaliser, batch, generated_BT,
        **_ratio_stats(log_ratio_BT, generated_BT, clipped_BT, generated_BT),
    )


def gspo_loss(
    logprobs_BT: torch.Tensor,
    batch: TokenBatch,
    normaliser: float,
    *,
    clip_low_threshold: float = 0.8,
    clip_high_threshold: float = 1.2,
) -> tuple[torch.Tensor, LossStats]:
    """GSPO-token: each generated token carries its row's sequence ratio; PPO's min over it and its clip.

    The sequence ratio is the geometric mean of the token ratios that
    ``batch.sequence_ratio_mask_BT`` marks (a row marking none gets ratio 1);
    ``num_clipped`` counts generated tokens whose sequence ratio lay outside the thresholds.
    """
    _check_normaliser(normaliser)
    if batch.sequence_ratio_mask_BT is None:
        raise ValueError("gspo needs sequence_ratio_mask_BT: the tokens whose log-ratios the sequence ratio averages")
    _check_thresholds("gspo", clip_low_threshold, clip_high_threshold)
    generated_BT = batch.loss_mask_BT > 0
    in_ratio_BT = batch.sequence_ratio_mask_BT != 0
    token_log_ratio_BT = logprobs_BT.detach() - batch.sampler_logprobs_BT
    marked_sum_B = torch.where(in_ratio_BT, token_log_ratio_BT, torch.zeros_like(token_log_ratio_BT)).sum(1)
    sequence_log_B = (marked_sum_B / in_ratio_BT.sum(1).clamp(min=1)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    sequence_log_ratio_BT = sequence_log_B[:, None].expand_as(logprobs_BT)
    # where() before exp(): only generated tokens carry the ratio, so padding never meets an overflow
    log_ratio_BT = torch.where(generated_BT, sequence_log_ratio_BT, torch.zeros_like(sequence_log_ratio_BT))
    ratio_BT = torch.exp(log_ratio_BT + logprobs_BT - logprobs_BT.detach())
    advantages_BT = batch.advantages_BT()
    objective_BT = torch.minimum(ratio_BT * advantages_BT,
                                 ratio_BT.clamp(clip_low_threshold, clip_high_threshold) * advantages_BT)
    loss_sum = -(objective_BT * batch.weighted_mask_BT() * batch.weights_B.float()[:, None]).sum()
    clipped_BT = _outside(log_ratio_BT, clip_low_threshold, clip_high_threshold)
    return _finish(
        loss_sum, normaliser, batch, generated_BT,
        **_ratio_stats(log_ratio_BT, generated_BT, clipped_BT, generated_BT),
    )


def dro_loss(
    logprobs_BT: torch.Tensor, batch: TokenBatch, normaliser: float, *, beta: float = 0.05
) -> tuple[torch.Tensor, LossStats]:
    """DRO: -sum (A logp - beta/2 (logp - q)^2) over generated tokens; the penalty keeps logp near the sampler's."""
    _check_normaliser(normaliser)
    if not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"dro needs beta >= 0, got {beta}")
    generated_BT = batch.loss_mask_BT > 0
    log_ratio_BT = logprobs_BT - batch.sampler_logprobs_BT
    objective_BT = batch.advantages_BT() * logprobs_BT - 0.5 * beta * log_ratio_BT.square()
    weight_BT = batch.weighted_mask_BT() * batch.weights_B.float()[:, None]
    loss_sum = -(weight_BT * objective_BT).sum()
    nothing_BT = torch.zeros_like(generated_BT)
    return _finish(
        loss_sum, normaliser, batch, generated_BT,
        **_ratio_stats(log_ratio_BT, generated_BT, nothing_BT, generated_BT),
    )


def cross_entropy_loss(
    logprobs_BT: torch.Tensor, batch: TokenBatch, normaliser: float
) -> tuple[torch.Tensor, LossStats]:
    """Weighted supervised loss -(1/N) sum m_t w_b logp_t over generated tokens (advantages unused)."""
    _check_normaliser(normaliser)
    generated_BT = batch.loss_mask_BT > 0
    loss_sum = -(logprobs_BT * batch.weighted_mask_BT() * batch.weights_B.float()[:, None]).sum()
    return _finish(loss_sum, normaliser, batch, generated_BT)


def compute_loss(
    config: LearnerConfig,
    logits_BTV: torch.Tensor,
    batch: TokenBatch,
    normaliser: float,
    reference_logprobs_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The loss ``config.loss`` of one micro-batch, divided by ``normaliser``; call ``backward`` on it.

    ``awr`` and ``filtered_bc`` are weighted cross-entropy: ``batch.weights_B`` must
    already hold ``consumers.advantages.training_weights(config, ...)`` for the step.
    ``reference_logprobs_BT`` is needed when ``config.kl_coef`` > 0.
    """
    return loss_from_logprobs(
        config, token_logprobs(logits_BTV, batch.tokens_BT, batch.temperatures_B), batch, normaliser,
        entropy_BT=token_entropies(logits_BTV, batch.temperatures_B), reference_logprobs_BT=reference_logprobs_BT,
    )


def loss_from_logprobs(
    config: LearnerConfig,
    logprobs_BT: torch.Tensor,
    batch: TokenBatch,
    normaliser: float,
    *,
    entropy_BT: torch.Tensor | None = None,
    reference_logprobs_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """``compute_loss`` from the current policy's token logprobs (only generated positions are read).

    ``entropy_BT`` (the policy's entropy at each generated token; with a gradient when
    ``config.entropy_coef`` > 0) is recorded in the statistics and drives the entropy
    bonus; ``reference_logprobs_BT`` drives the KL penalty (see the module docstring).
    """
    loss, stats = _objective(config, logprobs_BT, batch, normaliser)
    return regularise(config, loss, stats, logprobs_BT, batch, normaliser, entropy_BT, reference_logprobs_BT)


def regularise(
    config: LearnerConfig,
    loss: torch.Tensor,
    stats: LossStats,
    logprobs_BT: torch.Tensor,
    batch: TokenBatch,
    normaliser: float,
    entropy_BT: torch.Tensor | None,
    reference_logprobs_BT: torch.Tensor | None,
) -> tuple[torch.Tensor, LossStats]:
    """``loss`` plus the entropy bonus and the KL penalty that ``config`` asks for, with their statistics."""
    mask_BT = batch.weighted_mask_BT()
    generated_BT = batch.loss_mask_BT > 0
    extra_sum = torch.zeros((), dtype=torch.float32, device=logprobs_BT.device)
    entropy_sum = kl_sum = 0.0
    if entropy_BT is not None:
        entropy_sum = float(entropy_BT.detach()[generated_BT].sum())
        if config.entropy_coef > 0:
            extra_sum = extra_sum - config.entropy_coef * (entropy_BT * mask_BT).sum()
    elif config.entropy_coef > 0:
        raise ValueError("learner.entropy_coef > 0 needs the policy's entropies (entropy_BT)")
    if config.kl_coef > 0:
        if reference_logprobs_BT is None:
            raise ValueError("learner.kl_coef > 0 needs the reference policy's logprobs (reference_logprobs_BT)")
        delta_BT = (reference_logprobs_BT.detach() - logprobs_BT).clamp(-20.0, 20.0)
        k3_BT = torch.where(generated_BT, torch.exp(delta_BT) - delta_BT - 1.0, torch.zeros_like(delta_BT))
        kl_sum = float(k3_BT.detach().sum())
        extra_sum = extra_sum + config.kl_coef * (k3_BT * mask_BT).sum()
    stats = replace(stats, loss_sum=stats.loss_sum + float(extra_sum.detach()), entropy_sum=entropy_sum,
                    kl_sum=kl_sum)  # fmt: skip
    return loss + extra_sum / normaliser, stats


def _objective(
    config: LearnerConfig, logprobs_BT: torch.Tensor, batch: TokenBatch, normaliser: float
) -> tuple[torch.Tensor, LossStats]:
    """The policy objective ``config.loss`` alone."""
    if config.loss == "importance_sampling":
        return importance_sampling_loss(
            logprobs_BT,
            batch,
            normaliser,
            is_cap=config.is_cap,
            ratio_mask_low=config.ratio_mask_low,
            ratio_mask_high=config.ratio_mask_high,
        )
    if config.loss == "ppo":
        return ppo_loss(
            logprobs_BT,
            batch,
            normaliser,
            clip_eps=config.ppo_clip,
            ratio_mask_low=config.ratio_mask_low,
            ratio_mask_high=config.ratio_mask_high,
            clip_low=config.ppo_clip_low,
            clip_high=config.ppo_clip_high,
        )
    if config.loss in ("cross_entropy", "awr", "filtered_bc"):
        return cross_entropy_loss(logprobs_BT, batch, normaliser)
    raise ValueError(
        f"unknown loss {config.loss!r}; choose importance_sampling, ppo, cross_entropy, awr or filtered_bc"
    )
