"""The vLLM engine against grouprl's own: greedy ids up to the first near tie, log-probs within
float32 rounding, weights that follow the policy, the HF engine's ends and tool turns, seeds,
and nothing vLLM changes in the process left changed. The sampling tests run twice: vLLM in this
process, and a vLLM server (`--vllm-server`)."""

from __future__ import annotations

import copy
import os
import random

import numpy as np
import pytest
import torch

from grouprl.core import logp_mismatch
from grouprl.messages import Observation
from grouprl.models.lora import apply_lora, checkpoint_weights
from grouprl.rollout import completion_logprobs, sample_groups
from grouprl.rollout.stops import StopStrings
from grouprl.rollout.vllm_engine import VLLMEngine, VLLMOptions
from numerics import U32, assert_greedy_agrees, forward_bound, logit_magnitude

pytestmark = pytest.mark.numerics

OPTIONS = VLLMOptions(
    dtype="float32",
    max_model_len=256,
    kv_cache_bytes=64 << 20,
    block_size=32,
    chunked_prefill=False,
)  # as on a CPU (`grouprl.train.build.vllm_options`)
TEXTS = ["12+30=", "What is 7 plus 5?", "answer", "<think>add</think>", "1,200 dollars", "x"]


@pytest.fixture(params=["in-process", "server"])
def engine(request, model, tokenizer):
    """A fresh engine per test: vLLM in this process (a process runs one vLLM engine at a
    time: a test that starts its own closes this one; after the first start, one takes about
    0.3 s), or one of the session's vLLM servers (`--vllm-server`: the same requests, over
    HTTP, its weights synced from the model's)."""
    if request.param == "server":
        from grouprl.rollout.vllm_server import VLLMServerEngine

        servers = request.getfixturevalue("servers")
        engine = VLLMServerEngine(model, tokenizer, servers[:1], weights=model.state_dict)
    else:
        engine = VLLMEngine(model, tokenizer, OPTIONS)
    yield engine
    engine.close()


def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def teacher_forced(model, rollout):
    with torch.no_grad():
        return completion_logprobs(model, rollout, temperature=rollout.temperature)


def test_greedy_ids_equal_the_hf_engines_up_to_the_first_near_tie(model, tokenizer, engine):
    """Both engines pick the HF model's argmax wherever its top-2 gap exceeds twice the float32
    rounding a logit can take between two forwards of the same function (`forward_bound`: n·u
    times the largest logit, per side); each row is checked up to its first position below."""
    ids = prompts(tokenizer)
    hf = sample_groups(model, tokenizer, ids, group_size=1, max_new_tokens=24, temperature=0.0)
    ours = engine.sample(ids, group_size=1, max_new_tokens=24, temperature=0.0)
    assert ours.behaviour_logp is not None and ours.entropy is None
    splits = assert_greedy_agrees(model, ids, hf, ours)
    print(f"greedy rows split from the HF engine at {splits}")


def test_log_probs_are_the_trainers_within_float32_rounding(model, tokenizer, engine):
    """At temperature 1 with no top-k/top-p, vLLM's processed log-prob of each sampled token
    is the trainer's log_softmax(logits)[token] up to float32 rounding of two forwards of the
    same function: |Δ| <= forward_bound (2·n·u·M, M the largest logit possible)."""
    rollout = engine.sample(prompts(tokenizer), group_size=4, max_new_tokens=20, seed=3)
    trainer = teacher_forced(model, rollout)
    stats = logp_mismatch(rollout.behaviour_logp, trainer, rollout.loss_mask)
    bound = forward_bound(model.config, logit_magnitude(model))
    assert stats.tokens == int(rollout.loss_mask.sum()) > 100
    assert stats.abs_max <= bound, (stats, bound)
    assert torch.equal(rollout.behaviour_logp, rollout.old_logp)  # until the trainer's recompute
    print(f"|Δ log p| max {stats.abs_max:.2e}, mean {stats.abs_sum / stats.tokens:.2e}")


