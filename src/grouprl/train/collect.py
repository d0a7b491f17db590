"""One step's training data: prompts drawn, groups sampled and scored, DAPO's filter applied,
and each rank's share of the groups kept.

A step runs sampling rounds (`sample_round`: draw prompts, sample G completions each, score
them, add the overlong penalty) until it has B groups that teach something: one round, or with
dynamic sampling (DAPO, arXiv 2503.14476) up to 1 + `max_resample_rounds`, each dropping the
groups whose completions all pass or all fail (`grouprl.core.mixed_groups`). What was sampled is
counted in `GroupCounts`, summed over rounds and, once, over ranks.

Data parallel: every rank draws the same prompts (the single-process prompts) and samples whole
groups for its share of each minibatch (`Dist.my_groups`), with its own seed; with dynamic
sampling the kept groups are handed round (`hand_round`) so every rank trains as many.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from grouprl.config.options import RunConfig
from grouprl.core import ADVANTAGE_ESTIMATORS, mixed_groups, overlong_penalty, zero_variance_groups
from grouprl.faults import fault
from grouprl.models.precision import autocast
from grouprl.rollout import Rollout, RolloutEngine
from grouprl.rollout.types import Branches
from grouprl.tasks.base import TrainerState
from grouprl.tasks.data import PromptStream
from grouprl.tasks.rewards.scoring import RewardSet
from grouprl.tasks.tools.use import Episode
from grouprl.train.batch import Batch
from grouprl.train.parallel.distributed import SINGLE, Dist
from grouprl.train.prompts import fits, no_prompt_fits, prompt_ids, reset_prompt_ids
from grouprl.train.turn_rewards import episode_turns


@dataclass
class Sampler:
    """What a step needs to draw prompts, sample completions and score them."""

    engine: RolloutEngine
    tokenizer: Any
    stream: PromptStream
    rewards: RewardSet
    stop: list[str] | None
    budget: int | None  # longest prompt in tokens; None: no limit
    dtype: torch.dtype | None  # autocast dtype of the forward passes
    device: torch.device
    dist: Dist = SINGLE  # this rank's place in a torchrun job
    warn: Callable[[str], None] = print
    tools: Any = None  # the run's ToolUse (`grouprl.tasks.tools.use`): format, tools, environment
    episodes: bool = False  # the task draws fresh episodes (`Task.episodes`), keyed by position
    budget_by_flag: bool = False  # the budget is --max-prompt-length (else the context's room)
    warned: set[str] = field(default_factory=set)  # one-time warnings already given

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            self.warn(message)


@dataclass(frozen=True)
class GroupCounts:
    """What a step's sampling rounds drew, by group: summed over rounds with `+`, over ranks
    with `reduced` (one all-reduce)."""

    sampled: int = 0  # groups sampled
    kept: int = 0  # of them, those dynamic sampling kept (all when it is off)
    zero_std: int = 0  # groups whose rewards all agree (advantages all 0)
    all_pass: int = 0  # groups whose completions all pass (by the pass reward)
    none_pass: int = 0  # ... all fail
    tokens: int = 0  # completion tokens sampled, in every group
    zero_std_tokens: int = 0  # ... in the zero-variance groups

    def __add__(self, other: GroupCounts) -> GroupCounts:
        return GroupCounts(*(a + b for a, b in zip(_values(self), _values(other), strict=True)))

    def reduced(self, dist: Dist) -> GroupCounts:
        """The whole job's counts (every rank calls this, at the same point)."""
        return GroupCounts(*(int(v) for v in dist.sum(*_values(self))))


def _values(counts: GroupCounts) -> tuple[int, ...]:
    return tuple(getattr(counts, f.name) for f in dataclasses.fields(counts))


@dataclass(frozen=True)
class Collected:
    """A step's sampling: what this rank trains, everything it sampled, and the job's counts."""

    kept: Batch | None  # this rank's groups to train; None when no rank kept any
    sampled: Batch  # everything this rank sampled, kept or not (the reward metrics' batch)
    counts: GroupCounts  # of the whole job
    groups: int  # groups trained, over all ranks
    rounds: int  # sampling rounds run
    position: int  # the data position after this step's draws
    skipped_prompts: int  # prompts over the prompt budget, drawn and skipped (alike on all ranks)
    logged: dict[str, float]  # what reward functions logged with log_metric (mean over ranks)
    seconds: float  # wall time of the sampling (asynchronous: of the trainer's wait for it)
    sampler_seconds: float | None = None  # asynchronous: the sampler's own time on it

    @property
    def filtered(self) -> bool:
        """Whether dynamic sampling left groups out (the kept batch is not all that was sampled)."""
        return self.groups < self.counts.sampled


