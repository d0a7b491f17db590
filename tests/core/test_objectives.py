"""CISPO, SAPO, GMPO, LUSPO, VESPO and GPG in `policy_loss`: hand-worked numbers, float64 gradients against
each formula's derivative, and parity with independent transcriptions of TRL 1.16's and verl
0.9.1's computations (written here, not imported); and the per-token weight.

The worked example, two completions of three tokens (the second one token shorter):

    p_old = [[.2, .2, .2], [.2, .2, -]],  p_new = [[.4, .2, .1], [.3, .1, -]],  Â = [+1, −1]
    ratios r = [[2, 1, 0.5], [1.5, 0.5, -]]

CISPO, cap 1.2, token mean over the 5 tokens: weights sg(min(r, 1.2)) = [[1.2, 1, .5], [1.2, .5]];
loss = −(1/5)[1.2·ln .4 + ln .2 + .5·ln .1 − 1.2·ln .3 − .5·ln .1]; ∂loss/∂log π = −w·Â/5.

SAPO, τ+ = 1, τ− = 1.05, sequence mean of token means: the term σ(τ(r − 1))·(4/τ)·Â is
[[4σ(1), 2, 4σ(−.5)], [−(4/1.05)σ(.525), −(4/1.05)σ(−.525)]]; ∂/∂log π of it is 4σ(1 − σ)·r·Â.

GMPO, log-clip ±0.4: row 1 (s = +1) keeps min(log r, clamp) = [.4, 0, ln .5], row 2 (s = −1)
keeps [ln 1.5, −.4]; r_i = exp(mean); loss = −(r_1 − r_2)/2. Only the tokens whose own log-ratio
was kept carry a gradient: −Â_i·r_i/(2|y_i|).

LUSPO, GSPO's clip (3e-4 / 4e-4) on sequence ratios s = [exp(mean(ln 2, 0, ln .5)),
exp(mean(ln 1.5, ln .5))] = [1, √.75], each sequence's token losses summed, then the mean over
sequences: row 2 is clipped (s < 1 − 3e-4 with Â < 0: its term is −(1 − 3e-4), no gradient), so
loss = (−3·1 + 2·(1 − 3e-4))/2 and row 1's tokens get −(3·s/3)/2 = −1/2 each.

VESPO (k, λ = 2, 3 for Â ≥ 0; 3, 2 otherwise): log w = [ln 2 + ln .5, ln 1.5 + ln .5] = [0, ln .75],
φ = [1, e^(2 − 1.5)·.75³]; loss = −(1/5)[φ_1·Σ ln p_1 − φ_2·Σ ln p_2]; ∂loss/∂log π = −φ_i·Â_i/5.
"""

from __future__ import annotations

import math

import pytest
import torch

from grouprl.core import LossOptions, policy_loss

F64 = torch.float64
pytestmark = pytest.mark.numerics
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
ADV = torch.tensor([1.0, -1.0], dtype=F64)
NEW = [[0.4, 0.2, 0.1], [0.3, 0.1, 0.5]]  # the last is padding
OLD = [[0.2, 0.2, 0.2], [0.2, 0.2, 0.5]]


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def loss_and_grad(logp, old_logp, adv, mask, **settings):
    x = logp.clone().requires_grad_(True)
    out = policy_loss(x, old_logp, adv, mask, **settings)
    out.loss.backward()
    return out, x.grad


def example(**settings):
    logp, old = torch.tensor(NEW, dtype=F64).log(), torch.tensor(OLD, dtype=F64).log()
    return loss_and_grad(logp, old, ADV, MASK, **settings)


def close(a, b, tol=1e-14):
    assert torch.allclose(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64),
                          rtol=tol, atol=tol), (a, b)  # fmt: skip


# --- hand-worked (float64: each value is a few exact operations, so 1e-14 is ample) ---


def test_cispo_by_hand():
    out, grad = example(objective="cispo", cispo_cap=1.2, agg="token_mean")
    ln = math.log
    close(out.loss, -(1.2 * ln(0.4) + ln(0.2) + 0.5 * ln(0.1) - 1.2 * ln(0.3) - 0.5 * ln(0.1)) / 5)
    close(grad, [[-1.2 / 5, -1 / 5, -0.5 / 5], [1.2 / 5, 0.5 / 5, 0.0]])
    assert out.stats.clipped_high == 2  # the weights the cap cut: r = 2 and r = 1.5