def vllm_scores(engine, ids: list[int]) -> torch.Tensor:
    """vLLM's log-probs of fixed tokens (ids[1:] given the ones before), by a prompt-logprobs
    request on its current weights."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from grouprl.rollout.vllm_engine import contained

    with contained():
        (out,) = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)],
                                     SamplingParams(max_tokens=1, prompt_logprobs=0),
                                     use_tqdm=False)  # fmt: skip
    return torch.tensor([out.prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))])


def hf_scores(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0, :-1].double().log_softmax(-1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].float()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_weights_follow_the_policy_after_an_update(model, tokenizer, lora):
    """vLLM's log-probs of fixed tokens are the trainer's; after an update they stay the old
    weights' until `policy_updated`, then are the new weights' (a LoRA policy's merged)."""
    policy = copy.deepcopy(model)
    if lora:
        policy = apply_lora(policy, r=4, alpha=8)
    engine = VLLMEngine(policy, tokenizer, OPTIONS, weights=lambda: checkpoint_weights(policy))
    try:
        fixed = tokenizer("What is 12 plus 30? The answer is 42.")["input_ids"]
        bound = len(fixed) * forward_bound(model.config, 2 * logit_magnitude(model))
        engine.sample([fixed[:3]], group_size=2, max_new_tokens=2, seed=0)  # loads the weights
        before = vllm_scores(engine, fixed)
        assert (before - hf_scores(policy, fixed)).abs().sum() <= bound
        optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.01)
        logp = policy(torch.tensor([fixed])).logits.log_softmax(-1)[0, :-1]
        (-logp.gather(-1, torch.tensor(fixed[1:])[:, None]).sum()).backward()
        optimizer.step()  # an update: the fixed tokens' log-probs rise
        after = hf_scores(policy, fixed)
        assert (after - before).sum() > 100 * bound
        assert torch.equal(vllm_scores(engine, fixed), before)  # not loaded yet
        engine.policy_updated(1)
        engine.sample([fixed[:3]], group_size=2, max_new_tokens=2, seed=0)
        assert (vllm_scores(engine, fixed) - after).abs().sum() <= bound
        assert (engine.synced, engine.syncs) == (1, 2)
    finally:
        engine.close()


def test_a_moe_policys_weights_reach_vllm_after_an_update(tmp_path, capsys):
    """A mixture-of-experts policy (tiny Qwen3-MoE; its experts fused in the model, one key an
    expert on disk, as vLLM reads them): after an update and `policy_updated`, vLLM scores
    fixed tokens as the updated weights do, not as the old ones. vLLM's CPU MoE kernel is not
    float32-exact (its scores differ from the trainer's by ~1e-2 here, where dense models agree
    to ~1e-6), so the check is which weights vLLM holds: its scores after the sync are nearer
    the updated policy's than the old one's by most of what the update moved them."""
    from grouprl.models.tiny import save_tiny_moe_model

    policy, tokenizer = save_tiny_moe_model(tmp_path, "qwen3_moe", hidden_size=128)
    engine = VLLMEngine(policy, tokenizer, OPTIONS, weights=lambda: checkpoint_weights(policy))
    try:
        fixed = tokenizer("What is 12 plus 30? The answer is 42.")["input_ids"]
        engine.sample([fixed[:3]], group_size=2, max_new_tokens=2, seed=0)  # loads the weights
        before_vllm, before = vllm_scores(engine, fixed), hf_scores(policy, fixed)
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.05)
        logp = policy(torch.tensor([fixed])).logits.log_softmax(-1)[0, :-1]
        (-logp.gather(-1, torch.tensor(fixed[1:])[:, None]).sum()).backward()
        optimizer.step()
        after = hf_scores(policy, fixed)
        moved = float((after - before).abs().sum())
        kernel = float((before_vllm - before).abs().sum())  # vLLM's own difference, same weights
        assert moved > 10 * kernel
        assert torch.equal(vllm_scores(engine, fixed), before_vllm)  # not loaded yet
        engine.policy_updated(1)
        engine.sample([fixed[:3]], group_size=2, max_new_tokens=2, seed=0)
        now = vllm_scores(engine, fixed)
        assert float((now - after).abs().sum()) < float((now - before).abs().sum()) - 0.8 * moved
        with capsys.disabled():
            print(f"\nMoE: vLLM against the trainer, same weights: {kernel / len(fixed):.2e} a "
                  f"token; the update moved {moved / len(fixed):.2e} a token")  # fmt: skip
    finally:
        engine.close()


