"""One training step after sampling, the part that changes the weights: advantages, reference
log-probs, the update, the learning-rate schedule and the step's metrics (`learn`). The training
loop calls it once a step; `grouprl check` calls it to measure a step without stepping the
optimizer, so the two cannot drift apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from grouprl.config.options import RunConfig
from grouprl.config.validation import loss_options
from grouprl.core import ADVANTAGE_ESTIMATORS, kl_reward_penalty, overlong_penalty
from grouprl.models.lora import base_model_context
from grouprl.rollout import Rollout
from grouprl.train.batch import Batch
from grouprl.train.collect import Collected
from grouprl.train.groups import TokenWatch, group_records, watch_groups
from grouprl.train.metrics import step_metrics
from grouprl.train.nograd import no_grad_logprobs
from grouprl.train.parallel.distributed import Dist
from grouprl.train.routing import StepRoutes
from grouprl.train.run import Run, RunState
from grouprl.train.turn_rewards import (
    episode_turns,
    logged_turns,
    nan_padded,
    row_starts,
    spread_over_tokens,
    turn_reward_matrix,
)
from grouprl.train.update import recomputes_old_logp, update


@dataclass(frozen=True)
class StepLog:
    """What a step leaves for the logs."""

    metrics: dict[str, float]
    samples: list[dict[str, Any]]  # samples.jsonl's lines
    ratios: tuple[list[int], list[float]] | None  # ratios.jsonl's line, on a probed step
    groups: dict[str, Any] | None = None  # the viewer's whole groups, on a logged step


def learn(run: Run, state: RunState, collected: Collected) -> tuple[RunState, StepLog]:
    """The rest of a step, which changes the weights in place: advantages, reference log-probs,
    the update (`train_on`), the learning-rate schedule, the step's metrics; returns the next
    state and what to log. `grouprl check` measures a step by calling this on a run whose
    optimizer does not step."""
    start = time.perf_counter()
    cfg, dist, batch = run.cfg, run.dist, collected.kept
    weights = run.sampler.rewards.weights
    trained, samples, ratios, groups = None, [], None, None
    nonfinite = state.nonfinite_in_a_row
    if batch is not None:
        probe = _ratio_probe(cfg, state.step, batch, run)
        watch = watch_groups(cfg, state.step, batch, loss_options(cfg), dist)
        advantages, trained = train_on(run, batch, (state.entropy_coef, state.entropy_last),
                                       step=state.step, watch=watch)  # fmt: skip
        nonfinite = nonfinite + 1 if trained["nonfinite_updates"] else 0
        samples = _samples(batch, advantages, cfg.log_samples)
        ratios = None if probe is None else _probe_ratios(cfg, probe, run.policy, dist)
        groups = None if watch is None else _watched_groups(run, batch, advantages, watch)
        run.sampler.engine.policy_updated(state.step + 1)  # an engine's own copy follows
    lr = run.optimizer.param_groups[0]["lr"]  # the rate this step's updates used
    metrics = step_metrics(collected, trained, dist=dist, weights=weights, lr=lr)
    if batch is not None and batch.branches is not None:  # an agent's split trajectories
        (metrics["branch_rows"],) = dist.sum(int(batch.branches.parents.numel()))
    if cfg.max_staleness and batch is not None and batch.rollout.version is not None:
        # the trainer's version less the sampler's, over this rank's rows (one schedule: alike)
        metrics["staleness"] = float(state.step - batch.rollout.version.double().mean())
    run.scheduler.step()
    seconds = collected.seconds + time.perf_counter() - start
    (generated,) = dist.sum(int(collected.sampled.rollout.sampled_lengths.sum()))  # every rank's
    metrics.update(step_seconds=seconds, rollout_seconds=collected.seconds,
                   tokens_per_s=generated / seconds)  # fmt: skip
    if collected.sampler_seconds is not None:  # asynchronous: rollout_seconds is the wait
        metrics.update(sampler_seconds=collected.sampler_seconds,
                       update_seconds=seconds - collected.seconds)  # fmt: skip
    entropy = (state.entropy_coef, state.entropy_last)
    if trained is not None and "entropy_coef" in trained:  # the adaptive coefficient moved on
        entropy = (trained["entropy_coef"], trained["entropy_last"])
    state = RunState(state.step + 1, collected.position, nonfinite, state.initial_eval, *entropy)
    return state, StepLog(metrics, samples, ratios, groups)


def train_on(
    run: Run,
    batch: Batch,
    entropy_state: tuple[float | None, float | None] = (None, None),
    *,
    step: int = 0,
    watch: TokenWatch | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One update on `batch`: its advantages (N,) over the whole job's batch ((N, K) per turn
    with an estimator that takes turn rewards, each token trained with its turn's), the reference
    log-probs when beta > 0 (the initial policy: a frozen copy, or LoRA's base model), then
    `update` (with the adaptive entropy coefficient's state; `watch`: the viewer's rows, see
    `grouprl.train.groups`); returns the advantages and the update's diagnostics."""
    cfg, dist = run.cfg, run.dist
    trained, parents = with_branches(batch)
    ref_logp = None
    if cfg.beta > 0:
        with base_model_context(run.policy):
            model = run.reference or run.policy
            ref_logp = no_grad_logprobs(cfg, model, trained.rollout, run.sampler.dtype)
    old_logp = batch.rollout.old_logp  # the ratio's: the sampler's, or the trainer's below
    own = cfg.kl_in_reward and recomputes_old_logp(cfg, batch.rollout, run.sampler.dtype)
    if own and ref_logp is not None:
        old_logp = no_grad_logprobs(cfg, run.policy, batch.rollout, run.sampler.dtype)
    mine = None if ref_logp is None else _own_rows(batch, ref_logp)
    scored, kl_reward = _shaped(cfg, batch, mine, old_logp)
    advantages = batch_advantages(cfg, scored, dist, run.sampler.rewards.weights)  # (N,) or (N, K)
    if kl_reward is not None:  # the KL is in the reward, not the loss
        ref_logp = None
    teacher_logp, jsd_teacher = None, None
    if run.teacher is not None and cfg.teacher_loss == "jsd":  # it runs with each pass
        jsd_teacher = run.teacher
    elif run.teacher is not None:  # on-policy distillation: the teacher scores the samples
        teacher_logp = no_grad_logprobs(cfg, run.teacher, trained.rollout, run.sampler.dtype)
    if advantages.dim() == 2:  # per turn: each token its turn's
        width = trained.rollout.completion_ids.shape[1]
        given = spread_over_tokens(advantages, row_starts(trained.rollout), parents, width)
        given = torch.where(trained.rollout.loss_mask.cpu(), given, 0.0)  # 0 where not trained
    elif parents is not None:
        given = torch.cat([advantages, advantages[parents]])
    else:
        given = advantages
    routing = None if run.routing is None else StepRoutes(run.routing, trained.rollout, step,
                                                          run.device)  # fmt: skip
    with routing.recording() if routing is not None else contextlib.nullcontext():
        if routing is not None and routing.records_first(cfg, run.sampler.dtype):
            no_grad_logprobs(cfg, run.policy, trained.rollout, run.sampler.dtype)
        diagnostics = update(cfg, run.policy, run.optimizer, trained, given, ref_logp,
                             teacher_logp=teacher_logp, teacher=jsd_teacher,
                             dtype=run.sampler.dtype, scaler=run.scaler, dist=dist,
                             lockstep=run.lockstep, entropy_state=entropy_state, step=step,
                             watch=watch, parents=parents,
                             router_aux=0.0 if run.routing is None else run.routing.aux_coef)  # fmt: skip
    if routing is not None:  # how far routing moved (one no-grad forward, on its steps)
        diagnostics.update(routing.metrics(cfg, run.policy, trained.rollout, run.sampler.dtype,
                                           dist))  # fmt: skip
    if kl_reward is not None:  # per token, over every rank's trained tokens (TRL's "kl")
        total, tokens = dist.sum(float(kl_reward.sum()), int(batch.rollout.loss_mask.sum()))
        diagnostics["kl"] = total / max(tokens, 1)
    return advantages, diagnostics


