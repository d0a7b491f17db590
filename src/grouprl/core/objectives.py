"""The per-token objectives `policy_loss` can maximise in place of PPO's clipped surrogate.

Each is a plain function of (N, T) tensors whose value is the term maximised per token (the loss
is its negative, then aggregated); masked positions are 0 in every input (`policy_loss` does
that). References: TRL 1.16's `trl/trainer/grpo_trainer.py` and verl 0.9.1's
`verl/trainer/ppo/core_algos.py`, as each docstring says; where they differ, which one grouprl
follows.
"""

import math

import torch

Tensor = torch.Tensor

# exp(20) ≈ 4.9e8 stays finite in float32 and far outside any clip range; an overflowed ratio
# would turn the zero gradient of a clipped token into inf · 0 = NaN (verl clamps the same way).
MAX_LOG_RATIO = 20.0


def cispo_objective(ratio: Tensor, logp: Tensor, advantages: Tensor, *, cap: float = 5.0) -> Tensor:
    """CISPO (MiniMax-M1, arXiv 2506.13585), the per-token term maximised:

        sg(min(r, cap)) · Â · log π_θ

    REINFORCE on log π_θ weighted by the detached importance weight, capped from above: every
    token keeps a gradient (PPO's clip zeroes it beyond the range). grouprl follows TRL 1.16,
    whose cap is an absolute weight (its ``epsilon_high``; 5.0 recommended), not 1 + ε; the
    paper and verl 0.9.1 clip the weight on both sides, sg(clip(r, 1 − ε_low, 1 + ε_high)).
    Gradient: sg(min(r, cap)) · Â per unit of log π_θ.
    """
    return ratio.detach().clamp(max=cap) * advantages * logp


def sapo_objective(
    ratio: Tensor, advantages: Tensor, *, tau_pos: float = 1.0, tau_neg: float = 1.05
) -> Tensor:
    """SAPO (arXiv 2511.20347), the per-token term maximised: a smooth gate in place of the clip,

        σ(τ·(r − 1)) · (4/τ) · Â,    τ = tau_pos where Â > 0, else tau_neg

    (so its slope in r is Â at r = 1, as the unclipped surrogate's, and it fades smoothly as r
    leaves 1 instead of stopping at a hard bound). TRL 1.16 and verl 0.9.1 compute the same
    gate; the defaults are TRL's (1.0 and 1.05).
    """
    tau = torch.where(advantages > 0, *advantages.new_tensor([tau_pos, tau_neg]))  # Â's dtype
    return torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * advantages


def gmpo_objective(
    token_log_ratio: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float = 0.4,
    clip_high: float = 0.4,
) -> Tensor:  # fmt: skip
    """GMPO (arXiv 2507.20673; verl 0.9.1 ``geo_mean``), the per-token term maximised: the
    geometric mean of the token ratios, each clipped in log space the pessimistic way for Â's
    sign, times Â, the same for every token of a sequence:

        c_t = s·min(s·log ρ_t, s·clamp(log ρ_t, −clip_low, clip_high)),  s = sign(Â_i)
        Â_i · exp(1/|y_i| Σ_t c_t)

    so that with ``seq_mean_token_mean`` the loss is verl's mean over sequences of −Â_i·r_i.
    The paper clips at ±0.4 (ratios in [e^−0.4, e^0.4]). verl divides by |y_i| + 1e-8; grouprl by
    max(|y_i|, 1) (equal for every non-empty sequence). Sequence-level advantages only.
    """
    s = torch.sign(advantages)
    bounded = token_log_ratio.clamp(-clip_low, clip_high)
    clipped = s * torch.minimum(s * token_log_ratio, s * bounded)
    count = mask.sum(-1, keepdim=True).clamp(min=1)
    return advantages * (torch.where(mask, clipped, 0.0).sum(-1, keepdim=True) / count).exp()


def vespo_objective(
    token_log_ratio: Tensor, logp: Tensor, advantages: Tensor, mask: Tensor, *,
    k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0,
) -> Tensor:  # fmt: skip
    """VESPO (arXiv 2602.10693), the per-token term maximised, as TRL 1.16 computes it: a
    detached gamma-shaped weight of the sequence's importance ratio w = exp(Σ_t log ρ_t) (a sum,
    not GSPO's mean; clamped to [1e-8, e^20]) on REINFORCE,

        φ(w) = e^λ · w^k · e^(−λ·w)  (φ(1) = 1),   sg(φ(w_i)) · Â · log π_θ

    with k, λ = k_pos, lambda_pos where Â ≥ 0, else k_neg, lambda_neg (TRL's 2, 3, 3, 2). φ is
    computed in log space, a non-finite φ counts 0, as TRL does. Token-level ratios in (TRL's
    requirement); each token's log-ratio is clamped to ±20 before the sum.
    """
    with torch.no_grad():
        per_token = torch.where(mask, token_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), 0.0)
        log_w = per_token.sum(-1, keepdim=True).clamp(math.log(1e-8), MAX_LOG_RATIO)
        nonneg = advantages >= 0
        k = torch.where(nonneg, *advantages.new_tensor([k_pos, k_neg]))
        lam = torch.where(nonneg, *advantages.new_tensor([lambda_pos, lambda_neg]))
        phi = (lam + k * log_w - lam * log_w.exp()).exp().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    return phi * advantages * logp


#: The per-token objective `policy_loss` maximises in place of PPO's clipped surrogate (GRPO,
#: GSPO, DAPO, Dr. GRPO, LUSPO: "clip"): CISPO's capped-weight REINFORCE, SAPO's soft gate,
#: GMPO's geometric mean, VESPO's gamma weight. LUSPO (arXiv 2602.05261) is GSPO's clip with
#: each sequence's token losses summed (`seq_mean_token_sum`), so it needs no term of its own.
def gpg_objective(logp: Tensor, advantages: Tensor) -> Tensor:
    """GPG (arXiv 2504.02546; verl 0.9's ``gpg`` policy loss), the per-token term maximised:
    plain REINFORCE on the advantage, with no ratio and no clip,

        Â · log π_θ

    (so its gradient is Â per unit of log π_θ whatever the policy has moved since sampling; it
    is meant for one on-policy update per batch, with GPG's advantage `gpg_advantages`)."""
    return advantages * logp


def kl_cov_objective(ratio: Tensor, advantages: Tensor) -> Tensor:
    """KL-Cov's surrogate (arXiv 2505.22617; verl 0.9's ``kl_cov``): r·Â with no clip; the
    selected tokens' penalty coef·|log r| is `policy_loss`'s (`penalty_mask`)."""
    return ratio * advantages
