"""LoRA adapters: only they train, the wrapped model starts as the base, the base model is
the reference, and the saved merged model computes what the adapter model computes."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from grouprl.errors import UserError
from grouprl.models import load_model, load_tokenizer
from grouprl.models.lora import apply_lora, base_model_context, is_lora, save_final
from grouprl.rollout import completion_logprobs, sample_groups
from numerics import assert_merged_weights, assert_same_function


@pytest.fixture(scope="module")
def base():
    return load_model("builtin:arith")


def _moved(model):
    """The adapter after some training: its B matrices (zero at init) made non-zero."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


@pytest.mark.numerics
def test_only_adapters_train_and_the_start_is_the_base(base):
    lora = apply_lora(copy.deepcopy(base), r=4, alpha=8)
    assert is_lora(lora) and not is_lora(base)
    trained = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    assert not any("lm_head" in n or "embed" in n for n in trained)  # "all-linear" spares them
    assert all(p.dtype == torch.float32 for n, p in lora.named_parameters() if p.requires_grad)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():  # B = 0: each layer adds an exact 0 to the base's output
        assert torch.equal(lora(input_ids=ids).logits, base(input_ids=ids).logits)


def test_adapters_are_float32_over_a_bf16_base():
    lora = apply_lora(load_model("builtin:arith", dtype=torch.bfloat16), r=4, alpha=8)
    dtypes = {p.dtype for n, p in lora.named_parameters() if "lora_" in n}
    frozen = {p.dtype for n, p in lora.named_parameters() if "lora_" not in n}
    assert dtypes == {torch.float32} and frozen == {torch.bfloat16}


@pytest.mark.numerics
def test_the_reference_is_the_base_model_with_adapters_off(base):
    tokenizer = load_tokenizer("builtin:arith")
    lora = _moved(apply_lora(copy.deepcopy(base), r=4, alpha=8))
    rollout = sample_groups(lora, tokenizer, ["12+34="], group_size=4, max_new_tokens=12, seed=0)
    with torch.no_grad():
        with base_model_context(lora):
            ref = completion_logprobs(lora, rollout)
        policy = completion_logprobs(lora, rollout)
        plain = completion_logprobs(base, rollout)
    assert torch.equal(ref, plain)  # adapters off: each layer is its base layer, the same ops
    assert (policy - plain).abs().max() > 1e-3  # the adapter does change the policy


@pytest.mark.numerics
def test_merged_model_equals_the_adapter_model(base, tmp_path):
    tokenizer = load_tokenizer("builtin:arith")
    lora = _moved(apply_lora(copy.deepcopy(base), r=4, alpha=8))
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    unmerged = copy.deepcopy(lora)  # save_final consumes the LoRA wrapper
    with torch.no_grad():
        expected = lora(input_ids=ids).logits
    save_final(lora, tokenizer, tmp_path / "final")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert_merged_weights(merged, unmerged)
    from peft import PeftModel

    adapter = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "final" / "adapter")
    with torch.no_grad():
        assert_same_function(merged, unmerged, base, ids)
        # the saved adapter is the same weights through the same code: the same bits
        assert torch.equal(adapter(input_ids=ids).logits, expected)
        # an adapter directory is a model spec too: its base with the adapter merged in, by
        # the same float32 merge as final/
        from_adapter = load_model(tmp_path / "final" / "adapter")(input_ids=ids).logits
        assert torch.equal(from_adapter, merged(input_ids=ids).logits)


def test_target_modules_that_match_nothing_are_a_user_error(base):
    with pytest.raises(UserError, match=r"cannot add LoRA adapters.*--lora-target-modules"):
        apply_lora(copy.deepcopy(base), r=4, alpha=8, target_modules=["no_such_proj"])
