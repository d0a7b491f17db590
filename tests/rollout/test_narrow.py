"""Decode-step linear layers as W·xᵀ (`grouprl.rollout.narrow`): the same sums as x·Wᵀ, only in
the narrow band, only in the thread that decodes, and gone after the block."""

from __future__ import annotations

import threading

import pytest
import torch
from tests.numerics import U32, forward_bound
from torch import nn

from grouprl.models.lora import apply_lora
from grouprl.rollout import narrow
from grouprl.rollout.narrow import narrow_linears
from grouprl.rollout.sampling import sample_groups


def _calls(monkeypatch) -> list[int]:
    """Counts the narrow products taken (`narrow._product`)."""
    seen: list[int] = []
    real = narrow._product

    def counted(linear, x_t):
        seen.append(x_t.shape[1])
        return real(linear, x_t)

    monkeypatch.setattr(narrow, "_product", counted)
    return seen


@pytest.mark.parametrize("bias", [False, True])
def test_narrow_product_is_the_linear_layers_own_within_rounding(bias):
    # 32 rows of 96 features: in the band. Each output sums 96 products; two orders of that sum
    # differ by at most 2·96·u·Σ|w·x| (+ the bias' rounding).
    torch.manual_seed(0)
    layer = nn.Linear(96, 200, bias=bias)
    x = torch.randn(32, 1, 96)
    want = layer(x)
    with torch.no_grad(), narrow_linears(layer):
        assert "forward" in vars(layer)
        got = layer(x)
    assert "forward" not in vars(layer)
    assert got.shape == want.shape and got.is_contiguous()
    scale = (x.abs() @ layer.weight.abs().T) + (layer.bias.abs() if bias else 0)
    assert ((got - want).abs() <= 2 * 97 * U32 * scale).all()
    assert not torch.equal(torch.zeros_like(got), got)


def test_only_the_band_without_grad_in_the_decoding_thread(monkeypatch):
    seen = _calls(monkeypatch)
    layer = nn.Linear(96, 128)
    with narrow_linears(layer):
        with torch.no_grad():
            layer(torch.randn(4, 96))  # below the band
            layer(torch.randn(64, 96))  # above it
            assert seen == []
            layer(torch.randn(8, 96))
            layer(torch.randn(2, 24, 96))  # 48 rows
            assert seen == [8, 48]
        layer(torch.randn(16, 96))  # gradients on: the layer's own forward
        assert seen == [8, 48]
        with torch.no_grad():
            other = threading.Thread(target=lambda: layer(torch.randn(16, 96)))
            other.start()
            other.join()
        assert seen == [8, 48]  # another thread outside a block: untouched
    with torch.no_grad():
        layer(torch.randn(16, 96))  # after the block
    assert seen == [8, 48]


def test_blocks_overlap_and_the_override_goes_on_error():
    layer = nn.Linear(96, 128)
    with narrow_linears(layer):
        with narrow_linears(layer):
            pass
        assert "forward" in vars(layer)  # the outer block is still open
    assert "forward" not in vars(layer)
    with pytest.raises(RuntimeError, match="boom"), narrow_linears(layer):
        raise RuntimeError("boom")
    assert "forward" not in vars(layer) and narrow._users == {}


def test_small_or_wrapped_layers_keep_their_forward():
    small = nn.Linear(8, 576)  # a LoRA rank's width
    wide64 = nn.Linear(96, 128).double()
    custom = nn.Linear(96, 128)
    custom.forward = lambda x: x
    assert narrow._forward_of(small) is None
    assert narrow._forward_of(wide64) is None
    assert narrow._forward_of(custom) is None


def test_lora_layers_in_one_call_as_peft_adds_them(make_model, monkeypatch):
    # A LoRA model whose adapters are not zero: the layer's output through narrow_linears
    # against peft's own, both float32, to the forward bound of one layer
    model = apply_lora(make_model("llama"), r=4, alpha=8.0,
                       target_modules=["q_proj", "up_proj"])  # fmt: skip
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.1)
    layer = model.get_base_model().model.layers[0].mlp.up_proj
    x = torch.randn(16, 1, 64)
    with torch.no_grad():
        want = layer(x)
        seen = _calls(monkeypatch)
        with narrow_linears(model):
            got = layer(x)
    assert seen == [16, 16, 16]  # the base and both adapter products, narrow
    base, a, b = (
        layer.base_layer.weight,
        layer.lora_A["default"].weight,
        layer.lora_B["default"].weight,
    )
    scale = x.abs() @ base.abs().T + 2.0 * ((x.abs() @ a.abs().T) @ b.abs().T)
    assert ((got - want).abs() <= 2 * 2 * 64 * U32 * scale).all()


def test_sampling_takes_the_narrow_products_and_samples_the_same(
    make_model, tokenizer, monkeypatch
):
    # 4 prompts x G 4 = 16 rows: every decode step is in the band. Same seed, same tokens; the
    # sampled log-probs within the forward bound of two float32 forwards of one function.
    model = apply_lora(make_model("qwen2"), r=4, alpha=8.0)
    torch.manual_seed(2)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    prompts = ["abc", "hello", "xyz w", "q"]

    def sample():
        return sample_groups(model, tokenizer, prompts, group_size=4, max_new_tokens=6,
                             temperature=1.0, seed=3)  # fmt: skip

    monkeypatch.setattr(narrow, "MAX_ROWS", 0)  # off
    plain = sample()
    monkeypatch.setattr(narrow, "MAX_ROWS", 48)
    seen = _calls(monkeypatch)
    narrowed = sample()
    assert 16 in seen
    assert torch.equal(narrowed.completion_ids, plain.completion_ids)
    with torch.no_grad():
        magnitude = float(model(plain.prompt_ids).logits.abs().max())
    bound = forward_bound(model.config, magnitude)
    assert (narrowed.old_logp - plain.old_logp).abs().max() <= bound
