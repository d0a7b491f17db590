"""Group-relative advantages: a prompt's own group of completions is the baseline, so no critic.

GRPO, outcome supervision (DeepSeekMath, arXiv 2402.03300, §4.1.2), with rewards (B, G):

    Â_i = (R_i − mean(R_1..R_G)) / (std(R_1..R_G) + eps)

and every token of completion i gets Â_i. Variants, each a small function in a registry:

- estimator "grpo": R_i − mean(R) (above); "rloo" (arXiv 2402.14740): R_i minus the mean of the
  *other* rewards, = G/(G−1) · (R_i − mean(R)).
- scale "group": divide by the group's std + eps; "batch" (REINFORCE++, arXiv 2501.03262): by one
  std of the group-centred rewards over the whole batch + eps; "none" (Dr. GRPO, arXiv 2503.20783):
  no division.

GDPO (arXiv 2601.05242) for several rewards normalises each reward inside the group first, then
normalises their weighted sum over the batch (`gdpo_advantages`).

Deviations and choices: the std is the population std by default (the seeds' formula); TRL and
verl use the sample std (``unbiased_std=True``). A NaN reward means "could not be scored": it gets
advantage 0 and is left out of every mean, std and count. A group whose valid rewards are all equal
(or that has fewer than two of them) gets exact zeros, not rounding noise.
"""

from collections.abc import Callable

import torch

from ._registry import choose

Tensor = torch.Tensor


def _grpo(centred: Tensor, count: Tensor) -> Tensor:
    """R_i − mean(R): the group mean is the baseline (GRPO, arXiv 2402.03300)."""
    return centred


def _rloo(centred: Tensor, count: Tensor) -> Tensor:
    """R_i − mean of the other n−1 valid rewards = n/(n−1) · (R_i − mean(R)) (arXiv 2402.14740)."""
    return centred * count / (count - 1).clamp(min=1)


def _std(square_sum: Tensor, count: Tensor, unbiased: bool) -> Tensor:
    return (square_sum / (count - int(unbiased)).clamp(min=1)).sqrt()


def _group_scale(centred: Tensor, valid: Tensor, eps: float, unbiased: bool) -> Tensor:
    """std of each group's valid rewards + eps (GRPO)."""
    count = valid.sum(-1, keepdim=True)  # (B, 1)
    return _std(centred.square().sum(-1, keepdim=True), count, unbiased) + eps  # (B, 1)


def _batch_scale(centred: Tensor, valid: Tensor, eps: float, unbiased: bool) -> Tensor:
    """One std of the group-centred valid rewards over the whole batch + eps (REINFORCE++)."""
    return _std(centred.square().sum(), valid.sum(), unbiased) + eps  # ()


def _no_scale(centred: Tensor, valid: Tensor, eps: float, unbiased: bool) -> Tensor:
    """No division: Â_i = R_i − mean(R) (Dr. GRPO, arXiv 2503.20783)."""
    return torch.ones((), dtype=centred.dtype, device=centred.device)


def _whiten(advantages: Tensor, valid: Tensor, eps: float, unbiased: bool) -> Tensor:
    """(Â − mean(Â)) / (std(Â) + eps) over the batch's scored completions (TRL RLOOTrainer's
    normalize_advantages; REINFORCE++'s whitening)."""
    count = valid.sum()
    mean = torch.where(valid, advantages, 0.0).sum() / count.clamp(min=1)
    deviation = torch.where(valid, advantages - mean, 0.0)
    return (advantages - mean) / (_std(deviation.square().sum(), count, unbiased) + eps)


#: group_advantages' baselines (the estimators by name, with every other: `grouprl.core.registry`).
BASELINES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "grpo": _grpo,
    "rloo": _rloo,
}
ADVANTAGE_SCALES: dict[str, Callable[[Tensor, Tensor, float, bool], Tensor]] = {
    "group": _group_scale,
    "batch": _batch_scale,
    "none": _no_scale,
    "whiten": _whiten,  # not a divisor: group_advantages whitens with it
}


