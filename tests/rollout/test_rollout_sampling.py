"""sample_groups: agreement with `generate`, the sampling distribution, stopping, determinism."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from scipy import stats

from grouprl.errors import UserError
from grouprl.rollout import (
    HFRolloutEngine,
    RolloutEngine,
    completion_logprobs,
    encode_prompts,
    sample_groups,
    sampling,
)
from grouprl.rollout._hf import PreallocatedLayer, SharedPromptLayer
from grouprl.rollout.sampling import (
    sample_categorical,
    top_k_filter,
    top_p_filter,
)
from grouprl.rollout.stops import StopStrings
from numerics import assert_same_f64

EOS, PAD = 2, 0  # conftest.build_tokenizer's ids

PROMPTS = ["1+2=", "hello there, 37*45=", "x", "q: 12-7=? a:"]


def _generate(model, tokenizer, prompts, max_new_tokens):
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(
        **enc,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return out[:, enc["input_ids"].shape[1] :]


def test_greedy_matches_generate_token_for_token(model, tokenizer):
    rollout = sample_groups(
        model, tokenizer, PROMPTS, group_size=1, max_new_tokens=24, temperature=0.0
    )
    expected = _generate(model, tokenizer, PROMPTS, 24)
    assert torch.equal(rollout.completion_ids, expected)
    # Both pad after EOS; ours also says where each completion ends.
    for row, ids in enumerate(expected.tolist()):
        length = ids.index(EOS) + 1 if EOS in ids else 24
        assert int(rollout.lengths[row]) == length
        assert bool(rollout.truncated[row]) == (EOS not in ids)


def test_greedy_group_rows_are_identical_and_logp_at_temperature_one(llama, tokenizer):
    rollout = sample_groups(
        llama, tokenizer, PROMPTS[:2], group_size=3, max_new_tokens=8, temperature=0
    )
    assert rollout.temperature == 1.0
    ids = rollout.completion_ids.view(2, 3, -1)
    assert torch.equal(ids[:, 0], ids[:, 1]) and torch.equal(ids[:, 0], ids[:, 2])


def _first_token_probs(model, tokenizer, prompt, temperature):
    ids = tokenizer([prompt], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]
    return torch.softmax(logits / temperature, -1).double().numpy()


def _chi_square_p(counts, probs):
    """p-value of counts vs probs, pooling cells with expected count < 5 into one."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


@pytest.mark.numerics
def test_first_token_frequencies_follow_tempered_softmax(sharp_llama, tokenizer):
    temperature, samples = 0.7, 4000
    rollout = sample_groups(
        sharp_llama,
        tokenizer,
        ["37+45="],
        group_size=samples,
        max_new_tokens=1,
        temperature=temperature,
        seed=123,
    )
    counts = np.bincount(rollout.completion_ids[:, 0].numpy(), minlength=len(tokenizer))
    probs = _first_token_probs(sharp_llama, tokenizer, "37+45=", temperature)
    assert _chi_square_p(counts, probs) > 1e-3
    # The test has power: the untempered distribution is firmly rejected.
    wrong = _first_token_probs(sharp_llama, tokenizer, "37+45=", 1.0)
    assert _chi_square_p(counts, wrong) < 1e-6
    # old_logp is the tempered log-prob of the sampled token: log_softmax(z / T) of the float32
    # logits z, against float64 from the same z. Bound: float32 log_softmax rounds z / T once
    # and its log-sum-exp over V terms by at most (V + 2)·u·|values|; here V = 44, |z/T| <= 50
    # and |logp| <= 60, so 46 · 6e-8 · 60 ≈ 1.7e-4.
    with torch.no_grad():
        z = sharp_llama(input_ids=tokenizer(["37+45="], return_tensors="pt")["input_ids"]).logits
    z = z[0, -1].double() / temperature
    assert float(z.abs().max()) <= 50
    expected = torch.log_softmax(z, -1)[rollout.completion_ids[:, 0]]  # (N,)
    assert float(expected.abs().max()) <= 60
    bound = (len(tokenizer) + 2) * 2**-24 * 60
    torch.testing.assert_close(rollout.old_logp[:, 0].double(), expected, atol=bound, rtol=0)