def with_branches(batch: Batch) -> tuple[Batch, torch.Tensor | None]:
    """The batch the update trains on, and its branches' parent rows (K,) or None: with
    branches (`Branches`: an agent's trajectory that went on in rows of its own after its prefix
    broke), the batch's rows as groups of one (its rows keep their places) followed by the
    branch rows, each trained with its parent's advantage, as a sequence of its own. The
    advantages are the batch's own rows', computed before (branches are never normalised).
    Otherwise the batch itself."""
    if batch.branches is None:
        return batch, None
    joined = Rollout.concat([batch.rollout.regroup(1), batch.branches.rollout])
    parents = batch.branches.parents.to(batch.rewards.device)
    return dataclasses.replace(batch, rollout=joined, branches=None), parents


def _own_rows(batch: Batch, logp: torch.Tensor) -> torch.Tensor:
    """(N, T): the batch's own rows of `logp`, computed on its rows and branches together."""
    n, t = batch.rollout.completion_ids.shape
    return logp[:n, :t]


def _shaped(
    cfg: RunConfig, batch: Batch, ref_logp: torch.Tensor | None, old_logp: torch.Tensor
) -> tuple[Batch, torch.Tensor | None]:
    """The batch whose rewards the advantages see: clamped to --reward-clip, less β times each
    completion's summed k1 KL with --kl-in-reward (`grouprl.core.kl_reward_penalty` of
    `old_logp`, the policy that the update's ratio starts from, as TRL's RLOOTrainer takes it;
    also returned: (N,))."""
    rewards, penalty = batch.rewards, None
    if cfg.reward_clip is not None:
        rewards = rewards.clamp(*cfg.reward_clip)  # NaN (unscored) stays NaN
    if cfg.kl_in_reward and ref_logp is not None:
        penalty = kl_reward_penalty(old_logp, ref_logp, batch.rollout.loss_mask)
        rewards = rewards - cfg.beta * penalty.to(rewards.dtype)
    if rewards is batch.rewards:
        return batch, None
    return dataclasses.replace(batch, rewards=rewards), penalty


