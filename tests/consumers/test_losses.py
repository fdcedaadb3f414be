"""Losses against references written independently here: per-token loops and closed-form gradients.

Conventions: N is the normaliser, A the advantage, w the per-sample weight,
r = exp(logp - sampler_logp).  Gradients with respect to a leaf ``logprobs``
tensor read off each token's coefficient directly: d loss / d logp_t.
"""

import math
from dataclasses import replace

import pytest
import torch

from consumers.batching import micro_batches, pad_rows
from consumers.losses import (
    LossStats,
    TokenBatch,
    check_behaviour_policy,
    cispo_loss,
    compute_loss,
    cross_entropy_loss,
    dro_loss,
    gspo_loss,
    importance_sampling_loss,
    loss_from_logprobs,
    ppo_loss,
    token_entropies,
    token_logprobs,
)
from schemas.config import LearnerConfig

B, T, V = 3, 5, 7
MASK = [[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 1, 1]]
ADVANTAGES = [1.5, -0.7, 2.0]
WEIGHTS = [1.0, 0.5, 2.0]
NORMALISER = 4.0


def reference_logp(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """log p(token t | prefix) written out: logit minus log of the summed exponentials at position t-1."""
    row = logits_BTV[b, t - 1]
    return row[tokens_BT[b, t]] - torch.log(torch.exp(row).sum())


def generated(mask=MASK):
    return [(b, t) for b in range(len(mask)) for t in range(len(mask[b])) if mask[b][t]]


@pytest.fixture
def logits():
    generator = torch.Generator().manual_seed(0)
    return torch.nn.Parameter(torch.randn(B, T, V, generator=generator))


@pytest.fixture
def tokens():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, T), generator=generator)


def batch_with_ratios(logits, tokens, ratios: dict) -> TokenBatch:
    """A batch whose sampler logprobs make r_t = ratios[(b, t)] at the current logits (1 where unset)."""
    sampler = torch.zeros(B, T)
    for b, t in generated():
        sampler[b, t] = reference_logp(logits, tokens, b, t).detach() - math.log(ratios.get((b, t), 1.0))
    return TokenBatch(
        tokens_BT=tokens,
        loss_mask_BT=torch.tensor(MASK, dtype=torch.float32),
        sampler_logprobs_BT=sampler,
        advantages_B=torch.tensor(ADVANTAGES),
        weights_B=torch.tensor(WEIGHTS),
    )


