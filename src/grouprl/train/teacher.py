"""On-policy distillation's teacher in the update (`--teacher`): its metrics, and the
generalized JSD loss (`--teacher-loss jsd`), whose divergence is computed where the policy's
head runs, one chunk of positions at a time (`grouprl.rollout.logprobs.completion_logprobs`'s
`divergence`), against the teacher's next-token distributions on the same pass's rows.

The other loss, the per-token reverse-KL advantage, needs only the teacher's log-probs of the
sampled tokens, computed once per step (`grouprl.train.step`); this one needs its whole
distributions, so the teacher's decoder runs with each pass (once per epoch) and its head with
each chunk, without gradients: no (N, T, vocab) tensor is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from grouprl.core import generalized_jsd, mean_over, reverse_kl
from grouprl.rollout import Rollout
from grouprl.rollout.logprobs import Divergence, next_token_log_softmax
from grouprl.train.parallel.distributed import SINGLE, Dist


@dataclass(frozen=True)
class TeacherLoss:
    """--teacher-loss jsd: coef · Σ JSD_β over a minibatch's trained positions / its trained
    tokens (TRL GKDTrainer's sum over the valid tokens / num_items_in_batch), at the run's
    temperature for both distributions (as TRL divides both logits by it)."""

    model: nn.Module
    beta: float
    coef: float
    temperature: float

    def divergence(self, rollout: Rollout) -> Divergence:
        """The JSD at each of `rollout`'s positions against the teacher on the same rows."""
        teacher = next_token_log_softmax(self.model, rollout, temperature=self.temperature)

        def jsd(student: torch.Tensor, start: int) -> torch.Tensor:
            theirs = teacher(start, start + student.shape[0]).to(student.dtype)
            return generalized_jsd(student, theirs, self.beta)

        return jsd


def teacher_metrics(
    rollout: Rollout,
    teacher_logp: torch.Tensor | None,
    mask: torch.Tensor,
    jsd: tuple[float, float] | None,
    dist: Dist = SINGLE,
) -> dict[str, float]:
    """With a teacher, over the whole job: `teacher_kl`, the student's reverse KL to it per
    trained token (k1 on the student's own samples; with its log-probs `teacher_logp`), or
    `teacher_jsd`, the jsd loss's mean per trained position over the update's passes (`jsd`:
    the passes' sum and token count, already over every rank)."""
    if jsd is not None:
        return {"teacher_jsd": mean_over(*jsd)}
    if teacher_logp is None:
        return {}
    gap, tokens = reverse_kl(rollout.sampler_logp, teacher_logp, mask)
    if dist.enabled:
        gap, tokens = dist.all_reduce(torch.tensor([gap, tokens], dtype=torch.float64)).tolist()
    return {"teacher_kl": mean_over(gap, tokens)}
