"""Every number in ../shared/REFERENCES.md "Numbers a test can check" (1–11), computed by core.

Tolerances: everything here is float64 on a handful of O(1) values, a few operations each, so
a computed number is within ~1e-15 of the exact one: 1e-12 holds on any CPU and tells apart
any formula that is wrong. Sums over 2000 terms of O(0.1) (number 4) are off by at most
2000 · 1.1e-16 · 200 ≈ 4e-11: 1e-9. Numbers the references print to 4 or 5 digits are matched
to half a unit of their last digit (5e-5, 5e-8)."""

import math

import pytest
import torch

from grouprl.core import (
    aggregate,
    clipped_objective,
    group_advantages,
    kl_penalty,
    log_ratio,
    overlong_penalty,
    policy_loss,
)


def t(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64)


def assert_close(actual: torch.Tensor, expected, atol: float = 1e-12) -> None:
    torch.testing.assert_close(actual, t(expected).broadcast_to(actual.shape), rtol=0, atol=atol)


# 1. Rewards [1,0,1,0]: population std (eps → 0) → [1,−1,1,−1]; sample std → ±0.8660.
@pytest.mark.numerics
def test_1_balanced_group():
    rewards = t([[1, 0, 1, 0]])
    assert torch.equal(group_advantages(rewards, eps=0.0), t([[1, -1, 1, -1]]))
    assert_close(
        group_advantages(rewards, eps=0.0, unbiased_std=True), t([[1, -1, 1, -1]]) * 0.75**0.5
    )
    assert_close(
        group_advantages(rewards, eps=0.0, unbiased_std=True), [[0.8660, -0.8660] * 2], atol=5e-5
    )
    # The default eps = 1e-4 is added to the std: 0.5 / 0.5001.
    assert_close(group_advantages(rewards), t([[1, -1, 1, -1]]) * (0.5 / 0.5001))


# 2. [1,0,0,0]: population std → [1.7321, −0.5774 ×3]; no scaling → [0.75, −0.25 ×3]; RLOO → [1, −1/3 ×3].
@pytest.mark.numerics
def test_2_one_success_in_four():
    rewards = t([[1, 0, 0, 0]])
    assert_close(group_advantages(rewards, eps=0.0), [[3**0.5, -(3**-0.5), -(3**-0.5), -(3**-0.5)]])
    assert_close(
        group_advantages(rewards, eps=0.0), [[1.7321, -0.5774, -0.5774, -0.5774]], atol=5e-5
    )
    assert_close(group_advantages(rewards, scale="none"), [[0.75, -0.25, -0.25, -0.25]])
    assert_close(
        group_advantages(rewards, scale="none", estimator="rloo"), [[1, -1 / 3, -1 / 3, -1 / 3]]
    )


