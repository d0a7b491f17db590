"""Invariants of grouprl.core over random shapes, masks and values, plus float64 gradchecks.

Tolerances: all float64. Identities that hold exactly in arithmetic (sequence and
GSPO-token levels, advantages summing to 0) are checked to 1e-9 to 1e-12 absolute on O(1)
values: float64 rounding over the <= 64 terms involved is ~1e-14. gradcheck's finite
differences (eps 1e-6) have truncation error ~eps² times the third derivative (~1e-12) and
rounding error ~u/eps ≈ 1e-10, well inside its atol 1e-7 / rtol 1e-6."""

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.core import (
    ADVANTAGE_SCALES,
    AGGREGATIONS,
    BASELINES,
    RATIO_LEVELS,
    aggregate,
    group_advantages,
    policy_loss,
)

SETTINGS = settings(max_examples=50, deadline=None)
GARBAGE = (math.nan, math.inf, -math.inf, 1e9, -1e9)


@dataclass
class Case:
    logp: torch.Tensor  # (N, T) leaf, requires grad
    old_logp: torch.Tensor  # (N, T)
    ref_logp: torch.Tensor  # (N, T)
    advantages: torch.Tensor  # (N,)
    mask: torch.Tensor  # (N, T) bool
    kwargs: dict = field(default_factory=dict)  # policy_loss options: level, agg, clips, counts

    def leaf(self) -> torch.Tensor:
        return self.logp.detach().clone().requires_grad_()


@st.composite
def cases(draw, one_token: bool = False) -> Case:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    n, length = draw(st.integers(1, 6)), draw(st.integers(1, 7))
    logp = -3 * torch.rand(n, length, generator=g, dtype=torch.float64)
    spread = draw(st.sampled_from([0.05, 0.3, 1.0]))  # how far off-policy
    old_logp = logp + spread * torch.randn(n, length, generator=g, dtype=torch.float64)
    ref_logp = logp + 0.3 * torch.randn(n, length, generator=g, dtype=torch.float64)
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    if one_token:
        mask = torch.zeros(n, length, dtype=torch.bool)
        mask[torch.arange(n), torch.randint(length, (n,), generator=g)] = True
    elif draw(st.booleans()):  # completions: a prefix, up to and including EOS
        mask = torch.arange(length)[None] < torch.randint(length + 1, (n, 1), generator=g)
    else:
        mask = torch.rand(n, length, generator=g) < draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    kwargs = {
        "level": draw(st.sampled_from(list(RATIO_LEVELS))),
        "agg": draw(st.sampled_from(list(AGGREGATIONS))),
        "norm_len": length,
        "clip_low": draw(st.sampled_from([0.2, 3e-4])),
        "clip_high": draw(st.sampled_from([0.2, 0.28, 4e-4])),
        "dual_clip": draw(st.sampled_from([None, 3.0])),
    }
    if draw(st.booleans()):  # counts as a data-parallel rank would pass them
        kwargs |= {"num_tokens": int(mask.sum()) + 3, "num_seqs": int(mask.any(-1).sum()) + 1}
    return Case(logp.requires_grad_(), old_logp, ref_logp, advantages, mask, kwargs)


def loss_and_grad(case: Case, logp: torch.Tensor | None = None, **overrides):
    logp = case.leaf() if logp is None else logp
    kwargs = case.kwargs | overrides
    out = policy_loss(
        logp,
        kwargs.pop("old_logp", case.old_logp),
        kwargs.pop("advantages", case.advantages),
        case.mask,
        **kwargs,
    )
    (grad,) = torch.autograd.grad(out.loss, logp)
    return out, grad


@pytest.mark.numerics
def same_metrics(a: dict[str, float], b: dict[str, float]) -> bool:
    """Equal values, NaN equal to NaN (a diagnostic over no token is NaN on both sides)."""
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a
    )