def _teacher_forced_logits(model, rollout):
    """(N, T, V) logits predicting each completion token, from one plain forward."""
    g = rollout.group_size
    ids = torch.cat([rollout.prompt_ids.repeat_interleave(g, 0), rollout.completion_ids], 1)
    attn = torch.cat(
        [rollout.prompt_mask.repeat_interleave(g, 0), torch.ones_like(rollout.mask)], 1
    )
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    p = rollout.prompt_ids.shape[1]
    return logits[:, p - 1 : -1]


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.6), (8, 0.5)])
def test_top_k_top_p_never_emit_excluded_tokens(sharp_llama, tokenizer, top_k, top_p):
    temperature = 0.9
    rollout = sample_groups(
        sharp_llama,
        tokenizer,
        PROMPTS,
        group_size=32,
        max_new_tokens=12,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=0,
    )
    scores = _teacher_forced_logits(sharp_llama, rollout) / temperature  # (N, T, V)
    allowed = torch.ones_like(scores, dtype=torch.bool)
    flat = scores.reshape(-1, scores.shape[-1])
    if top_k:
        allowed &= (top_k_filter(flat, top_k) > -torch.inf).view_as(allowed)
    if top_p < 1:
        allowed &= (top_p_filter(flat, top_p) > -torch.inf).view_as(allowed)
    chosen = allowed.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    assert chosen[rollout.mask].all()
    # Truncation actually bit: some positions had excluded tokens to avoid.
    assert (~allowed).any(-1)[rollout.mask].float().mean() > 0.5


