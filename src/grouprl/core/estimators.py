"""verl's other outcome advantage estimators: REINFORCE++ (with and without its group baseline),
OPO, GPG, GRPO's Pass@k form and ReMax, each a pure function of one scalar reward per completion
(ReMax's baseline: the reward of one more, greedy, completion per prompt).

Rewards are (B, G), one row per prompt's group; `lengths` (B, G) are the completions' trained
token counts where an estimator weighs by them. A NaN reward (not scored) gets advantage 0 and
is left out of every statistic, as `group_advantages` does. A group's baseline is computed from
its scored completions only, so a group left with one scored completion is its own baseline: it
compares nothing and is a zero-variance group, like one whose scored rewards all agree (the
`frac_zero_std` it counts in, and what dynamic sampling drops). verl has no unscored completion;
its rule for a group of one (baseline 0, so A = R) is for groups sampled with n = 1, which
grouprl does not make (G >= 2). Every function returns (B, G) and
no gradient flows to its inputs. The reference is verl 0.9's `verl/trainer/ppo/core_algos.py`
(the estimator of the same name) and `verl/utils/torch_functional.py` (`masked_whiten`); each
docstring says its paper and where grouprl's differs. Outcome rewards only: verl's per-token
rewards (a KL penalty folded into the reward) have no counterpart, since grouprl's KL term is in
the loss (`--beta`), so REINFORCE++'s return is the sequence's score on each of its tokens.
"""

import torch

Tensor = torch.Tensor

#: verl's `masked_whiten` adds this to the variance (and `masked_mean` to the count).
WHITEN_EPS = 1e-8


def _scored(rewards: Tensor) -> tuple[Tensor, Tensor]:
    """(rewards with NaN as 0, valid mask), in float64 for the statistics."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (B, G), got shape {tuple(rewards.shape)}")
    rewards = rewards.detach().double()
    valid = ~rewards.isnan()
    return torch.where(valid, rewards, 0.0), valid


def _group_mean(r: Tensor, valid: Tensor) -> Tensor:
    """(B, 1) mean of each group's valid rewards (0 for a group with none)."""
    return r.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)


def _whiten_by_tokens(values: Tensor, tokens: Tensor) -> Tensor:
    """verl's `masked_whiten` of a per-sequence value broadcast over its tokens: the mean and
    the unbiased variance are over every token of the batch (a sequence weighs by its length),

        μ = Σ L_i v_i / (Σ L_i + 1e-8),  σ² = Σ L_i (v_i − μ)² / (Σ L_i + 1e-8) · ΣL / (ΣL − 1),
        A_i = (v_i − μ) / sqrt(σ² + 1e-8)."""
    total = tokens.sum()
    if total < 2:
        raise ValueError(
            f"whitening needs at least 2 trained tokens in the batch; got {int(total)}"
        )
    mean = (tokens * values).sum() / (total + WHITEN_EPS)
    var = (tokens * (values - mean) ** 2).sum() / (total + WHITEN_EPS) * total / (total - 1)
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS)


def reinforce_pp_advantages(rewards: Tensor, lengths: Tensor, *, baseline: bool) -> Tensor:
    """REINFORCE++ (Hu et al., arXiv 2501.03262), verl's `reinforce_plus_plus` (baseline=False)
    and `reinforce_plus_plus_baseline` (True):

        v_i = R_i                 (the undiscounted return of an outcome reward, γ = 1)
        v_i = R_i − mean_g(R)     (baseline: the mean of the group's scored rewards)
        A_i = whiten(v) over every trained token of the whole batch (`_whiten_by_tokens`)

    The global whitening is the method's point (a group's local std makes GRPO's estimator
    biased); pass the whole job's batch. The whitening shifts by the batch's token mean, so a
    group whose rewards all agree gets v = 0 but A = −μ/σ, as verl computes it: it still moves
    the policy (against the batch's mean), and the trainer does not skip it. A group with one
    scored completion is such a group (its mean is its reward). A batch whose valid values all
    agree gets exact zeros (verl: rounding-sized values)."""
    r, valid = _scored(rewards)
    values = r - _group_mean(r, valid) if baseline else r
    tokens = torch.where(valid, lengths.double(), 0.0)  # (B, G)
    if baseline:  # a constant group is exactly 0 (its mean can round a few ulp off)
        values = torch.where(_constant_groups(r, valid), 0.0, values)
    live = valid & (tokens > 0)
    if not live.any() or values[live].amax() <= values[live].amin():
        return torch.zeros_like(r)
    return torch.where(valid, _whiten_by_tokens(values, tokens), 0.0)


