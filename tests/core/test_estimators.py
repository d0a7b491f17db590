"""verl's other outcome estimators (`grouprl.core.estimators`): hand-computed numbers, then
parity with transcriptions of verl 0.9's `verl/trainer/ppo/core_algos.py` (and `masked_whiten`
of `verl/utils/torch_functional.py`) on random batches."""

from collections import defaultdict

import pytest
import torch

from grouprl.core.estimators import (
    gpg_advantages,
    opo_advantages,
    passk_advantages,
    reinforce_pp_advantages,
)

pytestmark = pytest.mark.numerics

F64 = dict(dtype=torch.float64)


#: Hand numbers against the float64 estimators: each side a few tens of float64 operations on
#: O(1) values, each adding at most 2^-53 relative: 64 of them, with margin.
HAND = 64 * 2**-52


def close(a, b):
    torch.testing.assert_close(a, torch.tensor(b, **F64), rtol=HAND, atol=HAND)


def summed(tokens: int) -> float:
    """The float64 bound of a statistic summed over `tokens` terms of O(1) values plus a few
    operations (whitening's mean, variance, rsqrt): (tokens + 16)·2^-52, relative and absolute."""
    return (tokens + 16) * 2**-52


def by_hand_whitened(values: list[float], tokens: list[int]) -> list[float]:
    """verl's masked_whiten of per-sequence values over their tokens, in plain floats:
    μ = ΣLv / (ΣL + 1e-8), σ² = ΣL(v − μ)² / (ΣL + 1e-8) · ΣL / (ΣL − 1), (v − μ) / √(σ² + 1e-8)."""
    n = sum(tokens)
    mean = sum(t * v for v, t in zip(values, tokens, strict=True)) / (n + 1e-8)
    var = sum(t * (v - mean) ** 2 for v, t in zip(values, tokens, strict=True)) / (n + 1e-8)
    var *= n / (n - 1)
    return [(v - mean) / (var + 1e-8) ** 0.5 for v in values]


def test_reinforce_pp_baseline_by_hand():
    # v = R − group mean: (0.5, −0.5) and (0, 0); tokens 2, 3, 1, 4 (10 in all)
    # μ ≈ (2·0.5 − 3·0.5)/10 = −0.05; σ² ≈ (2·0.55² + 3·0.45² + 0.05² + 4·0.05²)/9 = 1.225/9
    a = reinforce_pp_advantages(torch.tensor([[1.0, 0.0], [1.0, 1.0]]),
                                torch.tensor([[2, 3], [1, 4]]), baseline=True)  # fmt: skip
    want = by_hand_whitened([0.5, -0.5, 0.0, 0.0], [2, 3, 1, 4])
    close(a, [want[:2], want[2:]])  # the agreeing group: −μ/σ
    s = (1.225 / 9) ** 0.5  # and without verl's 1e-8s, within their size
    assert abs(float(a[1, 0]) - 0.05 / s) < 1e-7


def test_reinforce_pp_by_hand():
    # v = R: μ ≈ (2 + 1 + 4)/10 = 0.7; σ² ≈ (2·0.09 + 3·0.49 + 0.09 + 4·0.09)/9 = 2.1/9
    a = reinforce_pp_advantages(torch.tensor([[1.0, 0.0], [1.0, 1.0]]),
                                torch.tensor([[2, 3], [1, 4]]), baseline=False)  # fmt: skip
    want = by_hand_whitened([1.0, 0.0, 1.0, 1.0], [2, 3, 1, 4])
    close(a, [want[:2], want[2:]])
    assert abs(float(a[0, 1]) + 0.7 / (2.1 / 9) ** 0.5) < 1e-7
    # every reward equal: exact zeros; an unscored completion: 0, and out of the statistics
    assert (
        reinforce_pp_advantages(torch.ones(2, 3), torch.ones(2, 3), baseline=False).abs().sum() == 0
    )
    with_nan = reinforce_pp_advantages(torch.tensor([[1.0, 0.0], [1.0, float("nan")]]),
                                       torch.tensor([[2, 3], [1, 4]]), baseline=False)  # fmt: skip
    without = reinforce_pp_advantages(torch.tensor([[1.0, 0.0, 1.0]]), torch.tensor([[2, 3, 1]]),
                                      baseline=False)  # fmt: skip
    assert with_nan[1, 1] == 0
    close(with_nan.flatten()[:3], without.flatten().tolist())


def test_opo_by_hand():
    # b = (2·1 + 6·0 + 4·1)/12 = 0.5 (GRPO's mean would be 2/3); no std
    close(opo_advantages(torch.tensor([[1.0, 0.0, 1.0]]), torch.tensor([[2, 6, 4]])),
          [[0.5, -0.5, 0.5]])  # fmt: skip
    close(opo_advantages(torch.tensor([[1.0, 1.0]]), torch.tensor([[3, 5]])), [[0.0, 0.0]])