def test_gpg_by_hand():
    # GPG: Â·log π with no ratio and no clip, token mean over the 5 tokens: the gradient is
    # −Â/5 on every token however far the ratio moved (r = 2 and 0.5 included)
    out, grad = example(objective="gpg", agg="token_mean")
    ln = math.log
    close(out.loss, -(ln(0.4) + ln(0.2) + ln(0.1) - ln(0.3) - ln(0.1)) / 5)
    close(grad, [[-1 / 5] * 3, [1 / 5, 1 / 5, 0.0]])
    assert out.stats.clipped_high == out.stats.clipped_low == 0  # nothing bounds it


def test_sapo_by_hand():
    out, grad = example(objective="sapo", agg="seq_mean_token_mean")
    t = 1.05
    row1 = [4 * sigmoid(1), 2.0, 4 * sigmoid(-0.5)]
    row2 = [-(4 / t) * sigmoid(t * 0.5), -(4 / t) * sigmoid(-t * 0.5)]
    close(out.loss, -(sum(row1) / 3 + sum(row2) / 2) / 2)
    slope = [[4 * sigmoid(x) * (1 - sigmoid(x)) * r for x, r in ((1, 2), (0, 1), (-0.5, 0.5))],
             [-4 * sigmoid(x) * (1 - sigmoid(x)) * r for x, r in ((t * 0.5, 1.5), (-t * 0.5, 0.5))]]  # fmt: skip
    close(grad, [[-s / 6 for s in slope[0]], [-s / 4 for s in slope[1]] + [0.0]])
    assert out.stats.clipped_low == out.stats.clipped_high == 0


def test_gmpo_by_hand():
    out, grad = example(objective="gmpo", clip_low=0.4, clip_high=0.4, agg="seq_mean_token_mean")
    r1 = math.exp((0.4 + 0.0 + math.log(0.5)) / 3)
    r2 = math.exp((math.log(1.5) - 0.4) / 2)
    close(out.loss, -(r1 - r2) / 2)
    close(grad, [[0.0, -r1 / 6, -r1 / 6], [r2 / 4, 0.0, 0.0]])


def test_luspo_by_hand():
    out, grad = example(level="sequence", clip_low=3e-4, clip_high=4e-4, agg="seq_mean_token_sum")
    close(out.loss, (-3 + 2 * (1 - 3e-4)) / 2)
    close(grad, [[-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]])
    assert out.stats.clipped_low == 2  # row 2's two tokens, by its one sequence ratio


def test_vespo_by_hand():
    out, grad = example(objective="vespo", agg="token_mean")
    phi2 = math.exp(2 - 1.5) * 0.75**3
    ln = math.log
    close(out.loss, -((ln(0.4) + ln(0.2) + ln(0.1)) - phi2 * (ln(0.3) + ln(0.1))) / 5)
    close(grad, [[-1 / 5] * 3, [phi2 / 5, phi2 / 5, 0.0]])


def test_a_token_weight_scales_terms_and_leaves_the_denominators():
    weight = torch.tensor([[1.0, 0.0, 2.0], [0.5, 1.0, 9.0]], dtype=F64)
    plain, g_plain = example(objective="cispo", agg="token_mean")
    weighted, g_weighted = example(objective="cispo", agg="token_mean", token_weight=weight)
    close(g_weighted, g_plain * torch.where(MASK, weight, 0.0))
    per = -g_plain * 5  # each token's term's slope, ×1/5 undone
    logp = torch.tensor(NEW, dtype=F64).log()
    close(weighted.loss, -(per * logp * torch.where(MASK, weight, 0.0)).sum() / 5)  # still /5
    assert plain.stats.tokens == weighted.stats.tokens == 5


# --- float64 gradients on random inputs, against each formula's derivative ---


def random_batch(seed: int, n: int = 4, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=g, dtype=F64) * 3 - 0.05
    old = logp + (torch.rand(n, t, generator=g, dtype=F64) - 0.5) * 1.2
    adv = torch.randn(n, generator=g, dtype=F64)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return logp, old, adv, mask


