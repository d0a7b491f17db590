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


# --- corrections (grouprl.core.correction_weights), by hand ----------------------------------

from grouprl.core import CORRECTIONS, Correction, correction_weights  # noqa: E402

# proximal − behaviour on 2 rows x 3 tokens; row 1's last token is padding (wild on purpose)
_RATIOS = [[3.0, 0.6, 1.0], [1.01, 1.02, 1.0]]
_MASK = torch.tensor([[True, True, True], [True, True, False]])


def _logps():
    behaviour = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, 50.0]], dtype=torch.float64)
    d = torch.tensor(_RATIOS, dtype=torch.float64).log()
    d[1, 2] = -80.0  # padding
    return behaviour + d, behaviour


def _weights(correction, **kw):
    proximal, behaviour = _logps()
    w, sums = correction_weights(proximal, behaviour, _MASK, correction, **kw)
    return w.double(), sums


def test_token_tis_truncates_each_ratio_at_its_cap():
    w, sums = _weights(CORRECTIONS["token_tis"])  # w = min(ρ, 2)
    assert torch.allclose(w, torch.tensor([[2.0, 0.6, 1.0], [1.01, 1.02, 0.0]], dtype=torch.float64),
                          rtol=1e-6)  # fmt: skip
    assert (sums.truncated, sums.masked, sums.tokens) == (1, 0, 5)
    assert math.isclose(sums.weight_sum, 2 + 0.6 + 1 + 1.01 + 1.02, rel_tol=1e-6)
    assert math.isclose(sums.weight_min, 0.6, rel_tol=1e-6)
    assert math.isclose(sums.weight_max, 2.0, rel_tol=1e-6)


def test_a_floor_truncates_from_below_too():
    w, sums = _weights(Correction(weight="token", weight_low=0.8, weight_high=2.0))
    assert math.isclose(float(w[0, 1]), 0.8, rel_tol=1e-6) and sums.truncated == 2


def test_sequence_tis_is_the_product_of_token_ratios_truncated():
    w, sums = _weights(CORRECTIONS["seq_tis"])
    # row 0: 3 · 0.6 · 1 = 1.8 (under 2: kept as it is); row 1: 1.01 · 1.02 = 1.0302
    assert torch.allclose(w, torch.tensor([[1.8] * 3, [1.0302, 1.0302, 0.0]], dtype=torch.float64),
                          rtol=1e-6)  # fmt: skip
    assert sums.truncated == 0
    w, sums = _weights(Correction(weight="sequence", weight_high=1.2))
    assert torch.allclose(w[0], torch.full((3,), 1.2, dtype=torch.float64), rtol=1e-6)
    assert sums.truncated == 3  # each of row 0's tokens


def test_masks_zero_the_tokens_or_sequences_outside_their_band():
    w, sums = _weights(CORRECTIONS["token_band"])  # token band [0.5, 2]: only the 3 goes
    assert w[0].tolist() == [0.0, 1.0, 1.0] and w[1].tolist() == [1.0, 1.0, 0.0]
    assert (sums.masked, sums.truncated) == (1, 0)
    w, sums = _weights(Correction(mask="sequence", mask_high=1.2))  # products 1.8 and 1.0302
    assert w.tolist() == [[0.0] * 3, [1.0, 1.0, 0.0]] and sums.masked == 3
    # geometric means: 1.8^(1/3) = 1.2164 and 1.0302^(1/2) = 1.01499, both outside [0.99, 1.01]
    w, sums = _weights(CORRECTIONS["geo_mask"])
    assert w.abs().sum() == 0 and sums.masked == 5 and sums.weight_sum == 0
    w, _ = _weights(Correction(mask="geometric", mask_low=0.99, mask_high=1.015))
    assert w[1].tolist() == [1.0, 1.0, 0.0] and w[0].abs().sum() == 0


def test_masked_is_keeps_the_ratio_inside_its_band_and_zero_outside():
    # IcePop, M(ρ) = ρ on [0.5, 2], else 0: the 3 goes, 0.6 and the rest keep their ratio
    w, sums = _weights(CORRECTIONS["icepop"])
    expected = torch.tensor([[0.0, 0.6, 1.0], [1.01, 1.02, 0.0]], dtype=torch.float64)
    assert torch.allclose(w, expected, rtol=1e-6, atol=0)
    assert (sums.masked, sums.truncated) == (1, 0)  # a dropped token is not "truncated"
    # TRL's sequence_mask at 3: Π ρ = 1.8 and 1.0302 both <= 3, so each row's product stays
    w, _ = _weights(CORRECTIONS["seq_mis"])
    expected = torch.tensor([[1.8] * 3, [1.0302, 1.0302, 0.0]], dtype=torch.float64)
    assert torch.allclose(w, expected, rtol=1e-6, atol=0)
    # TRL's token_mask at 2: ρ_t, the 3 dropped
    w, _ = _weights(CORRECTIONS["token_mis"])
    assert torch.allclose(w, torch.tensor([[0.0, 0.6, 1.0], [1.01, 1.02, 0.0]],
                                          dtype=torch.float64), rtol=1e-6, atol=0)  # fmt: skip