def grad_of(loss: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    (gradient,) = torch.autograd.grad(loss, parameter)
    return gradient


def leaf_batch(ratios_T: list[float], advantage: float = 1.0, weight: float = 1.0):
    """One sequence: a prompt token then len(ratios_T) generated tokens at logp = -1 with the given ratios."""
    n = len(ratios_T) + 1
    logprobs = torch.full((1, n), -1.0, requires_grad=True)
    sampler = torch.tensor([[0.0] + [-1.0 - math.log(r) for r in ratios_T]])
    batch = TokenBatch(
        tokens_BT=torch.zeros(1, n, dtype=torch.int64),
        loss_mask_BT=torch.tensor([[0.0] + [1.0] * len(ratios_T)]),
        sampler_logprobs_BT=sampler,
        advantages_B=torch.tensor([advantage]),
        weights_B=torch.tensor([weight]),
    )
    return logprobs, batch


# ---------------------------------------------------------------- token_logprobs


def test_token_logprobs_match_a_per_token_loop_and_position_zero_is_zero(logits, tokens):
    got = token_logprobs(logits, tokens)
    assert got.shape == (B, T) and got.dtype == torch.float32
    assert torch.all(got[:, 0] == 0)
    for b in range(B):
        for t in range(1, T):
            assert got[b, t].item() == pytest.approx(reference_logp(logits, tokens, b, t).item(), abs=1e-5)


def test_token_logprobs_compute_in_float32_for_bf16_logits(logits, tokens):
    logits_bf16 = logits.detach().bfloat16()
    got = token_logprobs(logits_bf16, tokens)
    assert got.dtype == torch.float32
    expected = token_logprobs(logits_bf16.float(), tokens)
    torch.testing.assert_close(got, expected)


def test_token_logprobs_at_each_rows_sampling_temperature(logits, tokens):
    """The behaviour policy of a row sampled at temperature T is softmax(logits / T); greedy rows (T = 0) score at 1."""
    temperatures_B = torch.tensor([0.7, 0.0, 2.0])
    got = token_logprobs(logits, tokens, temperatures_B)
    for b, divisor in enumerate([0.7, 1.0, 2.0]):
        for t in range(1, T):
            expected = reference_logp(logits / divisor, tokens, b, t).item()
            assert got[b, t].item() == pytest.approx(expected, abs=1e-5)


def test_importance_losses_refuse_a_behaviour_policy_they_cannot_reproduce():
    ok = dict(temperatures_R=[0.7, 1.0], top_ps_R=[1.0, 1.0], top_ks_R=[0, 0])
    check_behaviour_policy("importance_sampling", **ok)
    check_behaviour_policy("cross_entropy", temperatures_R=[0.0], top_ps_R=[0.9], top_ks_R=[5])  # no ratios
    for loss, bad, match in [
        ("importance_sampling", dict(top_ps_R=[1.0, 0.9]), "top_p"),
        ("ppo", dict(top_ks_R=[0, 40]), "top_k"),
        ("ppo", dict(temperatures_R=[0.0, 1.0]), "greedy"),
        ("ppo", dict(temperatures_R=[0.005, 1.0]), "vLLM samples at 0.01"),  # and the row would say 0.005
    ]:
        with pytest.raises(ValueError, match=match) as info:
            check_behaviour_policy(loss, **{**ok, **bad})
        assert "\n" not in str(info.value)


def test_token_logprobs_refuse_mismatched_shapes(logits):
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        token_logprobs(logits, torch.zeros(B, T + 1, dtype=torch.int64))


# ---------------------------------------------------------------- importance sampling


def test_importance_sampling_gradient_matches_truncated_reference(logits, tokens):
    # ratios: 3.0 and 2.5 are truncated at cap 2; 0.1 and 9.0 are outside [0.125, 8] and masked.
    ratios = {(0, 2): 0.5, (0, 3): 1.5, (0, 4): 3.0, (1, 1): 0.1, (1, 2): 9.0, (2, 3): 1.0, (2, 4): 2.5}
    batch = batch_with_ratios(logits, tokens, ratios)
    loss, stats = importance_sampling_loss(token_logprobs(logits, tokens), batch, NORMALISER, is_cap=2.0)

    reference = torch.zeros(())
    for b, t in generated():
        r = ratios[(b, t)]
        if 0.125 <= r <= 8.0:
            reference = reference - WEIGHTS[b] * ADVANTAGES[b] * min(r, 2.0) * reference_logp(logits, tokens, b, t)
    torch.testing.assert_close(grad_of(loss, logits), grad_of(reference / NORMALISER, logits), atol=1e-5, rtol=1e-4)
    # value: -(1/N) sum w A min(r, cap) = -(1*1.5*(0.5 + 1.5 + 2) + 2*2*(1 + 2)) / 4 = -(6 + 12) / 4 = -4.5
    assert loss.item() == pytest.approx(-4.5, rel=1e-5)
    assert (stats.num_tokens, stats.num_clipped, stats.num_masked) == (7, 2, 2)
    assert stats.ratio_max == pytest.approx(9.0, rel=1e-5) and stats.ratio_min == pytest.approx(0.1, rel=1e-5)


def test_importance_sampling_on_policy_equals_reinforce(logits, tokens):
    batch = batch_with_ratios(logits, tokens, {})  # sampler logprobs == current logprobs: every r = 1
    loss, stats = importance_sampling_loss(token_logprobs(logits, tokens), batch, NORMALISER)
    reinforce = -sum(WEIGHTS[b] * ADVANTAGES[b] * reference_logp(logits, tokens, b, t) for b, t in generated())
    torch.testing.assert_close(grad_of(loss, logits), grad_of(reinforce / NORMALISER, logits), atol=1e-5, rtol=1e-4)
    assert stats.effective_sample_size == pytest.approx(1.0)
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5) and stats.num_clipped == 0


