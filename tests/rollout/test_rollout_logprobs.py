"""completion_logprobs: equal to sampling's old_logp, and to a plain unshared computation.

These are claims that two paths compute the same function, so they are checked on float64
models to `numerics.F64_SAME` of the magnitudes compared (see tests/numerics.py)."""

from __future__ import annotations

import pytest
import torch

from grouprl.rollout import completion_logprobs, sample_groups
from grouprl.rollout._hf import _PLAIN_HEAD
from numerics import assert_same_f64

PROMPTS = ["1+2=", "a longer prompt, 37*45=", "x", "q: 12-7=? a:"]


def _reference(model, rollout, temperature):
    """logp and entropy (N, T) from one forward of the N full sequences with full logits."""
    g = rollout.group_size
    ids = torch.cat([rollout.prompt_ids.repeat_interleave(g, 0), rollout.completion_ids], 1)
    attn = torch.cat(
        [rollout.prompt_mask.repeat_interleave(g, 0), torch.ones_like(rollout.mask)], 1
    )
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    p = rollout.prompt_ids.shape[1]
    logits = logits[:, p - 1 : -1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp_all = torch.log_softmax(logits / temperature, -1)  # (N, T, V)
    logp = logp_all.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros_like(logp)
    return torch.where(rollout.mask, logp, zero), torch.where(rollout.mask, entropy, zero)


@pytest.mark.numerics
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 10, 0.9)])
def test_old_logp_and_entropy_equal_completion_logprobs(
    model64, tokenizer, temperature, top_k, top_p
):
    model = model64
    rollout = sample_groups(
        model,
        tokenizer,
        PROMPTS,
        group_size=4,
        max_new_tokens=20,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=0,
    )
    assert rollout.prompt_mask.sum(-1).unique().numel() == len(PROMPTS)  # different lengths
    with torch.no_grad():
        logp, entropy = completion_logprobs(
            model, rollout, temperature=rollout.temperature, with_entropy=True
        )
    assert_same_f64(logp, rollout.old_logp)
    assert (logp[~rollout.mask] == 0).all()
    # the sampler's entropy is the trainer's, before truncation like old_logp
    assert_same_f64(rollout.entropy, entropy)
    assert (rollout.entropy > 0).any() and (rollout.entropy[~rollout.mask] == 0).all()


