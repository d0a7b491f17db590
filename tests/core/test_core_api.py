"""Contract details of grouprl.core: validation, NaN rewards, empty rows, dual clip, DP counts.

Tolerances: the inputs are float64 and small (n <= 8 rows of <= 6 tokens), so two ways of
computing the same quantity (split into ranks or chunks, a reference formula) differ by
reordering only, ~n·T·1.1e-16 relative; torch.testing.assert_close's float64 defaults (rtol
1e-7, atol 1e-7) and the explicit 1e-12 are far above that and far below any real error."""

import math
import re

import pytest
import torch

from grouprl.core import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    AGGREGATIONS,
    BASELINES,
    KL_ESTIMATORS,
    OBJECTIVES,
    RATIO_LEVELS,
    LossOptions,
    LossStats,
    PolicyLoss,
    aggregate,
    group_advantages,
    kl_penalty,
    log_ratio,
    mixed_groups,
    overlong_penalty,
    policy_loss,
    zero_variance_groups,
)

NAN = float("nan")


def t(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64)


def batch(n: int = 4, length: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, length, generator=g, dtype=torch.float64) * 3
    old_logp = logp + 0.2 * torch.randn(n, length, generator=g, dtype=torch.float64)
    ref_logp = logp + 0.2 * torch.randn(n, length, generator=g, dtype=torch.float64)
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, length, generator=g) < 0.7
    return logp.requires_grad_(), old_logp, ref_logp, advantages, mask


def test_registries_hold_the_documented_names():
    assert set(BASELINES) == {"grpo", "rloo"}
    assert list(ADVANTAGE_ESTIMATORS) == ["grpo", "rloo", "gdpo", "reinforce_pp",
                                          "reinforce_pp_baseline", "opo", "gpg", "grpo_passk",
                                          "remax", "process"]  # fmt: skip
    assert list(OBJECTIVES) == ["clip", "cispo", "sapo", "gmpo", "vespo", "gpg", "clip_cov",
                                "kl_cov"]  # fmt: skip
    assert set(ADVANTAGE_SCALES) == {"group", "batch", "none", "whiten"}
    assert set(RATIO_LEVELS) == {"token", "sequence", "sequence_token", "sequence_sum"}
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    assert set(AGGREGATIONS) == {
        "token_mean",
        "seq_mean_token_mean",
        "seq_mean_token_sum",
        "seq_mean_token_sum_norm",
    }


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: group_advantages(t([[1, 0]]), scale="std"),
            "valid choices: 'group', 'batch', 'none'",
        ),
        (lambda: group_advantages(t([[1, 0]]), estimator="ppo"), "valid choices: 'grpo', 'rloo'"),
        (lambda: group_advantages(t([[1.0], [0.0]])), "at least 2"),
        (lambda: group_advantages(t([1.0, 0.0])), r"\(B, G\)"),
        (
            lambda: log_ratio(t([[0.0]]), t([[0.0]]), t([[1.0]]), level="seq"),
            "'token', 'sequence', 'sequence_token'",
        ),
        (lambda: kl_penalty(t([0.0]), t([0.0]), estimator="k4"), "'k1', 'k2', 'k3'"),
        (
            lambda: aggregate(t([[0.0]]), t([[1.0]]), mode="mean"),
            "'token_mean', 'seq_mean_token_mean'",
        ),
        (lambda: aggregate(t([[0.0]]), t([[1.0]]), mode="seq_mean_token_sum_norm"), "norm_len"),
        (
            lambda: policy_loss(*batch()[:2], t([1.0] * 4), batch()[4], dual_clip=1.0),
            "dual_clip must be > 1",
        ),
        (lambda: policy_loss(*batch()[:2], t([1.0] * 4), batch()[4], beta=0.1), "needs ref_logp"),
        (
            lambda: policy_loss(*batch()[:2], t([1.0] * 3), batch()[4]),
            r"advantages must have shape \(N,\)",
        ),
        (lambda: policy_loss(*batch()[:2], t([1.0] * 4), batch()[4], clip_low=1.0), "clip_low"),
        (
            lambda: policy_loss(*batch()[:2], t([1.0] * 4), batch()[4], agg="sum"),
            "loss aggregation",
        ),
        (
            lambda: policy_loss(*batch()[:2], t([1.0] * 4), batch()[4], kl_estimator="k9"),
            "KL estimator",
        ),
        (lambda: log_ratio(t([[0.0, 1.0]]), t([[0.0]]), t([[1.0]])), "equal"),
        (lambda: overlong_penalty(t([1.0]), max_len=10, cache_len=0), "cache_len"),
    ],
)
def test_bad_arguments_raise_one_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.numerics
def test_nan_rewards_get_zero_and_are_left_out_of_the_statistics():
    rewards = t([[1.0, NAN, 0.0, 1.0], [NAN, NAN, 2.0, 5.0]])
    for scale in ADVANTAGE_SCALES:
        for estimator in BASELINES:
            adv = group_advantages(rewards, scale=scale, estimator=estimator)
            assert not adv.isnan().any() and adv[rewards.isnan()].eq(0).all()
    # Within a group, the NaN-free rewards give what they give on their own.
    adv = group_advantages(rewards, estimator="rloo")
    torch.testing.assert_close(
        adv[0, [0, 2, 3]], group_advantages(t([[1.0, 0.0, 1.0]]), estimator="rloo")[0]
    )
    torch.testing.assert_close(adv[1, 2:], group_advantages(t([[2.0, 5.0]]), estimator="rloo")[0])
    # "batch": one std over the valid group-centred rewards of the whole batch.
    centred = t([1 / 3, -2 / 3, 1 / 3, -1.5, 1.5])
    std = centred.square().mean().sqrt()
    torch.testing.assert_close(
        group_advantages(rewards, scale="batch")[~rewards.isnan()], centred / (std + 1e-4)
    )
    std = centred.square().sum().div(4).sqrt()
    got = group_advantages(rewards, scale="batch", unbiased_std=True)[~rewards.isnan()]
    torch.testing.assert_close(got, centred / (std + 1e-4))