@SETTINGS
@given(cases())
def test_on_policy_gradient_is_the_reinforce_gradient(case):
    """logp == old_logp: every ratio is 1 and ∇loss = ∇ aggregate(−Â·logp), at every level
    whose sequence ratio is length-normalised; the unnormalised sequence_sum (TRL's RLOO) is
    the REINFORCE gradient of the whole sequence's log-prob, |y_i| times each token's."""
    out, grad = loss_and_grad(case, old_logp=case.logp.detach())
    logp = case.leaf()
    counts = {k: case.kwargs.get(k) for k in ("norm_len", "num_tokens", "num_seqs")}
    weight = case.advantages[:, None]
    if case.kwargs.get("level") == "sequence_sum":
        weight = weight * case.mask.sum(-1, keepdim=True).to(weight.dtype)
    reinforce = aggregate(-weight * logp, case.mask, mode=case.kwargs["agg"], **counts)
    (expected,) = torch.autograd.grad(reinforce, logp)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    if case.mask.any():
        assert out.ratio_min.item() == out.ratio_max.item() == out.ratio_mean.item() == 1.0
        assert out.clip_frac_low.item() == out.clip_frac_high.item() == out.approx_kl.item() == 0.0
    else:  # diagnostics over no token are undefined (grouprl.core.mean_over)
        assert all(math.isnan(v) for k, v in out.metrics().items() if k != "loss")


@pytest.mark.numerics
@SETTINGS
@given(cases(one_token=True))
def test_one_token_completions_make_sequence_and_token_agree(case):
    token, token_grad = loss_and_grad(case, level="token")
    sequence, sequence_grad = loss_and_grad(case, level="sequence")
    torch.testing.assert_close(sequence.loss, token.loss)
    torch.testing.assert_close(sequence_grad, token_grad)
    assert sequence.metrics() == pytest.approx(token.metrics(), nan_ok=True)


@pytest.mark.numerics
@SETTINGS
@given(cases(), st.booleans())
def test_sequence_token_has_the_value_and_gradient_of_sequence(case, with_ref):
    ref = {"ref_logp": case.ref_logp, "beta": 0.1} if with_ref else {}
    sequence, sequence_grad = loss_and_grad(case, level="sequence", **ref)
    mixed, mixed_grad = loss_and_grad(case, level="sequence_token", **ref)
    assert mixed.loss.item() == sequence.loss.item()
    torch.testing.assert_close(mixed_grad, sequence_grad, rtol=1e-10, atol=1e-12)
    assert same_metrics(mixed.metrics(), sequence.metrics())


@st.composite
def reward_batches(draw) -> torch.Tensor:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    b, group = draw(st.integers(1, 5)), draw(st.integers(2, 8))
    if draw(st.booleans()):  # a verifier's 0/1
        rewards = torch.randint(2, (b, group), generator=g).double()
    else:
        rewards = 10 * torch.randn(b, group, generator=g, dtype=torch.float64)
    flat = torch.rand(b, generator=g) < 0.4  # zero-variance groups, at awkward values like 0.1
    rewards[flat] = torch.tensor([0.1, 1.0, 0.0, -3.3], dtype=torch.float64)[
        torch.randint(4, (1,), generator=g)
    ]
    rewards[torch.rand(b, group, generator=g) < draw(st.sampled_from([0.0, 0.2]))] = math.nan
    return rewards


@pytest.mark.numerics
@SETTINGS
@given(
    reward_batches(),
    st.sampled_from(list(ADVANTAGE_SCALES)),
    st.sampled_from(list(BASELINES)),
    st.booleans(),
)
def test_advantages_sum_to_zero_in_every_group(rewards, scale, estimator, unbiased):
    advantages = group_advantages(rewards, scale=scale, estimator=estimator, unbiased_std=unbiased)
    assert advantages.isfinite().all() and advantages[rewards.isnan()].eq(0).all()
    torch.testing.assert_close(
        advantages.sum(-1), torch.zeros(len(rewards), dtype=torch.float64), rtol=0, atol=1e-9
    )


@SETTINGS
@given(
    reward_batches(),
    cases(),
    st.sampled_from(list(ADVANTAGE_SCALES)),
    st.sampled_from(list(BASELINES)),
)
def test_a_zero_variance_group_contributes_zero_gradient(rewards, case, scale, estimator):
    advantages = group_advantages(rewards, scale=scale, estimator=estimator)  # (B, G)
    n = advantages.numel()
    g = torch.Generator().manual_seed(n)
    logp = torch.randn(n, case.logp.shape[1], generator=g, dtype=torch.float64).requires_grad_()
    old_logp = logp.detach() + 0.5 * torch.randn(logp.shape, generator=g, dtype=torch.float64)
    mask = torch.rand(logp.shape, generator=g) < 0.8
    out = policy_loss(
        logp,
        old_logp,
        advantages.flatten(),
        mask,
        **case.kwargs | {"num_tokens": None, "num_seqs": None},
    )
    (grad,) = torch.autograd.grad(out.loss, logp)
    valid = ~rewards.isnan()
    high = torch.where(valid, rewards, -math.inf).amax(-1)
    low = torch.where(valid, rewards, math.inf).amin(-1)
    silent = ((high <= low)[:, None] | ~valid).flatten()  # (N,) rows that carry no signal
    assert grad[silent].eq(0).all()