def test_importance_sampling_truncation_and_mask_boundaries():
    # cap 2: 1.98 passes as is, 2.02 is truncated to 2; mask [0.125, 8]: 0.12 and 8.1 dropped, 0.13 and 7.9 kept
    # (7.9 is above the cap, so it trains with weight 2).  d loss / d logp_t = -w A coef_t / N with A=3, w=0.5, N=2.
    ratios = [1.98, 2.02, 0.12, 0.13, 7.9, 8.1]
    expected_coef = [1.98, 2.0, 0.0, 0.13, 2.0, 0.0]
    logprobs, batch = leaf_batch(ratios, advantage=3.0, weight=0.5)
    loss, stats = importance_sampling_loss(logprobs, batch, 2.0, is_cap=2.0)
    got = grad_of(loss, logprobs)[0]
    expected = torch.tensor([0.0] + [-0.5 * 3.0 * c / 2.0 for c in expected_coef])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # truncated: 2.02 and 7.9; masked: 0.12 and 8.1
    assert (stats.num_tokens, stats.num_clipped, stats.num_masked) == (6, 2, 2)
    assert stats.masked_fraction == pytest.approx(2 / 6)


# ---------------------------------------------------------------- PPO


def test_ppo_clipping_at_the_boundaries():
    # eps 0.2.  d(-min(rA, clip(r) A))/d logp = -A r where the unclipped term binds, else 0.
    # A=+1: r=0.79 -> -0.79 (min is rA); 0.81, 1.19 inside -> -r; 1.21 -> 0 (clip binds).
    # A=-1: r=0.79 -> 0 (clip binds: -0.8 < -0.79); 0.81, 1.19 -> +r; 1.21 -> +1.21 (min is rA = -1.21).
    ratios = [0.79, 0.81, 1.19, 1.21]
    expected = {1.0: [-0.79, -0.81, -1.19, 0.0], -1.0: [0.0, 0.81, 1.19, 1.21]}
    for advantage, coefficients in expected.items():
        logprobs, batch = leaf_batch(ratios, advantage=advantage)
        loss, stats = ppo_loss(logprobs, batch, 1.0, clip_eps=0.2)
        torch.testing.assert_close(grad_of(loss, logprobs)[0, 1:], torch.tensor(coefficients), atol=1e-5, rtol=1e-5)
        assert stats.num_clipped == 1
    # value for A=+1: -(0.79 + 0.81 + 1.19 + 1.2) = -3.99
    logprobs, batch = leaf_batch(ratios, advantage=1.0)
    assert ppo_loss(logprobs, batch, 1.0, clip_eps=0.2)[0].item() == pytest.approx(-3.99, rel=1e-5)