def test_groups_with_fewer_than_two_scored_rewards_get_zeros():
    adv = group_advantages(t([[NAN, 1.0, NAN], [NAN, NAN, NAN]]), estimator="rloo", eps=0.0)
    assert adv.eq(0).all()


def test_integer_rewards_are_accepted():
    assert group_advantages(torch.tensor([[1, 0, 1, 0]]), eps=0.0).tolist() == [
        [1.0, -1.0, 1.0, -1.0]
    ]


def test_float_mask_equals_bool_mask():
    logp, old_logp, ref_logp, adv, mask = batch()
    a = policy_loss(logp, old_logp, adv, mask, ref_logp=ref_logp, beta=0.1)
    b = policy_loss(logp, old_logp, adv, mask.double(), ref_logp=ref_logp, beta=0.1)
    assert a.metrics() == b.metrics()


@pytest.mark.parametrize("agg", list(AGGREGATIONS))
@pytest.mark.parametrize("level", list(RATIO_LEVELS))
def test_no_valid_token_gives_zero_loss_nan_diagnostics_and_a_usable_graph(level, agg):
    """The loss over nothing is 0 (no gradient); a diagnostic over nothing is undefined: NaN
    (`mean_over`, the one definition the trainer's metrics use too)."""
    logp = torch.full((2, 3), NAN, dtype=torch.float64, requires_grad=True)
    out = policy_loss(
        logp, t([[NAN] * 3] * 2), t([NAN, 1.0]), torch.zeros(2, 3), level=level, agg=agg, norm_len=3,
        ref_logp=t([[math.inf] * 3] * 2), beta=0.1,
    )  # fmt: skip
    out.loss.backward()
    assert out.loss.item() == 0.0 and logp.grad.eq(0).all()
    diagnostics = {k: v for k, v in out.metrics().items() if k != "loss"}
    assert diagnostics and all(math.isnan(v) for v in diagnostics.values())


@pytest.mark.numerics
def test_an_empty_row_contributes_nothing():
    logp, old_logp, _, adv, mask = batch()
    mask[1] = False
    full = policy_loss(logp, old_logp, adv, mask, agg="seq_mean_token_mean")
    keep = [0, 2, 3]
    part = policy_loss(logp[keep], old_logp[keep], adv[keep], mask[keep], agg="seq_mean_token_mean")
    torch.testing.assert_close(full.loss, part.loss)


