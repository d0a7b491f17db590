"""kl_ratio_weighted: the KL term times the importance ratio, gradient included. By hand, for
k3 with d = ref_logp - logp: d/dlogp [(e^d - d - 1) e^(logp - old_logp)] = e^(logp - old_logp)
(logp - ref_logp), against d/dlogp [e^d - d - 1] = 1 - e^d unweighted."""

import math

import pytest
import torch

from grouprl.core import policy_loss

pytestmark = pytest.mark.numerics

# Tolerance: each value is exp, a subtraction and a product or two in float64, each <= 0.5 ulp
# (1.1e-16 relative); the worst, k3 = e^-1 + 1 - 1, loses ~0.5 ulp of 1.37 against 0.37:
# ~4e-16 relative in all, so rel=1e-15 holds and a wrong formula (differences ~0.1) does not.


def gradient(logp: float, old: float, ref: float, weighted: bool, level: str = "token"):
    x = torch.tensor([[logp]], dtype=torch.float64, requires_grad=True)
    out = policy_loss(x, torch.tensor([[old]], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                      torch.ones(1, 1, dtype=torch.bool), ref_logp=torch.tensor([[ref]], dtype=torch.float64),
                      beta=1.0, kl_ratio_weighted=weighted, agg="token_mean", level=level)  # fmt: skip
    out.loss.backward()
    return out.loss.item(), x.grad.item()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_the_value_is_the_same_and_the_gradient_is_logp_minus_ref(level):
    loss, grad = gradient(-1.0, -1.0, -2.0, weighted=True, level=level)
    assert loss == pytest.approx(math.exp(-1), rel=1e-15)  # k3 at d = -1, times a ratio of 1
    assert grad == pytest.approx(1.0, rel=1e-15)  # logp - ref
    plain_loss, plain = gradient(-1.0, -1.0, -2.0, weighted=False, level=level)
    assert plain_loss == loss and plain == pytest.approx(1 - math.exp(-1), rel=1e-15)


def test_off_policy_the_ratio_weights_value_and_gradient():
    loss, grad = gradient(-1.0, -1.5, -2.0, weighted=True)
    assert loss == pytest.approx(math.exp(-1) * math.exp(0.5), rel=1e-15)
    assert grad == pytest.approx(math.exp(0.5) * 1.0, rel=1e-15)
