"""Linear layers fed the same input as one product (`grouprl.rollout.fused`): their outputs
stacked, LoRA adapters included, and the stacked copy following every change of a weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grouprl.models.lora import apply_lora
from grouprl.rollout import llama_decode
from grouprl.rollout.fused import Fused
from numerics import assert_same_f64


class _Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 12, bias=False)
        self.k = nn.Linear(16, 4, bias=False)
        self.v = nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.q(x) + self.k(x).sum() + self.v(x).sum()


def _layers(lora: bool):
    torch.manual_seed(0)
    model = _Three().double()
    if lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=2, lora_alpha=3.0, target_modules=["q", "v"])  # k stays plain
        model = get_peft_model(model, config)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data.normal_(0, 0.5)
        base = model.get_base_model()
        return model, [base.q, base.k, base.v]
    return model, [model.q, model.k, model.v]


def _separate(layers, y_t):
    return torch.cat([layer(y_t.T).T for layer in layers])  # each layer's own forward


@pytest.mark.numerics
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_one_product_is_the_layers_outputs_stacked(lora):
    _, layers = _layers(lora)
    y_t = torch.randn(16, 5, dtype=torch.float64)
    fused = Fused(layers)
    with torch.no_grad():
        got, want = fused.product(y_t), _separate(layers, y_t)
    assert got.shape == (20, 5) and fused.sizes == [12, 4, 4]
    assert_same_f64(got, want)


@pytest.mark.numerics
def test_the_stacked_copy_follows_every_change_of_a_frozen_weight():
    # LoRA: the base is frozen and stacked; changed in place (a checkpoint's load) or replaced,
    # the copy is made again; the adapters train under torch's fused AdamW, which does not move
    # their version counters, and are read as they are
    model, layers = _layers(lora=True)
    y_t = torch.randn(16, 5, dtype=torch.float64)
    fused = Fused(layers)
    weights = [layer.base_layer.weight if hasattr(layer, "base_layer") else layer.weight
               for layer in layers]  # fmt: skip
    with torch.no_grad():
        fused.product(y_t)
        kept = fused._current(weights)
        assert kept is not None and fused._current(weights) is kept  # unchanged: no new copy
        layers[1].weight.mul_(2.0)  # in place
        assert_same_f64(fused.product(y_t), _separate(layers, y_t))
        layers[1].weight.data = layers[1].weight.detach() * 3.0  # a new tensor under it
        assert_same_f64(fused.product(y_t), _separate(layers, y_t))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=0.5, fused=True)
    before = [p._version for p in trained]
    model(torch.randn(3, 16, dtype=torch.float64)).square().sum().backward()
    optimizer.step()
    assert [p._version for p in trained] == before  # why the adapters are never copied
    with torch.no_grad():
        assert_same_f64(fused.product(y_t), _separate(layers, y_t))


@pytest.mark.numerics
def test_weights_that_train_run_one_product_each():
    # full fine-tuning under fused AdamW: nothing is stacked, each step's weights are read
    model, layers = _layers(lora=False)
    y_t = torch.randn(16, 5, dtype=torch.float64)
    fused = Fused(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    for _ in range(2):
        with torch.no_grad():
            assert_same_f64(fused.product(y_t), _separate(layers, y_t))
        assert fused._current([layer.weight for layer in layers]) is None
        model(torch.randn(3, 16, dtype=torch.float64)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_llama_keeps_its_fused_layers_between_sampling_calls(make_model):
    model = make_model("llama")
    first = llama_decode._fused_layers(model)
    assert llama_decode._fused_layers(model) is first
    wrapped = apply_lora(model, r=2, alpha=2.0)  # the layers are new peft modules
    again = llama_decode._fused_layers(wrapped.get_base_model())
    assert again is not first
    assert again[0][0].layers[0] is wrapped.get_base_model().model.layers[0].self_attn.q_proj