def test_ppo_gradient_matches_closed_form_reference(logits, tokens):
    ratios = {(0, 2): 0.5, (0, 3): 1.1, (0, 4): 1.6, (1, 1): 0.7, (1, 2): 1.05, (2, 3): 0.9, (2, 4): 20.0}
    batch = batch_with_ratios(logits, tokens, ratios)
    loss, _ = ppo_loss(token_logprobs(logits, tokens), batch, NORMALISER, clip_eps=0.2)
    # Reference: where the clip binds the token's term is a constant (no gradient); else it is -w A r(theta).
    # r = 20 is outside the ratio mask: no term at all.
    reference = torch.zeros(())
    for b, t in generated():
        r, a = ratios[(b, t)], ADVANTAGES[b]
        clip_binds = (a > 0 and r > 1.2) or (a < 0 and r < 0.8)
        if r > 8.0 or clip_binds:
            continue
        logp = reference_logp(logits, tokens, b, t)
        r_theta = torch.exp(logp - (logp.detach() - math.log(r)))
        reference = reference - WEIGHTS[b] * a * r_theta
    torch.testing.assert_close(grad_of(loss, logits), grad_of(reference / NORMALISER, logits), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- cross-entropy


def test_cross_entropy_gradient_with_sample_and_token_weights(logits, tokens):
    token_weights = torch.rand(B, T, generator=torch.Generator().manual_seed(2))
    batch = TokenBatch(
        tokens_BT=tokens,
        loss_mask_BT=torch.tensor(MASK, dtype=torch.float32),
        sampler_logprobs_BT=torch.zeros(B, T),
        advantages_B=torch.zeros(B),
        weights_B=torch.tensor(WEIGHTS),
        token_weights_BT=token_weights,
    )
    loss, stats = cross_entropy_loss(token_logprobs(logits, tokens), batch, NORMALISER)
    reference = sum(
        WEIGHTS[b]
        * token_weights[b, t]
        * torch.nn.functional.cross_entropy(logits[b, t - 1 : t], tokens[b, t : t + 1], reduction="sum")
        for b, t in generated()
    )
    torch.testing.assert_close(loss, reference / NORMALISER, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_of(loss, logits), grad_of(reference / NORMALISER, logits), atol=1e-5, rtol=1e-4)
    assert stats.num_tokens == 7 and stats.ratio_count == 0 and math.isnan(stats.effective_sample_size)


# ---------------------------------------------------------------- statistics


def test_effective_sample_size_formula():
    # ratios 1, 1, 2, 4: (sum)^2 / (n sum of squares) = 8^2 / (4 * (1 + 1 + 4 + 16)) = 64 / 88
    logprobs, batch = leaf_batch([1.0, 1.0, 2.0, 4.0])
    _, stats = importance_sampling_loss(logprobs, batch, 1.0, is_cap=10.0)
    assert stats.effective_sample_size == pytest.approx(64 / 88, rel=1e-5)
    assert stats.ratio_mean == pytest.approx(2.0, rel=1e-5)


def test_stats_merge_equals_stats_of_the_whole():
    logprobs_a, batch_a = leaf_batch([1.0, 3.0, 0.5])
    logprobs_b, batch_b = leaf_batch([9.0, 1.5])
    logprobs_all, batch_all = leaf_batch([1.0, 3.0, 0.5, 9.0, 1.5])
    stats_a = importance_sampling_loss(logprobs_a, batch_a, 1.0)[1]
    stats_b = importance_sampling_loss(logprobs_b, batch_b, 1.0)[1]
    whole = importance_sampling_loss(logprobs_all, batch_all, 1.0)[1]
    merged = stats_a.merge(stats_b)
    assert merged.num_sequences == 2 and whole.num_sequences == 1
    for name in ("num_tokens", "num_clipped", "num_masked", "ratio_count"):
        assert getattr(merged, name) == getattr(whole, name)
    for name in ("loss_sum", "ratio_max", "ratio_min", "effective_sample_size", "ratio_mean", "clip_fraction"):
        assert getattr(merged, name) == pytest.approx(getattr(whole, name), rel=1e-5)
    assert LossStats().merge(stats_a).to_dict() == pytest.approx(stats_a.to_dict())


# ---------------------------------------------------------------- accumulation and dispatch


def bigram_rows():
    """Five rows of different lengths, sampler logprobs near a bigram model's, for accumulation tests."""
    torch.manual_seed(3)
    model = torch.nn.Embedding(V, V)
    lengths = [4, 6, 3, 7, 5]
    tokens = [torch.randint(0, V, (n,)).tolist() for n in lengths]
    masks = [[0, 0] + [1] * (n - 2) for n in lengths]
    with torch.no_grad():
        current = [token_logprobs(model(torch.tensor([row])), torch.tensor([row]))[0] for row in tokens]
    sampler = [(lp + 0.4 * torch.randn(lp.shape)).tolist() for lp in current]  # ratios around 1, some truncated
    sampler = [
        [s if m else 0.0 for s, m in zip(row, mask, strict=True)] for row, mask in zip(sampler, masks, strict=True)
    ]
    return model, tokens, masks, sampler, [1.0, -0.5, 2.0, 0.3, -1.2], [1.0, 2.0, 0.5, 1.0, 1.5]


@pytest.mark.parametrize("loss_kind", ["importance_sampling", "ppo", "cross_entropy", "ppo+entropy"])
def test_micro_batch_accumulation_equals_one_batch(loss_kind):
    model, tokens, masks, sampler, advantages, weights = bigram_rows()
    loss_kind, _, bonus = loss_kind.partition("+")
    config = LearnerConfig(loss=loss_kind, entropy_coef=0.3 if bonus else 0.0)
    n_rows = len(tokens)

    whole = pad_rows(tokens, masks, sampler, advantages, weights)
    loss, whole_stats = compute_loss(config, model(whole.tokens_BT), whole, n_rows)
    expected = grad_of(loss, model.weight)

    parts = micro_batches(tokens, masks, sampler, advantages, micro_batch_tokens=12, weights_R=weights)
    assert len(parts) >= 3  # the test must actually split
    accumulated = torch.zeros_like(model.weight)
    merged = LossStats()
    for part in parts:
        part_loss, part_stats = compute_loss(config, model(part.tokens_BT), part, n_rows)
        accumulated += grad_of(part_loss, model.weight)
        merged = merged.merge(part_stats)
    torch.testing.assert_close(accumulated, expected, atol=1e-6, rtol=1e-5)
    assert merged.num_tokens == whole_stats.num_tokens == sum(sum(m) for m in masks)
    assert merged.loss_sum == pytest.approx(whole_stats.loss_sum, rel=1e-5)
    if loss_kind != "cross_entropy":
        assert merged.effective_sample_size == pytest.approx(whole_stats.effective_sample_size, rel=1e-5)


def test_compute_loss_dispatches_with_config_parameters(logits, tokens):
    batch = batch_with_ratios(logits, tokens, {(0, 4): 3.0, (2, 4): 1.5})
    logprobs = token_logprobs(logits, tokens)
    cases = [
        (
            LearnerConfig(loss="importance_sampling", is_cap=2.5),
            importance_sampling_loss(logprobs, batch, 2.0, is_cap=2.5),
        ),
        (LearnerConfig(loss="ppo", ppo_clip=0.1), ppo_loss(logprobs, batch, 2.0, clip_eps=0.1)),
        (LearnerConfig(loss="awr"), cross_entropy_loss(logprobs, batch, 2.0)),
        (LearnerConfig(loss="filtered_bc"), cross_entropy_loss(logprobs, batch, 2.0)),
    ]
    for config, (expected_loss, expected_stats) in cases:
        got_loss, got_stats = compute_loss(config, logits, batch, 2.0)
        assert got_loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
        assert got_stats.num_clipped == expected_stats.num_clipped
    # the three configs differ: cap 2.5 vs cap 2 changes the truncated token's weight
    default_cap = compute_loss(LearnerConfig(), logits, batch, 2.0)[0].item()
    assert default_cap != pytest.approx(cases[0][1][0].item(), rel=1e-6)


def test_bad_batches_and_normalisers_are_refused(logits, tokens):
    with pytest.raises(ValueError, match="advantages_B"):
        TokenBatch(tokens, torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B + 1), torch.ones(B))
    with pytest.raises(ValueError, match="int64"):
        TokenBatch(tokens.int(), torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B), torch.ones(B))
    with pytest.raises(ValueError, match="temperatures_B"):
        TokenBatch(tokens, torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B), torch.ones(B),
                   temperatures_B=torch.ones(B, T))
    batch = batch_with_ratios(logits, tokens, {})
    with pytest.raises(ValueError, match="normaliser"):
        cross_entropy_loss(token_logprobs(logits, tokens), batch, 0.0)


