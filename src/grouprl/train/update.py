"""One step's policy update: minibatches of whole groups, each in forward/backward passes whose
gradients accumulate, the clipped loss, then one optimizer step per minibatch (`update`); and the
optimizer itself.

How a step's groups are cut into minibatches and passes is `train/plan.py`; this file runs the
plan. Kept apart from `loop.py`, which tells the whole story of a run and calls `update` once a
step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from grouprl.config.options import RunConfig
from grouprl.config.training import ComputeOptions, ObjectiveOptions, UpdateOptions
from grouprl.config.validation import correction, loss_options, reuses_batches
from grouprl.core import (
    Correction,
    CorrectionSums,
    LossOptions,
    LossStats,
    MismatchSums,
    correction_weights,
    distillation_advantages,
    load_balancing_loss,
    logp_mismatch,
    mean_over,
    policy_loss,
)
from grouprl.faults import fault
from grouprl.models import activation_checkpointing as checkpointing
from grouprl.models.lora import adapter_dropout
from grouprl.models.precision import autocast
from grouprl.rollout import Rollout, model_device, routes
from grouprl.rollout.narrow import folded_adapters
from grouprl.train.batch import Batch
from grouprl.train.entropy import EntropyTerms, high_entropy_tokens
from grouprl.train.groups import TokenWatch
from grouprl.train.metrics import UpdateSums
from grouprl.train.nograd import trainer_old_logp
from grouprl.train.parallel.distributed import SINGLE, Dist
from grouprl.train.parallel.fsdp import Lockstep, logprobs
from grouprl.train.plan import (
    Minibatch,
    Shape,
    packs_every_pass,
    pad_passes,
    plan_minibatches,
    with_global_counts,
)
from grouprl.train.teacher import TeacherLoss, teacher_metrics


def update(
    cfg: RunConfig,
    policy,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    advantages: torch.Tensor,
    ref_logp: torch.Tensor | None,
    *,
    dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    dist: Dist = SINGLE,
    lockstep: Lockstep | None = None,
    entropy_state: tuple[float | None, float | None] = (None, None),
    step: int = 0,
    teacher_logp: torch.Tensor | None = None,
    teacher: nn.Module | None = None,
    watch: TokenWatch | None = None,
    parents: torch.Tensor | None = None,  # (K,): the last K rows are their branches (train_on)
    router_aux: float = 0.0,
) -> dict[str, float]:
    """`epochs` passes over `minibatches` minibatches of whole groups, one optimizer step each.

    entropy_state, step: the adaptive entropy coefficient and last entropy as the run's state
    holds them, and the step (Clip-Cov's draw's seed): see `EntropyTerms`. teacher_logp (N, T)
    / teacher: the teacher's log-probs of the samples, or itself (`grouprl.train.teacher`).
    watch: rows whose loss terms each pass records (`grouprl.train.groups`), or None.
    router_aux: the weight of a mixture-of-experts policy's balancing loss (0: off). advantages:
    (N,), or (N, T) per token (each turn's); ref_logp: (N, T) or None; dtype: the autocast dtype
    of the forwards (the run's one, `Sampler.dtype`; None: float32); scaler: the loss scaler of
    fp16 forwards (see `grad_scaler`). Returns the update's diagnostics (`UpdateSums.metrics`).

    Groups without a learning signal are skipped (`skip_zero_advantage`; not with beta > 0, an
    entropy bonus or Clip/KL-Cov): a group whose completions all scored the same has advantages
    0, so its loss terms -min(r·0, clip(r)·0) and their gradients are exactly 0. It never enters
    the forward and backward; the loss still divides by the whole minibatch's counts, and a
    minibatch left empty still takes its optimizer step (zero gradients move AdamW's moments and
    step count), so the parameters equal the full computation's up to float rounding (a
    parameter no forward touches would keep no gradient there: no supported model has one).
    `trained_frac` is the fraction of completions trained. A step whose loss or gradient norm is
    not finite is skipped (`nonfinite_updates`; the run stops after `max_nonfinite_steps` in a
    row): no NaN reaches the weights or AdamW's moments. Micro-batching: chunks of at most
    `micro_batch_size` completions accumulate gradients, each loss divided by the whole
    minibatch's counts, so the update is the same. Data parallel (`dist`): this rank's share of
    the groups; counts, gradients (before clipping) and every diagnostic are the global
    minibatch's. Under FSDP `lockstep` pads the passes.
    """
    rollout = batch.rollout
    advantages = advantages.to(model_device(policy))  # (N,) or (N, T)
    mask = rollout.loss_mask  # (N, T) the tokens the loss trains
    if cfg.mask_truncated:
        mask = mask & ~rollout.truncated[:, None]
    # the optimizer's own: under FSDP the model's parameters are the unsharded tensors whenever
    # the root module is unsharded (after a forward), the optimizer's the sharded DTensors
    params = [p for group in optimizer.param_groups for p in group["params"]]
    plans, mismatch = _plans(cfg, policy, rollout, advantages, mask, dtype, dist,
                             lockstep or Lockstep(dist), parents)  # fmt: skip
    inputs = _loss_inputs(cfg, rollout, advantages, mask, ref_logp, dtype, dist, teacher_logp,
                          teacher, router_aux)  # fmt: skip
    sums = UpdateSums(has_kl=ref_logp is not None)
    extras = EntropyTerms.start(cfg, dist, entropy_state, step, inputs.advantages, inputs.mask)
    for epoch in range(cfg.epochs):
        for index, plan in enumerate(plans):
            optimizer.zero_grad(set_to_none=True)
            passes = _backward(cfg, policy, plan, inputs, scaler, first_epoch=epoch == 0,
                               watch=watch, **extras.before(plan, epoch, index))  # fmt: skip
            if passes.trained_rows == 0:  # nothing trained here: a zero gradient (AdamW steps)
                _zero_gradients(params)
            dist.sum_gradients(params)
            passes = passes.over_ranks(dist)  # the global minibatch's loss and sums
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf
            grad_norm = optimizer_step(optimizer, params, max_norm=max_norm, scaler=scaler,
                                       loss=passes.loss)  # fmt: skip
            fault("update")
            sums.add(plan, passes, grad_norm)
            extras.after(*passes.entropy)
    mismatch = sums.mismatch if inputs.bypass else mismatch  # bypass: each pass's forward
    return {**_update_metrics(sums, inputs, mismatch, sums.applied, dist),
            **extras.metrics(inputs.threshold),
            **teacher_metrics(rollout, teacher_logp, mask, sums.teacher if teacher else None,
                              dist)}  # fmt: skip


def _update_metrics(
    sums: UpdateSums,
    inputs: _LossInputs,
    mismatch: MismatchSums | None,
    applied: CorrectionSums,
    dist: Dist,
) -> dict[str, float]:
    """The update's diagnostics over the whole job: the loss's, the sampler's mismatch (where
    the sampler is not the trainer), the correction's (where one applies), the routers'
    balancing loss per row (where weighted)."""
    if dist.enabled:
        dist.all_reduce(sums.extremes, "max")
    metrics = sums.metrics()
    if inputs.router_aux:
        metrics["router_aux_loss"] = sums.aux[0] / max(sums.aux[1], 1)
    if mismatch is not None:
        metrics.update(mismatch_metrics(mismatch, dist))
    if inputs.correction is not None:
        metrics.update(correction_metrics(applied, dist))
    return metrics


def _loss_inputs(
    cfg: RunConfig,
    rollout: Rollout,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None,
    dtype: torch.dtype | None,
    dist: Dist = SINGLE,
    teacher_logp: torch.Tensor | None = None,
    teacher: nn.Module | None = None,
    router_aux: float = 0.0,
) -> _LossInputs:
    """What every pass's loss reads: the correction only where the sampler is not the
    trainer's fp32 forward (another dtype, engine or version), bypass only there too; the
    off-policy sequence mask alone also where a batch trains several updates (its π_b is then
    the sampler's log-probs, old_logp: the drift is the updates'). With a teacher, per-token
    advantages (`teacher_logp`) or the jsd loss (`teacher`) beside the task's weighted ones;
    `router_aux`, the routers' balancing loss's weight."""
    corr = correction(cfg)
    differs = dtype is not None or rollout.behaviour_logp is not None
    if not differs:
        mask_only = corr.opsm_delta is not None and reuses_batches(cfg)
        corr = Correction(opsm_delta=corr.opsm_delta) if mask_only else Correction()
    keep, threshold = high_entropy_tokens(cfg, rollout, mask, dist)
    per_token = None
    if teacher_logp is not None:
        per_token = distillation_advantages(advantages, rollout.sampler_logp.to(mask.device),
                                            teacher_logp.to(mask.device), mask,
                                            coef=cfg.teacher_coef,
                                            task_weight=cfg.teacher_task_weight)  # fmt: skip
    jsd = None
    if teacher is not None:
        advantages = advantages * cfg.teacher_task_weight
        jsd = TeacherLoss(teacher, cfg.teacher_beta, cfg.teacher_coef, cfg.temperature)
    return _LossInputs(loss_options(cfg), advantages, mask, ref_logp, dtype,
                       corr if corr.active else None,
                       differs and cfg.proximal == "behaviour", keep, threshold,
                       per_token, jsd, router_aux)  # fmt: skip


def correction_metrics(sums: CorrectionSums, dist: Dist = SINGLE) -> dict[str, float]:
    """What the correction did over every trained token of the job's passes: the weight's mean,
    min and max over the tokens it kept, and the shares truncated and masked."""
    if dist.enabled:
        total = dist.all_reduce(torch.tensor(
            [sums.weight_sum, sums.truncated, sums.masked, sums.tokens], dtype=torch.float64,
            device=dist.device))  # fmt: skip
        ends = dist.all_reduce(torch.tensor([-sums.weight_min, sums.weight_max],
                                            dtype=torch.float64, device=dist.device), "max")  # fmt: skip
        sums = CorrectionSums(float(total[0]), -float(ends[0]), float(ends[1]),
                              int(total[1]), int(total[2]), int(total[3]))  # fmt: skip
    kept = sums.tokens - sums.masked
    return {
        "is_weight_mean": mean_over(sums.weight_sum, kept),
        "is_weight_min": sums.weight_min if kept else math.nan,
        "is_weight_max": sums.weight_max if kept else math.nan,
        "is_truncated_frac": mean_over(sums.truncated, sums.tokens),
        "is_masked_frac": mean_over(sums.masked, sums.tokens),
    }


def mismatch_metrics(sums: MismatchSums, dist: Dist = SINGLE) -> dict[str, float]:
    """The sampler's log-probs against the trainer's over every trained token of the job
    (`grouprl.core.logp_mismatch`): the mean and largest |Δ log p|, and k3's KL estimate per
    token. NaN over no token."""
    if dist.enabled:
        total = dist.all_reduce(torch.tensor([sums.abs_sum, sums.k3_sum, float(sums.tokens)],
                                             dtype=torch.float64, device=dist.device))  # fmt: skip
        largest = dist.all_reduce(torch.tensor([sums.abs_max], dtype=torch.float64,
                                               device=dist.device), "max")  # fmt: skip
        sums = MismatchSums(float(total[0]), float(largest[0]), float(total[1]), int(total[2]))
    return {
        "logp_mismatch_mean": mean_over(sums.abs_sum, sums.tokens),
        "logp_mismatch_max": sums.abs_max if sums.tokens else math.nan,
        "logp_mismatch_kl": mean_over(sums.k3_sum, sums.tokens),
    }


def _plans(
    cfg: RunConfig,
    policy: nn.Module,
    rollout: Rollout,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    dtype: torch.dtype | None,
    dist: Dist,
    lockstep: Lockstep,
    parents: torch.Tensor | None = None,
) -> tuple[list[Minibatch], MismatchSums | None]:
    """The update's minibatches and passes (`grouprl.train.plan`), with the global counts, the
    lockstep's fillers, and where the sampler is not the trainer's forward (autocast, or
    another engine) the trainer's own old_logp, with how far the sampler's were from it (None
    where they are the trainer's).

    Passes by width where their cost is measured: on a CPU, and not under FSDP, where every pass
    is a collective per layer (all ranks must run the same passes) and costs an all-gather of
    the model that the position count does not model."""
    by_width = model_device(policy).type == "cpu" and not dist.fsdp
    shape = Shape.of(policy)
    plans = plan_minibatches(cfg, rollout, advantages, mask,
                             shape.overhead if by_width else None, shape, parents)  # fmt: skip
    plans = with_global_counts(plans, dist)
    plans = pad_passes(plans, rollout, lockstep, packs_every_pass(cfg, shape))
    if not recomputes_old_logp(cfg, rollout, dtype):
        return plans, None  # the sampler's log-probs are the proximal policy's
    return trainer_old_logp(cfg, policy, plans, dtype)


def recomputes_old_logp(cfg: RunConfig, rollout: Rollout, dtype: torch.dtype | None) -> bool:
    """Whether the update takes `old_logp` from the trainer's own forward rather than from the
    sampler: a sampler that is not the trainer's fp32 forward (bf16, another engine, an older
    version), unless `--proximal behaviour` clips against the sampler itself."""
    differs = dtype is not None or rollout.behaviour_logp is not None
    return differs and cfg.proximal != "behaviour"


@dataclass(frozen=True)
class PassSums:
    """What a minibatch's forward/backward passes add up to on this rank (or, `over_ranks`, in
    the whole job): the loss, the `LossStats` sums, the rows trained (a lockstep filler adds
    nothing) and the minibatch's rows; and this rank's `LossStats` extremes (maxed over ranks
    once per update, by the caller)."""

    loss: float
    stats: list[float]  # LossStats.SUMS
    trained_rows: float
    rows: float
    extremes: torch.Tensor  # (len(LossStats.EXTREMES),) float64 on the CPU
    applied: CorrectionSums = field(default_factory=CorrectionSums)  # this rank's (reduced
    # once, by the caller)
    mismatch: MismatchSums = field(default_factory=MismatchSums)  # bypass: the sampler
    # against these passes' forward
    entropy: tuple[float, float] = (0.0, 0.0)  # with an entropy bonus: Σ H and the tokens
    teacher: tuple[float, float] = (0.0, 0.0)  # --teacher-loss jsd: Σ JSD and the tokens
    aux: tuple[float, float] = (0.0, 0.0)  # the routers' balancing loss: Σ loss·rows, Σ rows

    def over_ranks(self, dist: Dist) -> PassSums:
        """The sums of every rank's passes: one all-reduce (float64)."""
        if not dist.enabled:
            return self
        packed = torch.tensor([self.loss, *self.stats, self.trained_rows, self.rows,
                               *self.entropy, *self.teacher, *self.aux], dtype=torch.float64,
                              device=dist.device)  # fmt: skip
        loss, *stats, trained_rows, rows, h_sum, h_tokens, j_sum, j_tokens, a_sum, a_rows = (
            dist.all_reduce(packed).tolist())  # fmt: skip
        return dataclasses.replace(self, loss=loss, stats=stats, trained_rows=trained_rows,
                                   rows=rows, entropy=(h_sum, h_tokens),
                                   teacher=(j_sum, j_tokens), aux=(a_sum, a_rows))  # fmt: skip


