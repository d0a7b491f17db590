"""The GRPO / GSPO training loop, top to bottom.

Each step:
  1. take B prompts from the task's train split (a seeded permutation; the position is saved),
     skipping prompts too long for the model's context;
  2. sample G completions for each with the current policy through a `RolloutEngine` (the HF
     engine today; another backend plugs in here); their log-probs under the sampling
     distribution come back with them as `old_logp` (no extra forward pass);
  3. score every completion: the weighted sum of the reward functions (NaN where none scored),
     and pass/fail by the pass reward; DAPO's soft overlong penalty is added when enabled;
  4. optionally (dynamic sampling, DAPO) drop groups whose rewards all agree and sample more
     prompts, up to `max_resample_rounds` extra rounds;
  5. advantages = group_advantages(rewards): the group mean is the baseline, so no critic;
  6. reference log-probs when beta > 0 (the initial policy, frozen);
  7. `epochs` passes over `minibatches` minibatches of whole groups (groups whose advantages are
     all 0 left out of the compute when beta = 0: their gradient is exactly 0): current log-probs,
     `policy_loss` (token ratio for GRPO, sequence ratio for GSPO), backward (in chunks of
     `micro_batch_size` completions, gradients accumulated), gradient clipping, an optimizer
     step. With one epoch and one minibatch the update is exactly on-policy and the ratio is 1;
     only its gradient matters (GRPO paper, mu = 1);
  8. learning-rate schedule, metrics, sample completions, evaluation, checkpoints.

Deviations from the papers: dropout stays off throughout (the model stays in eval mode), so the
ratio compares the same function at two parameter values and is not noisy by construction
(LoRA's own dropout, when asked for, is the one exception).

Everything runs on the policy's device; forward passes run under autocast when the precision
asks for it, and then the trainer recomputes `old_logp` itself (the sampler's rounding differs).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from torch import nn

from grouprl.core import (
    group_advantages,
    overlong_penalty,
    zero_variance_groups,
)
from grouprl.errors import UserError
from grouprl.faults import fault
from grouprl.models.loading import resolve_device
from grouprl.models.lora import base_model_context, save_final
from grouprl.report import MetricSinks, plot_run
from grouprl.report.sinks import truncate_jsonl
from grouprl.rollout import HFRolloutEngine, Rollout, RolloutEngine
from grouprl.tasks import Task
from grouprl.tasks.base import TrainerState
from grouprl.tasks.data import PromptStream
from grouprl.tasks.scoring import RewardSet
from grouprl.train import checkpoint as ckpt
from grouprl.train.batch import Batch
from grouprl.train.build import (
    autocast,
    build_rewards,
    build_task,
    forward_dtype,
    load_policy,
    prompt_budget,
    prompt_ids,
    rows_that_fit,
    stop_strings,
)
from grouprl.train.config import TrainConfig, check_data_options, resolve, to_yaml
from grouprl.train.evaluate import EvalResult, evaluate
from grouprl.train.update import grad_scaler, make_optimizer, no_grad_logprobs, update


@dataclass(frozen=True)
class TrainSummary:
    run_dir: Path
    steps_done: int
    initial_eval: dict[str, float] | None
    final_eval: dict[str, float] | None
    interrupted: bool = False
    stopped_by: str | None = None  # "SIGINT" or "SIGTERM" when a signal stopped the run


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
    warn: Callable[[str], None] = print
    skipped: int = 0  # prompts skipped as too long, over the run
    warned_empty: bool = False  # dynamic sampling kept nothing once: said so

    def fits(self, ids: list[int]) -> bool:
        return self.budget is None or len(ids) <= self.budget


def draw_prompts(sampler: Sampler, k: int) -> tuple[list[dict], list[list[int]]]:
    """k rows from the stream whose prompts fit the prompt budget, and their token ids.

    A prompt over the budget is skipped (counted in `sampler.skipped`, warned about once);
    when a whole pass over the split finds none that fits, that is the user's to fix.
    """
    rows: list[dict] = []
    ids: list[list[int]] = []
    misses = 0
    while len(rows) < k:
        for row in sampler.stream.take(k - len(rows)):
            row_ids = prompt_ids(sampler.tokenizer, row["prompt"])
            if sampler.fits(row_ids):
                rows.append(row)
                ids.append(row_ids)
                misses = 0
                continue
            if sampler.skipped == 0:
                sampler.warn(
                    f"skipping a prompt of {len(row_ids)} tokens, over max_prompt_length "
                    f"{sampler.budget}; such prompts are counted as skipped_prompts in the metrics"
                )
            sampler.skipped += 1
            misses += 1
        if misses >= len(sampler.stream.rows):
            raise UserError(
                f"no prompt of the training data fits in {sampler.budget} tokens; raise "
                "--max-prompt-length or lower --max-new-tokens"
            )
    return rows, ids


def collect_batch(
    cfg: TrainConfig, step: int, sampler: Sampler
) -> tuple[Batch | None, dict[str, float], Batch]:
    """Sample and score B groups; with dynamic sampling keep only groups that teach something.

    Dynamic sampling (DAPO, arXiv 2503.14476) drops a group when all of its completions pass or
    all fail (by the pass reward, not the shaped total: groups that differ only in an overlong
    penalty or a format bonus are not worth a step), and samples more prompts, up to
    `max_resample_rounds` extra rounds.

    Returns the kept batch (None when no group was kept), sampling statistics (plus whatever
    reward functions logged with `log_metric`), and everything sampled, kept or not, which the
    step's reward, accuracy and length metrics describe.
    """
    B, G = cfg.prompts_per_step, cfg.group_size
    parts: list[Batch] = []
    sampled: list[Batch] = []
    n_kept = n_sampled = n_zero = 0
    skipped_before = sampler.skipped
    logged: dict[str, float] = {}
    rounds = 1 + (cfg.max_resample_rounds if cfg.dynamic_sampling else 0)
    for round_ in range(rounds):
        rows, ids = draw_prompts(sampler, B - n_kept)
        with autocast(sampler.device, sampler.dtype):
            rollout = sampler.engine.sample(
                ids,
                group_size=G,
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                stop=sampler.stop,
                seed=cfg.seed * 1_000_003 + step * 97 + round_,
            )
        fault("sample")
        scores = sampler.rewards.score(
            rollout.texts,
            rows,
            G,
            completion_ids=rollout.completion_id_lists(),
            state=TrainerState(global_step=step, max_steps=cfg.steps),
            timeout=cfg.reward_timeout,
        )
        rewards = scores.total  # (N,) on the CPU
        logged.update(scores.logged)
        if cfg.overlong_penalty:
            penalty = overlong_penalty(
                rollout.lengths, max_len=cfg.max_new_tokens, cache_len=cfg.overlong_cache
            )
            rewards = rewards + penalty.to(device="cpu", dtype=rewards.dtype)
        part = Batch(rollout, rows, rewards, scores.by_function, scores.passed, scores.extra)
        sampled.append(part)
        zero = zero_variance_groups(rewards.view(-1, G))  # (B_round,)
        n_sampled, n_zero = n_sampled + len(rows), n_zero + int(zero.sum())
        passes = scores.passed.view(-1, G)  # (B_round, G)
        decided = passes.all(-1) | ~passes.any(-1)  # (B_round,) all pass or all fail
        keep = [g for g in range(len(rows)) if not (cfg.dynamic_sampling and decided[g])]
        if keep:
            parts.append(part if len(keep) == len(rows) else part.select_groups(keep))
            n_kept += len(keep)
        if n_kept >= B:
            break
    stats = {
        **logged,
        "frac_zero_std": n_zero / n_sampled,
        "sample_rounds": round_ + 1,
        "skipped_prompts": sampler.skipped - skipped_before,
    }
    # Short of B groups after the last round: train on a multiple of the minibatch count.
    usable = n_kept - n_kept % cfg.minibatches
    stats["groups"] = usable
    everything = Batch.concat(sampled)
    if usable == 0:
        if cfg.dynamic_sampling and not sampler.warned_empty:
            sampler.warned_empty = True
            sampler.warn(
                f"dynamic sampling kept no group at step {step + 1}: in every group all "
                f"completions passed or all failed by the pass reward "
                f"'{sampler.rewards.pass_reward}' (a pass is a score >= 1); if it gives partial "
                "credit, name another with --pass-reward or turn --dynamic-sampling off"
            )
        return None, stats, everything
    batch = Batch.concat(parts)
    kept = batch if usable == n_kept else batch.select_groups(list(range(usable)))
    return kept, stats, everything


def evaluation_rows(
    cfg: TrainConfig, task: Task, sampler: Sampler, warn: Callable[[str], None]
) -> list[dict]:
    """The first `eval_size` held-out rows whose prompts fit the prompt budget (a warning when
    there are fewer)."""
    if cfg.eval_size > len(task.heldout):
        warn(
            f"eval_size {cfg.eval_size} is more than the {len(task.heldout)} held-out rows; "
            "evaluating all of them"
        )
    rows, too_long = rows_that_fit(task.heldout, cfg.eval_size, sampler.tokenizer, sampler.budget)
    if too_long:
        warn(f"{too_long} held-out prompts are over {sampler.budget} tokens and not evaluated")
    if not rows:
        raise UserError("no held-out prompt fits the prompt budget; raise --max-prompt-length")
    return rows


def run_eval(
    cfg: TrainConfig,
    policy,
    sampler: Sampler,
    rows: Sequence[dict],
    step: int,
    *,
    progress: bool,
) -> dict[str, float]:
    """Held-out pass@1 (sampled and greedy) and pass@k on a fixed subset, with a fixed seed."""
    state = TrainerState(global_step=step, max_steps=cfg.steps)

    def judge(batch_rows: Sequence[dict], rollout: Rollout) -> list[bool]:
        scores = sampler.rewards.score(
            rollout.texts,
            batch_rows,
            rollout.group_size,
            completion_ids=rollout.completion_id_lists(),
            state=state,
            timeout=cfg.reward_timeout,
            only_pass=True,
        )
        return scores.passed.tolist()

    with autocast(sampler.device, sampler.dtype):
        result: EvalResult = evaluate(
            policy,
            sampler.tokenizer,
            rows,
            judge=judge,
            samples=cfg.eval_samples,
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            stop=sampler.stop,
            seed=cfg.seed,
            greedy=True,
            progress=progress,
        )
    out = {"pass_at_1": result.pass_at_1, f"pass_at_{result.samples}": result.pass_at_k}
    if result.greedy_pass_at_1 is not None:
        out["greedy_pass_at_1"] = result.greedy_pass_at_1
    return out


class _StopFlag:
    """The first Ctrl-C (SIGINT) or SIGTERM (what cluster schedulers send on preemption) asks
    the loop to save and stop after the current step; a second Ctrl-C interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: int | None = None  # the signal that asked
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        for signum in self.SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = self.requested or signum

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to 1, then constant or a cosine decay to 0 at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def prepare_run_dir(cfg: TrainConfig) -> Path:
    """The run directory, checked before anything is written: an earlier run is never touched,
    and a directory that cannot be written is found before the model loads."""
    if cfg.resume is not None:
        run_dir = Path(cfg.resume)
    else:
        run_dir = Path(
            cfg.output_dir or Path("runs") / f"{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        if (run_dir / "config.yaml").exists():
            raise UserError(
                f"{run_dir} already holds a run; pass --resume {run_dir} to continue it "
                "or choose another --output-dir"
            )
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"cannot create the run directory {run_dir}: {probe} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot write the run directory {run_dir}: {probe} is not writable (permissions or "
            "a read-only file system); choose another --output-dir"
        )
    return run_dir


