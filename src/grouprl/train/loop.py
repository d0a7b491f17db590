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
from grouprl.report.doctor import diagnose
from grouprl.report.runs import FINAL_MARKER, finished_at
from grouprl.report.sinks import NullSinks, truncate_jsonl
from grouprl.rollout import HFRolloutEngine, Rollout, RolloutEngine, completion_logprobs
from grouprl.rollout.logprobs import plain_head
from grouprl.tasks import Task
from grouprl.tasks.base import TrainerState
from grouprl.tasks.data import PromptStream
from grouprl.tasks.scoring import RewardSet
from grouprl.train import checkpoint as ckpt
from grouprl.train import distributed
from grouprl.train.batch import Batch
from grouprl.train.build import (
    autocast,
    build_rewards,
    build_task,
    forward_dtype,
    keep_freed_memory,
    load_policy,
    prompt_budget,
    prompt_ids,
    rows_that_fit,
    stop_strings,
)
from grouprl.train.config import TrainConfig, check_data_options, resolve, to_yaml
from grouprl.train.distributed import SINGLE, Dist
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
    dist: Dist = SINGLE  # this rank's place in a torchrun job
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

    Data parallel: every rank draws the same prompts (the single-process prompts) and samples
    whole groups for its share of each minibatch (`Dist.my_groups`), with its own seed; kept
    groups are counted across ranks, and with dynamic sampling handed round so that every rank
    trains the same number (a round then draws a multiple of the world size).

    Returns this rank's kept batch (None when no group was kept anywhere), sampling statistics
    of the whole job (plus whatever reward functions logged with `log_metric`), and everything
    this rank sampled, kept or not, which the step's reward, accuracy and length metrics describe.
    """
    B, G = cfg.prompts_per_step, cfg.group_size
    dist = sampler.dist
    W, M = dist.world_size, cfg.minibatches
    parts: list[tuple[int, Batch]] = []  # (round, kept groups of this rank)
    sampled: list[Batch] = []
    n_kept = n_sampled = n_zero = n_all_pass = n_none_pass = 0
    tokens = zero_tokens = 0  # sampled completion tokens, those in zero-variance groups
    skipped_before = sampler.skipped
    logged: dict[str, float] = {}
    rounds = 1 + (cfg.max_resample_rounds if cfg.dynamic_sampling else 0)
    for round_ in range(rounds):
        need = B - n_kept
        every_rows, every_ids = draw_prompts(sampler, -(-need // W) * W)  # the same on all ranks
        n = len(every_rows)
        mine = dist.my_groups(n, M) if n % (W * M) == 0 else dist.mine(n)
        rows, ids = [every_rows[i] for i in mine], [every_ids[i] for i in mine]
        with autocast(sampler.device, sampler.dtype):
            rollout = sampler.engine.sample(
                ids,
                group_size=G,
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                stop=sampler.stop,
                # each rank its own stream (an odd 32-bit offset: CPU generators keep 32 bits)
                seed=cfg.seed * 1_000_003 + step * 97 + round_ + dist.rank * 0x9E3779B1,
                **({"all_done": dist.all_done} if dist.fsdp else {}),
            )
        fault("sample")
        scores = dist.agreed(  # a user error on any rank: every rank leaves here
            sampler.rewards.score,
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
        group_tokens = rollout.lengths.view(-1, G).sum(-1).cpu()  # (B_round,)
        tokens += int(group_tokens.sum())
        zero_tokens += int(group_tokens[zero.cpu()].sum())
        passes = scores.passed.view(-1, G)  # (B_round, G)
        n_all_pass += int(passes.all(-1).sum())
        n_none_pass += int((~passes.any(-1)).sum())
        decided = passes.all(-1) | ~passes.any(-1)  # (B_round,) all pass or all fail
        keep = [g for g in range(len(rows)) if not (cfg.dynamic_sampling and decided[g])]
        if keep:
            parts.append((round_, part if len(keep) == len(rows) else part.select_groups(keep)))
        (kept_here,) = dist.sum(len(keep))  # on every rank
        n_kept += int(kept_here)
        if n_kept >= B:
            break
    n_sampled, n_zero, n_all_pass, n_none_pass, tokens, zero_tokens = dist.sum(
        n_sampled, n_zero, n_all_pass, n_none_pass, tokens, zero_tokens
    )
    stats = {
        **_mean_over_ranks(dist, logged),
        "frac_zero_std": n_zero / n_sampled,
        # by the pass reward: all-wrong groups need easier data, all-right ones a harder one
        "frac_all_pass": n_all_pass / n_sampled,
        "frac_none_pass": n_none_pass / n_sampled,
        # the rollout compute spent on groups whose advantages are all 0
        "zero_std_token_frac": zero_tokens / tokens if tokens else 0.0,
        "sample_rounds": round_ + 1,
        "skipped_prompts": sampler.skipped - skipped_before,
    }
    # Short of B groups after the last round: train on a multiple of the minibatch count (on
    # every rank).
    usable = min(n_kept, B)
    usable -= usable % (W * M)
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
    if not (dist.enabled and cfg.dynamic_sampling):  # each rank kept its own share, in order
        batch = Batch.concat([b for _, b in parts])
        per = usable // W
        if len(batch.rows) != per:
            batch = batch.select_groups(list(range(per)))
        return batch, stats, everything
    return _my_share(dist, parts, usable, M, sampler.device), stats, everything


def _my_share(
    dist: Dist, parts: list[tuple[int, Batch]], usable: int, minibatches: int, device: torch.device
) -> Batch:
    """This rank's groups (`Dist.my_groups`) of the first `usable` kept groups in their global
    order (round by round, rank by rank), handed round between ranks."""
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
    """Held-out pass@1 (sampled and greedy) and pass@k on a fixed subset, with a fixed seed.

    Data parallel: each rank evaluates a contiguous share of the rows (padded with repeats of the
    first row to the longest share, so every rank judges as many batches), and the per-problem
    counts are gathered."""
    state = TrainerState(global_step=step, max_steps=cfg.steps)
    dist = sampler.dist
    share = dist.mine(len(rows))
    longest = max(len(r) for r in dist.shares(len(rows)))
    mine = [rows[i] for i in share] + [rows[0]] * (longest - len(share))

    def judge(batch_rows: Sequence[dict], rollout: Rollout) -> list[bool]:
        scores = dist.agreed(  # every rank judges as many batches: errors leave together
            sampler.rewards.score,
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
            mine,
            judge=judge,
            samples=cfg.eval_samples,
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            stop=sampler.stop,
            seed=cfg.seed,
            greedy=True,
            progress=progress,
            all_done=dist.all_done if dist.fsdp else None,
            real_rows=len(share),
            gather=dist.gather if dist.enabled else None,
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


def _advantages(cfg: TrainConfig, batch: Batch, dist: Dist) -> torch.Tensor:
    """This rank's advantages (N,), computed over the whole job's batch (so a batch-level
    scale uses the global batch's statistics)."""
    G, per = cfg.group_size, len(batch.rows)
    rewards = torch.cat(dist.gather(batch.rewards)) if dist.enabled else batch.rewards
    advantages = group_advantages(
        rewards.view(-1, G),
        scale=cfg.adv_scale,
        estimator=cfg.adv_estimator,
        eps=cfg.adv_eps,
        unbiased_std=cfg.unbiased_std,
    ).reshape(-1)  # (N_global,)
    return advantages[dist.rank * per * G : (dist.rank + 1) * per * G]


def _check_world(cfg: TrainConfig, dist: Dist) -> None:
    """What a torchrun job needs of the config, checked on every rank alike."""
    parts = dist.world_size * cfg.minibatches
    if cfg.prompts_per_step % parts:
        raise UserError(
            f"prompts_per_step {cfg.prompts_per_step} must be divisible by the world size "
            f"{dist.world_size} times minibatches {cfg.minibatches} (= {parts}): every rank "
            "trains whole groups, as many in each minibatch; change --prompts-per-step, "
            "--minibatches or --nproc-per-node"
        )
    if dist.fsdp and cfg.lora_r is not None:
        raise UserError(
            "--strategy fsdp does not shard LoRA models; use --strategy ddp (each rank holds the "
            "base model, and only the small adapters are reduced)"
        )


def _on_main(dist: Dist, compute: Callable[[], Any]) -> Any:
    """`compute()` on rank 0 (which may touch the run directory), its result on every rank; a
    user error there is raised on every rank."""
    result, error = None, None
    if dist.is_main:
        try:
            result = compute()
        except UserError as err:
            error = str(err)
    result, error = dist.broadcast((result, error))
    if error is not None:
        raise UserError(error) if dist.is_main else distributed.PeerFailed(error)
    return result


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


def _write_final(
    policy: nn.Module, tokenizer: Any, run_dir: Path, step: int, state_dict=None
) -> Path:
    """final/ written under a temporary name, marked with its step, then swapped in: a kill
    midway leaves the previous final/ (or none), never a half-written one."""
    final, tmp, old = run_dir / "final", run_dir / ".final-tmp", run_dir / ".final-old"
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    save_final(policy, tokenizer, tmp, state_dict)
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
    """Run (or resume) a training run described by `cfg`; see the module docstring.

    Under torchrun every rank calls this; rank 0 prints and writes the run directory."""
    console = console or Console(stderr=True, quiet=not distributed.is_main_process())

    def warn(message: str) -> None:
        console.print(f"[yellow]warning:[/] {message}")

    check_data_options(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = build_task(cfg)
        cfg = resolve(cfg, task_max_new_tokens=task.max_new_tokens)
    for warning in caught:
        warn(str(warning.message))
    device = resolve_device(distributed.rank_device(cfg.device))
    keep_freed_memory(device)  # large CPU tensors reuse freed pages instead of faulting anew
    dist = distributed.init(cfg.strategy, device)
    _check_world(cfg, dist)
    run_dir = _on_main(dist, lambda: prepare_run_dir(cfg))  # rank 0 picks the name
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    # under FSDP the whole model stays in host memory; each rank moves only its shards
    policy, tokenizer, reference = load_policy(cfg, torch.device("cpu") if dist.fsdp else device)
    if dist.fsdp:
        for model in (policy, reference):
            if model is not None:
                plain_head(model)  # probed once, before sharding (a whole-model forward)
                distributed.shard(model, logprobs=completion_logprobs, device=device)
    else:
        dist.broadcast_parameters(policy)
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
        dist=dist,
        warn=warn,
    )
    eval_rows = evaluation_rows(cfg, task, sampler, warn)
    optimizer = make_optimizer(cfg, policy)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    scaler = grad_scaler(cfg, device)

    state: dict[str, Any] = {"data_position": 0, "initial_eval": None, "nonfinite_in_a_row": 0}
    start = 0
    checkpoint = None
    if cfg.resume is not None:  # rank 0 sets damaged checkpoints aside; every rank reads
        checkpoint = _on_main(
            dist, lambda: ckpt.latest_checkpoint(run_dir, warn=warn, set_aside=True)
        )
    if checkpoint is not None:
        meta = ckpt.load_checkpoint(
            checkpoint, model=policy, optimizer=optimizer, scheduler=scheduler, sharded=dist.fsdp
        )
        _apply_hyperparameters(cfg, optimizer, scheduler)  # what --allow-change changed
        start = meta["step"]
        state = {key: meta.get(key, default) for key, default in state.items()}
        if scaler is not None and meta.get("grad_scaler"):
            scaler.load_state_dict(meta["grad_scaler"])
        saved_world = meta.get("world_size", 1)
        if saved_world != dist.world_size:
            console.print(
                f"resuming a run saved by {saved_world} process(es) with {dist.world_size}: the "
                "checkpoint is a full model, so this works, but the completions sampled from "
                "here on differ from those of an uninterrupted run (each rank has its own seed)"
            )
        if start >= cfg.steps and _on_main(dist, lambda: finished_at(run_dir)) == start:
            console.print(
                f"{run_dir} already finished at step {start} (steps {cfg.steps}); nothing to "
                f"do. To train longer: grouprl train --resume {run_dir} --steps N"
            )
            return TrainSummary(run_dir, start, state["initial_eval"], None)
        console.print(f"resuming {run_dir} from step {start}")
    if cfg.resume is not None and dist.is_main:  # rows after the checkpoint are replayed
        last_kept = start if state["initial_eval"] is not None else -1
        # a final evaluation at `start` is replayed too: the run ends there
        last_eval = min(last_kept, start - 1) if start >= cfg.steps else last_kept
        for name, keep in (("metrics.jsonl", last_kept), ("eval.jsonl", last_eval),
                           ("samples.jsonl", last_kept), ("ratios.jsonl", last_kept)):  # fmt: skip
            if truncate_jsonl(run_dir / name, keep_through_step=keep):
                warn(f"{name}: dropped a half-written line (the process was killed mid-write)")
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_atomically(run_dir / "config.yaml", to_yaml(cfg))
    sampler.stream.position = state["data_position"]
    # TensorBoard forgets what the replayed steps logged before (JSONL was truncated above)
    sinks = (
        MetricSinks(run_dir, purge_step=last_kept + 1 if cfg.resume is not None else None)
        if dist.is_main
        else NullSinks()
    )
    interactive = cfg.progress and console.is_terminal
    done = {  # the last completed step
        "step": start,
        "position": state["data_position"],
        "nonfinite": state["nonfinite_in_a_row"],
    }

    def save(step: int) -> Path | None:
        state.update(data_position=done["position"], nonfinite_in_a_row=done["nonfinite"])
        if scaler is not None:
            state.update(grad_scaler=scaler.state_dict())
        full = distributed.gather_full_state(policy, optimizer) if dist.fsdp else None
        if not dist.is_main:
            return None
        return ckpt.save_checkpoint(
            run_dir,
            step,
            model=policy,
            tokenizer=tokenizer,
            optimizer=optimizer,
            scheduler=scheduler,
            state={**state, "world_size": dist.world_size},
            keep_last=cfg.keep_last,
            full_state=full,
        )

    reported: set[str] = set()  # the doctor's findings already printed

    def evaluate_at(step: int) -> dict[str, float]:
        fault("eval")
        result = run_eval(cfg, policy, sampler, eval_rows, step, progress=False)
        sinks.log_eval(step, result)
        line = "  ".join(f"{k} {v:.3f}" for k, v in result.items())
        console.print(f"step {step:>5}  held-out  {line}")
        if cfg.doctor and dist.is_main and step > 0 and "off" not in reported:
            try:  # `grouprl doctor`, live: each warning once
                findings = diagnose(run_dir)
            except Exception as err:  # never let a diagnosis stop training
                reported.add("off")
                warn(f"doctor: stopped checking this run ({type(err).__name__}: {err})")
                findings = []
            for finding in findings:
                if finding.severity == "warning" and finding.code not in reported:
                    reported.add(finding.code)
                    warn(f"doctor: {finding.title}: {finding.evidence}; {finding.suggestion}")
        return result

    # From the first checkpoint on, SIGINT/SIGTERM finish the current step, save and stop.
    with _StopFlag() as stop:
        save(start)  # a run directory always holds a checkpoint to resume from
        # what every rank agreed on (a signal that arrives later waits for the next agreement)
        stopping = dist.first_signal(stop.requested)
        if state["initial_eval"] is None and stopping is None:  # else: on resume
            console.print(f"run directory: {run_dir}")
            weights = ", ".join(f"{n} x{w:g}" for n, w in rewards.weights.items())
            where = (
                f"{device}"
                if not dist.enabled
                else (f"{dist.world_size} processes ({dist.strategy}, {device.type})")
            )
            console.print(f"policy:  {cfg.model} ({_describe(policy)}) on {where}")
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
                while step < cfg.steps and stopping is None:
                    t0 = time.perf_counter()
                    batch, stats, sampled = collect_batch(cfg, step, sampler)
                    t_rollout = time.perf_counter() - t0
                    metrics: dict[str, float] = {**stats}
                    updating = True
                    if batch is not None:
                        advantages = _advantages(cfg, batch, dist)  # (N,)
                        probe = _ratio_probe(cfg, step, batch, policy, sampler)
                        ref_logp = None
                        if cfg.beta > 0:  # the initial policy: a frozen copy, or LoRA's base model
                            with base_model_context(policy):
                                ref_logp = no_grad_logprobs(
                                    cfg, reference or policy, batch.rollout, sampler.dtype
                                )  # (N, T)
                        metrics.update(
                            update(
                                cfg,
                                policy,
                                optimizer,
                                batch,
                                advantages,
                                ref_logp,
                                scaler=scaler,
                                dist=dist,
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
                        if probe is not None:
                            sinks.log_ratios(step + 1, *_probe_ratios(cfg, probe, policy, dist))
                    # everything sampled, kept or not; then what dynamic sampling kept
                    metrics.update(_batch_metrics(sampled, dist))
                    if batch is not None and (
                        cfg.dynamic_sampling if dist.enabled else batch is not sampled
                    ):
                        kept = _batch_metrics(batch, dist)
                        metrics.update({f"{k}_kept": v for k, v in kept.items()})
                    lr = optimizer.param_groups[0]["lr"]  # the rate this step's updates used
                    scheduler.step()
                    step += 1
                    done.update(
                        step=step, position=sampler.stream.position, nonfinite=nonfinite_in_a_row
                    )
                    updating = False
                    seconds = time.perf_counter() - t0
                    # every token sampled, on every rank
                    (generated,) = dist.sum(int(sampled.rollout.lengths.sum()))
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
                    stopping = dist.first_signal(stop.requested)  # all stop together
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
            dist.barrier()
            raise

        save(step)
        stopping = dist.first_signal(stop.requested)  # one arriving during the save counts too
        if stopping is not None:
            sinks.close()
            dist.barrier()
            name = signal.Signals(stopping).name
            console.print(
                f"stopped by {name}: saved a checkpoint at step {step}; "
                f"continue with: grouprl train --resume {run_dir}"
            )
            return TrainSummary(
                run_dir, step, state["initial_eval"], latest_eval, interrupted=True, stopped_by=name
            )

        final_eval = evaluate_at(step)
        sinks.close()
        full = distributed.gather_full_state(policy, None)[0] if dist.fsdp else None
        if not dist.is_main:
            return TrainSummary(run_dir, step, state["initial_eval"], final_eval)
        _write_final(policy, tokenizer, run_dir, step, full)
        plots = plot_run(run_dir)
        _print_summary(console, state["initial_eval"], final_eval)
        console.print(
            f"final policy: {run_dir / 'final'}   plots: {plots[0].parent if plots else '-'}"
        )
        return TrainSummary(run_dir, step, state["initial_eval"], final_eval)


@dataclass
class _Probe:
    """Completions whose ratio against the sampling policy is measured after the step."""

    rollout: Rollout  # one completion per group (groups of 1), spread over the batch
    old_logp: torch.Tensor  # (k, T) the sampling policy's log-probs, by the trainer's forward
    dtype: torch.dtype | None


def _ratio_probe(
    cfg: TrainConfig, step: int, batch: Batch, policy: nn.Module, sampler: Sampler
) -> _Probe | None:
    """This rank's share of the `log_ratios` completions of a logged step (every
    `log_ratios_every` steps), before the update: one completion from each of as many groups
    as possible, a different member of each, so lengths and prompts vary. Under bf16 their
    sampling-policy log-probs are recomputed by the trainer's forward (the sampler's differ
    from it by rounding, see `trainer_old_logp`): a second extra forward."""
    if not cfg.log_ratios or (step + 1) % cfg.log_ratios_every:
        return None
    rollout = batch.rollout
    B, G = rollout.num_prompts, rollout.group_size
    k = min(-(-cfg.log_ratios // sampler.dist.world_size), B * G)  # this rank's share
    rows = [(i % B) * G + (i // B + i) % G for i in range(k)]  # distinct: groups first
    sub = rollout.regroup(1).select_groups(rows)
    dtype = sampler.dtype
    old = sub.old_logp if dtype is None else no_grad_logprobs(cfg, policy, sub, dtype)
    return _Probe(sub, old, dtype)


def _probe_ratios(
    cfg: TrainConfig, probe: _Probe, policy: nn.Module, dist: Dist
) -> tuple[list[int], list[float]]:
    """Lengths and Σ_t log ρ_t (the log of the token-ratio product; divided by the length it is
    GSPO's log sequence ratio) of the probe's completions under the policy after the step's last
    update, every rank's together. One extra no-grad forward: for an on-policy step the ratio
    inside the update is 1 by construction; this is how far the update moved those sequences."""
    sub = probe.rollout
    logp = no_grad_logprobs(cfg, policy, sub, probe.dtype)  # (k, T)
    log_ratio = ((logp - probe.old_logp) * sub.mask).sum(-1)  # (k,)
    mine = (sub.lengths.tolist(), log_ratio.tolist())
    shares = dist.gather(mine) if dist.enabled else [mine]
    return [x for s in shares for x in s[0]], [x for s in shares for x in s[1]]


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


def _batch_metrics(batch: Batch, dist: Dist = SINGLE) -> dict[str, float]:
    """Reward, accuracy, length and entropy metrics of `batch` on every rank together."""
    mask = batch.rollout.mask
    entropy = batch.rollout.entropy  # of the sampling policy, over every sampled token
    local = {
        "rewards": batch.rewards,
        "lengths": batch.rollout.lengths.float().cpu(),
        "truncated": batch.rollout.truncated.float().cpu(),
        "by_function": batch.by_function,
        "passed": batch.passed,
        "entropy": None if entropy is None else (float(entropy[mask].sum()), int(mask.sum())),
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
    if batch.passed is not None:  # the pass reward's verdict: the one definition of correct
        metrics["accuracy"] = float(torch.cat([s["passed"] for s in shares]).float().mean())
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
    ended = False
    try:
        summary = train(cfg)
        ended = True
    finally:
        distributed.shutdown(together=ended)
    return EXIT_STATUS.get(summary.stopped_by, 130) if summary.interrupted else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: grouprl train")
