"""On-policy distillation: a teacher's per-token log-probs on the student's own samples as a
dense reward (Agarwal et al., "On-Policy Distillation of Language Models", arXiv 2306.13649;
Thinking Machines, "On-Policy Distillation", 2025, and its tinker-cookbook
`distillation/train_on_policy.py::incorporate_kl_penalty`).

The student samples; the teacher scores each sampled token; the negative reverse KL, which the
sample estimates, is each token's reward, credited to that token alone (discount 0):

    A_t = w · Â_i + c · (log π_T(y_t) − log π_b(y_t))

with π_b the sampler's log-probs (Tinker's choice: the sampling log-probs, not a recomputed
forward), Â_i the task's group advantage (w = 0: distillation alone, Tinker's zero-reward
datasets) and c the KL coefficient (Tinker's kl_penalty_coef, 1). The objective then treats
A_t as any advantage (the clip, CISPO, ...). Teacher and student must share a tokenizer: the
teacher scores the student's token ids.

The other loss (`generalized_jsd`, `--teacher-loss jsd`): the whole next-token distributions
compared at every position of the student's samples, a supervised loss with no ratio and no
sampling noise (GKD, Agarwal et al.; TRL's GKDTrainer).
"""

import math

import torch

from .advantages import over_tokens

Tensor = torch.Tensor


def distillation_advantages(
    advantages: Tensor,  # (N,) the task's, or (N, T) per turn
    sampler_logp: Tensor,  # (N, T) log π_b of the sampled tokens
    teacher_logp: Tensor,  # (N, T) log π_T of the same tokens
    mask: Tensor,  # (N, T) the trained tokens
    *,
    coef: float = 1.0,
    task_weight: float = 1.0,
) -> Tensor:
    """(N, T) per-token advantages w·Â_i + c·(log π_T − log π_b), 0 off the mask (detached)."""
    gap = teacher_logp.detach().double() - sampler_logp.detach().double()
    out = task_weight * over_tokens(advantages.detach().double()) + coef * gap
    return torch.where(mask.bool(), out, 0.0).to(sampler_logp.dtype)


def reverse_kl(sampler_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> tuple[float, int]:
    """Σ (log π_b − log π_T) over the trained tokens (k1: an unbiased estimate of the
    student's KL(π_b ‖ π_T) per token, from its own samples) and their count."""
    mask = mask.bool()
    gap = sampler_logp.detach().double() - teacher_logp.detach().double()
    return float(torch.where(mask, gap, 0.0).sum()), int(mask.sum())


def generalized_jsd(student_logp: Tensor, teacher_logp: Tensor, beta: float) -> Tensor:
    """Per position (...,): the generalized Jensen-Shannon divergence between the student's and
    the teacher's next-token distributions, summed over the vocabulary (the last dimension of
    both log-softmaxes, (..., V)); GKD's Eq. 1 (arXiv 2306.13649) as TRL 1.16 computes it
    (`trl/experimental/gkd/gkd_trainer.py::generalized_jsd_loss`):

        M = (1 − β)·π_S + β·π_T,   JSD_β = β·KL(π_T ‖ M) + (1 − β)·KL(π_S ‖ M)

    with TRL's endpoints: β = 0 is the forward KL(π_T ‖ π_S) and β = 1 the reverse KL(π_S ‖ π_T)
    (JSD_β itself tends to 0 at both ends). Differentiable in both; the caller detaches the
    teacher. Its gradient in the student's probabilities is (1 − β)·log(π_S / M) (β < 1)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    if beta == 0.0:
        return _kl(teacher_logp, student_logp)
    if beta == 1.0:
        return _kl(student_logp, teacher_logp)
    mixture = torch.logaddexp(student_logp + math.log1p(-beta), teacher_logp + math.log(beta))
    return beta * _kl(teacher_logp, mixture) + (1.0 - beta) * _kl(student_logp, mixture)


def _kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p ‖ q) over the last dimension from log-probabilities, 0·log 0 = 0."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), 0.0).sum(-1)
