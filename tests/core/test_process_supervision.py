"""DeepSeekMath's process supervision (arXiv 2402.03300, §4.1.3; REFERENCES.md): step rewards
normalised over every step of their group, a step's advantage the sum of the normalised rewards
of the steps at or after it. Hand-computed numbers; with one step each it is outcome
supervision's GRPO, bit for bit.

Tolerances: float64, a handful of O(1) values and a few operations: within 1e-12."""

import math

import torch

from grouprl.core import group_advantages, process_advantages

NAN = math.nan


def test_hand_computed_group_of_two():
    # completion 1 has steps rewarded 1 and 0, completion 2 one step rewarded 0 (no second).
    # The group's steps {1, 0, 0}: mean 1/3, population std sqrt(2/9) = sqrt(2)/3; normalised
    # (eps 0): 1 -> (2/3)/(sqrt(2)/3) = sqrt(2), 0 -> -1/sqrt(2). Sums from each step on:
    # completion 1: sqrt(2) - 1/sqrt(2) = 1/sqrt(2), then -1/sqrt(2); completion 2: -1/sqrt(2).
    rewards = torch.tensor([[[1.0, 0.0], [0.0, NAN]]], dtype=torch.float64)
    out = process_advantages(rewards, eps=0.0)
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(out, torch.tensor([[[s, -s], [-s, 0.0]]], dtype=torch.float64),
                               rtol=0, atol=1e-12)  # fmt: skip


def test_the_sample_std_and_eps():
    # steps {2, 0}: mean 1; sample std sqrt(2); eps 1: normalised ±1 / (sqrt(2) + 1)
    rewards = torch.tensor([[[2.0], [0.0]]], dtype=torch.float64)
    out = process_advantages(rewards, eps=1.0, unbiased_std=True)
    d = 1 / (math.sqrt(2) + 1)
    torch.testing.assert_close(out, torch.tensor([[[d], [-d]]], dtype=torch.float64),
                               rtol=0, atol=1e-12)  # fmt: skip


def test_one_step_each_is_outcome_grpo_bit_for_bit():
    torch.manual_seed(0)
    rewards = torch.rand(5, 4, dtype=torch.float64)
    rewards[1] = 0.1  # a group without spread: exact zeros in both
    rewards[2, 3] = NAN  # unscored: 0, left out of the statistics, in both
    for unbiased in (False, True):
        outcome = group_advantages(rewards, eps=1e-4, unbiased_std=unbiased)
        process = process_advantages(rewards[..., None], eps=1e-4, unbiased_std=unbiased)
        assert torch.equal(process[..., 0], outcome)


def test_an_outcome_reward_on_any_step_is_grpo_bit_for_bit_up_to_that_step():
    torch.manual_seed(1)
    outcome = torch.rand(3, 4, dtype=torch.float64)
    outcome[0, 1] = NAN  # unscored: 0 on every step
    last = torch.tensor([[2, 0, 1, 2], [0, 0, 0, 0], [1, 2, 2, 1]])  # each reward's step
    steps = torch.full((3, 4, 3), NAN, dtype=torch.float64)
    steps.scatter_(-1, last[..., None], outcome[..., None])
    got = process_advantages(steps, eps=1e-4)
    want = group_advantages(outcome, eps=1e-4)
    upto = torch.arange(3)[None, None, :] <= last[..., None]
    assert torch.equal(got, torch.where(upto, want[..., None], 0.0))


def test_steps_without_spread_give_exact_zeros_and_absent_steps_zero():
    rewards = torch.tensor([[[0.1, 0.1], [0.1, NAN]]], dtype=torch.float64)
    assert torch.equal(process_advantages(rewards), torch.zeros(1, 2, 2, dtype=torch.float64))
