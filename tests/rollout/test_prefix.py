"""The batch's common prompt prefix run once (`grouprl.rollout.prefix`): where the prompts split,
the packed line of the prefix and the remainders, and that the sampler and the log-prob pass
compute what the whole prompts' forward does, packed in one forward or in two."""

from __future__ import annotations

import pytest
import torch

from grouprl.models.lora import apply_lora
from grouprl.rollout import _hf, completion_logprobs, prefix, sample_groups
from grouprl.rollout.prefix import common_prefix, prefix_split
from numerics import assert_same_f64

#: a 23-character header every prompt starts with (the character tokenizer: one token each,
#: after <bos>), then prompts of 3, 8 and 1 characters of their own
HEADER = "question: what is this?"
PROMPTS = [HEADER + " abc", HEADER + " hello wo", HEADER + "x"]


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.bool)
    return ids, mask


def test_the_common_prefix_of_left_padded_prompts():
    ids, mask = _padded([[5, 6, 7, 8, 9], [5, 6, 7, 1, 2, 3, 4]])
    assert common_prefix(ids, mask) == 3
    # one prompt starts the other: each keeps its last token (the shortest less one)
    ids, mask = _padded([[5, 6, 7], [5, 6, 7, 8]])
    assert common_prefix(ids, mask) == 2
    assert common_prefix(*_padded([[5, 6, 7], [9, 6, 7]])) == 0
    assert common_prefix(*_padded([[5, 6, 7, 8]])) == 0  # one prompt: nothing to share
    holes = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)  # not left padding
    assert common_prefix(torch.full((2, 4), 5), holes) == 0


def test_a_split_moves_each_rows_padding_after_the_prefix(monkeypatch):
    monkeypatch.setattr(prefix, "MIN_PREFIX_TOKENS", 2)
    ids, mask = _padded([[5, 6, 7, 8, 9], [5, 6, 7, 1, 2, 3, 4]])
    split = prefix_split(ids, mask)
    assert split.length == 3
    assert split.ids.tolist() == [[0, 0, 8, 9], [1, 2, 3, 4]]
    assert split.mask.tolist() == [[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1]]
    assert split.positions[:, 2:].tolist() == [[3, 4], [5, 6]]  # the real tokens' positions
    assert split.positions[1].tolist() == [3, 4, 5, 6]
    monkeypatch.setattr(prefix, "MIN_PREFIX_TOKENS", 4)
    assert prefix_split(ids, mask) is None  # 3 shared tokens: under the floor


def test_the_packed_line_of_a_split(monkeypatch):
    # prompts [5 6 7 | 8 9] and [5 6 7 | 1 2 3 4]: the prefix once, then each remainder; a
    # remainder sees the prefix and itself, never the other; the cache's columns in the split's
    # layout [prefix | padding | rest] point into the line (padding at 0, masked)
    monkeypatch.setattr(prefix, "MIN_PREFIX_TOKENS", 2)
    ids, mask = _padded([[5, 6, 7, 8, 9], [5, 6, 7, 1, 2, 3, 4]])
    split = prefix_split(ids, mask)
    line, positions, allowed, columns = prefix._line(ids, mask, split)
    assert line.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert positions.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 6]]
    assert columns.tolist() == [[0, 1, 2, 0, 0, 3, 4], [0, 1, 2, 5, 6, 7, 8]]
    seen = allowed[0, 0]
    assert seen.shape == (9, 9)
    assert seen[4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]  # "9": prefix, "8", itself
    assert seen[6].nonzero().flatten().tolist() == [0, 1, 2, 5, 6]  # "2": prefix, "1", itself
    assert seen[2].nonzero().flatten().tolist() == [0, 1, 2]  # the prefix: causal


def _spy(monkeypatch) -> list[tuple[str, int] | None]:
    """Which way each prompt forward went: ("packed", C), ("two", C) or None (whole)."""
    taken: list[tuple[str, int] | None] = []
    packed, two = prefix.run_packed, prefix.run_prefix

    def spy_packed(*args):
        out = packed(*args)
        if out is not None:
            taken.append(("packed", out[0].length))
        return out

    def spy_two(*args):
        split = two(*args)
        taken.append(None if split is None else ("two", split.length))
        return split

    monkeypatch.setattr(prefix, "run_packed", spy_packed)
    monkeypatch.setattr(prefix, "run_prefix", spy_two)
    return taken