def test_trl_sequence_mask_default_falls_into_the_length_trap():
    # a mean token log-difference of 0.012 over 100 tokens: product exp(1.2) = 3.32 > 3, masked;
    # the geometric mean exp(0.012) = 1.012 is what a length-independent test reads
    behaviour = torch.zeros(1, 100, dtype=torch.float64) - 1.0
    mask = torch.ones(1, 100, dtype=torch.bool)
    w, _ = correction_weights(behaviour + 0.012, behaviour, mask, CORRECTIONS["seq_mis"])
    assert w.abs().sum() == 0
    w, _ = correction_weights(behaviour + 0.012, behaviour, mask,
                              Correction(mask="geometric", mask_high=1.02))  # fmt: skip
    assert bool((w == 1).all())


def test_a_weight_and_a_mask_compose():
    w, sums = _weights(Correction(weight="token", weight_high=2.0, mask="token", mask_low=0.7))
    assert torch.allclose(w, torch.tensor([[2.0, 0.0, 1.0], [1.01, 1.02, 0.0]], dtype=torch.float64),
                          rtol=1e-6)  # fmt: skip
    assert (sums.truncated, sums.masked) == (1, 1)
    assert math.isclose(sums.weight_min, 1.0, rel_tol=1e-6)  # over kept tokens


def test_deepseek_off_policy_mask_drops_drifted_negative_advantage_sequences():
    proximal, behaviour = _logps()
    # the current policy: row 0 lower than the sampler by 0.3 a token, row 1 by 0.05
    logp = behaviour - torch.tensor([[0.3], [0.05]], dtype=torch.float64)
    corr = Correction(opsm_delta=0.1)
    adv = torch.tensor([-1.0, -1.0])
    w, sums = correction_weights(proximal, behaviour, _MASK, corr, logp=logp, advantages=adv)
    assert w.tolist() == [[0.0] * 3, [1.0, 1.0, 0.0]] and sums.masked == 3
    w, _ = correction_weights(proximal, behaviour, _MASK, corr, logp=logp,
                              advantages=torch.tensor([0.5, -1.0]))  # fmt: skip
    assert w.tolist() == [[1.0] * 3, [1.0, 1.0, 0.0]]  # A >= 0 is never masked


def test_impossible_bounds_are_refused():
    import pytest

    for bad in (dict(weight="token"), dict(mask="token", mask_low=2.0, mask_high=0.5),
                dict(weight="token", weight_high=-1.0), dict(mask="mean", mask_high=2.0),
                dict(opsm_delta=-0.1)):  # fmt: skip
        with pytest.raises(ValueError):
            Correction(**bad)


def test_a_correction_weighs_grpo_gspo_and_cispo_by_hand():
    """The weight multiplies each objective's per-token term, denominators unchanged. On the
    proximal policy's own log-probs (every ratio 1, nothing clipped), with Â = (1, −1) and
    token TIS's w = [[2, 0.6, 1], [1.01, 1.02, pad]], seq_mean_token_mean:
      value  −(2 + 0.6 + 1)/3 · 1/2 + (1.01 + 1.02)/2 · 1/2 = −0.0925 for GRPO and GSPO (s_i = 1);
      d/d logp[0, 0]: GRPO −w/|y|/N = −2/3/2; GSPO spreads row 0's −Σw/|y| over its tokens
      through s_i = exp(mean log ρ): −(3.6/3)/3/2 = −0.2 on each; CISPO's sg(min(r, cap))·Â·log π
      has GRPO's gradient at r = 1."""
    from grouprl.core import policy_loss

    proximal, behaviour = _logps()
    weight, _ = correction_weights(proximal, behaviour, _MASK, CORRECTIONS["token_tis"])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    for objective, level, value, grad00, grad01 in (
        ("clip", "token", -0.0925, -1 / 3, -0.6 / 3 / 2),
        ("clip", "sequence", -0.0925, -0.2, -0.2),
        ("cispo", "token", None, -1 / 3, -0.6 / 3 / 2),
    ):
        logp = proximal.clone().requires_grad_(True)
        out = policy_loss(logp, proximal, adv, _MASK, objective=objective, level=level,
                          token_weight=weight.double())  # fmt: skip
        out.loss.backward()
        if value is not None:
            assert math.isclose(float(out.loss.detach()), value, rel_tol=1e-6), (objective, level)
        assert math.isclose(float(logp.grad[0, 0]), grad00, rel_tol=1e-6), (objective, level)
        assert math.isclose(float(logp.grad[0, 1]), grad01, rel_tol=1e-6), (objective, level)
        assert float(logp.grad[1, 2]) == 0.0  # padding
