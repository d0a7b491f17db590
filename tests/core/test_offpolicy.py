"""The training-inference mismatch statistic (`grouprl.core.logp_mismatch`), by hand."""

import math

import torch

from grouprl.core import MismatchSums, logp_mismatch


def test_the_mismatch_sums_by_hand():
    # behaviour (sampler) and trainer log-probs of 2 rows x 3 tokens; the last token of row 1
    # is padding (its values must not count, however wild)
    behaviour = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 99.0]])
    trainer = torch.tensor([[-1.1, -2.0, -0.3], [-0.1, -2.5, -99.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    stats = logp_mismatch(behaviour, trainer, mask)
    d = [-0.1, 0.0, 0.2, 0.0, 0.5]  # trainer − behaviour on the 5 tokens
    assert stats.tokens == 5
    assert math.isclose(stats.abs_sum, 0.8, abs_tol=1e-6)  # float32 inputs: 1e-6
    assert math.isclose(stats.abs_max, 0.5, abs_tol=1e-6)
    k3 = sum(math.exp(x) - 1 - x for x in d)  # 0.004837 + 0.021403 + 0.148721
    assert math.isclose(stats.k3_sum, k3, rel_tol=1e-5)
    assert stats.k3_sum > 0


def test_sums_add_and_an_empty_mask_counts_nothing():
    none = logp_mismatch(torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool))
    assert none == MismatchSums() and none.abs_max == -math.inf
    a = MismatchSums(1.0, 0.5, 0.1, 3)
    b = MismatchSums(2.0, 0.25, 0.2, 4)
    assert a + b == MismatchSums(3.0, 0.5, 0.1 + 0.2, 7) and a + none == a


def test_equal_log_probs_have_no_mismatch():
    logp = torch.randn(4, 6).clamp(max=0)
    stats = logp_mismatch(logp, logp.clone(), torch.ones(4, 6, dtype=torch.bool))
    assert (stats.abs_sum, stats.abs_max, stats.k3_sum, stats.tokens) == (0.0, 0.0, 0.0, 24)