# 3. All rewards equal → all advantages exactly 0 → zero gradient.
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -2.7, 1e6])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_3_equal_rewards_give_exact_zeros_and_no_gradient(value, estimator, scale):
    rewards = torch.full((1, 3), value, dtype=torch.float64)  # 3 × 0.1 / 3 is not 0.1 in floats
    advantages = group_advantages(rewards, estimator=estimator, scale=scale).flatten()
    assert advantages.eq(0).all()
    logp = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = policy_loss(
        logp,
        logp.detach() + 0.3 * torch.randn(3, 4, dtype=torch.float64),
        advantages,
        torch.ones(3, 4),
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and logp.grad.eq(0).all()


# 4. Mean per-token log-ratio 0.1 → sequence ratio e^0.1 for 5 and for 2000 tokens; the product of
#    the 2000 token ratios is e^200 (in log space).
@pytest.mark.numerics
def test_4_sequence_ratio_does_not_grow_with_length():
    old_logp = torch.full((2, 2000), -1.0, dtype=torch.float64)
    logp = old_logp + 0.1
    mask = torch.arange(2000)[None] < t([5, 2000])[:, None]
    seq = log_ratio(logp, old_logp, mask, level="sequence")
    assert_close(seq[mask], [0.1], atol=1e-12)
    assert_close(seq[:, 0].exp(), [math.exp(0.1)] * 2, atol=1e-12)
    assert abs(math.exp(0.1) - 1.10517) < 5e-6
    token_sum = log_ratio(logp, old_logp, mask, level="token").sum(-1)  # log of the product
    assert_close(token_sum, [0.5, 200.0], atol=1e-9)
    assert torch.isinf(token_sum.float().exp()[1])  # why it must stay in log space


# 5. Two tokens 0.20→0.40 and 0.50→0.25: token ratios 2.0, 0.5, sequence ratio 1.0; with ε = 0.2
#    the token clip binds on token 1 for Â > 0 and on token 2 for Â < 0; the sequence is not clipped.
@pytest.mark.numerics
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_5_two_token_example(advantage):
    old_logp, mask = t([[0.20, 0.50]]).log(), torch.ones(1, 2, dtype=torch.bool)
    logp = t([[0.40, 0.25]]).log().requires_grad_()
    assert_close(log_ratio(logp, old_logp, mask).exp(), [[2.0, 0.5]], atol=1e-12)
    assert_close(log_ratio(logp, old_logp, mask, level="sequence").exp(), [[1.0, 1.0]], atol=1e-12)

    token = policy_loss(logp, old_logp, t([advantage]), mask, level="token")
    token.loss.backward()
    bound = 0 if advantage > 0 else 1  # the token whose ratio the clip cuts
    assert logp.grad[0, bound] == 0 and logp.grad[0, 1 - bound] != 0
    high, low = (0.5, 0.0) if advantage > 0 else (0.0, 0.5)
    assert (token.clip_frac_high.item(), token.clip_frac_low.item()) == (high, low)
    # objective: Â=+1 → mean(1.2, 0.5); Â=−1 → mean(−2.0, −0.8)
    expected = (1.2 + 0.5) / 2 if advantage > 0 else (-2.0 - 0.8) / 2
    assert abs(token.loss.item() + expected) < 1e-12

    logp.grad = None
    sequence = policy_loss(logp, old_logp, t([advantage]), mask, level="sequence")
    sequence.loss.backward()
    assert sequence.clip_frac_high.item() == sequence.clip_frac_low.item() == 0.0
    assert abs(sequence.loss.item() + advantage) < 1e-12
    assert logp.grad.ne(0).all()


# 6. Log-ratios [0.1, −0.2, 0.4] → s = e^0.1 = cube root of the product of the ratios.
@pytest.mark.numerics
def test_6_geometric_mean():
    lr = t([[0.1, -0.2, 0.4]])
    s = log_ratio(lr, torch.zeros_like(lr), torch.ones(1, 3), level="sequence").exp()
    assert_close(s, [[math.exp(0.1)] * 3])
    assert_close(s, [[math.prod(math.exp(x) for x in (0.1, -0.2, 0.4)) ** (1 / 3)] * 3])
    assert abs(s[0, 0].item() - 1.10517) < 5e-6


# 7. GSPO's clip 3e-4 / 4e-4 is [0.9997, 1.0004]; s = e^0.001 with Â > 0 is clipped (zero gradient
#    for the whole completion), with Â < 0 it is not.
@pytest.mark.numerics
@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
def test_7_gspo_clip_range(level):
    assert_close(t([1 - 3e-4, 1 + 4e-4]), [0.9997, 1.0004])
    old_logp = t([[-1.0, -2.0, -0.5, -3.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    for advantage in (1.0, -1.0):
        logp = (old_logp + t([[0.003, -0.002, 0.001, 0.002]])).requires_grad_()  # mean 0.001
        out = policy_loss(
            logp, old_logp, t([advantage]), mask, level=level, clip_low=3e-4, clip_high=4e-4
        )
        out.loss.backward()
        assert_close(out.ratio_mean, math.exp(0.001))
        if advantage > 0:
            assert logp.grad.eq(0).all() and out.clip_frac_high.item() == 1.0
            assert abs(out.loss.item() + 1.0004) < 1e-12
        else:
            # loss = −s·Â, so d loss / d logp_t = s / |y| on every token
            assert_close(logp.grad, [[math.exp(0.001) / 4] * 4])
            assert out.clip_frac_low.item() == out.clip_frac_high.item() == 0.0


# 8. Clipped surrogate with ε = 0.2: ρ = 1.5 → 1.2 (Â=+1), −1.5 (Â=−1); ρ = 0.5 → 0.5, −0.8.
@pytest.mark.numerics
@pytest.mark.parametrize(
    ("ratio", "advantage", "expected"),
    [(1.5, 1.0, 1.2), (1.5, -1.0, -1.5), (0.5, 1.0, 0.5), (0.5, -1.0, -0.8)],
)
def test_8_clipped_surrogate(ratio, advantage, expected):
    assert_close(clipped_objective(t(ratio), t(advantage)), expected, atol=1e-15)
    out = policy_loss(t([[math.log(ratio)]]), t([[0.0]]), t([advantage]), torch.ones(1, 1))
    assert abs(out.loss.item() + expected) < 1e-12


# 9. k3 at d = 0.1 → 0.0048374; d = −0.1 → 0.0051709; d = 0 → 0.
@pytest.mark.numerics
def test_9_k3():
    k3 = kl_penalty(t([0.1, -0.1, 0.0]), t([0.0, 0.0, 0.0]), estimator="k3")
    assert_close(k3, [0.0048374, 0.0051709, 0.0], atol=5e-8)
    assert k3[2].item() == 0.0
    assert_close(k3, [math.exp(-0.1) + 0.1 - 1, math.exp(0.1) - 0.1 - 1, 0.0], atol=1e-15)
    d = t([0.3, -0.7])
    assert_close(kl_penalty(d, torch.zeros(2), estimator="k1"), d)
    assert_close(kl_penalty(d, torch.zeros(2), estimator="k2"), d**2 / 2)


# 10. Lengths 2 and 8: per-token weights 0.25 and 0.0625 (seq_mean_token_mean), 0.1 (token_mean).
@pytest.mark.numerics
@pytest.mark.parametrize(
    ("mode", "weights"), [("seq_mean_token_mean", (0.25, 0.0625)), ("token_mean", (0.1, 0.1))]
)
def test_10_aggregation_weights(mode, weights):
    mask = torch.arange(8)[None] < t([2, 8])[:, None]
    per_token = torch.zeros(2, 8, dtype=torch.float64, requires_grad=True)
    aggregate(per_token, mask, mode=mode).backward()
    expected = torch.where(mask, t(weights)[:, None], 0.0)
    assert_close(per_token.grad, expected, atol=1e-15)


# 11. Soft overlong penalty, L_max = 20480, L_c = 4096: 16384 → 0; 18432 → −0.5; 20480 → −1.
def test_11_overlong_penalty():
    lengths = torch.tensor([10, 16384, 18432, 20480, 30000])
    assert overlong_penalty(lengths, max_len=20480, cache_len=4096).tolist() == [
        0.0,
        0.0,
        -0.5,
        -1.0,
        -1.0,
    ]