@pytest.mark.numerics
@pytest.mark.parametrize("chunk_tokens", [7, None])  # several recomputed chunks; one stored
def test_shared_prompt_equals_unshared_values_and_gradients(model64, tokenizer, chunk_tokens):
    model = model64
    rollout = sample_groups(model, tokenizer, PROMPTS, group_size=3, max_new_tokens=16, seed=1)
    weights = torch.randn(
        rollout.mask.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    temperature = 0.8

    model.zero_grad()
    logp, entropy = completion_logprobs(
        model, rollout, temperature=temperature, with_entropy=True, chunk_tokens=chunk_tokens
    )
    ((logp * weights).sum() + entropy.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad()
    ref_logp, ref_entropy = _reference(model, rollout, temperature)
    ((ref_logp * weights).sum() + ref_entropy.sum()).backward()

    assert_same_f64(logp, ref_logp)
    assert_same_f64(entropy, ref_entropy)
    for name, p in model.named_parameters():
        assert torch.isfinite(grads[name]).all(), name
        assert_same_f64(grads[name], p.grad)
    model.zero_grad()


@pytest.mark.numerics
def test_buckets_run_rows_at_their_own_widths_with_the_same_values_and_gradients(
    model64, tokenizer
):
    """Rows of a group at different lengths (cut here to 16, 9, 3, 1 or 0 tokens), run in
    buckets across groups at each bucket's own width over the one prompt forward: the values
    and gradients of one pass at the longest's width."""
    import dataclasses

    model = model64
    rollout = sample_groups(model, tokenizer, PROMPTS, group_size=3, max_new_tokens=4, seed=1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, len(tokenizer), (12, 16), generator=gen)  # (12, 16) no specials
    cut = torch.tensor([16, 3, 9, 1, 16, 0, 3, 3, 1, 9, 1, 2])  # (12,) rows end at their own
    mask = torch.arange(16)[None] < cut[:, None]
    rollout = dataclasses.replace(rollout, completion_ids=ids, mask=mask, loss_mask=mask,
                                  old_logp=torch.zeros(12, 16), entropy=None)  # fmt: skip
    buckets = [torch.tensor([0, 4, 2]), torch.tensor([9, 7, 1, 6, 11]), torch.tensor([3, 8, 10, 5])]
    weights = torch.randn(
        mask.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    with torch.no_grad():
        completion_logprobs(model, rollout)  # the head probe runs once per model
    decoder_widths = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: decoder_widths.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )

    def values_and_grads(**kwargs):
        model.zero_grad()
        logp, entropy = completion_logprobs(model, rollout, temperature=0.8, with_entropy=True,
                                            **kwargs)  # fmt: skip
        ((logp * weights).sum() + entropy.sum()).backward()
        return logp, entropy, {name: p.grad.clone() for name, p in model.named_parameters()}

    try:
        logp, entropy, grads = values_and_grads(buckets=buckets)
        bucketed_widths = decoder_widths[:]
        decoder_widths.clear()
        ref_logp, ref_entropy, ref_grads = values_and_grads()
    finally:
        hook.remove()
        model.zero_grad()
    p = rollout.prompt_ids.shape
    # the prompts once, then each bucket as wide as its longest row but its last token (16, 9;
    # the third's rows are 1 token or none: their states are the prompts' last, no forward)
    assert bucketed_widths == [tuple(p), (3, 15), (5, 8)]
    assert decoder_widths == [tuple(p), (12, 15)]
    assert_same_f64(logp, ref_logp)
    assert_same_f64(entropy, ref_entropy)
    assert (logp[~mask] == 0).all() and (logp[mask] != 0).all()
    for name in grads:
        assert torch.isfinite(grads[name]).all(), name
        assert_same_f64(grads[name], ref_grads[name])
    for wrong in ([torch.tensor([0, 1])], [torch.arange(12), torch.tensor([3])]):
        with pytest.raises(ValueError, match="each of the 12 rows once"):
            completion_logprobs(model, rollout, buckets=wrong)


@pytest.mark.numerics
def test_sliding_window_layers_share_the_prompt_correctly(make_model, tokenizer):
    model = make_model("qwen2", sliding_window=5, dtype=torch.float64)
    assert "sliding_attention" in model.config.layer_types
    rollout = sample_groups(model, tokenizer, PROMPTS, group_size=3, max_new_tokens=12, seed=0)
    with torch.no_grad():
        logp = completion_logprobs(model, rollout)
        ref, _ = _reference(model, rollout, 1.0)
        # buckets need plain full-attention caches: here they are ignored, the values the same
        halves = list(torch.arange(rollout.mask.shape[0]).chunk(2))
        bucketed = completion_logprobs(model, rollout, buckets=halves)
    assert_same_f64(logp, ref)
    assert_same_f64(rollout.old_logp, ref)
    assert torch.equal(bucketed, logp)


@pytest.mark.numerics
def test_chunking_and_no_grad_give_the_same_values(llama, llama64, tokenizer):
    rollout = sample_groups(llama64, tokenizer, PROMPTS, group_size=2, max_new_tokens=10, seed=2)
    with torch.no_grad():
        whole = completion_logprobs(llama64, rollout)
        chunked = completion_logprobs(llama64, rollout, chunk_tokens=3)
        fp32 = completion_logprobs(llama, rollout)
    assert_same_f64(whole, chunked)
    assert whole.shape == rollout.mask.shape and fp32.dtype == torch.float32


@pytest.mark.numerics
def test_gradient_checkpointing_falls_back_to_unshared(make_model, tokenizer):
    model = make_model("llama", dtype=torch.float64)
    rollout = sample_groups(model, tokenizer, PROMPTS, group_size=2, max_new_tokens=8, seed=4)
    model.gradient_checkpointing_enable()
    model.train()
    logp = completion_logprobs(model, rollout)
    # old_logp from sampling is an ordinary tensor: it can sit in a differentiable loss.
    ((logp - rollout.old_logp).exp() * rollout.mask).sum().backward()
    assert_same_f64(logp.detach(), rollout.old_logp)


@pytest.mark.numerics
def test_models_with_processed_logits_take_the_full_logits_path(make_model, tokenizer):
    model = make_model("llama", dtype=torch.float64)
    original = model.forward

    def halved(*args, **kwargs):  # e.g. soft-capping: logits are not head(decoder(x))
        out = original(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    model.forward = halved
    rollout = sample_groups(model, tokenizer, PROMPTS, group_size=2, max_new_tokens=8, seed=5)
    with torch.no_grad():
        logp = completion_logprobs(model, rollout)
    assert _PLAIN_HEAD[model] is False
    assert_same_f64(logp, rollout.old_logp)


def test_empty_completions_give_zeros(llama, tokenizer):
    rollout = sample_groups(llama, tokenizer, PROMPTS[:1], group_size=2, max_new_tokens=3, seed=0)
    rollout.mask = torch.zeros_like(rollout.mask)
    logp, entropy = completion_logprobs(llama, rollout, with_entropy=True)
    assert (logp == 0).all() and (entropy == 0).all()


@pytest.mark.numerics
@pytest.mark.parametrize("chunk_tokens", [7, None])  # several recomputed chunks; one stored
def test_a_divergence_against_a_teacher_equals_the_full_distributions(
    model64, make_model, tokenizer, chunk_tokens
):
    """`divergence` sees each position's whole log-softmax and the teacher's at the same
    position (`next_token_log_softmax`): the JSD per position and its gradients equal those of
    both models' full logits over the N full sequences."""
    from grouprl.core import generalized_jsd
    from grouprl.rollout.logprobs import next_token_log_softmax

    teacher = make_model("qwen2", seed=3, dtype=torch.float64)
    rollout = sample_groups(model64, tokenizer, PROMPTS, group_size=3, max_new_tokens=16, seed=2)
    temperature = 0.8
    theirs = next_token_log_softmax(teacher, rollout, temperature=temperature)

    def jsd(student, start):
        return generalized_jsd(student, theirs(start, start + student.shape[0]), 0.5)

    model64.zero_grad()
    logp, div = completion_logprobs(model64, rollout, temperature=temperature,
                                    chunk_tokens=chunk_tokens, divergence=jsd)  # fmt: skip
    (div.sum() + logp.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model64.named_parameters()}

    model64.zero_grad()
    mine, teachers = (_full_log_softmax(m, rollout, temperature) for m in (model64, teacher))
    ref = torch.where(rollout.mask, generalized_jsd(mine, teachers.detach(), 0.5), 0.0)
    ref_logp = mine.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    (ref.sum() + torch.where(rollout.mask, ref_logp, 0.0).sum()).backward()
    assert (ref[rollout.mask] > 0).all() and (div[~rollout.mask] == 0).all()
    assert_same_f64(div, ref)
    for name, p in model64.named_parameters():
        assert_same_f64(grads[name], p.grad)
    assert all(p.grad is None for p in teacher.parameters())  # no gradient reaches it
    model64.zero_grad()


def _full_log_softmax(model, rollout, temperature):
    """log-softmax (N, T, V) of one forward of the N full sequences."""
    g = rollout.group_size
    ids = torch.cat([rollout.prompt_ids.repeat_interleave(g, 0), rollout.completion_ids], 1)
    attn = torch.cat([rollout.prompt_mask.repeat_interleave(g, 0), torch.ones_like(rollout.mask)],
                     1)  # fmt: skip
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    return torch.log_softmax(logits[:, rollout.prompt_ids.shape[1] - 1 : -1] / temperature, -1)