@SETTINGS
@given(cases(), st.booleans(), st.integers(0, 2**32 - 1))
def test_garbage_in_padding_changes_neither_loss_nor_gradient(case, with_ref, seed):
    g = torch.Generator().manual_seed(seed)
    pad = ~case.mask

    def dirty(x: torch.Tensor) -> torch.Tensor:
        junk = torch.tensor(GARBAGE, dtype=x.dtype)[
            torch.randint(len(GARBAGE), x.shape, generator=g)
        ]
        return torch.where(pad, junk, x.detach())

    empty = ~case.mask.any(-1)
    ref = {"ref_logp": case.ref_logp, "beta": 0.1} if with_ref else {}
    clean, clean_grad = loss_and_grad(case, **ref)
    dirty_ref = {"ref_logp": dirty(case.ref_logp), "beta": 0.1} if with_ref else {}
    logp = dirty(case.logp).requires_grad_()
    adv = torch.where(
        empty, math.nan, case.advantages
    )  # a row without tokens may carry any advantage
    messy, messy_grad = loss_and_grad(
        case, logp, old_logp=dirty(case.old_logp), advantages=adv, **dirty_ref
    )
    assert messy.loss.item() == clean.loss.item()
    assert torch.equal(messy_grad, clean_grad) and messy_grad[pad].eq(0).all()
    assert same_metrics(messy.metrics(), clean.metrics())


def gradcheck_inputs():
    # Log-ratios chosen away from the clip boundaries log(0.8), log(1.2) and the dual clip log(3),
    # per token and as row means, so the loss is smooth where gradcheck probes it.
    pad = math.nan
    ratios = torch.tensor(
        [
            [0.5, 0.3, pad],  # clipped above (token and sequence)
            [-0.05, 0.1, 0.0],  # inside the clip range
            [-0.6, -0.4, pad],  # clipped below
            [1.5, 1.3, 1.2],  # beyond the dual clip c = 3
            [0.05, pad, pad],  # one token
            [pad, pad, pad],  # empty row
        ],
        dtype=torch.float64,
    )
    mask = ~ratios.isnan()
    g = torch.Generator().manual_seed(0)
    logp = -0.5 - torch.rand(ratios.shape, generator=g, dtype=torch.float64)
    old_logp = torch.where(mask, logp - ratios.nan_to_num(), -1.0)
    ref_logp = logp + 0.2 * torch.randn(ratios.shape, generator=g, dtype=torch.float64)
    advantages = torch.tensor([1.0, -1.0, -0.5, -2.0, 0.7, 0.3], dtype=torch.float64)
    return logp.requires_grad_(), old_logp, ref_logp, advantages, mask


@pytest.mark.numerics
@pytest.mark.parametrize("agg", list(AGGREGATIONS))
@pytest.mark.parametrize("level", list(RATIO_LEVELS))
def test_gradcheck_policy_loss(level, agg):
    logp, old_logp, ref_logp, advantages, mask = gradcheck_inputs()

    def loss(logp: torch.Tensor) -> torch.Tensor:
        return policy_loss(
            logp, old_logp, advantages, mask, level=level, agg=agg, norm_len=3, dual_clip=3.0,
            ref_logp=ref_logp, beta=0.1,
        ).loss  # fmt: skip

    assert torch.autograd.gradcheck(loss, (logp,), eps=1e-6, atol=1e-7, rtol=1e-6)
    out = policy_loss(
        logp, old_logp, advantages, mask, level=level, agg=agg, norm_len=3, dual_clip=3.0
    )
    assert (
        out.clip_frac_low.item() > 0 and out.clip_frac_high.item() > 0
    )  # both clips are exercised