def test_filters_on_hand_made_scores():
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(top_k_filter(scores, 2)).tolist() == [[False, False, True, True]]
    # 0.5 < 0.7 so the second token is needed; 0.5 + 0.3 ≥ 0.7 so no third.
    assert torch.isinf(top_p_filter(scores, 0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(top_p_filter(scores, 0.4)).tolist() == [[False, True, True, True]]


@pytest.mark.parametrize("vocab", [40, 2500])  # one-level and two-level (blocked) search
def test_sample_categorical_matches_probabilities_and_skips_zeros(vocab):
    gen = torch.Generator().manual_seed(0)
    support = torch.randperm(vocab, generator=gen)[:20]  # 20 tokens with mass, spread out
    weights = torch.zeros(vocab)
    weights[support] = torch.rand(20, generator=gen) + 0.05
    draws = sample_categorical(weights.expand(4000, vocab), gen)  # unnormalised on purpose
    assert torch.isin(draws, support).all()
    counts = np.bincount(draws.numpy(), minlength=vocab)[support.numpy()]
    probs = weights[support].double().numpy()
    probs /= probs.sum()
    assert stats.chisquare(counts, probs * counts.sum()).pvalue > 1e-3


def test_group_samples_are_independent_draws(llama, tokenizer):
    rollout = sample_groups(llama, tokenizer, PROMPTS[:2], group_size=16, max_new_tokens=8, seed=3)
    for group in rollout.completion_ids.view(2, 16, -1):
        distinct = {tuple(row.tolist()) for row in group}
        assert len(distinct) >= 14  # near-uniform 50-way draws: collisions are rare
        assert len(set(group[:, 0].tolist())) > 4


def test_same_seed_same_completions_different_seed_differs(llama, tokenizer):
    kwargs = dict(group_size=4, max_new_tokens=10, temperature=0.8, top_p=0.95)
    a = sample_groups(llama, tokenizer, PROMPTS, seed=7, **kwargs)
    b = sample_groups(llama, tokenizer, PROMPTS, seed=7, **kwargs)
    c = sample_groups(llama, tokenizer, PROMPTS, seed=8, **kwargs)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts
    assert torch.equal(a.old_logp, b.old_logp)
    assert not torch.equal(a.completion_ids, c.completion_ids)


@pytest.mark.numerics
def test_prompt_alone_and_in_padded_batch_agree(model64, tokenizer):
    """Left padding changes nothing: the same greedy tokens, and the same log-probs (float64:
    the same computation over other shapes, see tests/numerics.py)."""
    model = model64
    alone = sample_groups(
        model, tokenizer, ["1+2="], group_size=1, max_new_tokens=12, temperature=0
    )
    batch = sample_groups(
        model, tokenizer, ["a much longer prompt: 1+2=?", "1+2=", "7"], group_size=1,
        max_new_tokens=12, temperature=0,
    )  # fmt: skip
    n = int(alone.lengths[0])
    assert torch.equal(batch.completion_ids[1, :n], alone.completion_ids[0, :n])
    assert_same_f64(batch.old_logp[1, :n], alone.old_logp[0, :n])


@pytest.mark.numerics
@pytest.mark.parametrize("layer", [PreallocatedLayer, SharedPromptLayer])
def test_eos_ends_rows_and_mask_stops_there(llama64, tokenizer, monkeypatch, layer):
    # A frequent character as a second EOS id (via generation_config, as instruct models do)
    # makes many rows end early, which also exercises compaction of finished rows (of per-row
    # caches, and of one prompt copy per group, which then writes out per-row copies).
    extra_eos = tokenizer.convert_tokens_to_ids("7")
    monkeypatch.setattr(llama64.generation_config, "eos_token_id", [EOS, extra_eos])
    if layer is SharedPromptLayer:  # the test prompts are short: share them anyway
        monkeypatch.setattr(sampling, "SHARED_PROMPT_MIN_TOKENS", 1)
    compactions = []
    select = layer.batch_select_indices
    monkeypatch.setattr(
        layer,
        "batch_select_indices",
        lambda self, idx: compactions.append(len(idx)) or select(self, idx),
    )
    rollout = sample_groups(llama64, tokenizer, PROMPTS, group_size=32, max_new_tokens=40, seed=0)
    assert compactions  # finished rows were dropped from the batch at least once
    with torch.no_grad():  # values stay exact for rows decoded after a compaction
        assert_same_f64(completion_logprobs(llama64, rollout), rollout.old_logp)
    ended = ~rollout.truncated
    assert 0.2 < ended.float().mean() < 1.0
    ids, mask = rollout.completion_ids, rollout.mask
    for row in range(ids.shape[0]):
        length = int(rollout.lengths[row])
        seq = ids[row, :length].tolist()
        hits = [i for i, t in enumerate(seq) if t in (EOS, extra_eos)]
        if rollout.truncated[row]:
            assert length == 40 and not hits
        else:
            assert hits == [length - 1]  # the first EOS is the last masked token
            assert "7" not in rollout.texts[row]
        assert mask[row, :length].all() and not mask[row, length:].any()
        assert (ids[row, length:] == PAD).all()
        assert (rollout.old_logp[row, length:] == 0).all()
        assert (rollout.old_logp[row, :length] < 0).all()


def test_stop_string_kept_and_mask_ends_at_its_last_token(llama, tokenizer):
    free = sample_groups(llama, tokenizer, ["1+2="], group_size=1, max_new_tokens=30, temperature=0)
    text = free.texts[0]
    assert len(text) >= 12
    stop = text[6:9]  # a 3-character string the greedy completion is known to contain
    first_end = text.index(stop) + len(stop)
    stopped = sample_groups(
        llama, tokenizer, ["1+2="], group_size=1, max_new_tokens=30, temperature=0,
        stop=["@@never@@", stop],
    )  # fmt: skip
    assert stopped.texts[0] == text[:first_end]
    assert int(stopped.lengths[0]) == first_end  # one token per character
    assert not stopped.truncated[0]
    assert torch.equal(stopped.completion_ids[0, :first_end], free.completion_ids[0, :first_end])


def test_stop_string_window_finds_multi_token_strings(tokenizer):
    stopper = StopStrings(tokenizer, ["a|b"])
    ids = tokenizer("xxa|b", add_special_tokens=False)["input_ids"]
    tokens = torch.tensor([[*ids, PAD, PAD]])
    running = torch.tensor([True])
    found = [bool(stopper.hits(tokens, None, running, t)[0]) for t in range(5)]
    assert found == [False, False, False, False, True]
    assert stopper.cut("12a|b34") == "12a|b"


def test_truncated_means_budget_spent_without_eos(llama, tokenizer):
    rollout = sample_groups(llama, tokenizer, PROMPTS, group_size=8, max_new_tokens=3, seed=0)
    assert rollout.completion_ids.shape[1] <= 3
    assert (rollout.lengths[rollout.truncated] == 3).all()
    last = rollout.completion_ids.gather(1, (rollout.lengths - 1)[:, None]).squeeze(1)
    assert ((last == EOS) == ~rollout.truncated).all()


def test_token_id_prompts_equal_string_prompts(llama, tokenizer):
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    a = sample_groups(llama, tokenizer, PROMPTS, group_size=2, max_new_tokens=6, seed=1)
    b = sample_groups(llama, tokenizer, ids, group_size=2, max_new_tokens=6, seed=1)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.prompt_ids, b.prompt_ids)
    assert b.prompts == PROMPTS  # decoded, BOS skipped


def test_chat_template_is_applied(llama, tokenizer):
    tok = tokenizer.__class__(
        tokenizer_object=tokenizer.backend_tokenizer, **tokenizer.special_tokens_map
    )
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    rollout = sample_groups(
        llama, tok, ["1+2="], group_size=1, max_new_tokens=2, chat_template=True, seed=0
    )
    expected = tok("1+2=|a:", add_special_tokens=False)["input_ids"]
    assert rollout.prompt_ids[0].tolist() == expected
    assert rollout.prompts == ["1+2="]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(group_size=0),
        dict(max_new_tokens=0),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_k=-2),
        dict(stop="\n"),
    ],
)
def test_bad_arguments_raise_user_error(llama, tokenizer, kwargs):
    args = dict(group_size=2, max_new_tokens=4) | kwargs
    with pytest.raises(UserError):
        sample_groups(llama, tokenizer, PROMPTS, **args)