def test_gpg_by_hand():
    # 6 completions, 3 with a non-zero reward: α = 2; group means 0.5, 0, 1
    close(gpg_advantages(torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])),
          [[1.0, -1.0], [0.0, 0.0], [0.0, 0.0]])  # fmt: skip


def test_a_group_with_one_scored_completion_is_its_own_baseline():
    """The rule for a group that None rewards left with one scored completion: its baseline is
    its own reward, so it compares nothing, as a group whose scored rewards agree.

    Groups: (1, unscored), (0, 1), (1, 1); trained tokens (2, ·), (1, 3), (2, 2)."""
    nan = float("nan")
    rewards = torch.tensor([[1.0, nan], [0.0, 1.0], [1.0, 1.0]], **F64)
    lengths = torch.tensor([[2, 5], [1, 3], [2, 2]])
    # OPO: b = (1·0 + 3·1)/4 = 0.75 for the second group; the other two give exact zeros
    close(opo_advantages(rewards, lengths), [[0.0, 0.0], [-0.75, 0.25], [0.0, 0.0]])
    # GPG: 5 scored completions, 4 of them non-zero: α = 5/4; (0, 1) centred by 0.5
    close(gpg_advantages(rewards), [[0.0, 0.0], [-0.625, 0.625], [0.0, 0.0]])
    # REINFORCE++ with its baseline: v = (0, ·), (−0.5, 0.5), (0, 0) over 10 tokens:
    # μ = (−0.5 + 3·0.5)/10 = 0.1; σ² = (2·0.01 + 0.36 + 3·0.16 + 4·0.01)/10 · 10/9 = 0.1;
    # the lone scored completion gets −μ/σ, as the agreeing group does: −0.1/√0.1 = −0.3162...
    a = reinforce_pp_advantages(rewards, lengths, baseline=True)
    want = by_hand_whitened([0.0, -0.5, 0.5, 0.0, 0.0], [2, 1, 3, 2, 2])  # (with verl's 1e-8s)
    close(a, [[want[0], 0.0], want[1:3], want[3:]])
    plain = [[-0.1 / 0.1**0.5, 0.0], [-0.6 / 0.1**0.5, 0.4 / 0.1**0.5], [-0.1 / 0.1**0.5] * 2]
    # without the 1e-8s: σ² = 0.1 + 1e-8 moves A by 5e-8 of itself (|A| < 2): within 1e-6
    torch.testing.assert_close(a, torch.tensor(plain, **F64), rtol=0, atol=1e-6)
    # Pass@k needs two scored completions: the lone one gets 0
    close(passk_advantages(rewards)[0], [0.0, 0.0])


def test_passk_by_hand():
    # best 1, second 0.5: gap 0.5 over the sample std of (1, 0, 0.5), 0.5
    close(passk_advantages(torch.tensor([[1.0, 0.0, 0.5]])), [[0.5 / (0.5 + 1e-6), 0.0, 0.0]])
    close(passk_advantages(torch.tensor([[0.0, 2.0, 0.5]]), scale="none"), [[0.0, 1.5, 0.0]])
    close(passk_advantages(torch.tensor([[1.0, 1.0, 0.0]])), [[0.0, 0.0, 0.0]])  # a tie at the top


# --- verl 0.9, transcribed (the loops as verl writes them; token-level rewards on the last token)


