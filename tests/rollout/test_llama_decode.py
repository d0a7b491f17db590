"""A Llama's leaner CPU decode step (`grouprl.rollout.llama_decode`): the model's own function
over the same cache, taken only where it applies; the log-prob pass's shared-prompt attention
(`grouprl.rollout.prompt_pass`); LoRA adapters folded into one product (`narrow.folded_adapters`).

The test models' k/v projections are 32 wide, under the narrow products' MIN_FEATURES, so the
tests that want the lean step lower that floor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grouprl.models.lora import apply_lora
from grouprl.rollout import _hf, completion_logprobs, llama_decode, narrow, prompt_pass
from grouprl.rollout import logprobs as logprobs_module
from grouprl.rollout.llama_decode import LlamaStep, llama_step
from grouprl.rollout.sampling import encode_prompts, left_pad, sample_groups
from numerics import U32, assert_same_f64, forward_bound

PROMPTS = ["abc", "hello wor", "xy"]  # left padding in two of three rows


def _random_adapters(model, seed=1, std=0.1):
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, std)
    return model


def _prefilled(model, tokenizer, group_size, shared):
    """The B prompts prefilled and expanded to B·G rows as the sampler does; returns the cache,
    the (N,) positions of the first new token and the (N, P) mask."""
    rows, _ = encode_prompts(tokenizer, PROMPTS)
    ids, mask = left_pad(rows, tokenizer.pad_token_id, torch.device("cpu"))
    cache = _hf.new_cache(model)
    _hf.forward_last(model, ids, mask, _hf.left_pad_positions(mask), cache)
    _hf.expand_cache(cache, group_size, extra=4, prompt_mask=mask if shared else None)
    assert isinstance(cache.layers[0], _hf.SharedPromptLayer if shared else _hf.PreallocatedLayer)
    return cache, mask.sum(-1).repeat_interleave(group_size), mask.repeat_interleave(group_size, 0)


@pytest.mark.numerics
@pytest.mark.parametrize("shared", [True, False], ids=["shared-prompt", "per-row"])
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_the_lean_step_computes_the_models_forward(
    make_model, tokenizer, shared, lora, monkeypatch
):
    # float64: the same function up to the order of sums (F64_SAME), two decode steps in a row
    # (the second reads the key the first wrote); the head in blocks of 16 of its 52 rows
    monkeypatch.setattr(llama_decode, "HEAD_ROWS", 16)
    model = make_model("llama", dtype=torch.float64)
    if lora:
        model = _random_adapters(apply_lora(model, r=4, alpha=6.0))  # scaling 1.5
    base = model.get_base_model() if lora else model
    g = 3
    with torch.no_grad():
        caches = [_prefilled(model, tokenizer, g, shared) for _ in range(2)]
        (want_cache, first, mask), (got_cache, _, _) = caches
        step = LlamaStep(base)
        tokens = torch.randint(
            4, len(tokenizer), (2, len(first)), generator=torch.Generator().manual_seed(0)
        )
        for t in range(2):
            seen = torch.cat([mask, torch.ones(len(first), t + 1, dtype=torch.bool)], 1)
            position = (first + t)[:, None]
            with _hf.SharedPromptDecoding(model, want_cache) if shared else _null():
                want = _hf.forward_last(model, tokens[t, :, None], seen, position, want_cache)
            got = step.step(tokens[t], position, seen, got_cache)
            assert got.shape == want.shape == (len(first), len(tokenizer))
            assert_same_f64(got, want)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_sampling_takes_the_lean_step_in_the_band_and_samples_the_same(
    make_model, tokenizer, monkeypatch
):
    # 3 prompts x G 4 = 12 rows: every decode step in the band; G 1: 3 rows, below it. Same
    # seed, same tokens; the log-probs within the bound of two float32 forwards of one function.
    monkeypatch.setattr(llama_decode, "MIN_FEATURES", 16)
    model = _random_adapters(apply_lora(make_model("llama"), r=4, alpha=6.0), std=0.05)
    steps = []
    real = LlamaStep.step
    monkeypatch.setattr(
        LlamaStep, "step", lambda self, *a: steps.append(len(a[0])) or real(self, *a)
    )

    def sample(group_size):
        return sample_groups(model, tokenizer, PROMPTS, group_size=group_size, max_new_tokens=6,
                             temperature=1.0, seed=3)  # fmt: skip

    lean = sample(4)
    assert steps == [12] * 5  # every step after the prefill's token
    monkeypatch.setattr("grouprl.rollout.sampling.llama_step", lambda model: None)
    plain = sample(4)
    assert len(steps) == 5
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    with torch.no_grad():
        magnitude = float(model(plain.prompt_ids).logits.abs().max())
    assert (lean.old_logp - plain.old_logp).abs().max() <= forward_bound(model.config, magnitude)
    monkeypatch.undo()
    monkeypatch.setattr(llama_decode, "MIN_FEATURES", 16)
    monkeypatch.setattr(
        LlamaStep, "step", lambda self, *a: steps.append(len(a[0])) or real(self, *a)
    )
    sample(1)
    assert len(steps) == 5  # 3 rows: the model's forward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sample(4)
    assert len(steps) == 5  # autocast's lower-precision forward is the model's


def test_only_plain_llamas_get_a_lean_step(make_model, monkeypatch):
    monkeypatch.setattr(llama_decode, "MIN_FEATURES", 16)
    assert isinstance(llama_step(make_model("llama")), LlamaStep)
    assert isinstance(llama_step(apply_lora(make_model("llama"), r=4, alpha=8.0)), LlamaStep)
    assert llama_step(make_model("qwen2")) is None  # another architecture (biases)
    assert llama_step(make_model("llama", dtype=torch.float64)) is None
    hooked = make_model("llama")
    hooked.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert llama_step(hooked) is None
    patched = make_model("llama")
    patched.forward = lambda *a, **k: None
    assert llama_step(patched) is None
    dropping = apply_lora(make_model("llama"), r=4, alpha=8.0, dropout=0.1)
    for module in dropping.modules():
        if isinstance(module, nn.Dropout):
            module.train()
    assert llama_step(dropping) is None
    monkeypatch.setattr(llama_decode, "MIN_FEATURES", 64)
    assert llama_step(make_model("llama")) is None  # 32-wide k/v products


@pytest.mark.numerics
def test_the_log_prob_pass_attends_through_the_shared_prompt(make_model, tokenizer, monkeypatch):
    # float64: values and gradients of the prompt pass against SDPA over the copied rows
    model = make_model("llama", dtype=torch.float64)
    rollout = sample_groups(model, tokenizer, PROMPTS, group_size=3, max_new_tokens=7, seed=1)
    calls = []
    real = prompt_pass.attention
    monkeypatch.setattr(prompt_pass, "attention", lambda *a: calls.append(1) or real(*a))

    def run():
        model.zero_grad()
        logp = completion_logprobs(model, rollout, temperature=0.8)
        (logp * torch.arange(logp.numel(), dtype=logp.dtype).view(logp.shape)).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    logp, grads = run()
    assert len(calls) == model.config.num_hidden_layers
    monkeypatch.setattr(logprobs_module, "_shares_prompt", lambda decoder: False)
    want, want_grads = run()
    assert len(calls) == model.config.num_hidden_layers
    assert_same_f64(logp, want)
    for name, grad in grads.items():
        assert_same_f64(grad, want_grads[name])
    model.zero_grad()
    # completions wider than the prompts (16 > 10 columns): SDPA, whose scores are tiled
    monkeypatch.undo()
    monkeypatch.setattr(prompt_pass, "attention", lambda *a: calls.append(1) or real(*a))
    wide = sample_groups(model, tokenizer, PROMPTS, group_size=3, max_new_tokens=16, seed=1)
    assert int(wide.mask.sum(-1).max()) > wide.prompt_ids.shape[1]
    with torch.no_grad():
        completion_logprobs(model, wide)
    assert len(calls) == model.config.num_hidden_layers


def test_folded_adapters_are_peft_sum_in_one_product(make_model, monkeypatch):
    # float32, scaling 1.5 (not a power of two: the fold rounds otherwise than peft's product,
    # scaling and sum); output and gradients within the bound of one layer's sums
    model = _random_adapters(
        apply_lora(make_model("llama"), r=4, alpha=6.0, target_modules=["up_proj"])
    )
    layer = model.get_base_model().model.layers[0].mlp.up_proj
    x = torch.randn(5, 7, 64, requires_grad=True)
    folds = []
    real = narrow._folded
    monkeypatch.setattr(narrow, "_folded", lambda *a: folds.append(1) or real(*a))

    def run():
        x.grad = None
        model.zero_grad()
        out = layer(x)
        out.pow(2).sum().backward()
        a = layer.lora_A["default"].weight
        return out.detach(), x.grad.clone(), a.grad.clone()

    want = run()
    with narrow.folded_adapters(model):
        got = run()
    assert len(folds) == 1 and "forward" not in vars(layer)
    w, a, b = (m.detach().abs() for m in (layer.base_layer.weight, layer.lora_A["default"].weight,
                                         layer.lora_B["default"].weight))  # fmt: skip
    x_abs, out_abs = x.detach().abs(), want[0].abs()
    # each side's output: sums of 64 and 4 products, rounded apart: 2·2·(64 + 4)·u·Σ|terms|
    out_bound = 2 * 2 * 68 * U32 * (x_abs @ w.T + 1.5 * ((x_abs @ a.T) @ b.T))
    assert not torch.equal(got[0], torch.zeros_like(got[0]))
    assert ((got[0] - want[0]).abs() <= out_bound).all()
    # gradients (dL/dout = 2·out): the outputs' difference carried through, plus each side's
    # own rounding of sums of 128 + 4 (dL/dx) and 35 + 128 (dL/dA) terms
    g_abs, g_bound = 2 * out_abs, 2 * out_bound
    x_bound = g_bound @ (w + 1.5 * b @ a) + 2 * 2 * 132 * U32 * (g_abs @ w + 1.5 * (g_abs @ b) @ a)
    a_bound = 1.5 * (
        (g_bound @ b).flatten(0, 1).T @ x_abs.flatten(0, 1)
        + 2 * 2 * 163 * U32 * (g_abs @ b).flatten(0, 1).T @ x_abs.flatten(0, 1)
    )
    assert ((got[1] - want[1]).abs() <= x_bound).all()
    assert ((got[2] - want[2]).abs() <= a_bound).all()
    with torch.autocast("cpu", dtype=torch.bfloat16), narrow.folded_adapters(model):
        layer(x)
    layer.lora_dropout["default"] = nn.Dropout(0.5).train()
    with narrow.folded_adapters(model):
        layer(x)
    assert len(folds) == 1  # under autocast, or with dropout acting: peft's own forward
