"""The GRPO / GSPO training loop, top to bottom.

Each step:
  1. take B prompts from the task's train split (a seeded permutation; the position is saved);
  2. sample G completions for each with the current policy through a `RolloutEngine` (the HF
     engine today; another backend plugs in here); their log-probs under the sampling
     distribution come back with them as `old_logp` (no extra forward pass);
  3. score every completion: the weighted sum of the reward functions (NaN where none scored);
     DAPO's soft overlong penalty is added when enabled;
  4. optionally (dynamic sampling, DAPO) drop groups whose rewards all agree and sample more
     prompts, up to `max_resample_rounds` extra rounds;
  5. advantages = group_advantages(rewards): the group mean is the baseline, so no critic;
  6. reference log-probs when beta > 0 (the initial policy, frozen);
  7. `epochs` passes over `minibatches` minibatches of whole groups (groups whose advantages are
     all 0 left out of the compute when beta = 0: their gradient is exactly 0): current log-probs,
     `policy_loss` (token ratio for GRPO, sequence ratio for GSPO), backward, gradient clipping,
     an optimizer step. With one epoch and one minibatch the update is exactly on-policy and the
     ratio is 1; only its gradient matters (GRPO paper, mu = 1);
  8. learning-rate schedule, metrics, sample completions, evaluation, checkpoints.

Deviations from the papers: dropout stays off throughout (the model stays in eval mode), so the
ratio compares the same function at two parameter values and is not noisy by construction.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from torch import nn

from grouprl.core import (
    PolicyLoss,
    group_advantages,
    overlong_penalty,
    policy_loss,
    zero_variance_groups,
)
from grouprl.errors import UserError
from grouprl.models import load_model, load_tokenizer
from grouprl.report import MetricSinks, plot_run
from grouprl.report.sinks import truncate_jsonl
from grouprl.rollout import HFRolloutEngine, Rollout, RolloutEngine, completion_logprobs
from grouprl.tasks import Task, get_task
from grouprl.tasks.base import call_reward
from grouprl.train import checkpoint as ckpt
from grouprl.train.config import TrainConfig, resolve, to_yaml
from grouprl.train.evaluate import EvalResult, evaluate

# Diagnostics of an update (see `update`): those that are exact even when groups are skipped
# (averaged over every update), and those that describe the trained completions only.
_EXACT_DIAGNOSTICS = ("loss", "grad_norm", "clip_frac_low", "clip_frac_high")
_TRAINED_DIAGNOSTICS = tuple(
    f.name for f in dataclasses.fields(PolicyLoss) if f.name not in (*_EXACT_DIAGNOSTICS, "kl")
)


@dataclass(frozen=True)
class TrainSummary:
    run_dir: Path
    steps_done: int
    initial_eval: dict[str, float] | None
    final_eval: dict[str, float] | None
    interrupted: bool = False


class PromptStream:
    """The train split in a seeded random order, epoch after epoch; `position` is resumable."""

    def __init__(self, rows: Sequence[dict], seed: int, position: int = 0):
        if len(rows) == 0:
            raise UserError("the task's train split is empty; give it at least one row")
        self.rows, self.seed, self.position = rows, seed, position
        self._epoch, self._order = -1, []

    def take(self, k: int) -> list[dict]:
        out = []
        for _ in range(k):
            epoch, index = divmod(self.position, len(self.rows))
            if epoch != self._epoch:
                gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._epoch, self._order = epoch, torch.randperm(len(self.rows), generator=gen)
            out.append(self.rows[int(self._order[index])])
            self.position += 1
        return out


@dataclass
class Batch:
    """One step's training data: whole groups, group-contiguous."""

    rollout: Rollout
    rows: list[dict]  # (B,) task rows of the prompts
    rewards: torch.Tensor  # (N,) weighted reward, NaN = unscored
    by_function: dict[str, torch.Tensor]  # name -> (N,) raw scores, NaN = None

    def select_groups(self, groups: list[int]) -> Batch:
        idx = self.rollout.group_rows(groups)  # (b·G,)
        return Batch(
            self.rollout.select_groups(groups),
            [self.rows[g] for g in groups],
            self.rewards[idx],
            {name: r[idx] for name, r in self.by_function.items()},
        )

    @staticmethod
    def concat(parts: list[Batch]) -> Batch:
        if len(parts) == 1:
            return parts[0]
        return Batch(
            Rollout.concat([p.rollout for p in parts]),
            [row for p in parts for row in p.rows],
            torch.cat([p.rewards for p in parts]),
            {
                name: torch.cat([p.by_function[name] for p in parts])
                for name in parts[0].by_function
            },
        )