def test_bad_prompts_raise_user_error(llama, tokenizer):
    with pytest.raises(UserError):
        sample_groups(llama, tokenizer, [], group_size=1, max_new_tokens=2)
    with pytest.raises(UserError):
        sample_groups(llama, tokenizer, "just a string", group_size=1, max_new_tokens=2)
    with pytest.raises(UserError):
        sample_groups(llama, tokenizer, [[]], group_size=1, max_new_tokens=2)
    with pytest.raises(UserError, match="chat template"):
        sample_groups(
            llama, tokenizer, ["1+2="], group_size=1, max_new_tokens=2, chat_template=True
        )


def test_engine_implements_protocol(llama, tokenizer):
    engine = HFRolloutEngine(llama, tokenizer)
    assert inspect.signature(engine.sample) == inspect.signature(RolloutEngine.sample).replace(
        parameters=list(inspect.signature(RolloutEngine.sample).parameters.values())[1:]
    )
    ids, _ = encode_prompts(tokenizer, PROMPTS[:1])
    a = engine.sample(ids, group_size=2, max_new_tokens=4, seed=5)
    b = sample_groups(llama, tokenizer, PROMPTS[:1], group_size=2, max_new_tokens=4, seed=5)
    assert torch.equal(a.completion_ids, b.completion_ids)


@pytest.mark.numerics
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_prompt_copy_per_group_samples_what_per_row_copies_do(make_model, tokenizer, arch,
                                                                  monkeypatch):  # fmt: skip
    """Decode attention over one copy of each prompt (grouped-query heads, left-padded prompts
    of different lengths) gives the per-row cache's tokens and log-probs, and is what plain
    architectures use; a sliding-window model keeps per-row copies."""
    from grouprl.rollout import _hf

    model = make_model(arch, dtype=torch.float64)  # the same computation: see tests/numerics.py
    monkeypatch.setattr(sampling, "SHARED_PROMPT_MIN_TOKENS", 1)  # the test prompts are short
    built = []
    init = SharedPromptLayer.__init__
    monkeypatch.setattr(
        SharedPromptLayer, "__init__", lambda self, *a, **k: built.append(1) or init(self, *a, **k)
    )
    shared = sample_groups(model, tokenizer, PROMPTS, group_size=4, max_new_tokens=16, seed=3)
    assert len(built) == 4  # one per layer
    plain = _hf.shares_prompt_attention
    monkeypatch.setattr(_hf, "shares_prompt_attention", lambda model: False)
    per_row = sample_groups(model, tokenizer, PROMPTS, group_size=4, max_new_tokens=16, seed=3)
    assert torch.equal(shared.completion_ids, per_row.completion_ids)
    assert_same_f64(shared.old_logp, per_row.old_logp)
    assert model.config._attn_implementation != _hf.SHARED_PROMPT_ATTENTION  # restored
    monkeypatch.setattr(_hf, "shares_prompt_attention", plain)
    assert not _hf.shares_prompt_attention(make_model("qwen2", sliding_window=8))
    built.clear()  # prompts under SHARED_PROMPT_MIN_TOKENS keep per-row copies
    monkeypatch.setattr(sampling, "SHARED_PROMPT_MIN_TOKENS", 32)
    sample_groups(model, tokenizer, PROMPTS, group_size=4, max_new_tokens=4, seed=3)
    assert built == []


def test_the_shared_prompt_decoding_state_is_each_threads_own():
    """An asynchronous run's sampler thread decodes while the trainer's thread evaluates: each
    decode loop's cache layers must stay its own (a shared list made one thread attend over the
    other's prompts: a shape error, or worse, a silent mix)."""
    import threading
    from types import SimpleNamespace

    from grouprl.rollout import _hf

    def model():
        return SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))

    mine, theirs = model(), model()
    entered, seen = threading.Event(), []

    def other_thread():
        with _hf.SharedPromptDecoding(theirs, SimpleNamespace(layers=["theirs"])):
            entered.set()
            seen.append(list(_hf._active.layers))

    with _hf.SharedPromptDecoding(mine, SimpleNamespace(layers=["mine"])):
        worker = threading.Thread(target=other_thread)
        worker.start()
        # the other thread needs nothing of this one: it ends while this one is still inside
        # (a backstop, not a speed check: it takes microseconds)
        assert entered.wait(60)
        worker.join(60)
        assert list(_hf._active.layers) == ["mine"] and seen == [["theirs"]]
    assert tuple(_hf._active.layers) == () and mine.config._attn_implementation == "sdpa"
