"""The objectives as `policy_loss` calls them, by name (`grouprl.core.registry`): each one's
term, the per-token quantity maximised in place of PPO's clipped surrogate, and its bound, the
tokens the bound acted on, (below, above), for the clip fractions. Each is a thin call of its
function in `grouprl.core.objectives` (or `loss.clipped_objective`) with its own knobs from the
`LossOptions`; `ratio` is the importance ratio (N, T) at the run's level, `old_logp` and `adv` are
0 at padding already and `logp` is not (each masks what it uses).
"""

import torch

from .loss import LossOptions, clipped_objective
from .objectives import (
    cispo_objective,
    gmpo_objective,
    gpg_objective,
    kl_cov_objective,
    sapo_objective,
    vespo_objective,
)

Tensor = torch.Tensor


def clip_term(opts: LossOptions, ratio: Tensor, logp: Tensor, old_logp: Tensor, adv: Tensor,
              mask: Tensor) -> Tensor:  # fmt: skip
    """PPO's clipped term (`clipped_objective`), with the dual clip when set."""
    return clipped_objective(
        ratio, adv, clip_low=opts.clip_low, clip_high=opts.clip_high, dual_clip=opts.dual_clip
    )


def cispo_term(opts: LossOptions, ratio: Tensor, logp: Tensor, old_logp: Tensor, adv: Tensor,
               mask: Tensor) -> Tensor:  # fmt: skip
    """CISPO's capped-weight REINFORCE (`cispo_objective`)."""
    return cispo_objective(ratio, torch.where(mask, logp, 0.0), adv, cap=opts.cispo_cap)


def sapo_term(opts: LossOptions, ratio: Tensor, logp: Tensor, old_logp: Tensor, adv: Tensor,
              mask: Tensor) -> Tensor:  # fmt: skip
    """SAPO's soft gate (`sapo_objective`)."""
    return sapo_objective(ratio, adv, tau_pos=opts.sapo_tau_pos, tau_neg=opts.sapo_tau_neg)


def gmpo_term(opts: LossOptions, ratio: Tensor, logp: Tensor, old_logp: Tensor, adv: Tensor,
              mask: Tensor) -> Tensor:  # fmt: skip
    """GMPO's geometric mean of log-clipped token ratios (`gmpo_objective`)."""
    token_log_ratio = torch.where(mask, logp, 0.0) - old_logp  # (N, T), 0 at padding
    return gmpo_objective(token_log_ratio, adv, mask, clip_low=opts.clip_low,
                          clip_high=opts.clip_high)  # fmt: skip


def vespo_term(opts: LossOptions, ratio: Tensor, logp: Tensor, old_logp: Tensor, adv: Tensor,
               mask: Tensor) -> Tensor:  # fmt: skip
    """VESPO's gamma weight of the sequence ratio (`vespo_objective`)."""
    valid = torch.where(mask, logp, 0.0)  # (N, T)
    return vespo_objective(valid - old_logp, valid, adv, mask, k_pos=opts.vespo_k_pos,
                           lambda_pos=opts.vespo_lambda_pos, k_neg=opts.vespo_k_neg,
                           lambda_neg=opts.vespo_lambda_neg)  # fmt: skip


def gpg_term(opts: LossOptions, ratio: Tensor, logp: Tensor, old_logp: Tensor, adv: Tensor,
             mask: Tensor) -> Tensor:  # fmt: skip
    """GPG's plain REINFORCE (`gpg_objective`)."""
    return gpg_objective(torch.where(mask, logp, 0.0), adv)


def kl_cov_term(opts: LossOptions, ratio: Tensor, logp: Tensor, old_logp: Tensor, adv: Tensor,
                mask: Tensor) -> Tensor:  # fmt: skip
    """KL-Cov's unclipped r·Â (`kl_cov_objective`; its penalty is `policy_loss`'s)."""
    return kl_cov_objective(ratio, adv)


def clip_bound(opts: LossOptions, ratio: Tensor, adv: Tensor) -> tuple[Tensor, Tensor]:
    """The clip acted: Â < 0 and r < 1 − clip_low; Â > 0 and r > 1 + clip_high."""
    return (adv < 0) & (ratio < 1 - opts.clip_low), (adv > 0) & (ratio > 1 + opts.clip_high)


def cap_bound(opts: LossOptions, ratio: Tensor, adv: Tensor) -> tuple[Tensor, Tensor]:
    """CISPO's cap acted (above, whatever Â's sign)."""
    return torch.zeros_like(ratio, dtype=torch.bool), ratio > opts.cispo_cap


def log_clip_bound(opts: LossOptions, ratio: Tensor, adv: Tensor) -> tuple[Tensor, Tensor]:
    """GMPO's log-space clip cut the token log-ratio."""
    log_ratio = ratio.log()
    return (adv < 0) & (log_ratio < -opts.clip_low), (adv > 0) & (log_ratio > opts.clip_high)
