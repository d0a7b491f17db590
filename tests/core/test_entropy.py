"""Entropy control (`grouprl.core.entropy`): the high-entropy token mask and the adaptive
entropy coefficient, by hand and against transcriptions of TRL 1.16's `GRPOTrainer`
(`get_high_entropy_mask`; the adaptive update in `_compute_loss`)."""

import math

import pytest
import torch

from grouprl.core.entropy import (
    adapted_coefficient,
    applied_coefficient,
    entropy_threshold,
    high_entropy_mask,
)

pytestmark = pytest.mark.numerics


def test_the_top_rho_tokens_by_hand():
    # 5 trained tokens with entropies 0.1, 0.5, 0.9, 0.3, 0.7 (a padded 9.0 never counts);
    # rho 0.4: the 0.6 quantile, linearly interpolated: sorted [.1 .3 .5 .7 .9] at 0.6·4 = 2.4
    # -> 0.5 + 0.4·0.2 = 0.58: the tokens of 0.7 and 0.9 stay
    entropy = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    threshold = entropy_threshold(entropy[mask], 0.4)
    # float32 entropies and interpolation: a few float32 roundings (2^-24 each) of O(1) values
    assert math.isclose(threshold, 0.58, rel_tol=8 * 2**-24)
    keep = high_entropy_mask(entropy, mask, threshold)
    assert keep.tolist() == [[False, False, True], [False, True, False]]
    assert high_entropy_mask(entropy, mask, entropy_threshold(entropy[mask], 1.0)).equal(mask)
    assert entropy_threshold(torch.tensor([]), 0.2) is None
    assert not high_entropy_mask(entropy, mask, None).any()
    # rho 0, as TRL accepts it: τ is the maximum, 0.9; only that token stays
    assert entropy_threshold(entropy[mask], 0.0) == pytest.approx(0.9, rel=2**-24)
    keep = high_entropy_mask(entropy, mask, entropy_threshold(entropy[mask], 0.0))
    assert keep.tolist() == [[False, False, True], [False, False, False]]
    with pytest.raises(ValueError, match="rho must lie in"):
        entropy_threshold(entropy[mask], 1.5)


def trls_high_entropy_mask(entropies, mask, threshold):
    """TRL 1.16's get_high_entropy_mask, one process (the gather is the identity)."""
    local = entropies[mask.bool()].float()
    gathered = local[local != -1e9]
    if gathered.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    entropy_threshold_ = torch.quantile(gathered, threshold)
    masked_entropies = entropies * mask.float()
    return (masked_entropies >= entropy_threshold_) & mask.bool()


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_the_mask_is_trls(rho):
    g = torch.Generator().manual_seed(int(rho * 10))
    entropy = torch.rand(6, 11, generator=g) * 3
    mask = torch.rand(6, 11, generator=g) < 0.8
    ours = high_entropy_mask(entropy, mask, entropy_threshold(entropy[mask], rho))
    assert torch.equal(ours, trls_high_entropy_mask(entropy, mask, 1 - rho))


def trls_controller(coef, entropies, *, target, delta, low, high):
    """TRL 1.16's adaptive entropy coefficient over optimizer steps: (applied, next) per step."""
    last, out = float("inf"), []
    for world_entropy in entropies:
        apply_coef = coef if last <= target else 0.0
        coef = min(coef + delta, high) if world_entropy <= target else max(coef - delta, low)
        last = world_entropy
        out.append((apply_coef, coef))
    return out


def test_the_adaptive_coefficient_is_trls():
    rule = {"target": 0.2, "delta": 0.005, "low": 0.0, "high": 0.012}
    measured = [0.15, 0.1, 0.3, 0.25, 0.05, 0.19, 0.18, 0.5]
    coef, last, ours = 0.003, None, []
    for entropy in measured:
        applied = applied_coefficient(coef, last, rule["target"])
        coef = adapted_coefficient(coef, entropy, target=rule["target"], delta=rule["delta"],
                                   low=rule["low"], high=rule["high"])  # fmt: skip
        last = entropy
        ours.append((applied, coef))
    assert ours == trls_controller(0.003, measured, **rule)
    # by hand: nothing applied before a measurement; up to the ceiling, down to the floor
    assert [a for a, _ in ours[:3]] == [0.0, 0.008, 0.012]
    assert [c for _, c in ours[:4]] == [0.008, 0.012, 0.007, 0.002]


# --- the entropy mechanism (Clip-Cov, KL-Cov) -------------------------------------------------

from grouprl.core import policy_loss  # noqa: E402
from grouprl.core.entropy import (  # noqa: E402
    clip_cov_candidates,
    covariance_count,
    token_covariance,
)


def test_token_covariance_by_hand():
    # Â = (1, −1) over 3 + 2 trained tokens: token mean (3 − 2)/5 = 0.2; log π mean −1
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    cov = token_covariance(adv, logp, mask, 0.2, -1.0)
    expected = [[0.0, -0.8, 0.8], [-1.2 * 0.5, -1.2 * -0.5, -math.inf]]
    assert torch.allclose(cov, torch.tensor(expected, dtype=torch.float64))
    assert clip_cov_candidates(cov, 0.5, 1.0).tolist() == [
        [False, False, True],
        [False, True, False],
    ]
    assert covariance_count(2e-4, 5) == 1 and covariance_count(0.5, 5) == 2


