"""On-policy distillation (`grouprl.core.distill`): the per-token advantages and the reverse-KL
estimate by hand, and `policy_loss` with per-token advantages."""

import math

import pytest
import torch

from grouprl.core import distillation_advantages, generalized_jsd, policy_loss, reverse_kl

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


def _log(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, **F64).log()


def test_generalized_jsd_by_hand():
    """π_S = (1/2, 1/2), π_T = (1/4, 3/4): the endpoints are TRL's forward and reverse KL, and
    β = 1/2 mixes them through M = (3/8, 5/8)."""
    s, t = _log(0.5, 0.5), _log(0.25, 0.75)
    forward = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)  # KL(T ‖ S)
    reverse = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # KL(S ‖ T)
    kl_t = 0.25 * math.log(0.25 / 0.375) + 0.75 * math.log(0.75 / 0.625)  # KL(T ‖ M)
    kl_s = 0.5 * math.log(0.5 / 0.375) + 0.5 * math.log(0.5 / 0.625)  # KL(S ‖ M)
    # a few float64 logs, products and sums of terms below 1: 16 roundings of 2^-53 each
    tol = dict(rtol=0, atol=16 * 2**-53)
    torch.testing.assert_close(generalized_jsd(s, t, 0.0), torch.tensor(forward, **F64), **tol)
    torch.testing.assert_close(generalized_jsd(s, t, 1.0), torch.tensor(reverse, **F64), **tol)
    expected = 0.5 * kl_t + 0.5 * kl_s
    torch.testing.assert_close(generalized_jsd(s, t, 0.5), torch.tensor(expected, **F64), **tol)
    # a teacher equal to the student: 0, but for the mixture's logaddexp's rounding
    assert abs(float(generalized_jsd(t, t, 0.3))) <= 8 * 2**-53
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        generalized_jsd(s, t, 1.5)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_generalized_jsd_gradient(beta):
    """The gradient in the student's logits z: ∂/∂z_j = π_j (g_j − Σ_i π_i g_i) with
    g = ∂JSD/∂π_S = (1 − β)·log(π_S / M) for β < 1 (the mixture's terms cancel), and
    log(π_S / π_T) + 1 at β = 1 (the reverse KL)."""
    z = torch.tensor([[0.3, -1.2, 2.0], [0.0, 0.5, -0.5]], **F64, requires_grad=True)
    teacher = torch.tensor([[1.0, 0.0, -1.0], [2.0, -2.0, 0.1]], **F64).log_softmax(-1)
    student = z.log_softmax(-1)
    generalized_jsd(student, teacher, beta).sum().backward()
    p, q = student.detach().exp(), teacher.exp()
    if beta == 0.0:
        g = -q / p
    elif beta == 1.0:
        g = (p / q).log() + 1
    else:
        g = (1 - beta) * (p / ((1 - beta) * p + beta * q)).log()
    expected = p * (g - (p * g).sum(-1, keepdim=True))
    # softmax, logs and 3-term sums in float64, each entry below 4 in magnitude: 64·2^-53
    torch.testing.assert_close(z.grad, expected, rtol=0, atol=64 * 2**-53)


def test_generalized_jsd_equals_trl():
    """TRL 1.16's own `GKDTrainer.generalized_jsd_loss` (trl/experimental/gkd/gkd_trainer.py)
    on random logits: its batchmean over the valid tokens is the mean of ours."""
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64)
    teacher = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64)
    labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 0, 1]])
    for beta in (0.0, 0.25, 0.5, 1.0):
        theirs = gkd.GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=beta,
                                                     temperature=0.9)  # fmt: skip
        per_token = generalized_jsd((student / 0.9).log_softmax(-1),
                                    (teacher / 0.9).log_softmax(-1), beta)  # fmt: skip
        ours = per_token[labels != -100].mean()
        # the same float64 operations in another order (logaddexp against logsumexp of a
        # stack): a few roundings per vocabulary entry over 7 entries and 8 tokens
        torch.testing.assert_close(ours, theirs, rtol=64 * 2**-53, atol=0)