# ---------------------------------------------------------------- entropy, KL penalty, asymmetric clip


def test_entropy_of_a_known_distribution_at_the_rows_temperature():
    # row 0, position 0 predicts token 1 from logits (ln 3, 0, -30, ...): p ~ (3/4, 1/4), H = ln 4 - (3/4) ln 3
    logits = torch.zeros(2, 2, V)
    logits[0, 0] = torch.tensor([math.log(3), 0.0] + [-30.0] * (V - 2))
    entropy = token_entropies(logits)
    assert entropy[0, 1].item() == pytest.approx(math.log(4) - 0.75 * math.log(3), abs=1e-5)
    assert entropy[1, 1].item() == pytest.approx(math.log(V), abs=1e-6)  # equal logits: uniform
    assert entropy[:, 0].tolist() == [0.0, 0.0]  # no context, no distribution
    # temperature 2 halves the logits: p ~ (sqrt 3, 1) / (sqrt 3 + 1)
    hot = token_entropies(logits, torch.tensor([2.0, 1.0]))[0, 1].item()
    p = math.sqrt(3) / (math.sqrt(3) + 1)
    assert hot == pytest.approx(-(p * math.log(p) + (1 - p) * math.log(1 - p)), abs=1e-5)


def test_stats_record_the_mean_entropy_of_generated_tokens_and_leave_the_loss_alone(logits, tokens):
    batch = batch_with_ratios(logits, tokens, {})
    loss, stats = compute_loss(LearnerConfig(), logits, batch, NORMALISER)
    entropy = token_entropies(logits)
    expected = sum(entropy[b, t].item() for b, t in generated()) / len(generated())
    assert stats.entropy_mean == pytest.approx(expected, rel=1e-5)
    assert stats.to_dict()["entropy_mean"] == pytest.approx(expected, rel=1e-5)
    assert stats.kl_sum == 0.0
    plain, _ = importance_sampling_loss(token_logprobs(logits, tokens), batch, NORMALISER)
    assert loss.item() == pytest.approx(plain.item(), rel=1e-6)