def _verl_inputs(rewards, lengths):
    bs, width = rewards.numel(), int(lengths.max())
    mask = (torch.arange(width)[None, :] < lengths.reshape(-1, 1)).double()
    token_rewards = torch.zeros(bs, width, **F64)
    token_rewards[torch.arange(bs), lengths.reshape(-1) - 1] = rewards.reshape(-1).double()
    index = [i // rewards.shape[1] for i in range(bs)]
    return token_rewards, mask, index


def _masked_whiten(values, mask):
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    var = ((values - mean) ** 2 * mask).sum() / (mask.sum() + 1e-8)
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _verl_rfpp_baseline(token_rewards, mask, index):
    scores = token_rewards.sum(-1)
    groups = defaultdict(list)
    for i in range(len(scores)):
        groups[index[i]].append(scores[i])
    mean = {k: torch.tensor(0.0, **F64) if len(v) == 1 else torch.mean(torch.stack(v))
            for k, v in groups.items()}  # fmt: skip
    scores = torch.stack([scores[i] - mean[index[i]] for i in range(len(scores))])
    scores = scores.unsqueeze(-1).tile([1, mask.shape[1]]) * mask
    return _masked_whiten(scores, mask) * mask


def _verl_rfpp(token_rewards, mask):
    returns, running = torch.zeros_like(token_rewards), 0
    for t in reversed(range(token_rewards.shape[1])):
        new = token_rewards[:, t] + 1.0 * running
        returns[:, t] = new * mask[:, t]
        running = new * mask[:, t] + running * (1 - mask[:, t])
    return _masked_whiten(returns, mask) * mask


def _verl_opo(token_rewards, mask, index):
    lengths, scores = mask.sum(-1), token_rewards.sum(-1)
    s, n = defaultdict(list), defaultdict(list)
    for i in range(len(scores)):
        s[index[i]].append(scores[i])
        n[index[i]].append(lengths[i])
    b = {k: torch.tensor(0.0, **F64) if len(s[k]) == 1
         else (torch.stack(n[k]) * torch.stack(s[k])).sum() / torch.stack(n[k]).sum() for k in s}  # fmt: skip
    return torch.stack([scores[i] - b[index[i]] for i in range(len(scores))]).unsqueeze(-1) * mask


def _verl_gpg(token_rewards, mask, index):
    scores = token_rewards.sum(-1)
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    groups = defaultdict(list)
    for i in range(len(scores)):
        groups[index[i]].append(scores[i])
    mean = {k: torch.mean(torch.stack(v)) for k, v in groups.items()}
    return torch.stack([alpha * (scores[i] - mean[index[i]]) for i in range(len(scores))]
                       ).unsqueeze(-1) * mask  # fmt: skip


def _verl_passk(token_rewards, mask, index, eps=1e-6):
    scores = token_rewards.sum(-1)
    advantages = torch.zeros_like(scores)
    members = defaultdict(list)
    for i in range(len(scores)):
        members[index[i]].append(i)
    for rows in members.values():
        rewards = scores[rows]
        top, where = torch.topk(rewards, 2)
        advantages[rows[where[0].item()]] = (top[0] - top[1]) / (torch.std(rewards) + eps)
    return advantages.unsqueeze(-1) * mask


@pytest.mark.parametrize("seed", range(4))
def test_parity_with_verl(seed):
    g = torch.Generator().manual_seed(seed)
    B, G = 5, 4
    # 0/1 rewards with a graded one, so that groups agree, differ and tie
    rewards = (torch.rand(B, G, generator=g) < 0.5).double() + 0.5 * (
        torch.rand(B, G, generator=g) < 0.2
    )
    lengths = torch.randint(1, 9, (B, G), generator=g)
    tokens, mask, index = _verl_inputs(rewards, lengths)
    first = lambda per_token: per_token[:, 0].view(B, G)  # noqa: E731 (a token's value: the row's)
    tol = summed(int(lengths.sum()))
    torch.testing.assert_close(reinforce_pp_advantages(rewards, lengths, baseline=True),
                               first(_verl_rfpp_baseline(tokens, mask, index)), rtol=tol, atol=tol)  # fmt: skip
    torch.testing.assert_close(reinforce_pp_advantages(rewards, lengths, baseline=False),
                               first(_verl_rfpp(tokens, mask)), rtol=tol, atol=tol)  # fmt: skip
    torch.testing.assert_close(opo_advantages(rewards, lengths),
                               first(_verl_opo(tokens, mask, index)), rtol=tol, atol=tol)  # fmt: skip
    # verl's α = B / count is a float32 quotient: one float32 rounding (2^-24) apart, beside
    # the float64 sums'
    torch.testing.assert_close(gpg_advantages(rewards), first(_verl_gpg(tokens, mask, index)),
                               rtol=2**-24 + tol, atol=tol)  # fmt: skip
    ours = passk_advantages(rewards, eps=1e-6, unbiased_std=True)
    theirs = first(_verl_passk(tokens, mask, index))
    # ties at the top: both give 0 (which of the tied rows holds the 0 does not matter)
    torch.testing.assert_close(ours.sort(-1).values, theirs.sort(-1).values, rtol=tol, atol=tol)


def test_remax_by_hand_and_as_verl():
    from grouprl.core import remax_advantages

    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.0, float("nan")], [1.0, 1.0, 0.0]], **F64)
    baselines = torch.tensor([0.5, 1.0, float("nan")], **F64)
    # R − R(greedy); an unscored completion, and a group whose greedy one went unscored: 0
    close(remax_advantages(rewards, baselines), [[0.5, -0.5, 0.0], [-1.0, -1.0, 0.0],
                                                 [0.0, 0.0, 0.0]])  # fmt: skip
    # verl's compute_remax_outcome_advantage: reward-to-go of the outcome reward, minus b
    scored = torch.tensor([[1.0, 0.0, 0.5]], **F64)
    tokens, mask, _ = _verl_inputs(scored, torch.tensor([[3, 1, 2]]))
    returns = (tokens * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    theirs = returns - torch.tensor([0.5, 0.5, 0.5], **F64).unsqueeze(-1) * mask
    assert torch.equal(remax_advantages(scored, torch.tensor([0.5], **F64))[0], theirs[:, 0])