def draw_prompts(
    sampler: Sampler, position: int, k: int
) -> tuple[list[dict], list[list[int]], list[Any], int, int]:
    """k rows from the stream at `position` whose prompts fit the prompt budget, their token
    ids, their keys (what seeds their groups' environments: the row, or for episodes its
    position in the stream), the position after them, and how many prompts were skipped as
    too long.

    A prompt over the budget is skipped (warned about once); when a whole pass over the split
    finds none that fits, that is the user's to fix. A row without a prompt (an environment
    that owns its data) is budgeted once its environment has written the prompt.
    """
    rows: list[dict] = []
    ids: list[list[int]] = []
    keys: list[Any] = []
    misses = skipped = 0
    shortest = None  # the shortest prompt over the budget since the last that fitted
    while len(rows) < k:
        for row in sampler.stream.take(position, k - len(rows)):
            position += 1
            row_ids = [] if "prompt" not in row else prompt_ids(
                sampler.tokenizer, row["prompt"], sampler.tools, row)  # fmt: skip
            if fits(row_ids, sampler.budget):
                rows.append(row)
                ids.append(row_ids)
                keys.append(Episode(position - 1) if sampler.episodes else row)
                misses, shortest = 0, None
                continue
            sampler.warn_once(
                "long prompt",
                f"skipping a prompt of {len(row_ids)} tokens, over the prompt budget of "
                f"{sampler.budget}; such prompts are counted as skipped_prompts in the metrics",
            )
            skipped += 1
            misses += 1
            shortest = len(row_ids) if shortest is None else min(shortest, len(row_ids))
        if misses >= len(sampler.stream.rows):
            raise no_prompt_fits("the training data", shortest, sampler.budget,
                                 by_flag=sampler.budget_by_flag)  # fmt: skip
    return rows, ids, keys, position, skipped


@dataclass(frozen=True)
class Round:
    """One sampling round on this rank: its groups, scored, and what it counted."""

    batch: Batch
    keep: list[int]  # the groups dynamic sampling keeps (all when it is off)
    counts: GroupCounts  # this rank's
    logged: dict[str, float]


def sample_round(
    cfg: RunConfig,
    sampler: Sampler,
    step: int,
    round_: int,
    rows: list[dict],
    ids: list[list[int]],
    keys: list[Any],
) -> Round:
    """Sample G completions for each of this rank's prompts, score them (the weighted reward
    functions, NaN where none scored), add DAPO's soft overlong penalty when enabled, and count.

    A user error in a reward function on any rank is raised on every rank (`Dist.agreed`)."""
    dist, G = sampler.dist, cfg.group_size
    rollout, rows, branches = _sample(cfg, sampler, step, round_, rows, ids, keys)
    fault("sample")
    scores = dist.agreed(
        sampler.rewards.score,
        rollout.texts,
        rows,
        G,
        completion_ids=rollout.completion_id_lists(),
        state=TrainerState(global_step=step, max_steps=cfg.steps),
        timeout=cfg.reward_timeout,
        transcripts=None if rollout.turns is None else rollout.turns.transcripts,
        environments=None if rollout.turns is None else rollout.turns.environments,
        num_turns=None if rollout.turns is None else episode_turns(rollout, branches),
    )
    if sampler.tools is not None and rollout.turns is not None:
        sampler.tools.scored(rollout.turns.environments)  # kept for the next rollouts
    rewards = scores.total  # (N,) on the CPU
    if cfg.overlong_penalty:
        penalty = overlong_penalty(
            rollout.sampled_lengths, max_len=cfg.max_new_tokens, cache_len=cfg.overlong_cache
        )
        rewards = rewards + penalty.to(device="cpu", dtype=rewards.dtype)
    greedy = "baselines" in ADVANTAGE_ESTIMATORS[cfg.adv_estimator].inputs()
    baselines = greedy_baselines(cfg, sampler, step, rows, ids) if greedy else None
    batch = Batch(rollout, rows, rewards, scores.by_function, scores.passed, scores.extra,
                  baselines, branches, scores.turns)  # fmt: skip
    passed = scores.passed.view(-1, G)  # (b, G)
    zero = zero_variance_groups(rewards.view(-1, G)).cpu()  # (b,)
    mixed = mixed_groups(passed)  # (b,)
    group_tokens = rollout.lengths.view(-1, G).sum(-1).cpu()  # (b,)
    keep = [g for g in range(len(rows)) if mixed[g] or not cfg.dynamic_sampling]
    counts = GroupCounts(
        sampled=len(rows),
        kept=len(keep),
        zero_std=int(zero.sum()),
        all_pass=int(passed.all(-1).sum()),
        none_pass=int((~passed.any(-1)).sum()),
        tokens=int(group_tokens.sum()),
        zero_std_tokens=int(group_tokens[zero].sum()),
    )
    return Round(batch, keep, counts, scores.logged)


