"""Observations fed as one chunk per forward (`grouprl.rollout.chunks`) against the one-token
loop, on real tiny Llama and Qwen2 models (positions and masks matter here: the scripted test
model ignores both, so it could not tell a wrong position from a right one).

Greedy decoding gives the same trajectories on both paths (ids, masks, ends, transcripts), and
their log-probs are the same computation (float64: tests/numerics.py); at temperature 1 the
teacher-forced log-probs of what the chunked path sampled are its `old_logp`.
"""

from __future__ import annotations

import pytest
import torch

from grouprl.messages import Observation
from grouprl.rollout import _hf, completion_logprobs, sample_groups
from numerics import assert_same_f64, forward_bound

SHORT = ["1+2=", "what is 3*4?", "hello there", "99-3=", "zzz"]
#: Prompts of one length: eager attention in float64 gives NaN on left padding (a query that
#: sees nothing sums two float64 minima to -inf), on either path.
EVEN = ["1+2=", "3*4?", "yes.", "99-3", "zzzz"]
#: Prompts of 32+ tokens: decoding keeps one prompt copy per group (`_hf.SharedPromptLayer`).
LONG = [p + " " + "abc def ghi jkl mno pqr stu vwx yz" for p in SHORT[:3]]


class Lengths:
    """A handler that answers a call at any of a few common characters with an observation of
    3, 11, 1 or 20 tokens by row and call, and ends a row at its 3rd (even rows) or 4th call."""

    closers = ("a", "e", "k", "n", "7", "3")
    ends_turns = False

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def respond(self, requests):
        answers = []
        for r in requests:
            if r.calls_made >= 2 + r.row % 2:
                answers.append(Observation(end=True, over_limit=True))
                continue
            k = [3, 11, 1, 20][(r.row + r.calls_made) % 4]
            ids = self.tokenizer("|" + "x" * (k - 1), add_special_tokens=False)["input_ids"]
            answers.append(Observation(ids=ids, messages=[{"role": "tool", "content": "x"}],
                                       calls=1))  # fmt: skip
        return answers


def _sample(model, tokenizer, prompts, *, one_token=False, budget=48, **kwargs):
    """Sample with the `Lengths` tools; `one_token`: force the one-token loop."""
    chunked = _hf.feeds_chunks
    if one_token:
        _hf.feeds_chunks = lambda *args: False
    try:
        return sample_groups(model, tokenizer, prompts, group_size=2, max_new_tokens=budget,
                             tools=Lengths(tokenizer), **kwargs)  # fmt: skip
    finally:
        _hf.feeds_chunks = chunked


def _largest_logit(model, rollout) -> float:
    """The largest |logit| over the rollout's prompts and completions, as the model reads them
    (the magnitude `forward_bound` scales with)."""
    g = rollout.group_size  # prompts are (B, P), completions (B·G, T), group-contiguous
    ids = torch.cat([rollout.prompt_ids.repeat_interleave(g, 0), rollout.completion_ids], dim=1)
    mask = torch.cat([rollout.prompt_mask.repeat_interleave(g, 0), rollout.mask], dim=1)
    return float(model(input_ids=ids, attention_mask=mask).logits.abs().max())


def _assert_same_trajectories(got, want):
    assert got.completion_ids.tolist() == want.completion_ids.tolist()
    assert got.mask.tolist() == want.mask.tolist()
    assert got.loss_mask.tolist() == want.loss_mask.tolist()
    assert got.truncated.tolist() == want.truncated.tolist()
    assert got.turns.transcripts == want.turns.transcripts
    assert got.turns.calls.tolist() == want.turns.calls.tolist()
    assert got.turns.ended_by_turns.tolist() == want.turns.ended_by_turns.tolist()


@pytest.mark.numerics
@pytest.mark.parametrize("prompts", [SHORT, LONG], ids=["per-row-prompts", "shared-prompts"])
@pytest.mark.parametrize("budget", [48, 23])
def test_greedy_trajectories_are_those_of_the_one_token_loop(model64, tokenizer, prompts, budget):
    got = _sample(model64, tokenizer, prompts, budget=budget, temperature=0.0)
    want = _sample(model64, tokenizer, prompts, budget=budget, temperature=0.0, one_token=True)
    _assert_same_trajectories(got, want)
    assert_same_f64(got.old_logp, want.old_logp)  # the same computation, summed in other orders
    assert_same_f64(got.entropy, want.entropy)
    calls = got.turns.calls
    assert int(calls.sum()) >= 6 and int((calls == 0).sum()) < len(calls)  # the case is real
    if budget == 23:  # some observation is cut by the budget, ending its trajectory there
        assert bool((got.truncated & ~got.loss_mask[:, -1] & got.mask[:, -1]).any())