def batch_advantages(
    cfg: RunConfig, batch: Batch, dist: Dist, weights: dict[str, float] | None = None
) -> torch.Tensor:
    """This rank's advantages (N,) from the run's estimator (`grouprl.core.registry`),
    computed over the whole job's batch (so a batch-level statistic is the global batch's):
    the rewards and whatever else the estimator takes (trained-token counts, greedy baselines,
    each reward's own scores with `weights`, the reward functions'; the rewards per turn,
    `grouprl.train.turn_rewards`), gathered from every rank. Per turn: (N, K), each episode's
    turn advantages, K the job's most turns."""
    G, per = cfg.group_size, len(batch.rows)
    estimator = ADVANTAGE_ESTIMATORS[cfg.adv_estimator]
    needs = estimator.inputs()
    local = {"rewards": batch.rewards}  # (n,) each, or (n, K) for the components
    if "lengths" in needs:
        local["lengths"] = batch.rollout.sampled_lengths.to(batch.rewards.device)
    if "baselines" in needs:
        local["baselines"] = batch.baselines  # (B,)
    w: list[float] = []
    if "components" in needs:
        local["components"], w = gdpo_components(cfg, batch, weights or {})
    if estimator.per_turn:
        turns = episode_turns(batch.rollout, batch.branches)
        local["turn_rewards"] = turn_reward_matrix(batch.turn_rewards, batch.rewards, turns)
    whole = {k: _joined(dist.gather(v)) if dist.enabled else v for k, v in local.items()}
    K = whole["turn_rewards"].shape[1] if "turn_rewards" in whole else None
    given = {
        "rewards": whole["rewards"].view(-1, G),  # (B, G)
        "lengths": whole["lengths"].view(-1, G) if "lengths" in whole else None,  # (B, G)
        "baselines": whole.get("baselines"),  # (B,)
        "components": whole["components"].view(-1, G, len(w)) if w else None,  # (B, G, K)
        "turn_rewards": whole["turn_rewards"].view(-1, G, K) if K else None,  # (B, G, K)
        "weights": w, "scale": cfg.adv_scale, "eps": cfg.adv_eps,
        "unbiased_std": cfg.unbiased_std,
    }  # fmt: skip
    advantages = estimator.call(given).to(batch.rewards.dtype)
    advantages = advantages.reshape(-1, K) if K else advantages.reshape(-1)  # (N_global, ...)
    return advantages[dist.rank * per * G : (dist.rank + 1) * per * G]


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's rows as one tensor; (n, K) parts NaN-padded to the most columns."""
    if parts[0].dim() < 2:
        return torch.cat(parts)
    k = max(p.shape[1] for p in parts)
    return torch.cat([nan_padded(p, k) for p in parts])


def gdpo_components(
    cfg: RunConfig, batch: Batch, weights: dict[str, float]
) -> tuple[torch.Tensor, list[float]]:
    """GDPO's rewards (N, K) and weights (K,): each weighted reward function's raw scores, and
    DAPO's overlong penalty, when on, as one more reward of weight 1 (normalised in its group
    like the others)."""
    names = [name for name, w in weights.items() if w != 0 and name in batch.by_function]
    columns = [batch.by_function[name].to(torch.float64) for name in names]
    w = [weights[name] for name in names]
    if cfg.overlong_penalty:
        lengths = batch.rollout.sampled_lengths.cpu()
        columns.append(
            overlong_penalty(lengths, max_len=cfg.max_new_tokens, cache_len=cfg.overlong_cache)
            .to(torch.float64)
        )  # fmt: skip
        w.append(1.0)
    return torch.stack(columns, -1), w


