"""One step's policy update: minibatches of whole groups, micro-batch chunks, the clipped loss,
gradient accumulation, clipping and the optimizer step (`update`), and the optimizer itself.

Kept apart from `loop.py`, which tells the whole story of a run and calls `update` once a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from grouprl.core import PolicyLoss, policy_loss
from grouprl.faults import fault
from grouprl.models import activation_checkpointing as checkpointing
from grouprl.models.lora import adapter_dropout
from grouprl.rollout import Rollout, completion_logprobs
from grouprl.train.batch import Batch
from grouprl.train.build import autocast, forward_dtype
from grouprl.train.config import TrainConfig

# Diagnostics of an update (see `update`): those that are exact even when groups are skipped
# (averaged over every update), and those that describe the trained completions only.
_EXACT_DIAGNOSTICS = ("loss", "grad_norm", "clip_frac_low", "clip_frac_high")
_TRAINED_DIAGNOSTICS = tuple(
    f.name for f in dataclasses.fields(PolicyLoss) if f.name not in (*_EXACT_DIAGNOSTICS, "kl")
)


@dataclass(frozen=True)
class Chunk:
    """One forward/backward's completions: a rollout and its rows in the step's rollout."""

    rollout: Rollout
    rows: torch.Tensor  # (n,) long


def plan_rows(cfg: TrainConfig, rollout: Rollout, rows: torch.Tensor) -> list[Chunk]:
    """`rollout` (whose completions are `rows` of the step's rollout) in micro-batch chunks."""
    return [Chunk(piece, rows[span]) for piece, span in rollout.chunks(cfg.micro_batch_size)]


@dataclass(frozen=True)
class Minibatch:
    """One optimizer step's share of a rollout: the groups it trains (in micro-batch chunks),
    and the counts its loss divides by (those of all its groups, skipped ones included)."""

    rollout: Rollout | None  # the trained groups; None when every group was skipped
    rows: torch.Tensor  # (n,) long, their rows in the step's rollout
    num_tokens: torch.Tensor  # () loss tokens in the whole minibatch
    num_seqs: torch.Tensor  # () sequences with at least one loss token, likewise
    chunks: tuple[Chunk, ...] = ()


def plan_minibatches(
    cfg: TrainConfig, rollout: Rollout, advantages: torch.Tensor, mask: torch.Tensor
) -> list[Minibatch]:
    """`cfg.minibatches` minibatches of whole groups, in order, without the groups that have
    nothing to learn (all advantages 0) when `skip_zero_advantage` applies (beta = 0), each cut
    into chunks of at most `cfg.micro_batch_size` completions.

    A group is never cut across minibatches: its advantages are normalised over all G of its
    completions. Raises ValueError unless B is divisible by `cfg.minibatches`. advantages: (N,);
    mask: (N, T), the loss mask.
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
        trained = rollout.select_groups(groups) if groups else None
        rows = rollout.group_rows(groups)
        plans.append(
            Minibatch(
                rollout=trained,
                rows=rows,
                num_tokens=m.sum(),
                num_seqs=m.any(-1).sum(),
                chunks=tuple(plan_rows(cfg, trained, rows)) if trained is not None else (),
            )
        )
    return plans


def trainer_old_logp(cfg: TrainConfig, policy, plans: list[Minibatch]) -> list[Minibatch]:
    """The minibatches with `old_logp` recomputed by the trainer's own forward.

    Under bf16 the sampler's KV-cached decode and the trainer's full-sequence forward round
    differently (measured: up to 0.06 per token, 4e-3 per sequence), more than GSPO's clip range.
    Recomputing on exactly the chunks (and so the shapes) that the update then runs, through the
    same forward path (prompt shared, or not under gradient checkpointing), makes the first
    update's ratio 1 again. Runs before any optimizer step.
    """
    device, dtype = _device(policy), forward_dtype(cfg)
    out = []
    for plan in plans:
        chunks = []
        for chunk in plan.chunks:
            with torch.no_grad(), autocast(device, dtype):
                old_logp = completion_logprobs(
                    policy,
                    chunk.rollout,
                    temperature=cfg.temperature,
                    share_prompt=not cfg.gradient_checkpointing,  # the update's own path
                )
            chunks.append(
                dataclasses.replace(
                    chunk, rollout=dataclasses.replace(chunk.rollout, old_logp=old_logp)
                )
            )
        out.append(dataclasses.replace(plan, chunks=tuple(chunks)))
    return out


def no_grad_logprobs(
    cfg: TrainConfig, model: nn.Module, rollout: Rollout, dtype: torch.dtype | None
) -> torch.Tensor:
    """Log-probs (N, T) of the rollout's completions under `model`, without gradients (the
    reference policy's, for the KL term), in chunks no larger than the update's: a micro-batch,
    or else a minibatch, so this pass never needs more memory than training does."""
    out = torch.zeros_like(rollout.old_logp)  # (N, T)
    minibatch = max(1, rollout.num_prompts // cfg.minibatches) * rollout.group_size
    for piece, span in rollout.chunks(cfg.micro_batch_size or minibatch):
        with torch.no_grad(), autocast(_device(model), dtype):
            out[span] = completion_logprobs(model, piece, temperature=cfg.temperature)
    return out


def _combine(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """One minibatch's diagnostics from its chunks' (diagnostics, loss tokens): the loss is the
    sum (every chunk divides by the whole minibatch's counts), means are token-weighted, the
    ratio's extremes are extremes over chunks that had tokens."""
    if len(parts) == 1:
        return parts[0][0]
    tokens = sum(t for _, t in parts)
    live = [d for d, t in parts if t > 0] or [parts[0][0]]
    out = {}
    for key in parts[0][0]:
        if key == "loss":
            out[key] = sum(d[key] for d, _ in parts)
        elif key == "ratio_min":
            out[key] = min(d[key] for d in live)
        elif key == "ratio_max":
            out[key] = max(d[key] for d in live)
        else:
            out[key] = sum(d[key] * t for d, t in parts) / tokens if tokens else 0.0
    return out


def update(
    cfg: TrainConfig,
    policy,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    advantages: torch.Tensor,
    ref_logp: torch.Tensor | None,
    scaler: torch.amp.GradScaler | None = None,
) -> dict[str, float]:
    """`epochs` passes over `minibatches` minibatches of whole groups, one optimizer step each.

    advantages: (N,); ref_logp: (N, T) or None; scaler: the loss scaler of fp16 forwards (see
    `grad_scaler`). Returns the diagnostics averaged over updates.

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

    An optimizer step whose loss or gradient norm is NaN or inf is skipped (counted in
    `nonfinite_updates`; the trainer stops the run after `max_nonfinite_steps` such steps in a
    row), so a bad batch never writes NaN into the weights or AdamW's moments.

    Micro-batching: a minibatch's forward/backward runs in chunks of at most
    `micro_batch_size` completions whose gradients accumulate; every chunk's loss divides by the
    whole minibatch's counts, so the sum is the minibatch's loss and the update is the same.
    """
    rollout = batch.rollout
    device, dtype = _device(policy), forward_dtype(cfg)
    advantages = advantages.to(device)  # (N,)
    mask = rollout.mask  # (N, T)
    if cfg.mask_truncated:
        mask = mask & ~rollout.truncated[:, None]
    params = trainable_parameters(policy)
    plans = plan_minibatches(cfg, rollout, advantages, mask)
    if dtype is not None:
        plans = trainer_old_logp(cfg, policy, plans)
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
    totals: dict[str, float] = {}
    n_updates = n_trained_updates = nonfinite = 0
    for _ in range(cfg.epochs):
        for plan in plans:
            optimizer.zero_grad(set_to_none=True)
            diagnostics = dict.fromkeys(_EXACT_DIAGNOSTICS, 0.0)
            if not plan.chunks:
                for p in params:
                    p.grad = torch.zeros_like(p)
            else:
                parts = []
                for chunk in plan.chunks:
                    with (
                        autocast(device, dtype),
                        _recomputing(cfg, policy),
                        adapter_dropout(policy, cfg.lora_dropout > 0),
                    ):
                        logp = completion_logprobs(
                            policy, chunk.rollout, temperature=cfg.temperature
                        )  # (n, T) float32
                    m = mask[chunk.rows]  # (n, T)
                    out = policy_loss(
                        logp,
                        chunk.rollout.old_logp,
                        advantages[chunk.rows],
                        m,
                        level=cfg.ratio_level,
                        clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high,
                        dual_clip=cfg.dual_clip,
                        ref_logp=None if ref_logp is None else ref_logp[chunk.rows],
                        beta=cfg.beta,
                        kl_estimator=cfg.kl_estimator,
                        agg=cfg.loss_agg,
                        norm_len=cfg.norm_len,
                        num_tokens=plan.num_tokens,
                        num_seqs=plan.num_seqs,
                    )
                    (out.loss if scaler is None else scaler.scale(out.loss)).backward()
                    parts.append((out.metrics(), float(m.sum())))
                diagnostics = _combine(parts)
                # Skipped tokens have advantage 0 and are never clipped: over the minibatch's
                # tokens the clip fractions are exactly those of the full computation.
                share = sum(t for _, t in parts) / max(float(plan.num_tokens), 1.0)
                diagnostics["clip_frac_low"] *= share
                diagnostics["clip_frac_high"] *= share
                n_trained_updates += 1
            if scaler is not None:
                scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            finite_loss = math.isfinite(diagnostics["loss"])
            if scaler is not None:  # skips the step itself when the scaled gradients overflowed
                scaler.step(optimizer)  # (an overflow is how the scale finds its level: no alarm)
                scaler.update()
                finite = finite_loss  # a NaN loss, though, is nothing a smaller scale can fix
            else:
                finite = finite_loss and math.isfinite(float(grad_norm))
                if finite:
                    optimizer.step()
            if not finite:  # a NaN or inf never reaches the weights, nor AdamW's moments
                nonfinite += 1
                n_trained_updates -= 1 if plan.chunks else 0
                diagnostics = dict.fromkeys(_EXACT_DIAGNOSTICS, 0.0)
                grad_norm = torch.zeros(())
            fault("update")
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
    result["nonfinite_updates"] = nonfinite
    return result


def _recomputing(cfg: TrainConfig, policy: nn.Module) -> contextlib.AbstractContextManager:
    return (
        checkpointing.recomputing(policy)
        if cfg.gradient_checkpointing
        else contextlib.nullcontext()
    )


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def grad_scaler(cfg: TrainConfig, device: torch.device) -> torch.amp.GradScaler | None:
    """A dynamic loss scaler when forward passes run in fp16, else None.

    fp16 has a narrow exponent range: small gradients of fp16 activations flush to zero and large
    ones overflow. Scaling the loss up before backward and the gradients down before the step
    keeps them representable; a step whose gradients overflowed is skipped and the scale lowered
    (torch.amp's usual recipe). bf16 has fp32's range and needs none.
    """
    if forward_dtype(cfg) != torch.float16:
        return None
    return torch.amp.GradScaler(device.type)


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
