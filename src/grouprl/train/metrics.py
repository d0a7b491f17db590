"""A step's metrics, every one defined here: what sampling drew (`sampling_metrics`), the
rewards, lengths, entropy and tool use of a batch (`batch_metrics`), the update's diagnostics
(`UpdateSums`, sums over minibatches, passes and ranks divided once), and the step's record that
joins them (`step_metrics`). A metric over nothing (no token, no row, no finite update) is NaN,
logged as null: `grouprl.core.mean_over`, the one definition.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from grouprl.core import CorrectionSums, LossStats, MismatchSums, mean_over
from grouprl.rollout import Rollout
from grouprl.train.batch import Batch
from grouprl.train.parallel.distributed import SINGLE, Dist

if TYPE_CHECKING:
    from grouprl.train.collect import Collected
    from grouprl.train.plan import Minibatch


def step_metrics(
    collected: Collected,
    update: dict[str, float] | None,
    *,
    dist: Dist,
    weights: dict[str, float],
    lr: float,
) -> dict[str, float]:
    """A step's record (before its timings): what sampling drew, the update's diagnostics (None:
    no rank kept a group, so nothing was trained), everything sampled (kept or not), then what
    dynamic sampling kept, and the learning rate the step's updates used."""
    metrics = sampling_metrics(collected)
    metrics.update(update or {})
    metrics.update(batch_metrics(collected.sampled, dist, weights))
    if collected.kept is not None and collected.filtered:
        metrics.update({f"{k}_kept": v for k, v in batch_metrics(collected.kept, dist).items()})
    metrics["lr"] = lr
    return metrics


def sampling_metrics(collected: Collected) -> dict[str, float]:
    """What a step's sampling rounds drew, over the whole job: the groups without a gradient,
    by the pass reward, rounds, prompts skipped, groups trained, and what rewards logged."""
    c = collected.counts
    return {
        **collected.logged,
        "frac_zero_std": mean_over(c.zero_std, c.sampled),
        # by the pass reward: all-wrong groups need easier data, all-right ones a harder one
        "frac_all_pass": mean_over(c.all_pass, c.sampled),
        "frac_none_pass": mean_over(c.none_pass, c.sampled),
        # the rollout compute spent on groups whose advantages are all 0
        "zero_std_token_frac": mean_over(c.zero_std_tokens, c.tokens),
        "sample_rounds": collected.rounds,
        "skipped_prompts": collected.skipped_prompts,
        "groups": collected.groups,
    }


@dataclass
class UpdateSums:
    """An update's diagnostics as sums over its minibatches (and, inside each, over passes and
    ranks), divided once at the end (`metrics`): nothing is averaged twice."""

    has_kl: bool
    updates: int = 0  # optimizer steps whose loss and gradient were finite
    nonfinite: int = 0  # optimizer steps skipped as non-finite
    loss: float = 0.0  # Σ over finite updates of the global minibatch loss
    grad_norm: float = 0.0  # Σ over finite updates
    loss_tokens: float = 0.0  # Σ global loss tokens of the finite updates' minibatches
    trained_rows: float = 0.0  # Σ over every update of rows that ran (globally)
    rows: float = 0.0  # Σ over every update of the minibatch's rows (globally)
    # the trained tokens' LossStats of the finite updates: sums added, extremes maxed
    sums: torch.Tensor = dataclasses.field(
        default_factory=lambda: torch.zeros(len(LossStats.SUMS), dtype=torch.float64)
    )
    extremes: torch.Tensor = dataclasses.field(
        default_factory=lambda: torch.full(
            (len(LossStats.EXTREMES),), -math.inf, dtype=torch.float64
        )
    )

    teacher: tuple[float, float] = (0.0, 0.0)  # --teacher-loss jsd: Σ JSD and the tokens
    aux: tuple[float, float] = (0.0, 0.0)  # the routers' balancing loss: Σ loss·rows, Σ rows
    applied: CorrectionSums = dataclasses.field(default_factory=CorrectionSums)  # this rank's
    mismatch: MismatchSums = dataclasses.field(default_factory=MismatchSums)  # bypass: this rank's

    def add(self, plan: Minibatch, passes: Any, grad_norm: float | None) -> None:
        """One minibatch's update: its passes' sums over every rank (`update.PassSums`: the global
        loss and sums, this rank's extremes) and the gradient norm (None: the step was skipped
        as non-finite)."""
        loss, sums, extremes = passes.loss, passes.stats, passes.extremes
        self.trained_rows += passes.trained_rows
        self.rows += passes.rows
        self.teacher = tuple(a + b for a, b in zip(self.teacher, passes.teacher, strict=True))
        self.aux = tuple(a + b for a, b in zip(self.aux, passes.aux, strict=True))
        self.applied, self.mismatch = self.applied + passes.applied, self.mismatch + passes.mismatch
        if grad_norm is None:  # a NaN or inf never reached the weights, nor AdamW's moments
            self.nonfinite += 1
            return
        self.updates += 1
        self.loss += loss
        self.grad_norm += grad_norm
        self.loss_tokens += float(plan.num_tokens)
        self.sums += torch.tensor(sums, dtype=torch.float64)
        self.extremes = torch.maximum(self.extremes, extremes)

    def metrics(self) -> dict[str, float]:
        """Loss and gradient norm per finite update; clip fractions over every loss token of
        their minibatches (skipped groups included: their advantages are 0, so never clipped,
        which makes the fractions exactly those of the full computation); ratio statistics and
        KL estimates over the tokens that were trained; NaN where nothing was counted
        (`mean_over`)."""
        stats = LossStats.combine(self.sums, self.extremes)
        out = {
            "loss": mean_over(self.loss, self.updates),
            "grad_norm": mean_over(self.grad_norm, self.updates),
            "clip_frac_low": mean_over(stats.pop("clipped_low"), self.loss_tokens),
            "clip_frac_high": mean_over(stats.pop("clipped_high"), self.loss_tokens),
            **stats,
            "trained_frac": mean_over(self.trained_rows, self.rows),
            "nonfinite_updates": self.nonfinite,
        }
        if not self.has_kl:
            del out["kl"]
        return out