def test_entropy_bonus_subtracts_the_entropy_and_its_gradient_raises_it(logits, tokens):
    batch = batch_with_ratios(logits, tokens, {})
    base, _ = compute_loss(LearnerConfig(), logits, batch, NORMALISER)
    bonus, stats = compute_loss(LearnerConfig(entropy_coef=0.5), logits, batch, NORMALISER)
    entropy_sum = sum(token_entropies(logits)[b, t] for b, t in generated())
    assert bonus.item() == pytest.approx(base.item() - 0.5 * entropy_sum.item() / NORMALISER, rel=1e-5)
    assert stats.loss_sum == pytest.approx(bonus.item() * NORMALISER, rel=1e-5)
    extra = grad_of(bonus, logits) - grad_of(base, logits)
    torch.testing.assert_close(extra, grad_of(-0.5 * entropy_sum / NORMALISER, logits), atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # a small step against the bonus's gradient raises every trained position's entropy
        stepped = logits - 0.1 * extra
    before, after = token_entropies(logits.detach()), token_entropies(stepped)
    assert all(after[b, t] > before[b, t] for b, t in generated())


def test_kl_penalty_is_k3_and_pulls_logprobs_towards_the_reference():
    # tokens at logp -1; references -2 (policy above it), -1 (equal), -0.5 (policy below it)
    logprobs, batch = leaf_batch([1.0, 1.0, 1.0], advantage=0.0)
    reference = torch.tensor([[0.0, -2.0, -1.0, -0.5]])
    loss, stats = loss_from_logprobs(LearnerConfig(kl_coef=0.1), logprobs, batch, 2.0,
                                     reference_logprobs_BT=reference)
    deltas = [-1.0, 0.0, 0.5]  # d = ref - logp
    k3 = [math.exp(d) - d - 1 for d in deltas]
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2.0, rel=1e-5)
    assert stats.kl_mean == pytest.approx(sum(k3) / 3, rel=1e-5)
    gradient = grad_of(loss, logprobs)[0, 1:]  # d/dlogp of c exp(ref - logp) - ... = c (1 - exp(d)) / N
    torch.testing.assert_close(gradient, torch.tensor([0.1 * (1 - math.exp(d)) / 2.0 for d in deltas]))
    assert gradient[0] > 0 and gradient[1] == 0 and gradient[2] < 0  # descent moves each logp towards its reference


def test_regularisers_refuse_what_they_cannot_compute():
    logprobs, batch = leaf_batch([1.0])
    with pytest.raises(ValueError, match="kl_coef > 0 needs the reference"):
        loss_from_logprobs(LearnerConfig(kl_coef=0.1), logprobs, batch, 1.0)
    with pytest.raises(ValueError, match="entropy_coef > 0 needs"):
        loss_from_logprobs(LearnerConfig(entropy_coef=0.1), logprobs, batch, 1.0)


