"""Packed forwards (`completion_logprobs(..., packs=...)`): rows concatenated into lines whose
position ids restart at each row, the lines one batch. A claim that two paths compute
the same function, checked on float64 models to `numerics.F64_SAME` (tests/numerics.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grouprl.models.lora import apply_lora
from grouprl.rollout import completion_logprobs, sample_groups
from grouprl.rollout.packed import packs_rows
from numerics import assert_same_f64

PROMPTS = ["1+2=", "a longer prompt, 37*45=", "x", "q: 12-7=? a:"]
#: rows ending at their own lengths (16 … 0 tokens), two in the middle with an untrained gap
CUT = torch.tensor([16, 3, 9, 1, 16, 0, 3, 3, 1, 9, 1, 2])
PACKS = [torch.tensor([0, 4, 2]), torch.tensor([9, 7, 1, 6, 11]), torch.tensor([3, 8, 10, 5])]


def ragged(model, tokenizer):
    """A rollout of 4 prompts of different lengths × G 3 whose rows end at `CUT`."""
    rollout = sample_groups(model, tokenizer, PROMPTS, group_size=3, max_new_tokens=4, seed=1)
    ids = torch.randint(4, len(tokenizer), (12, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(16)[None] < CUT[:, None]  # (12, 16)
    loss_mask = mask.clone()
    loss_mask[[0, 4], 5:8] = False  # tokens fed, not trained (a tool's output)
    return dataclasses.replace(rollout, completion_ids=ids, mask=mask, loss_mask=loss_mask,
                               old_logp=torch.zeros(12, 16), entropy=None)  # fmt: skip


def values_and_grads(model, rollout, **kwargs):
    weights = torch.randn(rollout.mask.shape, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float64)  # fmt: skip
    model.zero_grad()
    logp, entropy = completion_logprobs(model, rollout, temperature=0.8, with_entropy=True,
                                        **kwargs)  # fmt: skip
    ((logp * weights).sum() + entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return logp, entropy, grads


def assert_packed_equals_padded(model, rollout):
    lengths = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    try:
        logp, entropy, grads = values_and_grads(model, rollout, packs=PACKS)
    finally:
        hook.remove()
    want_logp, want_entropy, want_grads = values_and_grads(model, rollout, share_prompt=False)
    prompt = rollout.prompt_mask.sum(-1)
    # one forward, a line per pack, as long as the longest line: its rows' prompts and
    # completions but their last token (the shorter lines end in filler)
    lines = [sum(int(prompt[r // 3]) + max(int(CUT[r]), 1) - 1 for r in pack.tolist())
             for pack in PACKS]  # fmt: skip
    assert lengths == [(len(PACKS), max(lines))] and len(set(lines)) == len(PACKS)
    assert_same_f64(logp, want_logp)
    assert_same_f64(entropy, want_entropy)
    assert (logp[~rollout.mask] == 0).all() and (logp[rollout.mask] != 0).all()
    assert grads.keys() == want_grads.keys() and grads
    for name in grads:
        assert torch.isfinite(grads[name]).all(), name
        assert_same_f64(grads[name], want_grads[name])


@pytest.mark.numerics
def test_packed_rows_equal_the_padded_forward_values_and_gradients(model64, tokenizer):
    assert packs_rows(model64)
    assert_packed_equals_padded(model64, ragged(model64, tokenizer))


@pytest.mark.numerics
def test_packed_rows_equal_the_padded_forward_with_lora(make_model, tokenizer):
    model = apply_lora(make_model("llama", dtype=torch.float64), r=4, alpha=8)
    with torch.no_grad():  # adapters that act: B is 0 when made
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    assert packs_rows(model)
    assert_packed_equals_padded(model, ragged(model, tokenizer))


@pytest.mark.numerics
def test_packed_rows_keep_a_sliding_window_per_row(make_model, tokenizer):
    model = make_model("qwen2", sliding_window=5, dtype=torch.float64)
    assert "sliding_attention" in model.config.layer_types
    assert packs_rows(model)
    assert_packed_equals_padded(model, ragged(model, tokenizer))


def test_packs_must_partition_the_rows(llama, tokenizer):
    rollout = ragged(llama, tokenizer)
    for wrong in ([torch.tensor([0, 1])], [torch.arange(12), torch.tensor([3])]):
        with pytest.raises(ValueError, match="each of the 12 rows once"):
            completion_logprobs(llama, rollout, packs=wrong)


def test_a_model_whose_attention_ignores_the_restart_does_not_pack(make_model):
    model = make_model("llama")
    model.config._attn_implementation = "eager"  # eager ...

    def no_packing(module, args, kwargs):  # ... with every position id replaced by 0, 1, 2, …
        kwargs["position_ids"] = torch.arange(kwargs["input_ids"].shape[1])[None]
        return args, kwargs

    model.get_decoder().register_forward_pre_hook(no_packing, with_kwargs=True)
    assert not packs_rows(model)


@pytest.mark.numerics
def test_packed_rows_equal_the_padded_forward_on_a_mixture_of_experts(tmp_path):
    """A token's route is a function of its own hidden state, so packing leaves every top-k
    choice, value and gradient as the padded forward has them (float64: no near-tie flips)."""
    from grouprl.models.tiny import save_tiny_moe_model

    model, tokenizer = save_tiny_moe_model(tmp_path, "qwen3_moe")
    model = model.to(torch.float64)
    model.set_experts_implementation("eager")  # torch's grouped_mm takes no float64
    assert packs_rows(model)
    assert_packed_equals_padded(model, ragged(model, tokenizer))
