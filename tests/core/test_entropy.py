"""Entropy control (`grouprl.core.entropy`): the high-entropy token mask and the adaptive
entropy coefficient, by hand and against transcriptions of TRL 1.16's `GRPOTrainer`
(`get_high_entropy_mask`; the adaptive update in `_compute_loss`)."""

import math

import pytest
import torch

from grouprl.core.entropy import (
    adapted_coefficient,
    applied_coefficient,
    entropy_threshold,
    high_entropy_mask,
)


def test_the_top_rho_tokens_by_hand():
    # 5 trained tokens with entropies 0.1, 0.5, 0.9, 0.3, 0.7 (a padded 9.0 never counts);
    # rho 0.4: the 0.6 quantile, linearly interpolated: sorted [.1 .3 .5 .7 .9] at 0.6·4 = 2.4
    # -> 0.5 + 0.4·0.2 = 0.58: the tokens of 0.7 and 0.9 stay
    entropy = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    threshold = entropy_threshold(entropy[mask], 0.4)
    assert math.isclose(threshold, 0.58, rel_tol=1e-6)
    keep = high_entropy_mask(entropy, mask, threshold)
    assert keep.tolist() == [[False, False, True], [False, True, False]]
    assert high_entropy_mask(entropy, mask, entropy_threshold(entropy[mask], 1.0)).equal(mask)
    assert entropy_threshold(torch.tensor([]), 0.2) is None
    assert not high_entropy_mask(entropy, mask, None).any()
    with pytest.raises(ValueError, match="rho must lie in"):
        entropy_threshold(entropy[mask], 0.0)


def trls_high_entropy_mask(entropies, mask, threshold):
    """TRL 1.16's get_high_entropy_mask, one process (the gather is the identity)."""
    local = entropies[mask.bool()].float()
    gathered = local[local != -1e9]
    if gathered.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    entropy_threshold_ = torch.quantile(gathered, threshold)
    masked_entropies = entropies * mask.float()
    return (masked_entropies >= entropy_threshold_) & mask.bool()


@pytest.mark.parametrize("rho", [0.2, 0.5, 0.8, 1.0])
def test_the_mask_is_trls(rho):
    g = torch.Generator().manual_seed(int(rho * 10))
    entropy = torch.rand(6, 11, generator=g) * 3
    mask = torch.rand(6, 11, generator=g) < 0.8
    ours = high_entropy_mask(entropy, mask, entropy_threshold(entropy[mask], rho))
    assert torch.equal(ours, trls_high_entropy_mask(entropy, mask, 1 - rho))


def trls_controller(coef, entropies, *, target, delta, low, high):
    """TRL 1.16's adaptive entropy coefficient over optimizer steps: (applied, next) per step."""
    last, out = float("inf"), []
    for world_entropy in entropies:
        apply_coef = coef if last <= target else 0.0
        coef = min(coef + delta, high) if world_entropy <= target else max(coef - delta, low)
        last = world_entropy
        out.append((apply_coef, coef))
    return out


def test_the_adaptive_coefficient_is_trls():
    rule = {"target": 0.2, "delta": 0.005, "low": 0.0, "high": 0.012}
    measured = [0.15, 0.1, 0.3, 0.25, 0.05, 0.19, 0.18, 0.5]
    coef, last, ours = 0.003, None, []
    for entropy in measured:
        applied = applied_coefficient(coef, last, rule["target"])
        coef = adapted_coefficient(coef, entropy, target=rule["target"], delta=rule["delta"],
                                   low=rule["low"], high=rule["high"])  # fmt: skip
        last = entropy
        ours.append((applied, coef))
    assert ours == trls_controller(0.003, measured, **rule)
    # by hand: nothing applied before a measurement; up to the ceiling, down to the floor
    assert [a for a, _ in ours[:3]] == [0.0, 0.008, 0.012]
    assert [c for _, c in ours[:4]] == [0.008, 0.012, 0.007, 0.002]