def batch_metrics(
    batch: Batch, dist: Dist = SINGLE, weights: dict[str, float] | None = None
) -> dict[str, float]:
    """Reward, accuracy, length and entropy metrics of `batch` on every rank together; lengths
    and entropy over the sampled tokens (the loss mask). With the reward `weights`: each
    weighted reward's spread, and with two or more, each one's share of the advantage."""
    mask = batch.rollout.loss_mask
    entropy = batch.rollout.entropy  # of the sampling policy, over every sampled token
    local = {
        "rewards": batch.rewards,
        "lengths": batch.rollout.sampled_lengths.float().cpu(),
        "truncated": batch.rollout.truncated.float().cpu(),
        "by_function": batch.by_function,
        "passed": batch.passed,
        "entropy": None if entropy is None else (float(entropy[mask].sum()), int(mask.sum())),
        "tools": _tool_counts(batch.rollout),
    }
    shares = dist.gather(local) if dist.enabled else [local]
    rewards = torch.cat([s["rewards"] for s in shares])  # (N_global,) group-contiguous
    lengths = torch.cat([s["lengths"] for s in shares])
    G = batch.rollout.group_size
    metrics = {
        "reward_mean": float(rewards.nanmean()),
        "reward_std": float(_nanstd_groups(rewards, G).nanmean()),
        "unscored_frac": float(rewards.isnan().float().mean()),
        "completion_len_mean": float(lengths.mean()),
        "completion_len_max": float(lengths.max()),
        "truncated_frac": float(torch.cat([s["truncated"] for s in shares]).mean()),
    }
    if entropy is not None and not dist.enabled:
        metrics["entropy"] = float(entropy[mask].mean()) if mask.any() else math.nan
    elif entropy is not None:
        total, tokens = (sum(s["entropy"][i] for s in shares) for i in range(2))
        metrics["entropy"] = mean_over(total, tokens)
    for name in batch.by_function:
        values = torch.cat([s["by_function"][name] for s in shares])
        metrics[f"reward_{name}"] = float(values.nanmean())
    weighted = {n: w for n, w in (weights or {}).items() if w != 0 and n in batch.by_function}
    for name in weighted:
        values = torch.cat([s["by_function"][name] for s in shares]).double()
        scored = values[~values.isnan()]
        spread = float(scored.std(unbiased=False)) if len(scored) else math.nan
        metrics[f"reward_{name}_spread"] = spread
    if len(weighted) >= 2:
        metrics.update(_reward_shares(shares, rewards, weighted, G))
    if batch.passed is not None:  # the pass reward's verdict: the one definition of correct
        metrics["accuracy"] = float(torch.cat([s["passed"] for s in shares]).float().mean())
    if local["tools"] is not None:
        total = {k: sum(s["tools"][k] for s in shares) for k in local["tools"]}
        rows = total["rows"]
        metrics.update(
            tool_calls_mean=total["calls"] / rows,
            tool_call_rate=total["calling"] / rows,
            tool_failure_frac=mean_over(total["failures"], total["calls"]),
            turns_mean=total["turns"] / rows,
            observation_token_frac=mean_over(total["observed"], total["tokens"]),
            ended_by_turns_frac=total["ended_by_turns"] / rows,
            env_steps_mean=total["steps"] / rows,  # an environment's step() answers
        )
    return metrics


def _reward_shares(
    shares: list[dict], rewards: torch.Tensor, weights: dict[str, float], G: int
) -> dict[str, float]:
    """Each weighted reward's share of the within-group variance of the total reward R:
    Σ_groups Cov(w_k·r_k, R) / Σ_groups Var(R), which sums to 1 over the rewards (an unscored
    score counts as 0). A share near 1 means that reward alone sets the advantages."""
    total = torch.nan_to_num(rewards.double(), nan=0.0).view(-1, G)
    centred = total - total.mean(-1, keepdim=True)
    variance = float(centred.square().sum())
    out = {}
    for name, w in weights.items():
        part = w * torch.nan_to_num(torch.cat([s["by_function"][name] for s in shares]).double())
        part = part.view(-1, G)
        covariance = float(((part - part.mean(-1, keepdim=True)) * centred).sum())
        out[f"reward_share_{name}"] = covariance / variance if variance > 0 else math.nan
    return out


def _tool_counts(rollout: Rollout) -> dict[str, int] | None:
    """A tool rollout's counts, to sum over ranks: rows, calls, rows that called, failed calls,
    model turns, observation tokens, attended tokens, rows ended by --max-turns, environment
    steps answered."""
    turns = rollout.turns
    if turns is None:
        return None
    return {
        "rows": len(rollout.texts),
        "calls": int(turns.calls.sum()),
        "calling": int((turns.calls > 0).sum()),
        "failures": int(turns.failures.sum()),
        "turns": sum(m["role"] == "assistant" for t in turns.transcripts for m in t),
        "observed": int((rollout.mask & ~rollout.loss_mask).sum()),
        "tokens": int(rollout.mask.sum()),
        "ended_by_turns": int(turns.ended_by_turns.sum()),
        "steps": sum(m["role"] == "user" for t in turns.transcripts for m in t),
    }


def _nanstd_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    r = rewards.view(-1, group_size)  # (B, G)
    mean = r.nanmean(dim=1, keepdim=True)
    return ((r - mean) ** 2).nanmean(dim=1).sqrt()  # (B,)
