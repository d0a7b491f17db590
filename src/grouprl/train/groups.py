"""Whole groups, token by token, for the run viewer (`grouprl view`).

At the first and the last step and every `log_groups_every` steps, `log_groups` groups of the
step's batch, spread evenly over it
(so over its minibatches: the first update's ratios are 1 by construction), are watched
through the update (`TokenWatch`: each pass that trains one of their completions records what
its loss saw, so the last epoch's pass is what stays) and then written whole (`group_records`):

- per group: the prompt (text and ids), its images as small PNG data URLs (a vision-language
  policy's), the reference answer, whether any of its completions was trained (a group whose
  rewards all agree is skipped when its advantages are 0);
- per completion: its reward, each reward function's score, whether it passed, its advantage,
  its text, its length and whether it was truncated;
- per token: the id, the loss mask (tool and observation tokens are shown but not trained), the
  sampler's log-prob and entropy, the log-probs of the last pass that trained it (the proximal
  policy's the ratio is taken against, and the current one's), the ratio the loss used (at its
  level: GSPO's is the sequence's, on every token), whether the objective's bound acted (1:
  below, 2: above; `grouprl.core.bounded_tokens`), the objective's token weight where one
  applies (top-entropy selection, Clip-Cov, a correction), KL-Cov's penalised tokens, per-token
  advantages (a teacher's, or each turn's), and the log-prob after the step: one extra no-grad forward on these
  completions (k·G), as `ratios.jsonl` takes for its probe.

Under data parallelism each rank watches its share of the groups and the records are gathered
(rank 0 writes them). The update's result does not depend on being watched: the watch only
reads detached tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from grouprl.config.options import RunConfig
from grouprl.core import LossOptions, bounded_tokens, importance_ratio
from grouprl.images import thumbnail
from grouprl.train.batch import Batch
from grouprl.train.parallel.distributed import Dist
from grouprl.train.turn_rewards import logged_turns

#: Significant digits kept for a float: log-probs near 0 keep their relative precision, and
#: GSPO's ratios (1 ± 4e-4) keep 2 digits past the clip range's.
DIGITS = 7


@dataclass
class TokenWatch:
    """Rows of the step's rollout whose loss terms `update` records with `see`: each pass that
    trains one of them replaces what an earlier pass recorded, so what stays is the last update's
    (the last epoch's)."""

    groups: list[int]  # the watched groups of this rank's batch
    group_size: int
    options: LossOptions
    seen: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def rows(self) -> list[int]:
        """The watched rows of the step's rollout, group by group."""
        G = self.group_size
        return [g * G + i for g in self.groups for i in range(G)]

    def see(
        self,
        rows: torch.Tensor,  # (n,) the pass's rows of the step's rollout
        logp: torch.Tensor,  # (n, T) this pass's log-probs
        old_logp: torch.Tensor,  # (n, T) the proximal policy's, which the ratio is taken against
        advantages: torch.Tensor,  # (n,) or (n, T)
        mask: torch.Tensor,  # (n, T) the tokens the loss trains
        weight: torch.Tensor | None = None,  # (n, T) the objective's token weight, or None: 1
        penalised: torch.Tensor | None = None,  # (n, T) bool: KL-Cov's penalised tokens
    ) -> None:
        wanted = set(self.rows)
        hits = [(i, r) for i, r in enumerate(rows.tolist()) if r in wanted]
        if not hits:
            return
        idx = torch.tensor([i for i, _ in hits], device=logp.device)
        with torch.no_grad():
            lp, old, m = logp[idx].detach(), old_logp[idx].detach(), mask[idx].bool()
            adv = advantages[idx].detach()
            adv = torch.where(m, adv[:, None] if adv.dim() == 1 else adv, 0.0)  # (k, T)
            ratio = importance_ratio(lp, old, m, level=self.options.level)  # (k, T)
            below, above = bounded_tokens(self.options, ratio, adv)
            bound = below.to(torch.int8) + 2 * above.to(torch.int8)  # (k, T) 0, 1 or 2
        for j, (_, row) in enumerate(hits):
            record = {"logp": lp[j], "old_logp": old[j], "ratio": ratio[j], "bound": bound[j]}
            if weight is not None:
                record["weight"] = weight[idx][j].detach()
            if penalised is not None:
                record["penalised"] = penalised[idx][j]
            if advantages.dim() == 2:  # a teacher's per-token advantages
                record["token_advantages"] = adv[j]
            self.seen[row] = {k: v.cpu() for k, v in record.items()}


def watch_groups(
    cfg: RunConfig, step: int, batch: Batch, options: LossOptions, dist: Dist
) -> TokenWatch | None:
    """The watch of a logged step (the first, the last, and every `log_groups_every`,
    counting from 1 like the logs: a short run shows groups too): ⌈log_groups / ranks⌉ of this
    rank's groups, whole, spread evenly over its batch. None on other steps."""
    logged = step + 1 in (1, cfg.steps) or (step + 1) % cfg.log_groups_every == 0
    if not cfg.log_groups or not logged:
        return None
    B = len(batch.rows)
    k = min(-(-cfg.log_groups // dist.world_size), B)
    return TokenWatch([i * B // k for i in range(k)], batch.rollout.group_size, options)


def group_records(
    cfg: RunConfig,
    batch: Batch,
    advantages: torch.Tensor,  # (N,) this rank's
    watch: TokenWatch,
    after_logp: torch.Tensor,  # (k·G, T) the watched groups' log-probs after the step
    dist: Dist,
) -> dict[str, Any]:
    """A logged step's record: how the loss weighed its tokens (`loss_settings`) and the watched
    groups as JSON-ready dicts (see the module docstring), every rank's, in rank order."""
    rollout, G = batch.rollout, batch.rollout.group_size
    groups = []
    offset = dist.rank * len(batch.rows)  # the group's index in the job's batch
    turns, per_turn = logged_turns(batch)
    for j, g in enumerate(watch.groups):
        rows = range(g * G, (g + 1) * G)
        prompt_ids = rollout.prompt_ids[g][rollout.prompt_mask[g]].tolist()
        after = after_logp[j * G : (j + 1) * G]  # (G, T)
        completions = [_completion(batch, row, advantages, watch, after[i])
                       for i, row in enumerate(rows)]  # fmt: skip
        if per_turn is not None:  # each turn's reward and advantage (its first is `advantage`)
            for c, row in zip(completions, rows, strict=True):
                c["turn_rewards"] = _floats(per_turn[row, : turns[row]])
                if advantages.dim() == 2:
                    c["turn_advantages"] = _floats(advantages[row, : turns[row]])
        rewards = [_number(batch.rewards[row]) for row in rows]
        groups.append({
            "index": offset + g,
            "prompt": rollout.prompts[g],
            "prompt_ids": prompt_ids,
            "answer": _plain(batch.rows[g].get("answer")),
            "images": _thumbnails(rollout, g),
            "rewards": rewards,
            "trained": any(row in watch.seen for row in rows),
            "completions": completions,
        })  # fmt: skip
    shares = dist.gather(groups) if dist.enabled else [groups]
    return {**loss_settings(cfg, watch.options),
            "groups": [group for share in shares for group in share]}  # fmt: skip


def _thumbnails(rollout: Any, g: int) -> list[str]:
    """Prompt g's images as small PNG data URLs (none for a text prompt)."""
    media = None if rollout.media is None else rollout.media.prompts[g]
    return [] if media is None else [thumbnail(image) for image in media.images]


def loss_settings(cfg: RunConfig, options: LossOptions) -> dict[str, Any]:
    """What the viewer needs to read a record's ratios: the ratio's level, the objective and its
    bounds, and how many optimizer steps each batch took (one: every ratio is 1 by
    construction, and only the log-prob after the step shows what the update did)."""
    return {
        "algo": cfg.algo,
        "level": options.level,
        "objective": options.objective,
        "clip_low": options.clip_low,
        "clip_high": options.clip_high,
        "cispo_cap": options.cispo_cap if options.objective == "cispo" else None,
        "updates_per_batch": cfg.epochs * cfg.minibatches,
        "group_size": cfg.group_size,
        "temperature": cfg.temperature,
    }


def vocabulary(tokenizer: Any) -> dict[str, Any]:
    """Each token id's text (its own decode, special tokens kept), stored once per run: the
    viewer shows a token as its piece. A byte-level BPE piece that holds part of a UTF-8
    character shows as U+FFFD; the completion's text beside it is exact."""
    size = len(tokenizer)
    pieces = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False,
                                    clean_up_tokenization_spaces=False)  # fmt: skip
    special = sorted(set(getattr(tokenizer, "all_special_ids", []) or []))
    return {"pieces": pieces, "special": [i for i in special if i < size]}


def _completion(
    batch: Batch,
    row: int,
    advantages: torch.Tensor,
    watch: TokenWatch,
    after_logp: torch.Tensor,  # (T,) this completion's
) -> dict[str, Any]:
    rollout = batch.rollout
    length = int(rollout.mask[row].sum())  # every completion token (observations included)
    cut = slice(0, length)
    out: dict[str, Any] = {
        "text": rollout.texts[row],
        "reward": _number(batch.rewards[row]),
        "scores": {name: _number(values[row]) for name, values in batch.by_function.items()},
        "passed": None if batch.passed is None else bool(batch.passed[row]),
        "advantage": _number(advantages[row] if advantages.dim() == 1 else advantages[row, 0]),
        "truncated": bool(rollout.truncated[row]),
        "ids": rollout.completion_ids[row, cut].tolist(),
        "trained_mask": rollout.loss_mask[row, cut].to(torch.int8).tolist(),
        "sampler_logp": _floats(rollout.sampler_logp[row, cut]),
        "after_logp": _floats(after_logp[cut]),
    }
    if rollout.entropy is not None:
        out["entropy"] = _floats(rollout.entropy[row, cut])
    seen = watch.seen.get(row)
    if seen is not None:  # the loss's view at the last pass that trained this completion
        for name in ("logp", "old_logp", "ratio"):
            out[name] = _floats(seen[name][cut])
        out["bound"] = seen["bound"][cut].tolist()
        for name in ("weight", "token_advantages"):
            if name in seen:
                out[name] = _floats(seen[name][cut])
        if "penalised" in seen:
            out["penalised"] = seen["penalised"][cut].to(torch.int8).tolist()
    return out


def _number(x: torch.Tensor | float) -> float | None:
    """A float rounded to DIGITS significant digits; None for NaN (unscored) or ±inf."""
    value = float(x)
    return float(f"{value:.{DIGITS}g}") if math.isfinite(value) else None


def _floats(t: torch.Tensor) -> list[float | None]:
    return [_number(x) for x in t.detach().double().cpu().tolist()]


def _plain(value: Any) -> Any:
    """A task row's value as JSON can hold it (its text where it is something else)."""
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
