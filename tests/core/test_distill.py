"""On-policy distillation (`grouprl.core.distill`): the per-token advantages and the reverse-KL
estimate by hand, and `policy_loss` with per-token advantages."""

import pytest
import torch

from grouprl.core import distillation_advantages, policy_loss, reverse_kl

pytestmark = pytest.mark.numerics

F64 = dict(dtype=torch.float64)
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_distillation_advantages_by_hand():
    sampler = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 9.0]], **F64)
    teacher = torch.tensor([[-0.5, -2.5, -0.5], [-1.1, -1.0, -9.0]], **F64)
    adv = torch.tensor([1.0, -1.0], **F64)
    # w·Â + c·(log π_T − log π_b): gaps [[.5, −.5, 0], [−1, 2, -]]; every value here is a
    # dyadic fraction, so float64 computes them exactly
    a = distillation_advantages(adv, sampler, teacher, MASK, coef=0.5, task_weight=2.0)
    assert torch.equal(a, torch.tensor([[2.25, 1.75, 2.0], [-2.5, -1.0, 0.0]], **F64))
    alone = distillation_advantages(adv, sampler, teacher, MASK, coef=1.0, task_weight=0.0)
    assert torch.equal(alone, torch.tensor([[0.5, -0.5, 0.0], [-1.0, 2.0, 0.0]], **F64))
    gap, tokens = reverse_kl(sampler, teacher, MASK)  # Σ (log π_b − log π_T) = −.5 + .5 + 0 + 1 − 2
    assert (tokens, gap) == (5, -1.0)
    # the teacher is the student: the task's advantages, and no KL
    same = distillation_advantages(adv, sampler, sampler, MASK)
    assert torch.equal(same, torch.where(MASK, adv[:, None].expand(2, 3), 0.0))


def test_policy_loss_takes_per_token_advantages():
    """(N, T) advantages: each token's term is its own; (N,) is the same loss as its broadcast."""
    logp = torch.tensor([[0.4, 0.2, 0.1], [0.3, 0.1, 0.5]], **F64).log()
    old = torch.tensor([[0.2, 0.2, 0.2], [0.2, 0.2, 0.5]], **F64).log()
    adv = torch.tensor([1.0, -1.0], **F64)
    per_row = policy_loss(logp, old, adv, MASK, agg="token_mean").loss
    broadcast = policy_loss(
        logp, old, adv[:, None].expand(2, 3).clone(), MASK, agg="token_mean"
    ).loss
    assert torch.equal(per_row, broadcast)
    # token-mean GPG with Â_t: loss = −Σ Â_t·log π_t / 5, gradient −Â_t / 5
    a = torch.tensor([[1.0, 2.0, -1.0], [0.5, -3.0, 7.0]], **F64)
    x = logp.clone().requires_grad_(True)
    out = policy_loss(x, old, a, MASK, objective="gpg", agg="token_mean")
    out.loss.backward()
    terms = torch.where(MASK, a * logp, 0.0)
    expected = -terms.sum() / 5
    # 5 products, a sum and a division in float64, in other orders: 8·2^-53 of Σ|terms| / 5
    bound = 8 * 2**-53 * float(terms.abs().sum()) / 5
    assert abs(float(out.loss - expected)) <= bound
    # each entry −Â_t · (1/5): two roundings at most
    torch.testing.assert_close(x.grad, torch.where(MASK, -a / 5, 0.0), rtol=4 * 2**-53, atol=0)
    with pytest.raises(ValueError, match="weighs whole sequences"):
        policy_loss(logp, old, a, MASK, objective="vespo")
