"""The chosen token's log-prob without the (M, V) log-softmax (`grouprl.rollout.selected`), from
the logits or from the head's input block by block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grouprl.rollout import selected
from grouprl.rollout.selected import selected_head_logp, selected_logp
from numerics import assert_same_f64


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selected_log_probs_and_gradients_are_the_log_softmaxs(temperature):
    # float64: log_softmax(z / tau).gather(y) and its gradient, up to the order of sums;
    # logits of magnitude 30 (a peaked head) and a target repeated across rows
    torch.manual_seed(0)
    logits = (torch.randn(6, 50, dtype=torch.float64) * 30).requires_grad_()
    targets = torch.tensor([3, 3, 0, 49, 17, 3])
    weights = torch.arange(1.0, 7.0, dtype=torch.float64)
    got = selected_logp(logits, targets, temperature)
    (gotgrad,) = torch.autograd.grad((got * weights).sum(), logits)
    want = F.log_softmax(logits / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(1)
    (wantgrad,) = torch.autograd.grad((want * weights).sum(), logits)
    assert_same_f64(got, want)
    assert_same_f64(gotgrad, wantgrad)
    assert torch.autograd.gradcheck(
        lambda z: selected_logp(z, targets, temperature),
        (logits.detach().div(30).requires_grad_(),),
    )


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_head_in_blocks_is_the_log_softmax_of_its_logits(temperature, monkeypatch):
    # float64: 50 vocabulary rows in blocks of 16 (the last one 2 wide); targets in the first,
    # a middle and the last block, at block edges, one repeated; logits of magnitude ~30;
    # gradients to the states and to the head's weight
    monkeypatch.setattr(selected, "HEAD_BLOCK", 16)
    torch.manual_seed(0)
    h = (torch.randn(7, 12, dtype=torch.float64) * 3).requires_grad_()
    weight = torch.randn(50, 12, dtype=torch.float64).requires_grad_()
    targets = torch.tensor([0, 15, 16, 31, 49, 48, 15])
    weights = torch.arange(1.0, 8.0, dtype=torch.float64)
    got = selected_head_logp(h, weight, targets, temperature)
    got_h, got_w = torch.autograd.grad((got * weights).sum(), (h, weight))
    logits = h @ weight.T
    assert 20 < float(logits.abs().max()) < 60
    want = F.log_softmax(logits / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(1)
    want_h, want_w = torch.autograd.grad((want * weights).sum(), (h, weight))
    assert_same_f64(got, want)
    assert_same_f64(got_h, want_h)
    assert_same_f64(got_w, want_w)
    assert torch.autograd.gradcheck(
        lambda a, w: selected_head_logp(a, w, targets, temperature),
        (h.detach().div(3).requires_grad_(), weight.detach().requires_grad_()),
    )
    frozen = selected_head_logp(h, weight.detach(), targets, temperature)  # LoRA's head
    (only_h,) = torch.autograd.grad((frozen * weights).sum(), h)
    assert_same_f64(only_h, want_h)