def _constant_groups(r: Tensor, valid: Tensor) -> Tensor:
    """(B, 1) True where a group's valid rewards all agree (or it has none)."""
    high = torch.where(valid, r, -torch.inf).amax(-1, keepdim=True)
    low = torch.where(valid, r, torch.inf).amin(-1, keepdim=True)
    return high <= low


def opo_advantages(rewards: Tensor, lengths: Tensor) -> Tensor:
    """OPO (Hao et al., "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585), verl's
    `opo`: the length-weighted group mean as the baseline, no std,

        b_g = Σ_j L_j R_j / Σ_j L_j,   A_i = R_i − b_g        (over the scored completions)

    A group whose scored rewards agree (one scored completion among them) gets exact zeros. The
    paper's optimality holds for exactly on-policy training (one update per batch, no KL or
    entropy term): the trainer refuses OPO otherwise."""
    r, valid = _scored(rewards)
    tokens = torch.where(valid, lengths.double(), 0.0)
    weight = tokens.sum(-1, keepdim=True)
    baseline = (tokens * r).sum(-1, keepdim=True) / weight.clamp(min=1e-30)
    advantages = torch.where(_constant_groups(r, valid), 0.0, r - baseline)
    return torch.where(valid, advantages, 0.0)


def gpg_advantages(rewards: Tensor) -> Tensor:
    """GPG (Chu et al., "GPG: A Simple and Strong Reinforcement Learning Baseline", arXiv
    2504.02546), verl's `gpg`: the group-centred reward scaled up by the share of completions
    whose reward is non-zero, over the whole batch, with no std,

        α = B / max(1, #{i: R_i ≠ 0}),   A_i = α · (R_i − mean_g(R))   (over the scored ones)

    with B the batch's scored completions (verl counts every row; an unscored one is left out
    here); a group whose scored rewards agree (one scored completion among them) gets 0. With 0/1 rewards α = B / #correct: the fewer correct, the larger each step. Pair it
    with the `gpg` objective (−Â·log π, no ratio, no clip)."""
    r, valid = _scored(rewards)
    nonzero = (valid & (r != 0)).sum()
    alpha = valid.sum().double() / nonzero.clamp(min=1)  # float64 (an int quotient is float32)
    advantages = torch.where(_constant_groups(r, valid), 0.0, alpha * (r - _group_mean(r, valid)))
    return torch.where(valid, advantages, 0.0)


def passk_advantages(
    rewards: Tensor, *, scale: str = "group", eps: float = 1e-6, unbiased_std: bool = True
) -> Tensor:
    """GRPO for Pass@k (Chen et al., "Pass@k Training", arXiv 2503.19595 as verl cites it),
    verl's `grpo_passk`: only each group's best completion learns,

        A_best = (R_max − R_second) [/ (std_g(R) + eps)],   A_i = 0 for every other i

    (`scale` "group" divides by the std, as verl's norm_adv_by_std_in_grpo; "none" does not;
    verl's std is torch's unbiased one and its eps 1e-6). A tie at the top gives 0. Needs two
    scored completions per group (a group with fewer gets 0)."""
    if scale not in ("group", "none"):
        raise ValueError(f"grpo_passk scales by the group's std or not at all; got {scale!r}")
    r, valid = _scored(rewards)
    masked = torch.where(valid, r, -torch.inf)
    top = masked.topk(2, dim=-1)  # (B, 2): the two best valid rewards and where they are
    gap = (top.values[:, 0] - top.values[:, 1]).nan_to_num(0.0, posinf=0.0, neginf=0.0)  # (B,)
    count = valid.sum(-1)
    if scale == "group":
        mean = r.sum(-1) / count.clamp(min=1)
        square = torch.where(valid, r - mean[:, None], 0.0).square().sum(-1)
        std = (square / (count - int(unbiased_std)).clamp(min=1)).sqrt()
        gap = torch.where(gap > 0, gap / (std + eps), 0.0)  # a tie is 0, even with eps 0
    gap = torch.where(count >= 2, gap, 0.0)
    advantages = torch.zeros_like(r)
    return advantages.scatter(-1, top.indices[:, :1], gap[:, None])


def remax_advantages(rewards: Tensor, baselines: Tensor) -> Tensor:
    """ReMax (Li et al., arXiv 2310.10505), verl's `remax`: each completion's reward against the
    reward of its prompt's greedy completion, no std,

        A_i = R_i − R(greedy)

    (`baselines` (B,); an unscored greedy completion leaves its group at 0, as an unscored
    completion is)."""
    r, valid = _scored(rewards)
    b = baselines.detach().double()[:, None]  # (B, 1)
    return torch.where(valid & ~b.isnan(), r - b.nan_to_num(0.0), 0.0)