def _checked(rewards: Tensor, shape: str, eps: float) -> Tensor:
    """`rewards` detached and floating point, after the checks every estimator needs: its
    `shape` ("(B, G)" or "(B, G, K)"), a group of at least 2, eps >= 0."""
    if rewards.dim() != shape.count(",") + 1:
        raise ValueError(f"rewards must have shape {shape}, got {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError("group-relative advantages need a group size G of at least 2, got G = 1")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    rewards = rewards.detach()
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


def over_tokens(advantages: Tensor) -> Tensor:
    """Advantages that broadcast over (N, T): one per sequence (N,) as (N, 1), one per token
    (N, T) as they are."""
    return advantages[:, None] if advantages.dim() == 1 else advantages


def zero_variance_groups(rewards: Tensor) -> Tensor:
    """(B,) True where a group's scored rewards (B, G) all agree, or fewer than two were scored.

    Such a group's advantages are all 0 and it adds no gradient: "both go silent on
    zero-variance groups" (the seeds). Its share of a batch is the `frac_zero_std` diagnostic,
    and DAPO's dynamic sampling (arXiv 2503.14476) drops these groups. NaN = not scored.
    """
    valid = ~rewards.isnan()  # (B, G)
    high = torch.where(valid, rewards, -torch.inf).amax(-1)  # (B,)
    low = torch.where(valid, rewards, torch.inf).amin(-1)  # (B,)
    return high <= low  # one valid reward: high == low; none: -inf <= inf


def mixed_groups(passed: Tensor) -> Tensor:
    """(B,) True where a group's completions (B, G) neither all pass nor all fail.

    DAPO's dynamic sampling (arXiv 2503.14476, §3.2) keeps only these groups: 0 < accuracy < 1.
    It judges by pass/fail (`passed`, bool), not by the shaped reward, so a group that differs
    only in a length penalty or a format bonus is not kept for it.
    """
    passed = passed.bool()
    return passed.any(-1) & ~passed.all(-1)


def group_advantages(
    rewards: Tensor,  # (B, G)
    *,
    scale: str = "group",
    estimator: str = "grpo",
    eps: float = 1e-4,
    unbiased_std: bool = False,
) -> Tensor:
    """Per-completion advantages (B, G) from rewards (B, G), one row per prompt's group.

        grpo: Â_i = (R_i − mean(R)) / (std(R) + eps)            (arXiv 2402.03300, §4.1.2)
        rloo: Â_i = (R_i − 1/(G−1) Σ_{j≠i} R_j) / (std(R) + eps)  (arXiv 2402.14740)

    ``scale`` picks the divisor (ADVANTAGE_SCALES: "group", "batch", "none"), or "whiten": the
    baseline's advantages, unscaled, then (Â − mean) / (std + eps) over the batch's scored
    completions (TRL RLOOTrainer's normalize_advantages). ``estimator`` the
    baseline (BASELINES: "grpo", "rloo"). The std is the population std, or the sample
    std with ``unbiased_std=True``. NaN rewards get 0 and are excluded from the group's statistics;
    zero-variance groups get exact zeros. No gradient flows to ``rewards``. G = 1 is a ValueError.
    """
    estimate = choose(BASELINES, estimator, "advantage estimator")
    divisor = choose(ADVANTAGE_SCALES, scale, "advantage scale")
    rewards = _checked(rewards, "(B, G)", eps)
    valid = ~rewards.isnan()  # (B, G)
    count = valid.sum(-1, keepdim=True)  # (B, 1)
    r = torch.where(valid, rewards, 0.0)  # (B, G)
    mean = r.sum(-1, keepdim=True) / count.clamp(min=1)  # (B, 1)
    # Rounding can leave R − mean a few ulp off zero when all rewards are equal (3 × 0.1 / 3 ≠ 0.1),
    # so a group with no spread is zeroed explicitly: it carries no learning signal.
    silent = zero_variance_groups(rewards)[:, None] | ~valid  # (B, G)
    centred = torch.where(silent, 0.0, r - mean)  # (B, G)
    if divisor is _whiten:  # the baseline's advantages, whitened over the whole batch
        advantages = _whiten(estimate(centred, count), valid, eps, unbiased_std)
    else:
        advantages = estimate(centred, count) / divisor(centred, valid, eps, unbiased_std)
    return torch.where(silent, 0.0, advantages)  # (B, G)


def process_advantages(
    turn_rewards: Tensor,  # (B, G, K) each completion's step (turn) rewards, NaN: none
    *,
    eps: float = 1e-4,
    unbiased_std: bool = False,
) -> Tensor:
    """Process supervision (DeepSeekMath, arXiv 2402.03300, §4.1.3): step rewards (B, G, K), NaN
    where a completion has no step k, are normalised over every valid step of their group,

        r̃ = (r − mean(R)) / (std(R) + eps),   R = the group's step rewards,

    and a step's advantage is the sum of the normalised rewards of the steps at or after it,
    Â_k = Σ_{k' ≥ k} r̃_{k'} (each token of step k gets Â_k). Returns (B, G, K). A step without a
    reward of its own (NaN inside a completion) gets the sum of the steps after it; one past a
    completion's last step, 0; a group whose step rewards are all equal, exact zeros (as does an
    unscored completion). With at most one rewarded step each (an outcome reward, on whichever
    step) it is `group_advantages` (outcome supervision's GRPO) on every step up to that one, bit
    for bit: the same operations on the same values. The std is the population std, or the sample std with ``unbiased_std``."""
    rewards = _checked(turn_rewards, "(B, G, K)", eps)
    valid = ~rewards.isnan()
    if bool((valid.sum(-1) <= 1).all()):  # one rewarded step at most: outcome supervision's
        outcome = torch.where(valid, rewards, 0.0).sum(-1)  # the one reward, exactly
        outcome = torch.where(valid.any(-1), outcome, torch.nan)[..., None]  # (B, G, 1)
        upto = valid.flip(-1).cumsum(-1).flip(-1) > 0  # the steps at or before it
        return torch.where(upto, _summed_to_go(outcome, eps, unbiased_std), 0.0)
    return _summed_to_go(rewards, eps, unbiased_std)


def _summed_to_go(rewards: Tensor, eps: float, unbiased_std: bool) -> Tensor:
    """`process_advantages` of (B, G, K) step rewards (see there)."""
    b, g, k = rewards.shape
    flat = rewards.reshape(b, g * k)  # the group's steps, completion by completion
    valid = ~flat.isnan()
    count = valid.sum(-1, keepdim=True)  # (B, 1)
    r = torch.where(valid, flat, 0.0)
    mean = r.sum(-1, keepdim=True) / count.clamp(min=1)
    silent = zero_variance_groups(flat)[:, None] | ~valid  # as group_advantages: exact zeros
    centred = torch.where(silent, 0.0, r - mean)
    normed = centred / (_std(centred.square().sum(-1, keepdim=True), count, unbiased_std) + eps)
    normed = torch.where(silent, 0.0, normed).reshape(b, g, k)
    return normed.flip(-1).cumsum(-1).flip(-1)  # Σ over the steps at or after each


def gdpo_advantages(
    components: Tensor,  # (B, G, K): K rewards' raw scores, NaN = not scored
    weights: Tensor | list[float],  # (K,)
    *,
    eps: float = 1e-4,
) -> Tensor:
    """Group reward-decoupled advantages (B, G) (GDPO, Liu et al., arXiv 2601.05242), as the
    authors' reference implementation computes them:

        Â_k,i = (r_k,i − mean_G(r_k)) / (std_G(r_k) + eps)     each reward k inside its group
        A_i   = Σ_k w_k · Â_k,i
        Â_i   = (A_i − mean_batch(A)) / (std_batch(A) + eps)   once over the whole batch

    with sample (Bessel) stds and an unscored reward counted as 0. Under GRPO the weighted sum is
    normalised instead, so distinct reward combinations collapse into one advantage (G = 2:
    (0,0) vs (1,0) and (0,0) vs (1,1) both give ±1); here they stay apart.

    Choices: a reward constant inside a group gets Â_k = 0 exactly, and a group in which every
    reward is constant gets advantages of exactly 0 after the batch step too (the reference
    would give it −mean/std there; zero keeps such groups silent, as GRPO's are, so they can be
    skipped). Pass the whole job's batch: the batch statistics are global. With K = 1 this is
    GRPO's advantage of w·r with the sample std (`group_advantages`).
    """
    rewards = _checked(components, "(B, G, K)", eps)
    K = rewards.shape[-1]
    w = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)
    if w.shape != (K,):
        raise ValueError(f"weights must have shape ({K},), got {tuple(w.shape)}")
    if K == 1:
        return group_advantages(rewards[..., 0] * w[0], eps=eps, unbiased_std=True)
    r = torch.nan_to_num(rewards, nan=0.0)  # (B, G, K)
    centred = r - r.mean(1, keepdim=True)  # (B, G, K)
    constant = r.amax(1, keepdim=True) <= r.amin(1, keepdim=True)  # (B, 1, K)
    centred = torch.where(constant, 0.0, centred)  # exact zeros, not rounding noise
    per_reward = centred / (r.std(1, keepdim=True) + eps)  # (B, G, K)
    combined = (per_reward * w).sum(-1)  # (B, G)
    flat = combined.reshape(-1)
    advantages = (combined - flat.mean()) / (flat.std() + eps)  # (B, G)
    silent = constant.all(-1)  # (B, 1): every reward constant in the group
    return torch.where(silent, 0.0, advantages)