def _sample(
    cfg: RunConfig,
    sampler: Sampler,
    step: int,
    round_: int,
    rows: list[dict],
    ids: list[list[int]],
    keys: list[Any],
) -> tuple[Rollout, list[dict], Branches | None]:
    """This rank's groups sampled (environments reset first, each group from one seed, its
    prompts then encoded with reset's text and budgeted), the rows as rewards see them, and the
    rows an agent's split trajectories went on in (`Branches`, or None)."""
    handler = None
    # each rank its own stream (an odd 32-bit offset: CPU generators keep 32 bits)
    seed = cfg.seed * 1_000_003 + step * 97 + round_ + sampler.dist.rank * 0x9E3779B1
    if sampler.tools is not None:
        start = sampler.tools.rollout(rows, cfg.group_size, cfg.seed, step, round_, keys=keys)
        handler, rows = start.handler, start.rows
        if start.environments is not None:
            ids = reset_prompt_ids(sampler.tokenizer, start.prompts, sampler.tools, sampler.budget,
                                   rows)  # fmt: skip
    with autocast(sampler.device, sampler.dtype):
        rollout = sampler.engine.sample(
            ids,
            group_size=cfg.group_size,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            stop=sampler.stop,
            seed=seed,
            tools=handler,
        )
    branches = None
    if sampler.tools is not None:

        def resample(prompts: list[list[int]], k: int) -> Rollout:
            with autocast(sampler.device, sampler.dtype):
                return sampler.engine.sample(
                    prompts, group_size=1, max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                    stop=sampler.stop, seed=seed + 7919 * (k + 1), tools=handler,
                )  # fmt: skip

        branches = sampler.tools.sampled(rollout, handler, resample)
    return rollout, rows, branches


def greedy_baselines(
    cfg: RunConfig, sampler: Sampler, step: int, rows: list[dict], ids: list[list[int]]
) -> torch.Tensor:
    """ReMax's baselines (b,): the reward of one greedy completion of each prompt, scored as
    the sampled ones are (with DAPO's overlong penalty when on; never with tools: the run
    refuses ReMax with them at set-up)."""
    with autocast(sampler.device, sampler.dtype):
        greedy = sampler.engine.sample(ids, group_size=1, max_new_tokens=cfg.max_new_tokens,
                                       temperature=0.0, stop=sampler.stop, seed=None)  # fmt: skip
    scores = sampler.dist.agreed(
        sampler.rewards.score, greedy.texts, rows, 1,
        completion_ids=greedy.completion_id_lists(),
        state=TrainerState(global_step=step, max_steps=cfg.steps), timeout=cfg.reward_timeout,
    )  # fmt: skip
    baselines = scores.total
    if cfg.overlong_penalty:
        penalty = overlong_penalty(greedy.sampled_lengths, max_len=cfg.max_new_tokens,
                                   cache_len=cfg.overlong_cache)  # fmt: skip
        baselines = baselines + penalty.to(device="cpu", dtype=baselines.dtype)
    return baselines


