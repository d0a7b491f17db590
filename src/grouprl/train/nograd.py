"""The update's log-prob passes without gradients: the trainer's own `old_logp` on exactly the
chunks the update then runs (`trainer_old_logp`), and any model's log-probs of a rollout in
chunks no larger than the update's (`no_grad_logprobs`: the reference's, a teacher's, the
policy's after a step).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from grouprl.config.options import RunConfig
from grouprl.core import MismatchSums, logp_mismatch
from grouprl.models.precision import autocast
from grouprl.rollout import Rollout, model_device, routes
from grouprl.train.parallel.fsdp import logprobs
from grouprl.train.plan import Chunk, Minibatch, Shape, plan_rows


def trainer_old_logp(
    cfg: RunConfig, policy, plans: list[Minibatch], dtype: torch.dtype | None
) -> tuple[list[Minibatch], MismatchSums]:
    """The minibatches with `old_logp` recomputed by the trainer's own forward, and the
    sampler's log-probs' distance from it over the trained tokens (`logp_mismatch`).

    Under bf16 the sampler's KV-cached decode and the trainer's full-sequence forward round
    differently (measured: up to 0.06 per token, 4e-3 per sequence), more than GSPO's clip range;
    another engine (vLLM) differs by its kernels and precision, and by top-k / top-p, which its
    log-probs include. Recomputing on exactly the chunks (and so the shapes) that the update
    then runs, through the same forward path (prompt shared, or not under gradient
    checkpointing), makes the first update's ratio 1 again. Runs before any optimizer step.
    """
    device = model_device(policy)
    out, mismatch = [], MismatchSums()
    for plan in plans:
        chunks = []
        for chunk in plan.chunks:
            with torch.no_grad(), autocast(device, dtype), routes.forwarding(chunk.rows):
                old_logp = logprobs(
                    policy,
                    chunk.rollout,
                    temperature=cfg.temperature,
                    share_prompt=not cfg.gradient_checkpointing,  # the update's own path
                    buckets=chunk.buckets,
                    packs=chunk.packs,
                )
            if chunk.weight:  # a lockstep filler's rows are not trained
                sampled = chunk.rollout
                mismatch += logp_mismatch(sampled.sampler_logp, old_logp, sampled.loss_mask)
            behaviour = chunk.rollout.sampler_logp  # kept: the correction reads it
            chunks.append(
                dataclasses.replace(
                    chunk,
                    rollout=dataclasses.replace(
                        chunk.rollout, old_logp=old_logp, behaviour_logp=behaviour
                    ),
                )
            )
        out.append(dataclasses.replace(plan, chunks=tuple(chunks)))
    return out, mismatch


def no_grad_logprobs(
    cfg: RunConfig, model: nn.Module, rollout: Rollout, dtype: torch.dtype | None
) -> torch.Tensor:
    """Log-probs (N, T) of the rollout's completions under `model`, without gradients (the
    reference policy's, for the KL term), in chunks no larger than the update's: a micro-batch
    (of completions or of tokens), or else a minibatch, so this pass never needs more memory
    than training does; cut as the update cuts a minibatch (`plan_rows`: widths on a CPU,
    packed lines, token budgets).
    Under FSDP every process must run as many passes: there the chunks are by completions."""
    out = torch.zeros_like(rollout.old_logp)  # (N, T)
    minibatch = max(1, rollout.num_prompts // cfg.minibatches) * rollout.group_size
    sharded = cfg.strategy == "fsdp" and torch.distributed.is_initialized()
    shape = None if sharded else Shape.of(model)
    by_width = shape is not None and model_device(model).type == "cpu"
    for piece, span in rollout.chunks(cfg.micro_batch_size or minibatch):
        rows = torch.arange(span.start, span.stop)
        if shape is None:
            chunks = [Chunk(piece, rows)]
        else:
            chunks = plan_rows(cfg, piece, rows, shape.overhead if by_width else None, shape)
        for chunk in chunks:
            with (
                torch.no_grad(),
                autocast(model_device(model), dtype),
                routes.forwarding(chunk.rows),
            ):
                out[chunk.rows] = logprobs(model, chunk.rollout, temperature=cfg.temperature,
                                           buckets=chunk.buckets, packs=chunk.packs)  # fmt: skip
    return out
