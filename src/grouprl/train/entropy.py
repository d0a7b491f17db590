"""The update's entropy terms (`grouprl.core.entropy`): the high-entropy tokens of a step, the
entropy bonus's coefficient over its optimizer steps, and which tokens Clip-Cov holds back and
KL-Cov penalises in each minibatch: the covariance of each trained token's log-prob and
advantage, with the means, the count and the selection over the whole minibatch on every rank.

Choices (verl 0.9 computes these per micro-batch, from the current forward's log-probs): here
the statistics are the minibatch's, from its old log-probs (the sampling policy's, or the
trainer's recomputed ones), so the selection does not depend on how the minibatch is cut into
passes or ranks, and is known before its first pass; on the first on-policy update the two are
the same numbers. Clip-Cov's random subset is drawn with a generator seeded by the run's seed,
step, epoch and minibatch (reproducible, and the same on every rank); the tokens the clip
already binds are not left out of its candidates (verl leaves them out; their gradient is 0
either way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from grouprl.config.options import RunConfig
from grouprl.config.validation import entropy_bonus
from grouprl.core import COVARIANCE_OBJECTIVES, mean_over
from grouprl.core.entropy import (
    adapted_coefficient,
    applied_coefficient,
    clip_cov_candidates,
    covariance_count,
    entropy_threshold,
    high_entropy_mask,
    token_covariance,
)
from grouprl.errors import UserError
from grouprl.rollout import Rollout
from grouprl.train.parallel.distributed import Dist
from grouprl.train.plan import Minibatch


def covariance_selection(
    cfg: RunConfig,
    plan: Minibatch,
    advantages: torch.Tensor,  # (N,) the step's, on this rank
    mask: torch.Tensor,  # (N, T) the loss mask
    dist: Dist,
    seed: int,
) -> tuple[list[torch.Tensor | None], int]:
    """For each pass of `plan`: the (n, T) bool tokens selected (None for a lockstep filler);
    and how many were selected over every rank."""
    chunks = [c for c in plan.chunks if c.weight]
    device = mask.device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for c in chunks:
        m = mask[c.rows]
        total[0] += (advantages[c.rows].double()[:, None] * m).sum()
        total[1] += torch.where(m, c.rollout.old_logp.double(), 0.0).sum()
    if dist.enabled:
        dist.all_reduce(total)
    tokens = int(plan.num_tokens)
    if tokens == 0:
        return [None for _ in plan.chunks], 0
    mean_adv, mean_logp = (total / tokens).tolist()
    covs = {id(c): token_covariance(advantages[c.rows], c.rollout.old_logp, mask[c.rows],
                                    mean_adv, mean_logp) for c in chunks}  # fmt: skip
    if cfg.objective == "kl_cov":
        picked, count = _top(covs, covariance_count(cfg.kl_cov_ratio, tokens), dist)
    else:
        candidates = {k: clip_cov_candidates(v, cfg.clip_cov_low, cfg.clip_cov_high)
                      for k, v in covs.items()}  # fmt: skip
        picked, count = _random(candidates, covariance_count(cfg.clip_cov_ratio, tokens), dist,
                                seed)  # fmt: skip
    return [picked.get(id(c)) for c in plan.chunks], count


def _top(covs: dict[int, torch.Tensor], k: int, dist: Dist) -> tuple[dict[int, torch.Tensor], int]:
    """Exactly the k tokens of highest covariance over every rank (verl's topk)."""
    flat = torch.cat([v.flatten() for v in covs.values()]).cpu() if covs else torch.zeros(0)
    positions = (flat > -torch.inf).nonzero().flatten()  # this rank's trained tokens
    pools = dist.gather(flat[positions]) if dist.enabled else [flat[positions]]
    offset = sum(len(pool) for pool in pools[: dist.rank])
    pool = torch.cat(pools)
    best = pool.topk(min(k, len(pool))).indices
    return _marked(covs, positions, best, offset), len(best)


def _marked(
    selections: dict[int, torch.Tensor], positions: torch.Tensor, chosen: torch.Tensor,
    offset: int,
) -> dict[int, torch.Tensor]:  # fmt: skip
    """The tokens at `chosen` (indices into every rank's `positions`, this rank's from
    `offset`) marked True in tensors shaped as `selections`'."""
    mine = chosen[(chosen >= offset) & (chosen < offset + len(positions))] - offset
    flat = torch.zeros(sum(v.numel() for v in selections.values()), dtype=torch.bool)
    flat[positions[mine]] = True
    out, start = {}, 0
    for key, v in selections.items():
        out[key] = flat[start : start + v.numel()].view_as(v).to(v.device)
        start += v.numel()
    return out


def _random(
    candidates: dict[int, torch.Tensor], k: int, dist: Dist, seed: int
) -> tuple[dict[int, torch.Tensor], int]:
    """k of the candidate tokens of every rank, drawn uniformly (one permutation, the same on
    every rank), marked on each rank's own."""
    flat = (
        torch.cat([v.flatten() for v in candidates.values()]).cpu()
        if candidates
        else torch.zeros(0)
    )
    positions = flat.nonzero().flatten()  # this rank's candidates, in pass order
    counts = dist.gather(len(positions)) if dist.enabled else [len(positions)]
    offset, total = sum(counts[: dist.rank]), sum(counts)
    generator = torch.Generator().manual_seed(seed)
    draw = torch.randperm(total, generator=generator)[: min(k, total)]
    return _marked(candidates, positions, draw, offset), len(draw)


def high_entropy_tokens(
    cfg: RunConfig, rollout: Rollout, mask: torch.Tensor, dist: Dist
) -> tuple[torch.Tensor | None, float | None]:
    """The tokens whose sampling entropy is in the top `top_entropy_quantile` of the whole
    job's trained tokens, and the threshold (None, None: every token)."""
    if cfg.top_entropy_quantile >= 1:
        return None, None
    if rollout.entropy is None:
        raise UserError(
            "--top-entropy-quantile needs the sampler's entropy; this engine gives none"
        )
    entropy = rollout.entropy.to(mask.device)
    local = entropy[mask].float().cpu()
    pool = torch.cat(dist.gather(local)) if dist.enabled else local
    threshold = entropy_threshold(pool, cfg.top_entropy_quantile)
    return high_entropy_mask(entropy, mask, threshold), threshold


@dataclass
class EntropyBonus:
    """The entropy bonus over an update's optimizer steps: its coefficient (fixed, or TRL's
    adaptive one, `grouprl.core.entropy`) and what each step measured."""

    coef: float
    last: float | None  # the last step's mean token entropy (None: none measured yet)
    target: float | None  # None: a fixed coefficient
    rule: dict[str, float]
    total: float = 0.0  # Σ H and the tokens over the update's steps, for the metric
    tokens: float = 0.0

    @classmethod
    def start(cls, cfg: RunConfig, coef: float | None, last: float | None) -> EntropyBonus | None:
        if not entropy_bonus(cfg):
            return None
        rule = {"delta": cfg.entropy_coef_delta, "low": cfg.entropy_coef_min,
                "high": cfg.entropy_coef_max}  # fmt: skip
        return cls(cfg.entropy_coef if coef is None else coef, last, cfg.entropy_target, rule)

    def applied(self) -> float:
        """The coefficient this optimizer step applies."""
        if self.target is None:
            return self.coef
        return applied_coefficient(self.coef, self.last, self.target)

    def measured(self, total: float, tokens: float) -> None:
        """After an optimizer step: its entropy sums over the whole job (the kept tokens)."""
        self.total, self.tokens = self.total + total, self.tokens + tokens
        if tokens and self.target is not None:
            entropy = total / tokens
            self.coef = adapted_coefficient(self.coef, entropy, target=self.target, **self.rule)
            self.last = entropy

    def metrics(self) -> dict[str, float | None]:
        return {"policy_entropy": mean_over(self.total, self.tokens), "entropy_coef": self.coef,
                "entropy_last": self.last}  # fmt: skip


@dataclass
class EntropyTerms:
    """What an update adds to its passes beyond the objective: the entropy bonus (None: off)
    and, for Clip-Cov and KL-Cov, each minibatch's selected tokens; and their metrics."""

    cfg: RunConfig
    dist: Dist
    bonus: EntropyBonus | None
    step: int
    advantages: torch.Tensor  # (N,) the step's, on this rank
    mask: torch.Tensor  # (N, T) its loss mask
    selected: int = 0
    considered: int = 0

    @classmethod
    def start(
        cls, cfg: RunConfig, dist: Dist, state: tuple[float | None, float | None], step: int,
        advantages: torch.Tensor, mask: torch.Tensor,
    ) -> EntropyTerms:  # fmt: skip
        """`state`: the adaptive coefficient and the last entropy as the run's state holds them
        (None, None: the run's start); `step` seeds Clip-Cov's draw."""
        return cls(cfg, dist, EntropyBonus.start(cfg, *state), step, advantages, mask)

    def before(self, plan: Minibatch, epoch: int, index: int) -> dict[str, Any]:
        """`_backward`'s keywords for the minibatch `index` of epoch `epoch`."""
        selections = None
        if self.cfg.objective in COVARIANCE_OBJECTIVES:
            seed = ((self.cfg.seed * 1_000_003 + self.step) * 1009 + epoch) * 31 + index
            selections, count = covariance_selection(self.cfg, plan, self.advantages, self.mask,
                                                     self.dist, seed)  # fmt: skip
            self.selected += count
            self.considered += int(plan.num_tokens)
        bonus = None if self.bonus is None else self.bonus.applied()
        return {"bonus": bonus, "selections": selections}

    def after(self, plan: Minibatch, entropy_sum: float, tokens: float) -> None:
        """After the minibatch's optimizer step: its entropy over the whole job."""
        if self.bonus is not None:
            self.bonus.measured(entropy_sum, tokens)

    def metrics(self, threshold: float | None) -> dict[str, float | None]:
        """The update's: the high-entropy tokens' threshold, the bonus's, Clip/KL-Cov's share."""
        out = {} if self.bonus is None else self.bonus.metrics()
        if threshold is not None:
            out["entropy_threshold"] = threshold
        if self.cfg.objective in COVARIANCE_OBJECTIVES:
            out["cov_selected_frac"] = mean_over(self.selected, self.considered)
        return out