def score(
    rollout: Rollout,
    rows: list[dict],
    task: Task,
    weights: dict[str, float],
    timeout: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted reward per completion (N,), NaN where every function returned None, and each
    function's own scores by name."""
    G = rollout.group_size
    by_function = {
        name: torch.tensor(
            call_reward(name, task.reward_funcs[name], rollout.texts, rows, G, timeout=timeout)
        )
        for name in weights
    }  # name -> (N,)
    total = sum(weights[name] * r.nan_to_num(0.0) for name, r in by_function.items())
    scored = torch.stack([~r.isnan() for r in by_function.values()]).any(dim=0)  # (N,)
    return torch.where(scored, total, math.nan).float(), by_function


def autocast(cfg: TrainConfig) -> torch.autocast:
    """bf16 autocast for forward passes when `precision` asks for it (a no-op context in fp32)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bf16")


@dataclass(frozen=True)
class Minibatch:
    """One optimizer step's share of a rollout: the groups it trains, and the counts its loss
    divides by (those of all its groups, skipped ones included)."""

    rollout: Rollout | None  # the trained groups; None when every group was skipped
    rows: torch.Tensor  # (n,) long, their rows in the step's rollout
    num_tokens: torch.Tensor  # () loss tokens in the whole minibatch
    num_seqs: torch.Tensor  # () sequences with at least one loss token, likewise


def plan_minibatches(
    cfg: TrainConfig, rollout: Rollout, advantages: torch.Tensor, mask: torch.Tensor
) -> list[Minibatch]:
    """`cfg.minibatches` minibatches of whole groups, in order, without the groups that have
    nothing to learn (all advantages 0) when `skip_zero_advantage` applies (beta = 0).

    A group is never cut: its advantages are normalised over all G of its completions. Raises
    ValueError unless B is divisible by `cfg.minibatches`. advantages: (N,); mask: (N, T), the
    loss mask.
    """
    b, G = rollout.num_prompts, rollout.group_size
    if b % cfg.minibatches:
        raise ValueError(f"cannot split {b} prompts into {cfg.minibatches} equal minibatches")
    per = b // cfg.minibatches  # groups per minibatch
    skip = cfg.skip_zero_advantage and cfg.beta == 0
    plans = []
    for first in range(0, b, per):
        groups = list(range(first, first + per))
        span = slice(first * G, (first + per) * G)  # the minibatch's rows
        if skip:
            live = (advantages[span].view(per, G) != 0).any(-1).tolist()  # (per,)
            groups = [g for g, keep in zip(groups, live) if keep]
        m = mask[span]  # (per·G, T)
        plans.append(
            Minibatch(
                rollout=rollout.select_groups(groups) if groups else None,
                rows=rollout.group_rows(groups),
                num_tokens=m.sum(),
                num_seqs=m.any(-1).sum(),
            )
        )
    return plans


def trainer_old_logp(cfg: TrainConfig, policy, plans: list[Minibatch]) -> list[Minibatch]:
    """The minibatches with `old_logp` recomputed by the trainer's own forward.

    Under bf16 the sampler's KV-cached decode and the trainer's full-sequence forward round
    differently (measured: up to 0.06 per token, 4e-3 per sequence), more than GSPO's clip range.
    Recomputing on exactly the rows (and so the shapes) that the update then runs makes the first
    update's ratio 1 again. Runs before any optimizer step.
    """
    out = []
    for plan in plans:
        if plan.rollout is not None:
            with torch.no_grad(), autocast(cfg):
                old_logp = completion_logprobs(policy, plan.rollout, temperature=cfg.temperature)
            plan = dataclasses.replace(
                plan, rollout=dataclasses.replace(plan.rollout, old_logp=old_logp)
            )
        out.append(plan)
    return out


def collect_batch(
    cfg: TrainConfig,
    step: int,
    engine: RolloutEngine,
    task: Task,
    stream: PromptStream,
    weights: dict[str, float],
) -> tuple[Batch | None, dict[str, float]]:
    """Sample and score B groups; with dynamic sampling keep only groups that teach something.

    Returns the batch (None when dynamic sampling kept no group at all) and sampling statistics.
    """
    B, G = cfg.prompts_per_step, cfg.group_size
    parts: list[Batch] = []
    n_kept = n_sampled = n_zero = 0
    rounds = 1 + (cfg.max_resample_rounds if cfg.dynamic_sampling else 0)
    for round_ in range(rounds):
        rows = stream.take(B - n_kept)
        with autocast(cfg):
            rollout = engine.sample(
                [row["prompt"] for row in rows],
                group_size=G,
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                stop=task.stop,
                seed=cfg.seed * 1_000_003 + step * 97 + round_,
            )
        rewards, by_function = score(rollout, rows, task, weights, cfg.reward_timeout)
        if cfg.overlong_penalty:
            penalty = overlong_penalty(
                rollout.lengths, max_len=cfg.max_new_tokens, cache_len=cfg.overlong_cache
            )
            rewards = rewards + penalty.to(rewards.dtype)
        zero = zero_variance_groups(rewards.view(-1, G))  # (B_round,)
        n_sampled, n_zero = n_sampled + len(rows), n_zero + int(zero.sum())
        keep = [g for g in range(len(rows)) if not (cfg.dynamic_sampling and zero[g])]
        if keep:
            part = Batch(rollout, rows, rewards, by_function)
            parts.append(part if len(keep) == len(rows) else part.select_groups(keep))
            n_kept += len(keep)
        if n_kept >= B:
            break
    stats = {"frac_zero_std": n_zero / n_sampled, "sample_rounds": round_ + 1}
    # Short of B groups after the last round: train on a multiple of the minibatch count.
    usable = n_kept - n_kept % cfg.minibatches
    stats["groups"] = usable
    if usable == 0:
        return None, stats
    batch = Batch.concat(parts)
    return (batch if usable == n_kept else batch.select_groups(list(range(usable)))), stats


def update(
    cfg: TrainConfig,
    policy,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    advantages: torch.Tensor,
    ref_logp: torch.Tensor | None,
) -> dict[str, float]:
    """`epochs` passes over `minibatches` minibatches of whole groups, one optimizer step each.

    advantages: (N,); ref_logp: (N, T) or None. Returns the diagnostics averaged over updates.

    Groups without a learning signal are skipped (`skip_zero_advantage`, beta = 0 only): when
    every completion of a group scored the same, its advantages are all 0, so its loss terms
    -min(r·0, clip(r)·0) and their gradients are exactly 0. Such groups never enter the forward
    and backward; the loss still divides by the whole minibatch's token and sequence counts, and
    a minibatch left empty still takes its optimizer step (zero gradients move AdamW's moments
    and step count), so the parameters equal the full computation's up to float rounding (there
    every trainable parameter gets a zero gradient; in the full computation a parameter that the
    forward never touches would keep none and be left alone: no supported model has one). The
    saving grows as the policy improves and more groups are all correct. Loss, gradient norm and
    clip fractions are those of the full computation; ratio statistics and approx_kl describe
    the trained completions (NaN when none was); `trained_frac` is the fraction trained.
    """
    rollout = batch.rollout
    mask = rollout.mask  # (N, T)
    if cfg.mask_truncated:
        mask = mask & ~rollout.truncated[:, None]
    params = trainable_parameters(policy)
    plans = plan_minibatches(cfg, rollout, advantages, mask)
    if cfg.precision == "bf16":
        plans = trainer_old_logp(cfg, policy, plans)
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
    totals: dict[str, float] = {}
    n_updates = n_trained_updates = 0
    for _ in range(cfg.epochs):
        for plan in plans:
            optimizer.zero_grad(set_to_none=True)
            diagnostics = dict.fromkeys(_EXACT_DIAGNOSTICS, 0.0)
            if plan.rollout is None:
                for p in params:
                    p.grad = torch.zeros_like(p)
            else:
                with autocast(cfg):
                    logp = completion_logprobs(
                        policy, plan.rollout, temperature=cfg.temperature
                    )  # (n, T) float32
                m = mask[plan.rows]  # (n, T)
                out = policy_loss(
                    logp,
                    plan.rollout.old_logp,
                    advantages[plan.rows],
                    m,
                    level=cfg.ratio_level,
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    dual_clip=cfg.dual_clip,
                    ref_logp=None if ref_logp is None else ref_logp[plan.rows],
                    beta=cfg.beta,
                    kl_estimator=cfg.kl_estimator,
                    agg=cfg.loss_agg,
                    norm_len=cfg.norm_len,
                    num_tokens=plan.num_tokens,
                    num_seqs=plan.num_seqs,
                )
                out.loss.backward()
                diagnostics = out.metrics()
                # Skipped tokens have advantage 0 and are never clipped: over the minibatch's
                # tokens the clip fractions are exactly those of the full computation.
                share = float(m.sum()) / max(float(plan.num_tokens), 1.0)
                diagnostics["clip_frac_low"] *= share
                diagnostics["clip_frac_high"] *= share
                n_trained_updates += 1
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            optimizer.step()
            diagnostics["grad_norm"] = float(grad_norm)
            for key, value in diagnostics.items():
                totals[key] = totals.get(key, 0.0) + value
            n_updates += 1
    result = {
        key: value / (n_updates if key in _EXACT_DIAGNOSTICS else n_trained_updates)
        for key, value in totals.items()
    }
    for key in _TRAINED_DIAGNOSTICS:
        result.setdefault(key, math.nan)
    result["trained_frac"] = sum(len(plan.rows) for plan in plans) / len(rollout.texts)
    return result


def run_eval(
    cfg: TrainConfig, policy, tokenizer, task: Task, *, progress: bool
) -> dict[str, float]:
    """Held-out pass@1 (sampled and greedy) and pass@k on a fixed subset, with a fixed seed."""
    with autocast(cfg):
        result: EvalResult = evaluate(
            policy,
            tokenizer,
            list(task.heldout[: cfg.eval_size]),
            reward_fn=task.reward_funcs["correct"],
            samples=cfg.eval_samples,
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            stop=task.stop,
            seed=cfg.seed,
            greedy=True,
            progress=progress,
        )
    out = {"pass_at_1": result.pass_at_1, f"pass_at_{result.samples}": result.pass_at_k}
    if result.greedy_pass_at_1 is not None:
        out["greedy_pass_at_1"] = result.greedy_pass_at_1
    return out


class _StopFlag:
    """The first Ctrl-C asks the loop to save and stop after the current step; a second one
    interrupts at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._previous = None
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def make_optimizer(cfg: TrainConfig, policy: nn.Module) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, with the fused kernel where the device has one.

    On this project's 2-core CPU one fused step of a 20M-parameter model took 18 ms against
    96 ms for the default multi-tensor kernel (1.06M parameters: 0.9 ms against 3.2 ms); GSPO
    takes 4 steps per rollout. Same update rule, equal to float rounding.
    """
    params = trainable_parameters(policy)
    # torch checks only at the first step() whether the fused kernel fits; decide up front
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay, fused=fused
    )


def trainable_parameters(policy: nn.Module) -> list[nn.Parameter]:
    return [p for p in policy.parameters() if p.requires_grad]


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to 1, then constant or a cosine decay to 0 at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def prepare_run_dir(cfg: TrainConfig) -> Path:
    """The run directory, checked before anything is written: an earlier run is never touched."""
    if cfg.resume is not None:
        run_dir = Path(cfg.resume)
        if ckpt.latest_checkpoint(run_dir) is None:
            raise UserError(
                f"{run_dir} holds no checkpoint to resume from; start a new run instead"
            )
        return run_dir
    run_dir = Path(cfg.output_dir or Path("runs") / f"{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}")
    if (run_dir / "config.yaml").exists():
        raise UserError(
            f"{run_dir} already holds a run; pass --resume {run_dir} to continue it "
            "or choose another --output-dir"
        )
    return run_dir


def train(cfg: TrainConfig, *, console: Console | None = None) -> TrainSummary:
    """Run (or resume) a training run described by `cfg`; see the module docstring."""
    console = console or Console(stderr=True)
    task = get_task(cfg.task)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = resolve(cfg, task_max_new_tokens=task.max_new_tokens)
    for warning in caught:
        console.print(f"[yellow]warning:[/] {warning.message}")
    weights = dict(cfg.rewards or task.reward_weights)
    for name in weights:
        if name not in task.reward_funcs:
            raise UserError(
                f"unknown reward '{name}' for task {task.name}; "
                f"choose from: {', '.join(task.reward_funcs)}"
            )
    run_dir = prepare_run_dir(cfg)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    policy = load_model(cfg.model).eval()
    tokenizer = load_tokenizer(cfg.model)
    engine = HFRolloutEngine(policy, tokenizer)  # samples with the policy itself: no weight sync
    reference = load_model(cfg.model).eval().requires_grad_(False) if cfg.beta > 0 else None
    optimizer = make_optimizer(cfg, policy)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))

    state: dict[str, Any] = {"data_position": 0, "initial_eval": None}
    start = 0
    if cfg.resume is not None:
        meta = ckpt.load_checkpoint(
            ckpt.latest_checkpoint(run_dir), model=policy, optimizer=optimizer, scheduler=scheduler
        )
        start = meta["step"]
        state = {key: meta[key] for key in state}
        for name in ("metrics.jsonl", "eval.jsonl", "samples.jsonl"):
            truncate_jsonl(run_dir / name, keep_through_step=start)
        console.print(f"resuming {run_dir} from step {start}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    stream = PromptStream(task.train, cfg.seed, state["data_position"])
    sinks = MetricSinks(run_dir)
    interactive = cfg.progress and console.is_terminal

    def save(step: int) -> Path:
        state.update(data_position=stream.position)
        return ckpt.save_checkpoint(
            run_dir,
            step,
            model=policy,
            optimizer=optimizer,
            scheduler=scheduler,
            state=state,
            keep_last=cfg.keep_last,
        )

    def evaluate_at(step: int) -> dict[str, float]:
        result = run_eval(cfg, policy, tokenizer, task, progress=False)
        sinks.log_eval(step, result)
        line = "  ".join(f"{k} {v:.3f}" for k, v in result.items())
        console.print(f"step {step:>5}  held-out  {line}")
        return result

    if state["initial_eval"] is None:
        console.print(f"run directory: {run_dir}")
        state["initial_eval"] = evaluate_at(0)
    latest_eval = None
    step = start
    with _StopFlag() as stop, _progress(console, interactive) as bar:
        task_id = bar.add_task("train", total=cfg.steps, completed=start, info="")
        while step < cfg.steps and not stop.requested:
            t0 = time.perf_counter()
            batch, stats = collect_batch(cfg, step, engine, task, stream, weights)
            t_rollout = time.perf_counter() - t0
            metrics: dict[str, float] = {**stats}
            if batch is not None:
                B, G = len(batch.rows), cfg.group_size
                advantages = group_advantages(
                    batch.rewards.view(B, G),
                    scale=cfg.adv_scale,
                    estimator=cfg.adv_estimator,
                    eps=cfg.adv_eps,
                    unbiased_std=cfg.unbiased_std,
                ).reshape(-1)  # (N,)
                ref_logp = None
                if reference is not None:
                    with torch.no_grad(), autocast(cfg):
                        ref_logp = completion_logprobs(
                            reference, batch.rollout, temperature=cfg.temperature
                        )  # (N, T)
                metrics.update(update(cfg, policy, optimizer, batch, advantages, ref_logp))
                metrics.update(_batch_metrics(batch))
                sinks.log_samples(step + 1, _samples(batch, advantages, cfg.log_samples))
            lr = optimizer.param_groups[0]["lr"]  # the rate this step's updates used
            scheduler.step()
            step += 1
            seconds = time.perf_counter() - t0
            generated = int(batch.rollout.lengths.sum()) if batch is not None else 0
            metrics.update(
                step_seconds=seconds,
                rollout_seconds=t_rollout,
                tokens_per_s=generated / seconds,
                lr=lr,
            )
            sinks.log_step(step, metrics)
            info = (
                f"reward {metrics.get('reward_mean', math.nan):.3f}  "
                f"acc {metrics.get('accuracy', math.nan):.3f}  "
                f"{metrics['tokens_per_s']:.0f} tok/s"
            )
            bar.update(task_id, completed=step, info=info)
            if not interactive and (step % max(1, cfg.steps // 20) == 0 or step == cfg.steps):
                console.print(f"step {step:>5}/{cfg.steps}  {info}")
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                latest_eval = evaluate_at(step)
            if step % cfg.save_every == 0 and step < cfg.steps:
                save(step)

    interrupted = step < cfg.steps
    save(step)
    if interrupted:
        sinks.close()
        console.print(
            f"interrupted: saved a checkpoint at step {step}; "
            f"continue with: grouprl train --resume {run_dir}"
        )
        return TrainSummary(run_dir, step, state["initial_eval"], latest_eval, interrupted=True)

    final_eval = evaluate_at(step)
    sinks.close()
    policy.save_pretrained(run_dir / "final")
    tokenizer.save_pretrained(run_dir / "final")
    plots = plot_run(run_dir)
    _print_summary(console, state["initial_eval"], final_eval)
    console.print(f"final policy: {run_dir / 'final'}   plots: {plots[0].parent if plots else '-'}")
    return TrainSummary(run_dir, step, state["initial_eval"], final_eval)


def _progress(console: Console, interactive: bool) -> Progress:
    return Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=not interactive,
        transient=False,
    )


def _batch_metrics(batch: Batch) -> dict[str, float]:
    rewards, G = batch.rewards, batch.rollout.group_size
    lengths = batch.rollout.lengths.float()
    metrics = {
        "reward_mean": float(rewards.nanmean()),
        "reward_std": float(_nanstd_groups(rewards, G).nanmean()),
        "unscored_frac": float(rewards.isnan().float().mean()),
        "completion_len_mean": float(lengths.mean()),
        "completion_len_max": float(lengths.max()),
        "truncated_frac": float(batch.rollout.truncated.float().mean()),
    }
    if batch.rollout.entropy is not None:  # of the sampling policy, over every sampled token
        mask = batch.rollout.mask
        metrics["entropy"] = float(batch.rollout.entropy[mask].mean()) if mask.any() else 0.0
    for name, values in batch.by_function.items():
        metrics[f"reward_{name}"] = float(values.nanmean())
    if "correct" in batch.by_function:
        metrics["accuracy"] = metrics["reward_correct"]
    return metrics


def _nanstd_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    r = rewards.view(-1, group_size)  # (B, G)
    mean = r.nanmean(dim=1, keepdim=True)
    return ((r - mean) ** 2).nanmean(dim=1).sqrt()  # (B,)


def _samples(batch: Batch, advantages: torch.Tensor, k: int) -> list[dict[str, Any]]:
    """The first completion of the first k groups: enough to read what the policy writes."""
    G, out = batch.rollout.group_size, []
    for g in range(min(k, len(batch.rows))):
        row = g * G
        out.append(
            {
                "prompt": batch.rows[g]["prompt"],
                "completion": batch.rollout.texts[row],
                "reward": float(batch.rewards[row]),
                "advantage": float(advantages[row]),
                "answer": batch.rows[g].get("answer"),
            }
        )
    return out


def _print_summary(console: Console, before: dict | None, after: dict) -> None:
    table = Table(title="held-out accuracy")
    table.add_column("metric")
    table.add_column("start", justify="right")
    table.add_column("end", justify="right")
    table.add_column("change", justify="right")
    for key, value in after.items():
        start = (before or {}).get(key, math.nan)
        table.add_row(key, f"{start:.3f}", f"{value:.3f}", f"{value - start:+.3f}")
    console.print(table)


def main(cfg: TrainConfig) -> int:
    summary = train(cfg)
    return 130 if summary.interrupted else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: grouprl train")