@pytest.mark.numerics
def test_dual_clip_bounds_the_loss_of_negative_advantages():
    old_logp, mask = t([[0.0, 0.0, 0.0]]), torch.ones(1, 3)
    logp = t([[math.log(5.0), math.log(2.0), math.log(0.5)]]).requires_grad_()
    out = policy_loss(logp, old_logp, t([-2.0]), mask, dual_clip=3.0, agg="seq_mean_token_sum")
    out.loss.backward()
    # per token: min(max(r, 0.8)·|Â|, 3·|Â|) = [6 (bounded), 4, 1.6]
    torch.testing.assert_close(out.loss, t(6.0 + 4.0 + 1.6))
    torch.testing.assert_close(logp.grad, t([[0.0, 2.0 * 2.0, 0.0]]))
    # Positive advantages are not affected.
    plain = policy_loss(logp, old_logp, t([2.0]), mask, agg="seq_mean_token_sum")
    dual = policy_loss(logp, old_logp, t([2.0]), mask, dual_clip=3.0, agg="seq_mean_token_sum")
    torch.testing.assert_close(plain.loss, dual.loss)


def test_huge_ratios_give_finite_loss_and_gradient():
    old_logp, mask = t([[-100.0, -1.0]]), torch.ones(1, 2)
    for adv in (1.0, -1.0):
        logp = t([[-0.5, -1.0]]).float().requires_grad_()
        out = policy_loss(logp, old_logp.float(), torch.tensor([adv]), mask)
        out.loss.backward()
        assert out.loss.isfinite() and logp.grad.isfinite().all()


@pytest.mark.numerics
@pytest.mark.parametrize("agg", list(AGGREGATIONS))
def test_global_counts_let_data_parallel_ranks_sum_to_the_full_loss(agg):
    logp, old_logp, ref_logp, adv, mask = batch(n=6, seed=3)
    kwargs = {"level": "sequence", "agg": agg, "norm_len": 5, "beta": 0.05}
    full = policy_loss(logp, old_logp, adv, mask, ref_logp=ref_logp, **kwargs)
    counts = {"num_tokens": mask.sum(), "num_seqs": int(mask.any(-1).sum())}
    ranks = [slice(0, 2), slice(2, 6)]
    summed = sum(
        policy_loss(
            logp[r], old_logp[r], adv[r], mask[r], ref_logp=ref_logp[r], **kwargs, **counts
        ).loss
        for r in ranks
    )
    torch.testing.assert_close(summed, full.loss)


@pytest.mark.numerics
def test_diagnostics():
    logp, old_logp, ref_logp, adv, mask = batch(n=8, length=6, seed=1)
    for level in RATIO_LEVELS:
        out = policy_loss(logp, old_logp, adv, mask, level=level, ref_logp=ref_logp)
        assert isinstance(out, PolicyLoss)
        ratio = log_ratio(logp, old_logp, mask, level=level).exp()[mask].detach()
        a = adv[:, None].expand_as(mask)[mask]
        torch.testing.assert_close(out.ratio_mean, ratio.mean())
        torch.testing.assert_close(out.ratio_min, ratio.min())
        torch.testing.assert_close(out.ratio_max, ratio.max())
        torch.testing.assert_close(out.clip_frac_low, ((a < 0) & (ratio < 0.8)).double().mean())
        torch.testing.assert_close(out.clip_frac_high, ((a > 0) & (ratio > 1.2)).double().mean())
        d = (logp - old_logp)[mask].detach()
        torch.testing.assert_close(out.approx_kl, (d.exp() - 1 - d).mean())
        k3 = kl_penalty(logp, ref_logp)[mask].detach()
        torch.testing.assert_close(out.kl, k3.mean())  # reported even with beta = 0
        for value in (out.clip_frac_low, out.ratio_mean, out.approx_kl, out.kl):
            assert value.dim() == 0 and not value.requires_grad
        assert out.loss.requires_grad
        assert set(out.metrics()) == {"loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min"} | {
            "ratio_max", "approx_kl", "kl"
        }  # fmt: skip
    assert policy_loss(logp, old_logp, adv, mask).kl is None
    with pytest.raises(AttributeError):
        out.loss = None  # frozen


@pytest.mark.numerics
def test_kl_term_is_added_with_beta():
    logp, old_logp, ref_logp, adv, mask = batch(seed=2)
    for agg in AGGREGATIONS:
        base = policy_loss(logp, old_logp, adv, mask, agg=agg, norm_len=5, ref_logp=ref_logp)
        with_kl = policy_loss(
            logp, old_logp, adv, mask, agg=agg, norm_len=5, ref_logp=ref_logp, beta=0.3
        )
        kl = aggregate(kl_penalty(logp, ref_logp), mask, mode=agg, norm_len=5)
        torch.testing.assert_close(with_kl.loss, base.loss + 0.3 * kl)


