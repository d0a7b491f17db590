"""The learning-rate shapes, by hand, and the linear one against transformers' after warm-up."""

import pytest
import torch
from transformers import get_linear_schedule_with_warmup

from grouprl.config import TrainConfig
from grouprl.train.run import lr_factor


def factors(**options) -> list[float]:
    cfg = TrainConfig(**options)
    return [lr_factor(cfg, s) for s in range(cfg.steps + 1)]


def test_the_shapes_by_hand():
    assert factors(steps=4, warmup_steps=0, lr_schedule="constant") == [1, 1, 1, 1, 1]
    assert factors(steps=4, warmup_steps=0, lr_schedule="linear") == [1, 0.75, 0.5, 0.25, 0]
    # warm-up (s + 1)/(w + 1), then the decay over the steps after it
    assert factors(steps=6, warmup_steps=2, lr_schedule="linear") == pytest.approx(
        [1 / 3, 2 / 3, 1, 0.75, 0.5, 0.25, 0], abs=1e-15
    )
    cosine = factors(steps=4, warmup_steps=0, lr_schedule="cosine")
    assert cosine == pytest.approx([1, 0.5 + 0.5**1.5, 0.5, 0.5 - 0.5**1.5, 0], abs=1e-15)


@pytest.mark.parametrize("warmup", [0, 3])
def test_linear_is_transformers_linear_after_the_warm_up(warmup):
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    theirs = get_linear_schedule_with_warmup(optimizer, warmup, 10).lr_lambdas[0]
    ours = factors(steps=10, warmup_steps=warmup, lr_schedule="linear")
    assert ours[warmup:] == [theirs(s) for s in range(warmup, 11)]
