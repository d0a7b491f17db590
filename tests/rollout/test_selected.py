"""The chosen token's log-prob without the (M, V) log-softmax (`grouprl.rollout.selected`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grouprl.rollout.selected import selected_logp
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