@dataclass(frozen=True)
class _LossInputs:
    """What every pass's loss reads besides the model: the objective and the step's tensors."""

    options: LossOptions
    advantages: torch.Tensor  # (N,) or (N, T) on the model's device
    mask: torch.Tensor  # (N, T) the loss mask
    ref_logp: torch.Tensor | None  # (N, T)
    dtype: torch.dtype | None  # the forwards' autocast dtype
    correction: Correction | None = None  # None: off, or nothing to correct
    bypass: bool = False  # the ratio's anchor is the sampler's log-probs (`--proximal behaviour`)
    keep: torch.Tensor | None = None  # (N, T) bool: the high-entropy tokens (None: all)
    threshold: float | None = None  # their entropy threshold
    token_advantages: torch.Tensor | None = None  # (N, T) with a teacher (None: `advantages`)
    teacher: TeacherLoss | None = None  # --teacher-loss jsd
    router_aux: float = 0.0  # the weight of the routers' balancing loss (0: off)


def _backward(
    cfg: RunConfig,
    policy,
    plan: Minibatch,
    inputs: _LossInputs,
    scaler: torch.amp.GradScaler | None,
    *,
    first_epoch: bool = True,
    bonus: float | None = None,
    selections: list[torch.Tensor | None] | None = None,
    watch: TokenWatch | None = None,
) -> PassSums:
    """Forward and backward of every pass of a minibatch, gradients accumulated; what they add
    up to on this rank (a lockstep filler adds nothing).

    With a correction, each chunk's weight (`grouprl.core.correction_weights`) multiplies its
    objective term: from the trainer's old_logp against the sampler's, or in bypass mode from
    this forward's (detached) log-probs, as verl's bypass mode computes it. The high-entropy
    tokens (`inputs.keep`) and `selections` (Clip-Cov's held back, KL-Cov's penalised) weigh in
    too (`_selection_weight`). `bonus` (None: none): the loss minus bonus · Σ H over the kept
    trained tokens / the minibatch's trained tokens; H is summed for the metrics. With
    --teacher-loss jsd the loss adds coef · Σ JSD over the trained positions / the same count."""
    device = model_device(policy)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    sums = torch.zeros(len(LossStats.SUMS), dtype=torch.float64, device=device)
    extremes = torch.full((len(LossStats.EXTREMES),), -math.inf, dtype=torch.float64, device=device)
    trained_rows, applied, mismatch = 0, CorrectionSums(), MismatchSums()
    h_sum, j_sum, a_sum = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(3))
    h_tokens = j_tokens = a_rows = 0
    for i, chunk in enumerate(plan.chunks):
        logp, entropy, jsd, aux = _forward(cfg, policy, chunk, inputs, bonus is not None)
        sampled, chunk_mask = chunk.rollout, inputs.mask[chunk.rows]
        keep = None if inputs.keep is None else inputs.keep[chunk.rows]
        chosen = None if selections is None else selections[i]
        weight, done = _token_weight(cfg, inputs, chunk, logp, keep, chosen)
        applied = applied + done if chunk.weight else applied
        if inputs.bypass and first_epoch and chunk.weight:
            mismatch += logp_mismatch(sampled.sampler_logp, logp.detach(), chunk_mask)
        ref_logp = None if inputs.ref_logp is None else inputs.ref_logp[chunk.rows]
        given = inputs.advantages if inputs.token_advantages is None else inputs.token_advantages
        out = policy_loss(logp, sampled.old_logp, given[chunk.rows], chunk_mask,
                          options=inputs.options, ref_logp=ref_logp, num_tokens=plan.num_tokens,
                          num_seqs=plan.num_seqs, token_weight=weight,
                          penalty_mask=chosen if cfg.objective == "kl_cov" else None)  # fmt: skip
        if watch is not None and chunk.weight:  # what the viewer shows of this pass's rows
            watch.see(chunk.rows, logp, sampled.old_logp, given[chunk.rows], chunk_mask, weight,
                      chosen if cfg.objective == "kl_cov" else None)  # fmt: skip
        loss = out.loss
        if jsd is not None:  # distillation's divergence over the trained positions
            total = torch.where(chunk_mask, jsd, 0.0).sum()
            loss = loss + inputs.teacher.coef * total / plan.num_tokens
            j_sum, j_tokens = (j_sum + total.detach() * chunk.weight,
                               j_tokens + int(chunk_mask.sum()) * chunk.weight)  # fmt: skip
        if aux is not None:  # the routers' balancing loss, weighted by the pass's rows
            share = len(chunk.rows) / max(plan.num_rows, 1)
            loss = loss + inputs.router_aux * aux * share
            a_sum, a_rows = (a_sum + aux.detach() * len(chunk.rows) * chunk.weight,
                             a_rows + len(chunk.rows) * chunk.weight)  # fmt: skip
        if entropy is not None:  # the bonus over the kept trained tokens
            total, tokens = _entropy_term(entropy, chunk_mask, keep)
            if bonus:  # the adaptive coefficient's 0 only measures: no backward through H
                loss = loss - bonus * total / plan.num_tokens
            h_sum, h_tokens = (
                h_sum + total.detach() * chunk.weight,
                h_tokens + tokens * chunk.weight,
            )
        loss_total = loss.detach()
        loss = loss if chunk.weight == 1.0 else loss * chunk.weight
        (loss if scaler is None else scaler.scale(loss)).backward()
        if chunk.weight:
            loss_sum += loss_total
            sums += out.stats.sums()
            extremes = torch.maximum(extremes, out.stats.extremes())
            trained_rows += len(chunk.rows)
    shared = torch.cat([loss_sum[None], sums, h_sum[None], j_sum[None], a_sum[None]]).tolist()
    return PassSums(shared[0], shared[1:-3], float(trained_rows), float(plan.num_rows),
                    extremes.cpu(), applied, mismatch, (shared[-3], float(h_tokens)),
                    (shared[-2], float(j_tokens)), (shared[-1], float(a_rows)))  # fmt: skip