def test_a_seed_gives_the_same_rollout_and_another_seed_another(tokenizer, engine):
    ids = prompts(tokenizer)
    a, b = (engine.sample(ids, group_size=4, max_new_tokens=16, seed=11) for _ in range(2))
    c = engine.sample(ids, group_size=4, max_new_tokens=16, seed=12)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.behaviour_logp, b.behaviour_logp)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    rows = a.completion_id_lists()  # a group's completions differ (their own seeds)
    assert len({tuple(r) for r in rows[:4]}) > 1


def test_rows_end_where_the_hf_engines_rules_end_them(tokenizer, engine):
    """EOS and stop strings: each row's mask ends at the first EOS or at the first token at
    which `StopStrings.hits` would fire step by step; its text is cut after the stop string."""
    stop = ["e", "1"]
    rollout = engine.sample(prompts(tokenizer), group_size=4, max_new_tokens=20, stop=stop, seed=5)
    stopper, eos = StopStrings(tokenizer, stop), {2, 0}
    ended = 0
    for row, (ids, length) in enumerate(zip(rollout.completion_ids.tolist(),
                                           rollout.lengths.tolist())):  # fmt: skip
        buffer = torch.tensor([ids])
        first = next(
            (t for t in range(length) if ids[t] in eos
             or bool(stopper.hits(buffer, None, torch.tensor([True]), t)[0])),
            None,
        )  # fmt: skip
        if first is None:
            assert bool(rollout.truncated[row]) and length == 20
        else:
            assert length == first + 1 and not bool(rollout.truncated[row])
            ended += 1
            text = rollout.texts[row]
            assert ids[first] in eos or any(text.endswith(s) for s in stop), text
    assert ended >= 4  # the check saw rows stop (9 of these 24 do)


class EveryTurn:
    """A turn handler that answers each turn's end (EOS) and each closer 'e' with a fixed
    observation, twice, then ends the trajectory at the next."""

    closers = ("e",)
    ends_turns = True

    def __init__(self, ids):
        self.ids, self.seen = ids, {}

    def respond(self, requests):
        out = []
        for request in requests:
            calls = self.seen.get(request.row, 0)
            self.seen[request.row] = calls + 1
            if calls >= 2:
                out.append(Observation(end=True))
            else:
                message = {"role": "tool", "name": "echo", "content": "ok"}
                out.append(Observation(ids=list(self.ids), messages=[message], calls=1))
        return out


def test_tool_turns_feed_observation_ids_exactly(model, tokenizer, engine):
    """Rows that close a call get the handler's observation ids appended, untrained, and go on
    sampling from prompt + everything so far: the trajectory is exactly the sampled and the fed
    ids (the trainer's teacher-forced log-probs of the sampled tokens, given those ids, are
    vLLM's within float32 rounding), as grouprl's own loops record it."""
    observation = tokenizer(" result: 42 ")["input_ids"]
    handler = EveryTurn(observation)
    rollout = engine.sample(prompts(tokenizer), group_size=2, max_new_tokens=60, seed=7,
                            tools=handler)  # fmt: skip
    fed = rollout.mask & ~rollout.loss_mask  # (N, T)
    assert int(rollout.turns.calls.sum()) >= 6 and fed.any()
    for row in range(rollout.completion_ids.shape[0]):
        spans = fed[row].nonzero().squeeze(1).tolist()
        ids = rollout.completion_ids[row].tolist()
        for start in range(0, len(spans), len(observation)):
            span = spans[start : start + len(observation)]
            assert [ids[t] for t in span] == observation[: len(span)]  # fed as given, in order
        calls = int(rollout.turns.calls[row])
        tool_turns = [m for m in rollout.turns.transcripts[row] if m["role"] == "tool"]
        assert len(tool_turns) == calls and fed[row].sum() <= calls * len(observation)
    assert (rollout.behaviour_logp[fed] == 0).all()
    trainer = teacher_forced(model, rollout)
    stats = logp_mismatch(rollout.behaviour_logp, trainer, rollout.loss_mask)
    assert stats.abs_max <= forward_bound(model.config, logit_magnitude(model)), stats


