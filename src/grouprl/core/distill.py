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
"""

import torch

Tensor = torch.Tensor


def distillation_advantages(
    advantages: Tensor,  # (N,) the task's
    sampler_logp: Tensor,  # (N, T) log π_b of the sampled tokens
    teacher_logp: Tensor,  # (N, T) log π_T of the same tokens
    mask: Tensor,  # (N, T) the trained tokens
    *,
    coef: float = 1.0,
    task_weight: float = 1.0,
) -> Tensor:
    """(N, T) per-token advantages w·Â_i + c·(log π_T − log π_b), 0 off the mask (detached)."""
    gap = teacher_logp.detach().double() - sampler_logp.detach().double()
    per_token = task_weight * advantages.detach().double()[:, None] + coef * gap
    return torch.where(mask.bool(), per_token, 0.0).to(sampler_logp.dtype)


def reverse_kl(sampler_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> tuple[float, int]:
    """Σ (log π_b − log π_T) over the trained tokens (k1: an unbiased estimate of the
    student's KL(π_b ‖ π_T) per token, from its own samples) and their count."""
    mask = mask.bool()
    gap = sampler_logp.detach().double() - teacher_logp.detach().double()
    return float(torch.where(mask, gap, 0.0).sum()), int(mask.sum())