def test_ppo_asymmetric_clip():
    # clip_low 0.2, clip_high 0.28: A=+1 learns up to r = 1.28; A=-1 stops at r = 0.8 as before
    ratios = [0.79, 1.25, 1.27, 1.3]
    logprobs, batch = leaf_batch(ratios, advantage=1.0)
    loss, _ = ppo_loss(logprobs, batch, 1.0, clip_eps=0.2, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(grad_of(loss, logprobs)[0, 1:], torch.tensor([-0.79, -1.25, -1.27, 0.0]))
    logprobs, batch = leaf_batch(ratios, advantage=-1.0)
    loss, _ = ppo_loss(logprobs, batch, 1.0, clip_eps=0.5, clip_low=0.2)  # high falls back to clip_eps
    torch.testing.assert_close(grad_of(loss, logprobs)[0, 1:], torch.tensor([0.0, 1.25, 1.27, 1.3]))
    config = LearnerConfig(loss="ppo", ppo_clip_low=0.2, ppo_clip_high=0.28)
    logprobs, batch = leaf_batch(ratios, advantage=1.0)
    via_config, _ = loss_from_logprobs(config, logprobs, batch, 1.0)
    torch.testing.assert_close(grad_of(via_config, logprobs)[0, 1:], torch.tensor([-0.79, -1.25, -1.27, 0.0]))


def test_ppo_where_the_clip_binds_on_a_ratio_past_float32_has_no_gradient_and_no_nan():
    # The API's ppo has no ratio mask (0, inf).  r = e^100 overflows float32, and with A = +1 the clip binds:
    # the token's term is the constant -1.2 A, so d loss / d logp = 0 there (not 0 * inf = NaN); the others
    # as in test_ppo_clipping_at_the_boundaries: -r inside the clip, -0.79 below it (min is rA).
    logprobs, batch = leaf_batch([0.79, 1.1, 1.0])
    with torch.no_grad():
        batch.sampler_logprobs_BT[0, 3] = -1.0 - 100.0
    loss, stats = ppo_loss(logprobs, batch, 1.0, clip_eps=0.2, ratio_mask_low=0.0, ratio_mask_high=math.inf)
    assert loss.item() == pytest.approx(-(0.79 + 1.1 + 1.2), rel=1e-5)
    torch.testing.assert_close(grad_of(loss, logprobs)[0], torch.tensor([0.0, -0.79, -1.1, 0.0]))
    assert stats.num_clipped == 1


# ---------------------------------------------------------------- CISPO and DRO (the API's losses)


def test_cispo_weighs_logp_by_the_clipped_ratio_without_a_gradient_through_it():
    # thresholds [0.5, 4]: coefficients r clipped = 0.5 (r 0.3), 1.2, 4 (r 6); A=2, w=0.5, N=2.
    # loss = -(w/N) sum clip(r) A logp with logp = -1: -(0.25) * 2 * (0.5 + 1.2 + 4) * -1 = 2.85
    # d loss / d logp_t = -(w/N) A clip(r_t) = -0.5 clip(r_t)
    logprobs, batch = leaf_batch([0.3, 1.2, 6.0], advantage=2.0, weight=0.5)
    loss, stats = cispo_loss(logprobs, batch, 2.0, clip_low_threshold=0.5, clip_high_threshold=4.0)
    assert loss.item() == pytest.approx(2.85, rel=1e-5)
    torch.testing.assert_close(grad_of(loss, logprobs)[0], torch.tensor([0.0, -0.25, -0.6, -2.0]))
    assert (stats.num_tokens, stats.num_clipped, stats.num_masked) == (3, 2, 0)
    # Tinker's defaults: no lower bound, upper 4
    logprobs, batch = leaf_batch([0.01, 5.0])
    loss, _ = cispo_loss(logprobs, batch, 1.0)
    torch.testing.assert_close(grad_of(loss, logprobs)[0], torch.tensor([0.0, -0.01, -4.0]))


def test_dro_is_the_reward_term_minus_a_quadratic_penalty_on_the_log_ratio():
    # logp = -1 everywhere; r = 1 and e^2 give log-ratios 0 and 2; A = 1.5, beta 0.1, w = 1, N = 1.
    # loss = -sum(logp A - 0.5 beta (logp - q)^2) = -(-1.5 - 0) - (-1.5 - 0.05 * 4) = 1.5 + 1.7 = 3.2
    # d loss / d logp_t = -A + beta (logp - q) = -1.5 + 0.1 * [0, 2] = [-1.5, -1.3]
    logprobs, batch = leaf_batch([1.0, math.exp(2.0)], advantage=1.5)
    loss, stats = dro_loss(logprobs, batch, 1.0, beta=0.1)
    assert loss.item() == pytest.approx(3.2, rel=1e-5)
    torch.testing.assert_close(grad_of(loss, logprobs)[0], torch.tensor([0.0, -1.5, -1.3]))
    assert stats.num_tokens == 2 and stats.ratio_max == pytest.approx(math.exp(2.0), rel=1e-5)


def test_ratio_losses_accept_an_open_ratio_mask():
    # ratio_mask_low 0 and ratio_mask_high inf keep every token, however far off (Tinker's importance_sampling)
    logprobs, batch = leaf_batch([0.001, 50.0])
    loss, stats = importance_sampling_loss(logprobs, batch, 1.0, is_cap=math.inf, ratio_mask_low=0.0,
                                           ratio_mask_high=math.inf)
    torch.testing.assert_close(grad_of(loss, logprobs)[0], torch.tensor([0.0, -0.001, -50.0]), rtol=1e-4, atol=1e-6)
    assert stats.num_masked == 0


# ---------------------------------------------------------------- GSPO (the API's sequence-ratio loss)


def test_gspo_gives_every_token_its_sequences_ratio_and_its_own_gradient():
    # ratios e^0.3, e^-0.1, e^2; sequence_ratio_mask marks the first two, so s = exp(mean(0.3, -0.1)) = e^0.1
    # and the third token's own ratio is left out.  w = 0.5, N = 2.
    # A = -1, thresholds [0.9, 1.2]: s lies inside, loss = -(w/N) sum_t min(s A, clip(s) A) = 0.25 * 3 s,
    # and d loss / d logp_t = -(w/N) A s = 0.25 s on each generated token (its own logp only: s is sg'd)
    s = math.exp(0.1)
    logprobs, batch = leaf_batch([math.exp(0.3), math.exp(-0.1), math.exp(2.0)], advantage=-1.0, weight=0.5)
    batch = replace(batch, sequence_ratio_mask_BT=torch.tensor([[0.0, 1.0, 1.0, 0.0]]))
    loss, stats = gspo_loss(logprobs, batch, 2.0, clip_low_threshold=0.9, clip_high_threshold=1.2)
    assert loss.item() == pytest.approx(0.75 * s, rel=1e-5)
    torch.testing.assert_close(grad_of(loss, logprobs)[0], torch.tensor([0.0, 0.25 * s, 0.25 * s, 0.25 * s]))
    assert (stats.num_tokens, stats.num_clipped) == (3, 0)
    assert stats.ratio_max == pytest.approx(s, rel=1e-5) and stats.ratio_min == pytest.approx(s, rel=1e-5)
    # A = 2 with the upper threshold 1.05 < s: the clip binds on every token, the loss is -(w/N) 3 * 1.05 * 2
    # and no gradient flows
    logprobs, batch = leaf_batch([math.exp(0.3), math.exp(-0.1), math.exp(2.0)], advantage=2.0, weight=0.5)
    batch = replace(batch, sequence_ratio_mask_BT=torch.tensor([[0.0, 1.0, 1.0, 0.0]]))
    loss, stats = gspo_loss(logprobs, batch, 2.0, clip_low_threshold=0.9, clip_high_threshold=1.05)
    assert loss.item() == pytest.approx(-0.25 * 3 * 1.05 * 2, rel=1e-5)
    torch.testing.assert_close(grad_of(loss, logprobs)[0], torch.zeros(4))
    assert stats.num_clipped == 3


def test_gspo_takes_each_sequences_own_ratio_and_refuses_what_it_cannot_compute():
    # two sequences in one batch: each token carries its own row's sequence ratio
    first, first_batch = leaf_batch([math.exp(0.2), math.exp(0.4)])
    second, second_batch = leaf_batch([math.exp(-0.5), math.exp(0.5)])
    logprobs = torch.cat([first.detach(), second.detach()]).requires_grad_(True)
    batch = TokenBatch(**{name: torch.cat([getattr(first_batch, name), getattr(second_batch, name)])
                          for name in ("tokens_BT", "loss_mask_BT", "sampler_logprobs_BT", "advantages_B",
                                       "weights_B")},
                       sequence_ratio_mask_BT=torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]))
    loss, stats = gspo_loss(logprobs, batch, 1.0, clip_low_threshold=0.0, clip_high_threshold=10.0)
    ratios = [math.exp(0.3), math.exp(-0.5)]
    assert loss.item() == pytest.approx(-2 * sum(ratios), rel=1e-5)
    torch.testing.assert_close(grad_of(loss, logprobs)[:, 1:], -torch.tensor(ratios)[:, None].expand(2, 2))
    assert stats.ratio_max == pytest.approx(ratios[0], rel=1e-5)
    with pytest.raises(ValueError, match="sequence_ratio_mask"):
        gspo_loss(first, first_batch, 1.0)
    with pytest.raises(ValueError, match="clip_low_threshold"):
        gspo_loss(first, replace(first_batch, sequence_ratio_mask_BT=first_batch.loss_mask_BT), 1.0,
                  clip_low_threshold=1.5, clip_high_threshold=1.2)


def test_gspo_stays_finite_when_the_sequence_ratio_is_absurd():
    # sampler logprob -500 against the policy's -1: a log-ratio of 499, whose exp overflows float32
    logprobs, batch = leaf_batch([math.exp(499.0), 1.0], advantage=-1.0)
    batch = replace(batch, sequence_ratio_mask_BT=torch.tensor([[0.0, 1.0, 1.0]]))
    loss, stats = gspo_loss(logprobs, batch, 1.0)
    grads = grad_of(loss, logprobs)
    assert math.isfinite(loss.item()) and bool(torch.isfinite(grads).all())
    assert stats.num_clipped == 2