def collect_batch(cfg: RunConfig, sampler: Sampler, step: int, position: int) -> Collected:
    """Sample and score B groups from data `position` on; with dynamic sampling keep only the
    groups that teach something, sampling more rounds while fewer than B were kept. Short of B
    after the last round, the step trains on a multiple of world size × minibatches (on every
    rank); on none at all (`kept` None) with a warning, once."""
    start = time.perf_counter()
    B, dist = cfg.prompts_per_step, sampler.dist
    W, M = dist.world_size, cfg.minibatches
    rounds = 1 + (cfg.max_resample_rounds if cfg.dynamic_sampling else 0)
    parts: list[tuple[int, Batch]] = []  # (round, kept groups of this rank)
    sampled: list[Batch] = []
    counts, kept_anywhere, skipped, logged = GroupCounts(), 0, 0, {}
    for round_ in range(rounds):
        every_rows, every_ids, every_key, position, too_long = draw_prompts(
            sampler,
            position,
            -(-(B - kept_anywhere) // W) * W,  # the same on all ranks
        )
        skipped += too_long
        n = len(every_rows)
        mine = dist.my_groups(n, M) if n % (W * M) == 0 else dist.mine(n)
        rows, ids = [every_rows[i] for i in mine], [every_ids[i] for i in mine]
        result = sample_round(cfg, sampler, step, round_, rows, ids, [every_key[i] for i in mine])
        sampled.append(result.batch)
        counts = counts + result.counts
        logged.update(result.logged)
        if result.keep:
            whole = len(result.keep) == len(rows)
            parts.append(
                (round_, result.batch if whole else result.batch.select_groups(result.keep))
            )
        (kept_here,) = dist.sum(len(result.keep))  # on every rank
        kept_anywhere += int(kept_here)
        if kept_anywhere >= B:
            break
    counts = counts.reduced(dist)
    usable = min(kept_anywhere, B)
    usable -= usable % (W * M)
    everything = Batch.concat(sampled)
    collected = dict(
        sampled=everything, counts=counts, groups=usable, rounds=round_ + 1, position=position,
        skipped_prompts=skipped, logged=_mean_over_ranks(dist, logged),
        seconds=time.perf_counter() - start,
    )  # fmt: skip
    if usable == 0:
        if cfg.dynamic_sampling:
            sampler.warn_once(
                "nothing kept",
                f"dynamic sampling kept no group at step {step + 1}: in every group all "
                f"completions passed or all failed by the pass reward "
                f"'{sampler.rewards.pass_reward}' (a pass is a score >= 1); if it gives partial "
                "credit, name another with --pass-reward or turn --dynamic-sampling off",
            )
        return Collected(kept=None, **collected)
    if dist.enabled and cfg.dynamic_sampling:
        kept = hand_round(dist, parts, usable, M, sampler.device)
    else:  # each rank kept its own share, in order
        kept = Batch.concat([b for _, b in parts])
        if len(kept.rows) != usable // W:
            kept = kept.select_groups(list(range(usable // W)))
    return Collected(kept=kept, **collected)


def hand_round(
    dist: Dist, parts: list[tuple[int, Batch]], usable: int, minibatches: int, device: torch.device
) -> Batch:
    """This rank's groups (`Dist.my_groups`) of the first `usable` groups that all ranks kept,
    taken in their global order (round by round, rank by rank), on `device`. `parts`: the
    (round, kept groups) this rank sampled. How dynamic sampling gives every rank as many
    groups to train, whoever sampled them."""
    everyone = dist.gather([(r, b.to("cpu")) for r, b in parts])
    ordered = sorted(
        ((round_, rank, b) for rank, pieces in enumerate(everyone) for round_, b in pieces),
        key=lambda x: (x[0], x[1]),
    )
    batch = Batch.concat([b for _, _, b in ordered])
    return batch.select_groups(dist.my_groups(usable, minibatches)).to(device)


def _mean_over_ranks(dist: Dist, values: dict[str, float]) -> dict[str, float]:
    """Each key's mean over the ranks that logged it."""
    if not dist.enabled:
        return values
    out: dict[str, list[float]] = {}
    for logged in dist.gather(values):
        for key, value in logged.items():
            out.setdefault(key, []).append(value)
    return {key: sum(v) / len(v) for key, v in out.items()}