def _forward(
    cfg: RunConfig, policy, chunk, inputs: _LossInputs, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """A pass's forward: the log-probs (n, T) of its rows, their entropies (or None), with
    --teacher-loss jsd the divergence from the teacher at each position (or None), and with a
    balancing loss its value over the pass's tokens (`grouprl.core.load_balancing_loss`; or
    None). Under a routes session (`grouprl.train.routing`) its rows' routes are recorded or
    replayed."""
    device = model_device(policy)
    with (
        autocast(device, inputs.dtype),
        _recomputing(cfg, policy),
        adapter_dropout(policy, cfg.lora_dropout > 0),
        routes.forwarding(chunk.rows),
        routes.collecting(inputs.router_aux != 0) as gates,
    ):
        divergence = None if inputs.teacher is None else inputs.teacher.divergence(chunk.rollout)
        out = logprobs(policy, chunk.rollout, temperature=cfg.temperature, buckets=chunk.buckets,
                       packs=chunk.packs, with_entropy=with_entropy, divergence=divergence)  # fmt: skip
    out = list(out) if isinstance(out, tuple) else [out]
    logp = out.pop(0)
    entropy = out.pop(0) if with_entropy else None
    jsd = out.pop(0) if divergence is not None else None
    aux = load_balancing_loss(gates, routes.tap_of(policy).top_k) if gates else None
    return logp, entropy, jsd, aux


def _token_weight(
    cfg: RunConfig,
    inputs: _LossInputs,
    chunk,
    logp: torch.Tensor,
    keep: torch.Tensor | None,
    chosen: torch.Tensor | None,
) -> tuple[torch.Tensor | None, CorrectionSums]:
    """A pass's per-token weight of the objective (None: all 1): the selections'
    (`_selection_weight`) times the off-policy correction's, from the trainer's old_logp
    against the sampler's or in bypass mode from this forward's (detached) log-probs; and what
    the correction did."""
    weight = _selection_weight(cfg, keep, chosen, logp.dtype)
    if inputs.correction is None:
        return weight, CorrectionSums()
    sampled = chunk.rollout
    proximal = logp.detach() if inputs.bypass else sampled.old_logp
    corrected, done = correction_weights(
        proximal, sampled.sampler_logp, inputs.mask[chunk.rows], inputs.correction, logp=logp,
        advantages=inputs.advantages[chunk.rows],
    )  # fmt: skip
    return (corrected if weight is None else weight * corrected), done


def _zero_gradients(params: list[nn.Parameter]) -> None:
    """A zero gradient for every parameter without one (an optimizer step still moves AdamW's
    moments and step count, as the full computation's would)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def _entropy_term(
    entropy: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor | None
) -> tuple[torch.Tensor, int]:
    """Σ H over a pass's kept trained tokens (with its gradient), and their count."""
    acting = mask if keep is None else mask & keep
    return torch.where(acting, entropy, 0.0).sum(), int(acting.sum())


def _selection_weight(
    cfg: ObjectiveOptions,
    keep: torch.Tensor | None,
    chosen: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """A pass's token weight from its selections (None: all 1): the high-entropy tokens keep
    theirs, the tokens Clip-Cov holds back get 0."""
    weight = None if keep is None else keep.to(dtype)
    if chosen is not None and cfg.objective == "clip_cov":
        held = (~chosen).to(dtype)
        weight = held if weight is None else weight * held
    return weight


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    *,
    max_norm: float,
    scaler: torch.amp.GradScaler | None,
    loss: float,
) -> float | None:
    """Unscale (fp16), clip to `max_norm` and step. Returns the gradient norm before clipping,
    or None when the step was skipped because the loss (the global minibatch's) or the gradient
    norm is not finite."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
        grad_norm = grad_norm.full_tensor()
    if scaler is not None:  # skips the step itself when the scaled gradients overflowed
        scaler.step(optimizer)  # (an overflow is how the scale finds its level: no alarm)
        scaler.update()
        finite = math.isfinite(loss)  # a NaN loss, though, is nothing a smaller scale can fix
    else:
        finite = math.isfinite(loss) and math.isfinite(float(grad_norm))
        if finite:
            optimizer.step()
    return float(grad_norm) if finite else None


def _recomputing(cfg: ComputeOptions, policy: nn.Module) -> contextlib.AbstractContextManager:
    """Gradient checkpointing's recompute; without it, LoRA layers' adapters folded into their
    base products (`folded_adapters`; not under checkpointing, whose recompute in backward
    must run the forward the pass ran)."""
    if cfg.gradient_checkpointing:
        return checkpointing.recomputing(policy)
    return folded_adapters(policy)


def grad_scaler(dtype: torch.dtype | None, device: torch.device) -> torch.amp.GradScaler | None:
    """A dynamic loss scaler when forward passes run in fp16 (`dtype`), else None.

    fp16 has a narrow exponent range: small gradients of fp16 activations flush to zero and large
    ones overflow. Scaling the loss up before backward and the gradients down before the step
    keeps them representable; a step whose gradients overflowed is skipped and the scale lowered
    (torch.amp's usual recipe). bf16 has fp32's range and needs none.
    """
    if dtype != torch.float16:
        return None
    return torch.amp.GradScaler(device.type)


def make_optimizer(cfg: UpdateOptions, policy: nn.Module) -> torch.optim.AdamW:
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
