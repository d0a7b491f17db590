"""Entropy control: training only the high-entropy "forking" tokens, and the entropy bonus's
adaptive coefficient.

High-entropy minority tokens (Wang et al., "Beyond the 80/20 Rule", arXiv 2506.01939): the
policy gradient restricted to the tokens whose entropy is in the top ρ of the batch,

    keep_t = 1[H_t ≥ τ],   τ = the (1 − ρ) quantile of H over the batch's trained tokens,

as TRL 1.16's `top_entropy_quantile` computes it (`GRPOTrainer.get_high_entropy_mask`:
`torch.quantile`'s linear interpolation, `>=`). The mask is a per-token weight (0 or 1) on the
objective's term, so a dropped token still counts in the loss's denominators and the KL term
still acts on it (TRL's order). ρ = 1 keeps every token; ρ = 0 (τ = the maximum) keeps only the
tokens of the highest entropy, as TRL does.

The adaptive entropy coefficient (Skywork-OR1, arXiv 2505.22312, as TRL 1.16 implements it):
after each optimizer step the step's mean token entropy H̄ moves the coefficient by δ toward
keeping H̄ at a target, and the next step applies it only while H̄ is at or below the target,

    c ← min(c + δ, c_max) if H̄ ≤ target else max(c − δ, c_min),
    applied = c if H̄ ≤ target else 0        (no measurement yet: 0)

The entropy mechanism (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs", arXiv
2505.22617; verl 0.9's ``clip_cov`` and ``kl_cov`` policy losses): entropy falls by the
covariance of log π and the advantage, so the few tokens of highest covariance are held back,

    cov_t = (Â_t − mean Â)·(log π_t − mean log π)      (means over the trained tokens)
    Clip-Cov: a random ⌊clip_cov_ratio·n⌋ (at least 1) of the tokens with lb < cov_t < ub lose
              their gradient (a token weight 0; the clip and the denominators unchanged)
    KL-Cov:   the top ⌊kl_cov_ratio·n⌋ (at least 1) by cov_t get + coef·|log r_t| in the loss,
              whose surrogate is r·Â with no clip
"""

import torch

from .advantages import over_tokens

Tensor = torch.Tensor


def entropy_threshold(entropies: Tensor, quantile: float) -> float | None:
    """τ, the (1 − ρ) quantile of `entropies` (the batch's trained tokens, flat), with ρ =
    `quantile` in [0, 1]; None over no token."""
    if not 0 <= quantile <= 1:
        raise ValueError(f"the entropy quantile rho must lie in [0, 1]; got {quantile}")
    if entropies.numel() == 0:
        return None
    return float(torch.quantile(entropies.detach().float(), 1 - quantile))


def high_entropy_mask(entropy: Tensor, mask: Tensor, threshold: float | None) -> Tensor:
    """(N, T) bool: the trained tokens (`mask`) whose entropy is at least `threshold` (none
    when it is None)."""
    mask = mask.bool()
    if threshold is None:
        return torch.zeros_like(mask)
    return mask & (entropy >= threshold)


def adapted_coefficient(
    coef: float, entropy: float, *, target: float, delta: float, low: float, high: float
) -> float:
    """The entropy bonus's next coefficient after a step whose mean token entropy was
    `entropy`: up by `delta` (at most `high`) at or below `target`, else down (at least `low`)."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


def applied_coefficient(coef: float, last_entropy: float | None, target: float) -> float:
    """What a step applies: `coef` while the last measured entropy is at or below `target`,
    else 0 (and 0 before any measurement)."""
    return coef if last_entropy is not None and last_entropy <= target else 0.0


def token_covariance(
    advantages: Tensor, logp: Tensor, mask: Tensor, mean_adv: float, mean_logp: float
) -> Tensor:
    """(N, T) float64 cov_t = (Â_i − mean_adv)(log π_t − mean_logp) on the trained tokens,
    −inf elsewhere (advantages (N,), or (N, T): Â_t); the means are the caller's (over the
    whole minibatch, every rank)."""
    centred = over_tokens(advantages.detach().double() - mean_adv) * (
        logp.detach().double() - mean_logp
    )
    return torch.where(mask.bool(), centred, -torch.inf)


def covariance_count(ratio: float, tokens: int) -> int:
    """How many tokens a covariance selection takes from `tokens`: int(ratio·n), at least 1."""
    return max(int(ratio * tokens), 1)


def clip_cov_candidates(cov: Tensor, low: float, high: float) -> Tensor:
    """(N, T) bool: the tokens Clip-Cov draws from, low < cov < high (−inf: not trained)."""
    return (cov > low) & (cov < high)
