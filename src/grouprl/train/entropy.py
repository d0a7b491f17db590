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
from grouprl.config.training import EntropyOptions, ObjectiveOptions
from grouprl.config.validation import entropy_bonus
from grouprl.core import OBJECTIVES, mean_over, over_tokens
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
    cfg: ObjectiveOptions,
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
        total[0] += (over_tokens(advantages[c.rows].double()) * m).sum()
        total[1] += torch.where(m, c.rollout.old_logp.double(), 0.0).sum()
    if dist.enabled:
        dist.all_reduce(total)
    tokens = int(plan.num_tokens)
    if tokens == 0:
        return [None for _ in plan.chunks], 0
    mean_adv, mean_logp = (total / tokens).tolist()
    covs = [token_covariance(advantages[c.rows], c.rollout.old_logp, mask[c.rows], mean_adv,
                             mean_logp) for c in chunks]  # fmt: skip
    # this rank's tokens, in pass order (none where it trains no pass: every rank still
    # takes part in the gathers)
    flat = torch.cat([v.flatten().cpu() for v in covs]) if covs else torch.zeros(0)
    if cfg.objective == "kl_cov":
        chosen, count = _top(flat, covariance_count(cfg.kl_cov_ratio, tokens), dist)
    else:
        candidates = clip_cov_candidates(flat, cfg.clip_cov_low, cfg.clip_cov_high)
        chosen, count = _random(candidates, covariance_count(cfg.clip_cov_ratio, tokens), dist,
                                seed)  # fmt: skip
    pieces = iter(zip(covs, chosen.split([v.numel() for v in covs]), strict=True))
    out = []
    for c in plan.chunks:
        cov, picked = next(pieces) if c.weight else (None, None)
        out.append(None if cov is None else picked.view_as(cov).to(device))
    return out, count


def _top(covs: torch.Tensor, k: int, dist: Dist) -> tuple[torch.Tensor, int]:
    """Exactly the k tokens of highest covariance over every rank (verl's topk), marked in this
    rank's flat `covs` (−inf: not trained)."""
    positions = (covs > -torch.inf).nonzero().flatten()
    pools = dist.gather(covs[positions]) if dist.enabled else [covs[positions]]
    pool = torch.cat(pools)
    best = pool.topk(min(k, len(pool))).indices
    offset = sum(len(p) for p in pools[: dist.rank])
    return _marked(len(covs), positions, best, offset), len(best)


def _random(candidates: torch.Tensor, k: int, dist: Dist, seed: int) -> tuple[torch.Tensor, int]:
    """k of the candidate tokens of every rank, drawn uniformly (one permutation, the same on
    every rank), marked in this rank's flat `candidates`."""
    positions = candidates.nonzero().flatten()
    counts = dist.gather(len(positions)) if dist.enabled else [len(positions)]
    generator = torch.Generator().manual_seed(seed)
    draw = torch.randperm(sum(counts), generator=generator)[: min(k, sum(counts))]
    return _marked(len(candidates), positions, draw, sum(counts[: dist.rank])), len(draw)


def _marked(size: int, positions: torch.Tensor, chosen: torch.Tensor, offset: int) -> torch.Tensor:
    """(size,) bool: this rank's `positions` whose index among every rank's (this rank's from
    `offset`) is in `chosen`."""
    mine = chosen[(chosen >= offset) & (chosen < offset + len(positions))] - offset
    flat = torch.zeros(size, dtype=torch.bool)
    flat[positions[mine]] = True
    return flat


def high_entropy_tokens(
    cfg: EntropyOptions, rollout: Rollout, mask: torch.Tensor, dist: Dist
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
        if OBJECTIVES[self.cfg.objective].by_covariance:
            seed = ((self.cfg.seed * 1_000_003 + self.step) * 1009 + epoch) * 31 + index
            selections, count = covariance_selection(self.cfg, plan, self.advantages, self.mask,
                                                     self.dist, seed)  # fmt: skip
            self.selected += count
            self.considered += int(plan.num_tokens)
        bonus = None if self.bonus is None else self.bonus.applied()
        return {"bonus": bonus, "selections": selections}

    def after(self, entropy_sum: float, tokens: float) -> None:
        """After the minibatch's optimizer step: its entropy over the whole job."""
        if self.bonus is not None:
            self.bonus.measured(entropy_sum, tokens)

    def metrics(self, threshold: float | None) -> dict[str, float | None]:
        """The update's: the high-entropy tokens' threshold, the bonus's, Clip/KL-Cov's share."""
        out = {} if self.bonus is None else self.bonus.metrics()
        if threshold is not None:
            out["entropy_threshold"] = threshold
        if OBJECTIVES[self.cfg.objective].by_covariance:
            out["cov_selected_frac"] = mean_over(self.selected, self.considered)
        return out