#: Written last into final/: the step the final policy is from.
FINAL_MARKER = "grouprl_final.json"


def _finished_at(run_dir: Path) -> int | None:
    """The step of the run's complete final/ directory, or None."""
    try:
        return int(json.loads((run_dir / "final" / FINAL_MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_final(policy: nn.Module, tokenizer: Any, run_dir: Path, step: int) -> Path:
    """final/ written under a temporary name, marked with its step, then swapped in: a kill
    midway leaves the previous final/ (or none), never a half-written one."""
    final, tmp, old = run_dir / "final", run_dir / ".final-tmp", run_dir / ".final-old"
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    save_final(policy, tokenizer, tmp)
    (tmp / FINAL_MARKER).write_text(json.dumps({"step": step}) + "\n")
    if final.exists():
        os.replace(final, old)  # the previous final policy of this same run, now superseded
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _apply_hyperparameters(
    cfg: TrainConfig, optimizer: torch.optim.Optimizer, scheduler: Any
) -> None:
    """The config's learning rate, weight decay and betas over what a checkpoint restored, so
    that `--resume --allow-change lr` means what it says (equal values change nothing)."""
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group.update(
            initial_lr=cfg.lr,
            lr=cfg.lr * lr_factor(cfg, scheduler.last_epoch),
            weight_decay=cfg.weight_decay,
            betas=tuple(cfg.adam_betas),
        )
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def _count(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _describe(model: nn.Module) -> str:
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{_count(total)} parameters, {_count(trained)} trained"


def train(cfg: TrainConfig, *, console: Console | None = None) -> TrainSummary:
    """Run (or resume) a training run described by `cfg`; see the module docstring."""
    console = console or Console(stderr=True)

    def warn(message: str) -> None:
        console.print(f"[yellow]warning:[/] {message}")

    check_data_options(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = build_task(cfg)
        cfg = resolve(cfg, task_max_new_tokens=task.max_new_tokens)
    for warning in caught:
        warn(str(warning.message))
    run_dir = prepare_run_dir(cfg)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    device = resolve_device(cfg.device)
    policy, tokenizer, reference = load_policy(cfg, device)
    rewards = build_rewards(cfg, task, device)
    sampler = Sampler(
        engine=HFRolloutEngine(policy, tokenizer),  # samples with the policy itself: no sync
        tokenizer=tokenizer,
        stream=PromptStream(task.train, cfg.seed),
        rewards=rewards,
        stop=stop_strings(cfg, task),
        budget=prompt_budget(cfg, policy, cfg.max_new_tokens),
        dtype=forward_dtype(cfg),
        device=device,
        warn=warn,
    )
    eval_rows = evaluation_rows(cfg, task, sampler, warn)
    optimizer = make_optimizer(cfg, policy)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    scaler = grad_scaler(cfg, device)

    state: dict[str, Any] = {"data_position": 0, "initial_eval": None, "nonfinite_in_a_row": 0}
    start = 0
    checkpoint = None
    if cfg.resume is not None:
        checkpoint = ckpt.latest_checkpoint(run_dir, warn=warn, set_aside=True)
    if checkpoint is not None:
        meta = ckpt.load_checkpoint(
            checkpoint, model=policy, optimizer=optimizer, scheduler=scheduler
        )
        _apply_hyperparameters(cfg, optimizer, scheduler)  # what --allow-change changed
        start = meta["step"]
        state = {key: meta.get(key, default) for key, default in state.items()}
        if scaler is not None and meta.get("grad_scaler"):
            scaler.load_state_dict(meta["grad_scaler"])
        if start >= cfg.steps and _finished_at(run_dir) == start:
            console.print(
                f"{run_dir} already finished at step {start} (steps {cfg.steps}); nothing to "
                f"do. To train longer: grouprl train --resume {run_dir} --steps N"
            )
            return TrainSummary(run_dir, start, state["initial_eval"], None)
        console.print(f"resuming {run_dir} from step {start}")
    if cfg.resume is not None:  # rows after the checkpoint are replayed (initial eval included)
        last_kept = start if state["initial_eval"] is not None else -1
        # a final evaluation at `start` is replayed too: the run ends there
        last_eval = min(last_kept, start - 1) if start >= cfg.steps else last_kept
        for name, keep in (("metrics.jsonl", last_kept), ("eval.jsonl", last_eval),
                           ("samples.jsonl", last_kept)):  # fmt: skip
            if truncate_jsonl(run_dir / name, keep_through_step=keep):
                warn(f"{name}: dropped a half-written line (the process was killed mid-write)")
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_atomically(run_dir / "config.yaml", to_yaml(cfg))
    sampler.stream.position = state["data_position"]
    # TensorBoard forgets what the replayed steps logged before (JSONL was truncated above)
    sinks = MetricSinks(run_dir, purge_step=last_kept + 1 if cfg.resume is not None else None)
    interactive = cfg.progress and console.is_terminal
    done = {  # the last completed step
        "step": start,
        "position": state["data_position"],
        "nonfinite": state["nonfinite_in_a_row"],
    }

    def save(step: int) -> Path:
        state.update(data_position=done["position"], nonfinite_in_a_row=done["nonfinite"])
        if scaler is not None:
            state.update(grad_scaler=scaler.state_dict())
        return ckpt.save_checkpoint(
            run_dir,
            step,
            model=policy,
            tokenizer=tokenizer,
            optimizer=optimizer,
            scheduler=scheduler,
            state=state,
            keep_last=cfg.keep_last,
        )

    def evaluate_at(step: int) -> dict[str, float]:
        fault("eval")
        result = run_eval(cfg, policy, sampler, eval_rows, step, progress=False)
        sinks.log_eval(step, result)
        line = "  ".join(f"{k} {v:.3f}" for k, v in result.items())
        console.print(f"step {step:>5}  held-out  {line}")
        return result

    # From the first checkpoint on, SIGINT/SIGTERM finish the current step, save and stop.
    with _StopFlag() as stop:
        save(start)  # a run directory always holds a checkpoint to resume from
        if state["initial_eval"] is None and stop.requested is None:  # else: on resume
            console.print(f"run directory: {run_dir}")
            weights = ", ".join(f"{n} x{w:g}" for n, w in rewards.weights.items())
            console.print(f"policy:  {cfg.model} ({_describe(policy)}) on {device}")
            console.print(
                f"data:    {task.name} ({len(task.train)} train rows, {len(eval_rows)} held-out "
                "rows evaluated)"
            )
            console.print(f"rewards: {weights}; pass reward: {rewards.pass_reward}")
            state["initial_eval"] = evaluate_at(0)
        latest_eval = None
        step = start
        updating = False
        nonfinite_in_a_row = state["nonfinite_in_a_row"]
        try:
            with _progress(console, interactive) as bar:
                task_id = bar.add_task("train", total=cfg.steps, completed=start, info="")
                while step < cfg.steps and stop.requested is None:
                    t0 = time.perf_counter()
                    batch, stats, sampled = collect_batch(cfg, step, sampler)
                    t_rollout = time.perf_counter() - t0
                    metrics: dict[str, float] = {**stats}
                    updating = True
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
                        if cfg.beta > 0:  # the initial policy: a frozen copy, or LoRA's base model
                            with base_model_context(policy):
                                ref_logp = no_grad_logprobs(
                                    cfg, reference or policy, batch.rollout, sampler.dtype
                                )  # (N, T)
                        metrics.update(
                            update(
                                cfg, policy, optimizer, batch, advantages, ref_logp, scaler=scaler
                            )
                        )
                        nonfinite_in_a_row = (
                            (nonfinite_in_a_row + 1) if metrics["nonfinite_updates"] else 0
                        )
                        if nonfinite_in_a_row:
                            warn(
                                f"step {step + 1}: non-finite loss or gradient; "
                                f"{metrics['nonfinite_updates']} update(s) skipped"
                            )
                        sinks.log_samples(step + 1, _samples(batch, advantages, cfg.log_samples))
                    metrics.update(_batch_metrics(sampled))  # everything sampled, kept or not
                    if batch is not sampled and batch is not None:  # what dynamic sampling kept
                        metrics.update({f"{k}_kept": v for k, v in _batch_metrics(batch).items()})
                    lr = optimizer.param_groups[0]["lr"]  # the rate this step's updates used
                    scheduler.step()
                    step += 1
                    done.update(
                        step=step, position=sampler.stream.position, nonfinite=nonfinite_in_a_row
                    )
                    updating = False
                    seconds = time.perf_counter() - t0
                    generated = int(sampled.rollout.lengths.sum())  # every token sampled
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
                    if not interactive and (
                        step % max(1, cfg.steps // 20) == 0 or step == cfg.steps
                    ):
                        console.print(f"step {step:>5}/{cfg.steps}  {info}")
                    if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                        latest_eval = evaluate_at(step)
                    if step % cfg.save_every == 0 and step < cfg.steps:
                        save(step)
                    if nonfinite_in_a_row >= cfg.max_nonfinite_steps:
                        raise UserError(
                            f"{nonfinite_in_a_row} steps in a row (to step {step}) had a non-finite "
                            "loss or gradient, so their updates were skipped; the weights are those "
                            "of the last finite update. Lower --lr, check the rewards for NaN, or "
                            "raise --max-nonfinite-steps"
                        )
        except UserError:
            # A user's mistake mid-run (a reward that raises): keep the last completed step, unless
            # the error came from inside an update, whose weights would be half a step.
            if not updating:
                save(done["step"])
            sinks.close()
            raise

        save(step)
        if stop.requested is not None:
            sinks.close()
            name = signal.Signals(stop.requested).name
            console.print(
                f"stopped by {name}: saved a checkpoint at step {step}; "
                f"continue with: grouprl train --resume {run_dir}"
            )
            return TrainSummary(
                run_dir, step, state["initial_eval"], latest_eval, interrupted=True, stopped_by=name
            )

        final_eval = evaluate_at(step)
        sinks.close()
        _write_final(policy, tokenizer, run_dir, step)
        plots = plot_run(run_dir)
        _print_summary(console, state["initial_eval"], final_eval)
        console.print(
            f"final policy: {run_dir / 'final'}   plots: {plots[0].parent if plots else '-'}"
        )
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
    if batch.passed is not None:  # the pass reward's verdict: the one definition of correct
        metrics["accuracy"] = float(batch.passed.float().mean())
    return metrics


def _nanstd_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    r = rewards.view(-1, group_size)  # (B, G)
    mean = r.nanmean(dim=1, keepdim=True)
    return ((r - mean) ** 2).nanmean(dim=1).sqrt()  # (B,)


def _samples(batch: Batch, advantages: torch.Tensor, k: int) -> list[dict[str, Any]]:
    """The first completion of the first k groups: enough to read what the policy writes (with
    any columns the reward functions added through `log_extra`)."""
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
                **{name: values[row] for name, values in batch.extra.items()},
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


#: Exit statuses of a run a signal stopped (128 + the signal number, as shells report them).
EXIT_STATUS = {"SIGINT": 130, "SIGTERM": 143}


def main(cfg: TrainConfig) -> int:
    summary = train(cfg)
    return EXIT_STATUS.get(summary.stopped_by, 130) if summary.interrupted else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: grouprl train")