def test_vllm_leaves_the_process_as_it_found_it(model, tokenizer):
    """Starting vLLM and sampling with it leave the environment (LD_PRELOAD, which a sandboxed
    program would inherit, among the rest), torch's thread count and set_num_threads, and the
    global random states as they were; the HF engine samples what it sampled before."""
    from grouprl.sandbox import available
    from grouprl.sandbox.run import run

    ids = prompts(tokenizer)
    hf_before = sample_groups(model, tokenizer, ids, group_size=2, max_new_tokens=12, seed=4)
    torch.manual_seed(123)
    np.random.seed(7)
    random.seed(5)
    environ, setter, threads = dict(os.environ), torch.set_num_threads, torch.get_num_threads()
    states = (torch.random.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    engine = VLLMEngine(model, tokenizer, OPTIONS)
    try:
        engine.sample(ids, group_size=2, max_new_tokens=12, seed=1)
        assert dict(os.environ) == environ  # LD_PRELOAD among them
        assert torch.set_num_threads is setter and torch.get_num_threads() == threads
        assert torch.equal(torch.random.get_rng_state(), states[0])
        assert (np.random.get_state()[1] == states[1]).all() and random.getstate() == states[2]
        hf_after = sample_groups(model, tokenizer, ids, group_size=2, max_new_tokens=12, seed=4)
        assert torch.equal(hf_after.completion_ids, hf_before.completion_ids)
        if available() is None:  # the sandbox runs here: a program in it still runs after vLLM
            ran = run("print(6 * 7)")
            assert ran.stdout.strip() == "42", ran
    finally:
        engine.close()
    torch.set_num_threads(2)  # the real function again: it changes the count
    assert torch.get_num_threads() == 2
    torch.set_num_threads(threads)


def test_starting_an_engine_closes_the_one_before(model, tokenizer, engine):
    if not isinstance(engine, VLLMEngine):
        pytest.skip("a server is another process: starting an engine here leaves it alone")
    engine.sample([[1, 2, 3]], group_size=2, max_new_tokens=2, seed=0)
    second = VLLMEngine(model, tokenizer, OPTIONS)
    try:
        with pytest.raises(RuntimeError, match="one vLLM engine at a time"):
            engine.sample([[1, 2, 3]], group_size=2, max_new_tokens=2, seed=0)
        assert second.sample([[1, 2, 3]], group_size=2, max_new_tokens=2, seed=0).lengths.numel()
    finally:
        second.close()


def test_a_head_size_without_a_cpu_kernel_is_refused_in_one_line(tmp_path):
    from grouprl.errors import UserError
    from grouprl.models.tiny import save_tiny_chat_model

    model, tokenizer = save_tiny_chat_model(tmp_path)  # heads of 16
    with pytest.raises(UserError, match="no kernel for head size 16"):
        VLLMEngine(model, tokenizer, OPTIONS)


def test_the_bound_is_pessimistic_but_not_vacuous(model):
    """The logit bound the tests use is a few units, not astronomically loose: a real
    difference (a wrong token, a dropped layer) is of the order of a logit itself."""
    bound = forward_bound(model.config, logit_magnitude(model))
    assert U32 < bound < 0.1, bound


def test_many_long_prompts_in_one_seeded_call(model, tokenizer):
    """128 rows of 200-token prompts: more prompt tokens than one of vLLM's steps takes. With
    chunked prefill (vLLM's default) a prompt split over steps fails on a CPU, seeded ("CPU
    Generator does not use offset"); the options a run gets turn it off there."""
    from grouprl.config import TrainConfig
    from grouprl.train.build import vllm_options

    options = vllm_options(TrainConfig(engine="vllm"), model, None, rows=128, max_len=232, seed=0)
    engine = VLLMEngine(model, tokenizer, options)
    try:
        ids = [[(7 * i + j) % 250 + 3 for j in range(200)] for i in range(32)]
        rollout = engine.sample(ids, group_size=4, max_new_tokens=8, seed=2)
        assert rollout.completion_ids.shape[0] == 128 and bool(rollout.lengths.min() >= 1)
    finally:
        engine.close()


def test_a_sliding_window_model_samples_what_the_trainer_computes(model, tokenizer):
    """A Qwen2 whose every layer attends a window of 8 tokens, on a 37-token prompt: vLLM's
    log-probs are the trainer's (which honours the window) within float32 rounding, so the
    window needs no refusal."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = {k: v for k, v in model.config.to_dict().items() if k != "layer_types"}
    config = Qwen2Config(**{**settings, "use_sliding_window": True, "sliding_window": 8,
                            "max_window_layers": 0})  # fmt: skip
    assert config.layer_types == ["sliding_attention"] * 2
    torch.manual_seed(0)
    windowed = Qwen2ForCausalLM(config).eval()
    engine = VLLMEngine(windowed, tokenizer, OPTIONS)
    try:
        rollout = engine.sample([list(range(3, 40))], group_size=2, max_new_tokens=16, seed=0)
    finally:
        engine.close()
    trainer = teacher_forced(windowed, rollout)
    stats = logp_mismatch(rollout.behaviour_logp, trainer, rollout.loss_mask)
    assert stats.abs_max <= forward_bound(config, logit_magnitude(windowed)), stats


def test_an_agent_programs_turns_and_branches_are_vllms_samples(tokenizer, engine):
    """`--agent` on the vLLM engine: the endpoint's turns are vLLM's samples (a stop string of
    the agent's ends each), their log-probs the rollout's behaviour log-probs; an episode that
    asks again with its prompt edited splits, and vLLM samples its branch too."""
    from pathlib import Path

    from grouprl.endpoint.use import agent_use
    from grouprl.endpoint.wire import Sampling

    programs = Path(__file__).parents[1] / "endpoint" / "agents" / "programs.py"
    end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    use = agent_use(f"{programs}:rewrites_completions", tokenizer, end, Sampling(1.0),
                    served="grouprl", max_calls=4)  # fmt: skip
    start = use.rollout([{"prompt": "What is 7 plus 5?"}] * 2, 2)
    kw = dict(max_new_tokens=24, tools=start.handler)
    r = engine.sample(start.prompts, group_size=2, seed=7, **kw)
    branches = use.sampled(r, start.handler,
                           lambda prompts, k: engine.sample(prompts, group_size=1, seed=8 + k,
                                                            **kw))  # fmt: skip
    results = start.handler.results
    assert all(x.failed is None for x in results)
    split = [row for row, x in enumerate(results) if x.prefix_breaks == 1]
    assert split and branches.parents.tolist() == split
    assert not r.truncated[split].any()  # a stop string ended their first rows
    b = branches.rollout
    for k in range(len(split)):
        assert tokenizer.decode(b.prompt_ids[k][b.prompt_mask[k]]) == "What is 7 plus 5? (edited)\n"
        sampled = b.loss_mask[k]
        assert sampled.any() and (b.behaviour_logp[k][sampled] < 0).all()  # vLLM's log-probs