def _verl_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(8, 12, generator=g, dtype=torch.float64) * 4
    logp = old + torch.randn(8, 12, generator=g, dtype=torch.float64) * 0.3
    mask = torch.rand(8, 12, generator=g) < 0.85
    adv = torch.randn(8, generator=g, dtype=torch.float64)
    return old, logp, mask, adv


def _means(adv, logp, mask):
    tokens = mask.sum()
    return float((adv[:, None] * mask).sum() / tokens), float(
        torch.where(mask, logp, 0.0).sum() / tokens
    )


@pytest.mark.parametrize("seed", range(3))
def test_kl_cov_is_verls(seed):
    """verl 0.9's compute_policy_loss_kl_cov, transcribed: the top int(n·ratio) tokens by
    covariance get + coef·|log r| on the unclipped −Â·r; token mean."""
    old, logp, mask, adv = _verl_inputs(seed)
    ratio_share, coef = 0.1, 0.7
    a_tok = adv[:, None].expand_as(logp)
    valid_idx = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
    va, vl = a_tok[mask], logp[mask]
    cov_list = (va - va.mean()) * (vl - vl.mean())
    k = max(1, int(len(cov_list) * ratio_share))
    top = valid_idx[torch.topk(cov_list, k).indices]
    x = logp.clone().requires_grad_(True)
    r = (x - old).exp()
    losses = -a_tok * r
    kl = -a_tok * r + coef * (x - old).abs()
    rows, cols = top // logp.shape[1], top % logp.shape[1]
    losses = losses.index_put((rows, cols), kl[rows, cols])
    theirs = (losses * mask).sum() / mask.sum()
    (g_theirs,) = torch.autograd.grad(theirs, x)
    # ours: the same selection from core's covariance (here of the same log-probs), core's loss
    cov = token_covariance(adv, logp, mask, *_means(adv, logp, mask))
    threshold = cov[mask].topk(covariance_count(ratio_share, int(mask.sum()))).values[-1]
    chosen = cov >= threshold
    assert int(chosen.sum()) == k and bool(chosen.view(-1)[top].all())
    y = logp.clone().requires_grad_(True)
    ours = policy_loss(y, old, adv, mask, objective="kl_cov", kl_cov_coef=coef, agg="token_mean",
                       penalty_mask=chosen).loss  # fmt: skip
    ours.backward()
    # float64 both, sums over the trained tokens in other orders: (n + 16)·2^-52 of the
    # loss's O(1) magnitude; the gradient's entries are O(1/n)
    tol = (int(mask.sum()) + 16) * 2**-52
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
    torch.testing.assert_close(y.grad, g_theirs, rtol=tol, atol=tol / int(mask.sum()))


@pytest.mark.parametrize("seed", range(3))
def test_clip_cov_is_verls_given_its_draw(seed):
    """verl 0.9's compute_policy_loss_clip_cov, transcribed: the in-band candidates (those the
    clip binds left out) and, for the same drawn tokens, the same loss and gradient."""
    old, logp, mask, adv = _verl_inputs(seed)
    lo, hi, ratio_share = -0.5, 0.5, 0.2
    a_tok = adv[:, None].expand_as(logp)
    r = (logp - old).exp()
    l1, l2 = -a_tok * r, -a_tok * r.clamp(0.8, 1.2)
    by_origin = (l2 > l1) & mask
    cov_all = (a_tok - (a_tok * mask).sum() / mask.sum()) * (
        logp - torch.where(mask, logp, 0).sum() / mask.sum()
    )
    cov_all[~mask] = -torch.inf
    theirs_candidates = (cov_all < hi) & (cov_all > lo) & mask & ~by_origin
    ours_candidates = clip_cov_candidates(
        token_covariance(adv, logp, mask, *_means(adv, logp, mask)), lo, hi
    )
    # grouprl keeps the clipped ones among its candidates (their gradient is 0 either way)
    assert torch.equal(theirs_candidates, ours_candidates & ~by_origin)
    picks = torch.nonzero(theirs_candidates)
    picks = picks[torch.randperm(len(picks), generator=torch.Generator().manual_seed(seed))]
    picks = picks[: covariance_count(ratio_share, int(mask.sum()))]
    corr = torch.ones_like(logp)
    corr[picks[:, 0], picks[:, 1]] = 0
    x = logp.clone().requires_grad_(True)
    rx = (x - old).exp()
    theirs = (
        torch.maximum(-a_tok * rx, -a_tok * rx.clamp(0.8, 1.2)) * corr * mask
    ).sum() / mask.sum()
    (g_theirs,) = torch.autograd.grad(theirs, x)
    y = logp.clone().requires_grad_(True)
    ours = policy_loss(y, old, adv, mask, objective="clip_cov", agg="token_mean",
                       token_weight=corr).loss  # fmt: skip
    ours.backward()
    # float64 both, sums over the trained tokens in other orders: (n + 16)·2^-52 of the
    # loss's O(1) magnitude; the gradient's entries are O(1/n)
    tol = (int(mask.sum()) + 16) * 2**-52
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
    torch.testing.assert_close(y.grad, g_theirs, rtol=tol, atol=tol / int(mask.sum()))
