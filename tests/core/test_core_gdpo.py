"""GDPO's advantages (arXiv 2601.05242) on groups small enough to work out by hand.

Every comparison runs in float64 on a few O(1) values: `F64_SAME` (tests/numerics.py) bounds
their rounding; the exact-zero claims are exact."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl.core import gdpo_advantages, group_advantages
from numerics import F64_SAME

pytestmark = pytest.mark.numerics
EPS = 1e-4


def t(values):
    return torch.tensor(values, dtype=torch.float64)


# Two rewards, G = 2. Group 1: its second completion satisfies one reward, (0,0) vs (1,0);
# group 2: its second satisfies both, (0,0) vs (1,1).
COLLAPSE = t([[[0, 0], [1, 0]], [[0, 0], [1, 1]]])  # (B=2, G=2, K=2)


def test_grpo_collapses_the_two_groups_and_gdpo_keeps_them_apart():
    # GRPO on the weighted sums [0, 1] and [0, 2]: both groups give ±(about 0.7071)
    totals = COLLAPSE.sum(-1)
    grpo = group_advantages(totals, eps=EPS, unbiased_std=True)
    by_hand = [0.5 / (math.sqrt(0.5) + EPS), 1.0 / (math.sqrt(2.0) + EPS)]  # centred / (std + ε)
    assert grpo[0, 1].item() == pytest.approx(by_hand[0], rel=F64_SAME)
    assert grpo[1, 1].item() == pytest.approx(by_hand[1], rel=F64_SAME)
    assert abs(grpo[0, 1] - grpo[1, 1]) < 1e-4  # the same up to ε

    # GDPO: per reward, [0, 1] in a group → ±a with a = 0.5 / (std [0,1] + ε), std = √0.5
    a = 0.5 / (math.sqrt(0.5) + EPS)
    combined = [-a, a, -2 * a, 2 * a]  # group 1 has one moving reward, group 2 two
    batch_std = math.sqrt(sum(x * x for x in combined) / 3)  # mean 0, sample std
    expected = t([[x / (batch_std + EPS) for x in combined[:2]],
                  [x / (batch_std + EPS) for x in combined[2:]]])  # fmt: skip
    gdpo = gdpo_advantages(COLLAPSE, [1.0, 1.0], eps=EPS)
    assert torch.allclose(gdpo, expected, rtol=F64_SAME, atol=0)
    assert gdpo[1, 1] > 1.9 * gdpo[0, 1]  # satisfying both rewards is worth twice one
    assert gdpo[0, 1].item() == pytest.approx(0.5476, abs=1e-4)  # ≈ 1/√(10/3)


def test_weights_scale_each_normalised_reward():
    heavy = gdpo_advantages(COLLAPSE, [1.0, 3.0], eps=EPS)
    a = 0.5 / (math.sqrt(0.5) + EPS)
    combined = [-a, a, -4 * a, 4 * a]  # group 2: 1·a + 3·a
    batch_std = math.sqrt(sum(x * x for x in combined) / 3)
    assert heavy[1, 1].item() == pytest.approx(4 * a / (batch_std + EPS), rel=F64_SAME)
    assert heavy[0, 1].item() == pytest.approx(a / (batch_std + EPS), rel=F64_SAME)


def test_a_group_whose_rewards_are_all_constant_gets_exact_zeros():
    rewards = t([[[1, 0], [1, 0], [1, 0]],      # every reward constant: silent
                 [[0, 2], [1, 2], [1, 2]],      # reward 2 constant, reward 1 moves
                 [[0, 0], [1, 1], [0, 1]]])  # fmt: skip
    adv = gdpo_advantages(rewards, [1.0, 1.0], eps=EPS)
    assert torch.equal(adv[0], torch.zeros(3, dtype=torch.float64))
    # a reward constant in its group adds exactly nothing, whatever its value
    shifted = rewards.clone()
    shifted[1, :, 1] = -7.0
    assert torch.equal(gdpo_advantages(shifted, [1.0, 1.0], eps=EPS), adv)


def test_an_unscored_reward_counts_as_zero():
    rewards = t([[[1, 0], [0, 1]], [[1, 1], [0, 0]]])
    unscored = rewards.clone()
    unscored[0, 1, 0] = math.nan  # a None where the score was 0
    assert torch.equal(gdpo_advantages(unscored, [1.0, 0.5]), gdpo_advantages(rewards, [1.0, 0.5]))


def test_one_reward_is_grpo_with_the_sample_std():
    rewards = t([[[0.0], [1.0], [1.0], [0.5]], [[2.0], [0.0], [1.0], [1.0]]])
    adv = gdpo_advantages(rewards, [2.0], eps=EPS)
    grpo = group_advantages(2.0 * rewards[..., 0], eps=EPS, unbiased_std=True)
    assert torch.allclose(adv, grpo, rtol=F64_SAME, atol=0)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"\(B, G, K\)"):
        gdpo_advantages(t([[0, 1]]), [1.0])
    with pytest.raises(ValueError, match="weights"):
        gdpo_advantages(COLLAPSE, [1.0])
    with pytest.raises(ValueError, match="G = 1"):
        gdpo_advantages(t([[[0, 1]]]), [1.0, 1.0])