@pytest.mark.numerics
def test_stop_strings_end_the_same_rows_at_the_same_tokens(model64, tokenizer):
    stop = ["dddd", "uuuu", "w+x", "111"]  # strings these models write, in some rows
    got = _sample(model64, tokenizer, SHORT, temperature=0.0, stop=stop)
    want = _sample(model64, tokenizer, SHORT, temperature=0.0, stop=stop, one_token=True)
    _assert_same_trajectories(got, want)
    assert got.texts == want.texts
    stopped = [any(t.endswith(x) for x in stop) for t in got.texts]
    assert any(stopped) and not all(stopped)


@pytest.mark.numerics
def test_eager_attention_takes_the_additive_mask(tokenizer, make_model):
    model = make_model("qwen2", dtype=torch.float64)
    model.set_attn_implementation("eager")
    got = _sample(model, tokenizer, EVEN, temperature=0.0)
    want = _sample(model, tokenizer, EVEN, temperature=0.0, one_token=True)
    assert int(got.turns.calls.sum()) > 0
    _assert_same_trajectories(got, want)
    # eager attention takes its softmax in float32 whatever the model's dtype, over key widths
    # that differ between the paths: a float32 difference between two forwards
    with torch.no_grad():
        magnitude = _largest_logit(model, got)
    bound = forward_bound(model.config, max(magnitude, 1.0))
    torch.testing.assert_close(got.old_logp, want.old_logp, rtol=0, atol=bound)


@pytest.mark.numerics
@pytest.mark.parametrize("prompts", [SHORT, LONG], ids=["per-row-prompts", "shared-prompts"])
def test_teacher_forcing_at_temperature_one_gives_old_logp(model, tokenizer, prompts):
    rollout = _sample(model, tokenizer, prompts, temperature=1.0, seed=3)
    assert int(rollout.turns.calls.sum()) > 0
    with torch.no_grad():
        logp = completion_logprobs(model, rollout)
        magnitude = _largest_logit(model, rollout)
    # two float32 forwards of the same function (a chunked decode against a full forward)
    bound = forward_bound(model.config, max(magnitude, 1.0))
    sampled = rollout.loss_mask
    torch.testing.assert_close(logp * sampled, rollout.old_logp, rtol=0, atol=bound)
    assert bool((rollout.old_logp[~sampled] == 0).all())


def test_an_observation_costs_one_forward(llama, tokenizer, monkeypatch):
    calls = []
    forward = llama.forward
    monkeypatch.setattr(llama, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))

    def run():
        calls.clear()
        rollout = sample_groups(llama, tokenizer, ["hello there"], group_size=1,
                                max_new_tokens=40, temperature=0.0, tools=_Single(tokenizer))  # fmt: skip
        return len(calls), rollout

    chunked_forwards, chunked = run()
    monkeypatch.setattr(_hf, "feeds_chunks", lambda *args: False)
    one_token_forwards, one_token = run()
    assert chunked.completion_ids.tolist() == one_token.completion_ids.tolist()
    sampled, total = int(chunked.loss_mask.sum()), int(chunked.mask.sum())
    assert total - sampled == 15 and int(chunked.turns.calls[0]) == 1
    # the prefill, then a forward for each token but the last: every completion token in the
    # one-token loop; in the chunked loop every sampled one, and one for the observation
    assert one_token_forwards == 1 + total - 1
    assert chunked_forwards == 1 + sampled - 1 + 1


class _Single:
    """Answers the first call (at any character) with a 15-token observation, ends at the next."""

    closers = tuple("abcdefghijklmnopqrstuvwxyz0123456789")
    ends_turns = False

    def __init__(self, tokenizer) -> None:
        self.ids = tokenizer("|" + "x" * 14, add_special_tokens=False)["input_ids"]

    def respond(self, requests):
        return [
            Observation(end=True)
            if r.calls_made
            else Observation(ids=self.ids, messages=[{"role": "tool", "content": "x"}], calls=1)
            for r in requests
        ]


def test_sliding_window_models_feed_one_token_per_step(make_model, tokenizer):
    model = make_model("qwen2", sliding_window=4)
    cache = _hf.new_cache(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 5, 6]]), **_hf.cache_kwargs(model, cache))
    _hf.expand_cache(cache, 2, extra=8)
    assert not _hf.feeds_chunks(model, cache)
    rollout = _sample(model, tokenizer, SHORT, temperature=0.0)  # the one-token loop, tools on
    assert int(rollout.turns.calls.sum()) > 0
