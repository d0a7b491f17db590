"""The GRPO / GSPO training loop, top to bottom.

Each step:
  1. take B prompts from the task's train split (a seeded permutation; the position is part of
     the run's state), skipping prompts too long for the model's context;
  2. sample G completions for each with the current policy through a `RolloutEngine` (the HF
     engine today; another backend plugs in here); their log-probs under the sampling
     distribution come back with them as `old_logp` (no extra forward pass);
  3. score every completion: the weighted sum of the reward functions (NaN where none scored),
     and pass/fail by the pass reward; DAPO's soft overlong penalty is added when enabled;
  4. optionally (dynamic sampling, DAPO) drop groups whose completions all pass or all fail and
     sample more prompts, up to `max_resample_rounds` extra rounds (steps 1-4: `collect_batch`);
  5. advantages = group_advantages(rewards): the group mean is the baseline, so no critic;
  6. reference log-probs when beta > 0 (the initial policy, frozen);
  7. `epochs` passes over `minibatches` minibatches of whole groups (groups whose advantages are
     all 0 left out of the compute when beta = 0: their gradient is exactly 0): current log-probs,
     `policy_loss` (token ratio for GRPO, sequence ratio for GSPO), backward (in chunks of
     `micro_batch_size` completions, gradients accumulated), gradient clipping, an optimizer
     step. With one epoch and one minibatch the update is exactly on-policy and the ratio is 1;
     only its gradient matters (GRPO paper, mu = 1);
  8. learning-rate schedule, metrics, sample completions (steps 5-8: `learn`); then the driver
     logs, evaluates and checkpoints.

A step is split where the weights begin to change: `collect_batch` only reads them, `learn`
changes them in place. The driver keeps the `RunState` of the last completed step, and saves it
only where the weights are that state's: when a user's mistake stops the run before or after
an update (`committed`), never from inside one.

Deviations from the papers: dropout stays off throughout (the model stays in eval mode), so the
ratio compares the same function at two parameter values and is not noisy by construction
(LoRA's own dropout, when asked for, is the one exception).

Everything runs on the policy's device; forward passes run under autocast when the precision
asks for it, and then the trainer recomputes `old_logp` itself (the sampler's rounding differs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from grouprl.config.options import RunConfig, TrainConfig
from grouprl.core import gdpo_advantages, group_advantages, overlong_penalty
from grouprl.errors import UserError
from grouprl.faults import fault
from grouprl.models.lora import base_model_context
from grouprl.report.doctor import diagnose
from grouprl.rollout import Rollout
from grouprl.train.batch import Batch
from grouprl.train.collect import Collected, collect_batch
from grouprl.train.evaluate import run_eval
from grouprl.train.parallel import distributed
from grouprl.train.parallel.distributed import SINGLE, Dist
from grouprl.train.run import (
    Run,
    RunState,
    committed,
    describe,
    open_sinks,
    restore,
    save,
    setup_run,
    write_final,
)
from grouprl.train.update import no_grad_logprobs, update


@dataclass(frozen=True)
class TrainSummary:
    run_dir: Path
    steps_done: int
    initial_eval: dict[str, float] | None
    final_eval: dict[str, float] | None
    interrupted: bool = False
    stopped_by: str | None = None  # "SIGINT" or "SIGTERM" when a signal stopped the run


def train(cfg: TrainConfig, *, console: Console | None = None) -> TrainSummary:
    """Run (or resume) a training run described by `cfg`; see the module docstring.

    Under torchrun every rank calls this; rank 0 prints and writes the run directory."""
    run = setup_run(cfg, console=console)
    state, finished = restore(run)
    if finished:
        return TrainSummary(run.run_dir, state.step, state.initial_eval, None)
    steps, final_eval = run.cfg.steps, None
    # From the first checkpoint on, SIGINT/SIGTERM finish the current step, save and stop.
    with open_sinks(run, state), _StopFlag() as stop, _StepBar(run, state) as bar:
        save(run, state)  # a run directory always holds a checkpoint to resume from
        # what every rank agreed on (a signal that arrives later waits for the next agreement)
        stopping = run.dist.first_signal(stop.requested)
        if state.initial_eval is None and stopping is None:  # else: on resume
            describe(run)
            with committed(run, state):
                state = dataclasses.replace(state, initial_eval=evaluate_at(run, 0))
        while state.step < steps and stopping is None:
            with committed(run, state):  # the weights are still `state`'s
                collected = collect_batch(run.cfg, run.sampler, state.step, state.data_position)
            state, log = learn(run, state, collected)  # changes the weights in place
            with committed(run, state):
                log_step(run, state, log, bar)
                if (
                    run.cfg.eval_every
                    and state.step % run.cfg.eval_every == 0
                    and state.step < steps
                ):
                    evaluate_at(run, state.step)
                if state.step % run.cfg.save_every == 0 and state.step < steps:
                    save(run, state)
                check_nonfinite(run, state)
            stopping = run.dist.first_signal(stop.requested)  # all stop together
        with committed(run, state):
            save(run, state)
        stopping = run.dist.first_signal(stop.requested)  # one arriving during the save counts too
        if stopping is not None:
            return stopped(run, state, stopping)
        with committed(run, state):
            final_eval = evaluate_at(run, state.step)
            finish(run, state, final_eval)
    return TrainSummary(run.run_dir, state.step, state.initial_eval, final_eval)


@dataclass(frozen=True)
class StepLog:
    """What a step leaves for the logs."""

    metrics: dict[str, float]
    samples: list[dict[str, Any]]  # samples.jsonl's lines
    ratios: tuple[list[int], list[float]] | None  # ratios.jsonl's line, on a probed step


def learn(run: Run, state: RunState, collected: Collected) -> tuple[RunState, StepLog]:
    """The rest of a step, which changes the weights in place: advantages, reference log-probs,
    the update, the learning-rate schedule; returns the next state and what to log."""
    start = time.perf_counter()
    cfg, dist, batch = run.cfg, run.dist, collected.kept
    metrics = collected.metrics()
    samples, ratios, nonfinite = [], None, state.nonfinite_in_a_row
    if batch is not None:
        advantages = batch_advantages(cfg, batch, dist, run.sampler.rewards.weights)  # (N,)
        probe = _ratio_probe(cfg, state.step, batch, run)
        ref_logp = None
        if cfg.beta > 0:  # the initial policy: a frozen copy, or LoRA's base model
            with base_model_context(run.policy):
                model = run.reference or run.policy
                ref_logp = no_grad_logprobs(cfg, model, batch.rollout, run.sampler.dtype)
        metrics.update(
            update(cfg, run.policy, run.optimizer, batch, advantages, ref_logp,
                   scaler=run.scaler, dist=dist, lockstep=run.lockstep)
        )  # fmt: skip
        nonfinite = nonfinite + 1 if metrics["nonfinite_updates"] else 0
        samples = _samples(batch, advantages, cfg.log_samples)
        ratios = None if probe is None else _probe_ratios(cfg, probe, run.policy, dist)
    # everything sampled, kept or not; then what dynamic sampling kept
    metrics.update(batch_metrics(collected.sampled, dist, run.sampler.rewards.weights))
    if batch is not None and collected.filtered:
        metrics.update({f"{k}_kept": v for k, v in batch_metrics(batch, dist).items()})
    metrics["lr"] = run.optimizer.param_groups[0]["lr"]  # the rate this step's updates used
    run.scheduler.step()
    seconds = collected.seconds + time.perf_counter() - start
    (generated,) = dist.sum(int(collected.sampled.rollout.sampled_lengths.sum()))  # every rank's
    metrics.update(step_seconds=seconds, rollout_seconds=collected.seconds,
                   tokens_per_s=generated / seconds)  # fmt: skip
    state = RunState(state.step + 1, collected.position, nonfinite, state.initial_eval)
    return state, StepLog(metrics, samples, ratios)


def batch_advantages(
    cfg: RunConfig, batch: Batch, dist: Dist, weights: dict[str, float] | None = None
) -> torch.Tensor:
    """This rank's advantages (N,), computed over the whole job's batch (so a batch-level
    scale uses the global batch's statistics). `weights`: the reward functions' (for gdpo)."""
    G, per = cfg.group_size, len(batch.rows)
    if cfg.adv_estimator == "gdpo":
        components, w = gdpo_components(cfg, batch, weights or {})
        gathered = torch.cat(dist.gather(components)) if dist.enabled else components
        advantages = gdpo_advantages(gathered.view(-1, G, len(w)), w, eps=cfg.adv_eps)
        advantages = advantages.to(batch.rewards.dtype)
    else:
        rewards = torch.cat(dist.gather(batch.rewards)) if dist.enabled else batch.rewards
        advantages = group_advantages(
            rewards.view(-1, G),
            scale=cfg.adv_scale,
            estimator=cfg.adv_estimator,
            eps=cfg.adv_eps,
            unbiased_std=cfg.unbiased_std,
        )
    advantages = advantages.reshape(-1)  # (N_global,)
    return advantages[dist.rank * per * G : (dist.rank + 1) * per * G]


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


def log_step(run: Run, state: RunState, log: StepLog, bar: _StepBar) -> None:
    """The step's metrics, samples and ratios to the sinks (rank 0, agreed), a warning for a
    skipped update, and the progress line."""
    metrics = log.metrics
    if state.nonfinite_in_a_row:
        run.warn(
            f"step {state.step}: non-finite loss or gradient; "
            f"{metrics['nonfinite_updates']} update(s) skipped"
        )

    def write() -> None:
        run.sinks.log_step(state.step, metrics)
        run.sinks.log_samples(state.step, log.samples)
        if log.ratios is not None:
            run.sinks.log_ratios(state.step, *log.ratios)

    run.on_main(write)
    bar.update(
        state.step,
        f"reward {metrics.get('reward_mean', math.nan):.3f}  "
        f"acc {metrics.get('accuracy', math.nan):.3f}  {metrics['tokens_per_s']:.0f} tok/s",
    )


def check_nonfinite(run: Run, state: RunState) -> None:
    if state.nonfinite_in_a_row >= run.cfg.max_nonfinite_steps:
        raise UserError(
            f"{state.nonfinite_in_a_row} steps in a row (to step {state.step}) had a non-finite "
            "loss or gradient, so their updates were skipped; the weights are those of the last "
            "finite update. Lower --lr, check the rewards for NaN, or raise --max-nonfinite-steps"
        )


def evaluate_at(run: Run, step: int) -> dict[str, float]:
    """The held-out evaluation at `step`, logged and printed; then `grouprl doctor`'s checks,
    live, each warning once."""
    fault("eval")
    result = run_eval(run.cfg, run.policy, run.sampler, run.eval_rows, step, lockstep=run.lockstep)
    run.on_main(lambda: run.sinks.log_eval(step, result))
    line = "  ".join(f"{k} {v:.3f}" for k, v in result.items())
    run.console.print(f"step {step:>5}  held-out  {line}")
    if run.cfg.doctor and run.dist.is_main and step > 0 and "off" not in run.reported:
        try:
            findings = diagnose(run.run_dir)
        except Exception as err:  # never let a diagnosis stop training
            run.reported.add("off")
            run.warn(f"doctor: stopped checking this run ({type(err).__name__}: {err})")
            findings = []
        for finding in findings:
            if finding.severity == "warning" and finding.code not in run.reported:
                run.reported.add(finding.code)
                run.warn(f"doctor: {finding.title}: {finding.evidence}; {finding.suggestion}")
    return result


def stopped(run: Run, state: RunState, signum: int) -> TrainSummary:
    """A signal stopped the run after `state` was saved: say how to continue."""
    run.dist.barrier()
    name = signal.Signals(signum).name
    run.console.print(
        f"stopped by {name}: saved a checkpoint at step {state.step}; "
        f"continue with: grouprl train --resume {run.run_dir}"
    )
    return TrainSummary(
        run.run_dir, state.step, state.initial_eval, None, interrupted=True, stopped_by=name
    )


def finish(run: Run, state: RunState, final_eval: dict[str, float]) -> None:
    """final/, the plots and the held-out summary."""
    plots = write_final(run, state.step)
    if run.dist.is_main:
        _print_summary(run.console, state.initial_eval, final_eval)
        run.console.print(f"final policy: {run.run_dir / 'final'}   plots: {plots or '-'}")


@dataclass
class _Probe:
    """Completions whose ratio against the sampling policy is measured after the step."""

    rollout: Rollout  # one completion per group (groups of 1), spread over the batch
    old_logp: torch.Tensor  # (k, T) the sampling policy's log-probs, by the trainer's forward
    dtype: torch.dtype | None


def _ratio_probe(cfg: RunConfig, step: int, batch: Batch, run: Run) -> _Probe | None:
    """This rank's share of the `log_ratios` completions of a logged step (every
    `log_ratios_every` steps), before the update: one completion from each of as many groups
    as possible, a different member of each, so lengths and prompts vary. Under bf16 their
    sampling-policy log-probs are recomputed by the trainer's forward (the sampler's differ
    from it by rounding, see `trainer_old_logp`): a second extra forward."""
    if not cfg.log_ratios or (step + 1) % cfg.log_ratios_every:
        return None
    rollout = batch.rollout
    B, G = rollout.num_prompts, rollout.group_size
    k = min(-(-cfg.log_ratios // run.dist.world_size), B * G)  # this rank's share
    rows = [(i % B) * G + (i // B + i) % G for i in range(k)]  # distinct: groups first
    sub = rollout.regroup(1).select_groups(rows)
    dtype = run.sampler.dtype
    old = sub.old_logp if dtype is None else no_grad_logprobs(cfg, run.policy, sub, dtype)
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


class _StepBar:
    """A live progress bar on a terminal; elsewhere a plain line every 5% of the steps."""

    def __init__(self, run: Run, state: RunState) -> None:
        self.console, self.steps = run.console, run.cfg.steps
        self.interactive = run.cfg.progress and run.console.is_terminal
        self.bar = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=run.console,
            disable=not self.interactive,
            transient=False,
        )
        self.task = self.bar.add_task("train", total=self.steps, completed=state.step, info="")

    def __enter__(self) -> _StepBar:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def update(self, step: int, info: str) -> None:
        self.bar.update(self.task, completed=step, info=info)
        if not self.interactive and (step % max(1, self.steps // 20) == 0 or step == self.steps):
            self.console.print(f"step {step:>5}/{self.steps}  {info}")


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
        metrics["entropy"] = float(entropy[mask].mean()) if mask.any() else 0.0
    elif entropy is not None:
        total, tokens = (sum(s["entropy"][i] for s in shares) for i in range(2))
        metrics["entropy"] = total / tokens if tokens else 0.0
    for name in batch.by_function:
        values = torch.cat([s["by_function"][name] for s in shares])
        metrics[f"reward_{name}"] = float(values.nanmean())
    weighted = {n: w for n, w in (weights or {}).items() if w != 0 and n in batch.by_function}
    for name in weighted:
        values = torch.cat([s["by_function"][name] for s in shares]).double()
        scored = values[~values.isnan()]
        metrics[f"reward_{name}_spread"] = float(scored.std(unbiased=False)) if len(scored) else 0.0
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
            tool_failure_frac=total["failures"] / total["calls"] if total["calls"] else 0.0,
            turns_mean=total["turns"] / rows,
            observation_token_frac=total["observed"] / max(total["tokens"], 1),
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
        if batch.rollout.turns is not None:  # the whole transcript, tool turns marked
            out[-1]["transcript"] = batch.rollout.turns.transcripts[row]
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


def train_and_leave(cfg: TrainConfig) -> TrainSummary:
    """`train`, then leave the torchrun job (if any): every rank together when the run ended
    (stopped by a signal included), at once when an error ends it."""
    ended = False
    try:
        summary = train(cfg)
        ended = True
    finally:
        distributed.shutdown(together=ended)
    return summary