def token_mean_factor(mask):
    return 1 / mask.sum().to(F64)


def seq_mean_factor(mask):
    return 1 / (mask.shape[0] * mask.sum(-1, keepdim=True).to(F64))


# Tolerance of the random-batch tests: each gradient entry and loss is a sum of at most 4 x 6
# float64 terms of magnitude below ~10, each a few operations off by <= 0.5 ulp: an error below
# 24 x 10 x 2.2e-16 ~ 5e-14, so 1e-13 (and the kernels' reordering of such sums stays inside it).
@pytest.mark.parametrize("seed", range(5))
def test_gradients_are_each_formulas_derivative(seed):
    logp, old, adv, mask = random_batch(seed)
    a, r = adv[:, None], (logp - old).exp()
    _, g = loss_and_grad(logp, old, adv, mask, objective="cispo", cispo_cap=1.1, agg="token_mean")
    close(g, torch.where(mask, -r.clamp(max=1.1) * a * token_mean_factor(mask), 0.0), 1e-13)

    tau = torch.where(a > 0, *a.new_tensor([1.0, 1.05]))
    sig = torch.sigmoid(tau * (r - 1))
    _, g = loss_and_grad(logp, old, adv, mask, objective="sapo", agg="seq_mean_token_mean")
    close(g, torch.where(mask, -4 * sig * (1 - sig) * r * a * seq_mean_factor(mask), 0.0), 1e-13)

    lr, s = logp - old, torch.sign(a)
    kept = (s * lr <= s * lr.clamp(-0.4, 0.4)).to(F64)  # the min kept the token's own log-ratio
    count = mask.sum(-1, keepdim=True).to(F64)
    c = torch.where(mask, s * torch.minimum(s * lr, s * lr.clamp(-0.4, 0.4)), 0.0)
    ratio = (c.sum(-1, keepdim=True) / count).exp()
    _, g = loss_and_grad(logp, old, adv, mask, objective="gmpo", clip_low=0.4, clip_high=0.4,
                         agg="seq_mean_token_mean")  # fmt: skip
    close(g, torch.where(mask, -a * ratio * kept / (count * mask.shape[0]), 0.0), 1e-13)

    seq = (torch.where(mask, lr, 0.0).sum(-1, keepdim=True) / count).exp()  # GSPO's s_i
    inside = (seq >= 1 - 3e-4) & (seq <= 1 + 4e-4)
    kept = inside | ((a > 0) & (seq < 1)) | ((a < 0) & (seq > 1))  # min keeps s·Â itself
    _, g = loss_and_grad(logp, old, adv, mask, level="sequence", clip_low=3e-4, clip_high=4e-4,
                         agg="seq_mean_token_sum")  # fmt: skip
    # d/d log π_t of −(1/N)·|y_i|·s_i·Â_i = −Â_i·s_i/N on every token of an unclipped sequence
    close(g, torch.where(mask & kept, -a * seq / mask.shape[0], 0.0), 1e-13)

    log_w = torch.where(mask, lr, 0.0).sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)
    k, lam = torch.where(a >= 0, 2.0, 3.0), torch.where(a >= 0, 3.0, 2.0)
    phi = (lam + k * log_w - lam * log_w.exp()).exp()
    _, g = loss_and_grad(logp, old, adv, mask, objective="vespo", agg="token_mean")
    close(g, torch.where(mask, -phi * a * token_mean_factor(mask), 0.0), 1e-13)


# --- parity with the references' computations, transcribed ---