def test_zero_variance_groups_by_hand():
    nan = float("nan")
    rewards = torch.tensor(
        [
            [1.0, 0.0, 1.0, 0.0],  # spread: teaches
            [1.0, 1.0, 1.0, 1.0],  # all equal: silent
            [0.3, nan, 0.3, nan],  # the scored ones agree: silent
            [nan, 0.5, nan, nan],  # one scored: silent
            [nan, nan, nan, nan],  # none scored: silent
            [0.1, 0.1, nan, 0.2],  # spread among the scored: teaches
        ]
    )
    assert zero_variance_groups(rewards).tolist() == [False, True, True, True, True, False]


def test_every_loss_statistic_says_how_it_combines():
    """A new LossStats field must be a sum or an extreme: nothing becomes an average by default."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(LossStats)]
    assert sorted(names) == sorted(LossStats.SUMS + LossStats.EXTREMES)
    assert not set(LossStats.SUMS) & set(LossStats.EXTREMES)


@pytest.mark.numerics
def test_stats_of_chunks_combine_to_the_stats_of_the_whole():
    """Sums add and extremes max over any split of the rows, exactly: the whole batch's means
    come out of its chunks' stats (rows 0-1 and 2-3; row 3 has no valid token)."""
    logp, old_logp, ref_logp, adv, mask = batch(n=4, length=5, seed=4)
    mask[3] = False
    kwargs = dict(ref_logp=ref_logp, level="sequence", clip_low=0.05, clip_high=0.05)
    whole = policy_loss(logp, old_logp, adv, mask, **kwargs)
    parts = [
        policy_loss(logp[r], old_logp[r], adv[r], mask[r], **{**kwargs, "ref_logp": ref_logp[r]})
        for r in (slice(0, 2), slice(2, 4))
    ]
    sums = sum(p.stats.sums() for p in parts)
    extremes = torch.maximum(*(p.stats.extremes() for p in parts))
    combined = LossStats.combine(sums, extremes)
    tokens = float(mask.sum())
    assert combined["clipped_low"] / tokens == pytest.approx(float(whole.clip_frac_low), abs=1e-12)
    assert combined["clipped_high"] / tokens == pytest.approx(
        float(whole.clip_frac_high), abs=1e-12
    )
    for key in ("ratio_mean", "ratio_min", "ratio_max", "approx_kl", "kl"):
        assert combined[key] == pytest.approx(float(getattr(whole, key)), rel=1e-12), key
    empty = LossStats.combine(parts[1].stats.sums() * 0, parts[1].stats.extremes() * 0 - math.inf)
    assert all(math.isnan(empty[k]) for k in ("ratio_mean", "ratio_min", "approx_kl"))


def test_loss_options_are_one_object_and_checked_once():
    logp, old_logp, _, adv, mask = batch(seed=5)
    options = LossOptions(level="sequence", clip_low=3e-4, clip_high=4e-4, agg="token_mean")
    by_object = policy_loss(logp, old_logp, adv, mask, options=options)
    by_keywords = policy_loss(logp, old_logp, adv, mask, level="sequence", clip_low=3e-4,
                              clip_high=4e-4, agg="token_mean")  # fmt: skip
    assert by_object.metrics() == by_keywords.metrics()
    with pytest.raises(TypeError, match="not both"):
        policy_loss(logp, old_logp, adv, mask, options=options, beta=0.1)
    for bad, match in (
        ({"level": "word"}, "unknown ratio level 'word'"),
        ({"agg": "seq_mean_token_sum_norm"}, "needs norm_len > 0"),
        ({"clip_low": 1.0}, "clip_low must lie in [0, 1)"),
        ({"dual_clip": 1.0}, "dual_clip must be > 1"),
        ({"beta": -0.1}, "beta must be >= 0"),
    ):
        with pytest.raises(ValueError, match=re.escape(match)):
            LossOptions(**bad)


def test_mixed_groups_are_those_with_a_pass_and_a_fail():
    passed = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0], [0, 0, 1]], dtype=torch.bool)
    assert mixed_groups(passed).tolist() == [False, False, True, True]
