"""The pieces TRL's RLOOTrainer needs, hand-numbered: the unnormalised sequence ratio
(`sequence_sum`), advantages whitened over the batch (`whiten`), and the KL as a reward penalty
(`kl_reward_penalty`)."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl.core import group_advantages, kl_reward_penalty, log_ratio


def test_the_sequence_sum_ratio_is_the_whole_sequences_probability_ratio():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -0.2, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # row 0: (0.5) + (−1.0) + 0 = −0.5 on each token; row 1: (−0.2) + (−0.5) = −0.7, 0 on padding
    got = log_ratio(logp, old, mask, level="sequence_sum")
    want = torch.tensor([[-0.5, -0.5, -0.5], [-0.7, -0.7, 0.0]], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=0, atol=1e-15)  # sums of 3 float64 terms
    gspo = log_ratio(logp, old, mask, level="sequence")  # GSPO's divides by the length
    assert torch.allclose(gspo[:, 0], want[:, 0] / torch.tensor([3.0, 2.0], dtype=torch.float64))


def test_whitened_rloo_advantages_are_trls_normalize_advantages():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    # leave-one-out: group 0: 1 − 1/3, 0 − 2/3, 0 − 2/3, 1 − 1/3; group 1: 2 − 2/3, 0 − 4/3, 1 − 1, 1 − 1
    loo = torch.tensor(
        [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [4 / 3, -4 / 3, 0.0, 0.0]], dtype=torch.float64
    )
    assert torch.allclose(group_advantages(rewards, scale="none", estimator="rloo"), loo)
    mean = loo.mean()  # 0: each group's leave-one-out advantages sum to 0
    std = math.sqrt(((loo - mean) ** 2).sum() / 7)  # unbiased, over the 8 completions
    want = (loo - mean) / (std + 1e-4)
    got = group_advantages(rewards, scale="whiten", estimator="rloo", unbiased_std=True)
    assert torch.allclose(got, want, rtol=0, atol=1e-15)


def test_whitening_leaves_unscored_completions_out_and_at_zero():
    rewards = torch.tensor([[1.0, 0.0, float("nan")], [3.0, 1.0, 2.0]], dtype=torch.float64)
    loo = torch.tensor([[1.0, -1.0, 0.0], [1.5, -1.5, 0.0]], dtype=torch.float64)  # n = 2, then 3
    valid = torch.tensor([1.0, -1.0, 1.5, -1.5, 0.0], dtype=torch.float64)  # 5 scored
    std = math.sqrt((valid**2).sum() / 5)  # population; the mean is 0
    got = group_advantages(rewards, scale="whiten", estimator="rloo")
    assert got[0, 2] == 0
    assert torch.allclose(got, loo / (std + 1e-4), rtol=0, atol=1e-15)


def test_the_kl_reward_penalty_is_k1_summed_over_trained_tokens():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -9.0], [-0.25, -1.0, -0.5]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    # row 0: 0.5 + (−1.0) = −0.5 (the third token is not trained); row 1: −0.25 + 0.5 + 0 = 0.25
    assert torch.equal(kl_reward_penalty(old, ref, mask), torch.tensor([-0.5, 0.25]))
    with pytest.raises(ValueError):
        kl_reward_penalty(old, ref[:, :2], mask)