def trl_loss(loss_type, logp, old, adv, mask, epsilon_high=5.0):
    """TRL 1.16 GRPOTrainer._compute_loss for one process, no accumulation, beta 0 (token
    ratios): cispo/vespo normalise by the batch's tokens, sapo like grpo."""
    maskf = mask.to(logp.dtype)
    log_ratio = logp - old
    coef_1 = torch.exp(log_ratio)
    advantages = adv.unsqueeze(1)
    if loss_type == "luspo":  # sequence-level importance weights, GSPO's clip (eps 3e-4/4e-4)
        seq = (log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)
        coef = torch.exp(seq.unsqueeze(-1))
        clipped = torch.clamp(coef, 1 - 3e-4, 1 + 4e-4)
        per_token_loss = -torch.min(coef * advantages, clipped * advantages)
        return (per_token_loss * maskf).sum(-1).mean()
    if loss_type == "cispo":
        clamped = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped * advantages * logp
    elif loss_type == "sapo":
        # TRL's torch.where of two Python floats is float32 whatever the batch's dtype; in the
        # batch's dtype here (the same in TRL's float32 training)
        temps = torch.where(advantages > 0, *advantages.new_tensor([1.0, 1.05]))
        per_token_loss = -torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps * advantages
    else:  # vespo: get_gamma_weights, no vLLM correction
        with torch.no_grad():
            seq = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * maskf, dim=-1, keepdim=True)
            log_w = torch.clamp(seq, math.log(1e-8), 20.0)
            nonneg = advantages >= 0
            k = torch.where(nonneg, 2.0, 3.0)
            lam = torch.where(nonneg, 3.0, 2.0).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0)
        per_token_loss = -phi * advantages * logp
    if loss_type == "sapo":
        return ((per_token_loss * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)).mean()
    return (per_token_loss * maskf).sum() / maskf.sum().clamp(min=1.0)


def verl_geo_mean(logp, old, adv, mask, low=0.4, high=0.4):
    """verl 0.9.1 compute_policy_loss_geo_mean (advantages broadcast per token)."""
    maskf = mask.to(logp.dtype)
    advantages = adv[:, None].expand_as(logp)
    negative_approx_kl = logp - old
    sgn = torch.sign(advantages)
    clamped = torch.clamp(negative_approx_kl, -low, high)
    kept = sgn * torch.min(sgn * negative_approx_kl, sgn * clamped)
    count = maskf.sum(dim=-1)
    ratio = torch.exp((kept * maskf).sum(dim=-1) / (count + 1e-8))
    advantage = (advantages * maskf).sum(dim=-1) / (count + 1e-8)
    return torch.mean(-advantage * ratio)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("loss_type", "settings"), [
    ("cispo", dict(objective="cispo", agg="token_mean")),
    ("vespo", dict(objective="vespo", agg="token_mean")),
    ("sapo", dict(objective="sapo", agg="seq_mean_token_mean")),
    ("luspo", dict(level="sequence", clip_low=3e-4, clip_high=4e-4, agg="seq_mean_token_sum")),
])  # fmt: skip
def test_parity_with_trl(seed, loss_type, settings):
    logp, old, adv, mask = random_batch(seed)
    ours, g_ours = loss_and_grad(logp, old, adv, mask, **settings)
    x = logp.clone().requires_grad_(True)
    theirs = trl_loss(loss_type, x, old, adv, mask)
    theirs.backward()
    close(ours.loss, theirs, 1e-13)
    close(g_ours, torch.where(mask, x.grad, 0.0), 1e-13)


@pytest.mark.parametrize("seed", range(5))
def test_parity_with_verls_geo_mean(seed):
    logp, old, adv, mask = random_batch(seed)
    ours, g_ours = loss_and_grad(logp, old, adv, mask, objective="gmpo", clip_low=0.4,
                                 clip_high=0.4, agg="seq_mean_token_mean")  # fmt: skip
    x = logp.clone().requires_grad_(True)
    theirs = verl_geo_mean(x, old, adv, mask)
    theirs.backward()
    # verl divides by |y_i| + 1e-8, grouprl by |y_i|: a relative 1e-8/|y_i| in the exponent
    close(ours.loss, theirs, 1e-8)
    close(g_ours, torch.where(mask, x.grad, 0.0), 1e-8)


def test_the_rules_of_the_objectives():
    with pytest.raises(ValueError, match="unknown objective 'ppo'"):
        LossOptions(objective="ppo")
    with pytest.raises(ValueError, match="needs ratio level 'token'"):
        LossOptions(objective="vespo", level="sequence")
    with pytest.raises(ValueError, match="temperatures must be > 0"):
        LossOptions(objective="sapo", sapo_tau_neg=0.0)
    with pytest.raises(ValueError, match="cispo_cap must be > 0"):
        LossOptions(objective="cispo", cispo_cap=0.0)