@dataclass
class _Probe:
    """Completions whose ratio against the sampling policy is measured after the step."""

    rollout: Rollout  # one completion per group (groups of 1), spread over the batch
    old_logp: torch.Tensor  # (k, T) the sampling policy's log-probs, by the trainer's forward
    dtype: torch.dtype | None


def _ratio_probe(cfg: RunConfig, step: int, batch: Batch, run: Run) -> _Probe | None:
    """This rank's share of the `log_ratios` completions of a logged step (every
    `log_ratios_every` steps), before the update: one completion from each of as many groups
    as possible, a different member of each, so lengths and prompts vary. Under bf16, or from
    another engine, their sampling-policy log-probs are recomputed by the trainer's forward (the
    sampler's differ from it, see `trainer_old_logp`): a second extra forward."""
    if not cfg.log_ratios or (step + 1) % cfg.log_ratios_every:
        return None
    rollout = batch.rollout
    B, G = rollout.num_prompts, rollout.group_size
    k = min(-(-cfg.log_ratios // run.dist.world_size), B * G)  # this rank's share
    rows = [(i % B) * G + (i // B + i) % G for i in range(k)]  # distinct: groups first
    sub = rollout.regroup(1).select_groups(rows)
    dtype = run.sampler.dtype
    exact = dtype is None and sub.behaviour_logp is None  # the sampler is the trainer
    old = sub.old_logp if exact else no_grad_logprobs(cfg, run.policy, sub, dtype)
    return _Probe(sub, old, dtype)


def _probe_ratios(
    cfg: RunConfig, probe: _Probe, policy: torch.nn.Module, dist: Dist
) -> tuple[list[int], list[float]]:
    """Sampled lengths and Σ_t log ρ_t over the sampled tokens (the log of the token-ratio
    product; divided by the length it is GSPO's log sequence ratio) of the probe's completions
    under the policy after the step's last update, every rank's together. One extra no-grad
    forward: for an on-policy step the ratio inside the update is 1 by construction; this is how
    far the update moved those sequences."""
    sub = probe.rollout
    logp = no_grad_logprobs(cfg, policy, sub, probe.dtype)  # (k, T)
    log_ratio = ((logp - probe.old_logp) * sub.loss_mask).sum(-1)  # (k,)
    mine = (sub.sampled_lengths.tolist(), log_ratio.tolist())
    shares = dist.gather(mine) if dist.enabled else [mine]
    return [x for s in shares for x in s[0]], [x for s in shares for x in s[1]]


def _samples(batch: Batch, advantages: torch.Tensor, k: int) -> list[dict[str, Any]]:
    """The first completion of the first k groups: enough to read what the policy writes (with
    any columns the reward functions added through `log_extra`)."""
    G, out = batch.rollout.group_size, []
    turns, per_turn = logged_turns(batch)
    for g in range(min(k, len(batch.rows))):
        row = g * G
        out.append(
            {
                "prompt": batch.rows[g]["prompt"],
                "completion": batch.rollout.texts[row],
                "reward": float(batch.rewards[row]),
                "advantage": float(
                    advantages[row] if advantages.dim() == 1 else advantages[row, 0]
                ),
                "answer": batch.rows[g].get("answer"),
                **{name: values[row] for name, values in batch.extra.items()},
            }
        )
        if per_turn is not None:  # each turn's reward (NaN: none of its own) and advantage
            n = turns[row]
            out[-1]["turn_rewards"] = [None if x != x else x for x in per_turn[row, :n].tolist()]
            if advantages.dim() == 2:
                out[-1]["turn_advantages"] = advantages[row, :n].tolist()
        if batch.rollout.turns is not None:  # the whole transcript, tool turns marked
            out[-1]["transcript"] = batch.rollout.turns.transcripts[row]
        if batch.branches is not None:  # the rows its split trajectory went on in
            parents = batch.branches.parents.tolist()
            texts = [batch.branches.rollout.texts[k] for k, p in enumerate(parents) if p == row]
            if texts:
                out[-1]["branches"] = texts
    return out


def _watched_groups(
    run: Run, batch: Batch, advantages: torch.Tensor, watch: TokenWatch
) -> dict[str, Any]:
    """The watched groups' records (`grouprl.train.groups`), with their completions' log-probs
    under the policy after the step: one no-grad forward on them (every rank its own)."""
    sub = batch.select_groups(watch.groups)
    after = no_grad_logprobs(run.cfg, run.policy, sub.rollout, run.sampler.dtype)  # (k·G, T)
    return group_records(run.cfg, batch, advantages, watch, after, run.dist)