def _way(monkeypatch, way: str) -> None:
    if way == "two":  # a line over the limit: the prefix, then the remainders against it
        monkeypatch.setattr(prefix, "MAX_PACKED_TOKENS", 0)


@pytest.mark.numerics
@pytest.mark.parametrize("way", ["packed", "two"])
@pytest.mark.parametrize("group_size", [4, 1], ids=["shared-prompt", "per-row"])
def test_sampling_with_the_prefix_run_once_samples_the_same(make_model, tokenizer, monkeypatch,
                                                            group_size, way):  # fmt: skip
    # float64: the same function up to the order of sums, so the same tokens and log-probs
    # within F64_SAME; G 4 keeps one prompt copy per group while decoding, G 1 per-row copies
    model = make_model("llama", dtype=torch.float64)
    taken = _spy(monkeypatch)
    _way(monkeypatch, way)

    def sample():
        return sample_groups(model, tokenizer, PROMPTS, group_size=group_size, max_new_tokens=6,
                             temperature=1.0, seed=3)  # fmt: skip

    got = sample()
    assert taken == [(way, len(HEADER) + 1)]  # <bos> and the header: the shortest keeps "x"
    monkeypatch.setattr(prefix, "MIN_PREFIX_TOKENS", 10**6)
    want = sample()
    assert taken[-1] is None
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert_same_f64(got.old_logp, want.old_logp)


@pytest.mark.numerics
@pytest.mark.parametrize("way", ["packed", "two"])
@pytest.mark.parametrize("new_tokens", [7, 40], ids=["prompt-pass", "expanded-cache"])
def test_the_log_prob_pass_with_the_prefix_run_once(make_model, tokenizer, monkeypatch,
                                                    new_tokens, way):  # fmt: skip
    # float64, LoRA: values and gradients against the whole prompts' forward, through the
    # per-group prompt attention (completions narrower than the prompts) and the expanded cache
    model = apply_lora(make_model("llama", dtype=torch.float64), r=4, alpha=8.0)
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.1)
    rollout = sample_groups(model, tokenizer, PROMPTS, group_size=3, max_new_tokens=new_tokens,
                            seed=1)  # fmt: skip
    wide = int(rollout.mask.sum(-1).max()) > rollout.prompt_ids.shape[1]
    assert wide == (new_tokens == 40)  # the cache expanded per row: SDPA over the copies
    taken = _spy(monkeypatch)
    _way(monkeypatch, way)

    def run():
        model.zero_grad()
        logp = completion_logprobs(model, rollout, temperature=0.8)
        weights = torch.arange(logp.numel(), dtype=logp.dtype).view(logp.shape)
        (logp * weights * rollout.mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logp.detach() * rollout.mask, grads

    logp, grads = run()
    assert taken == [(way, len(HEADER) + 1)]
    monkeypatch.setattr(prefix, "MIN_PREFIX_TOKENS", 10**6)
    want, want_grads = run()
    assert taken[-1] is None
    assert_same_f64(logp, want)
    assert grads.keys() == want_grads.keys() and grads
    for name, grad in grads.items():
        assert_same_f64(grad, want_grads[name])


def test_the_prefix_is_not_split_where_it_does_not_apply(make_model, tokenizer):
    ids, mask = _padded([[1, *range(4, 24)], [1, *range(4, 24), 5]])
    assert prefix_split(ids, mask) is not None  # 21 shared tokens
    sliding = make_model("qwen2", sliding_window=8)  # sliding-window layers keep their columns
    assert not prefix.shares_prefix(sliding, _hf.new_cache(sliding))
    llama = make_model("llama")
    assert prefix.shares_prefix(llama, _hf.new_cache(llama))
    cache = _hf.new_cache(llama)
    with torch.no_grad():
        _hf.forward_last(llama, ids, mask, _hf.left_pad_positions(mask), cache)
    assert not prefix.shares_prefix(llama, cache)  # a cache that holds positions already
    assert prefix.packs_prompts(llama, _hf.new_cache(llama))
    llama.config._attn_implementation = "eager"  # a mask it would add, not take: two forwards
    try:
        assert not prefix.packs_prompts(llama, _hf.new_cache(llama))
        assert prefix.shares_prefix(llama, _hf.new_cache(llama))
    finally:
        llama.config._attn_implementation = "sdpa"
