"""Tool use on a real model (the bundled `builtin:lookup`): exact tokens, trained tokens,
rewards on the model's own text, a run without tools unchanged, and a run that learns."""

from __future__ import annotations

import json

import pytest
import torch

from grouprl.cli import main
from grouprl.config import TrainConfig
from grouprl.core import policy_loss
from grouprl.models import load_model, load_tokenizer
from grouprl.rollout import completion_logprobs, sample_groups
from grouprl.tasks import get_task
from grouprl.tasks.tools.calls import TagTools, Tool
from grouprl.train.build import build_tools
from grouprl.workflows.sft import encode_batch
from numerics import assert_same_f64, to_float64


@pytest.fixture(scope="module")
def lookup():
    """builtin:lookup in float64 (sampler and trainer are compared as the same computation:
    tests/numerics.py), its tokenizer, the task, and a rollout of 8 prompts x 4 with tools."""
    model = to_float64(load_model("builtin:lookup"))
    tokenizer = load_tokenizer("builtin:lookup")
    task = get_task("lookup")
    tools = build_tools(TrainConfig(task="lookup"), task, tokenizer).handler
    rows = task.train[:8]
    rollout = sample_groups(model, tokenizer, [r["prompt"] for r in rows], group_size=4,
                            max_new_tokens=task.max_new_tokens, seed=1, tools=tools)  # fmt: skip
    assert 0 < int((rollout.turns.calls > 0).sum()) < 32  # some rows call, some guess
    return model, tokenizer, task, rows, rollout


@pytest.mark.numerics
def test_a_trajectory_is_the_sampled_ids_and_the_observation_ids_and_teacher_forcing_agrees(
    lookup,
):
    model, tokenizer, _, _, rollout = lookup
    for i in range(len(rollout.texts)):
        n = int(rollout.lengths[i])
        ids, observed = rollout.completion_ids[i, :n], ~rollout.loss_mask[i, :n]
        tools = [m for m in rollout.turns.transcripts[i] if m["role"] == "tool"]
        # the observation's ids are the tool's text encoded once, exactly where it was fed
        want = [
            t for m in tools for t in tokenizer(m["content"], add_special_tokens=False)["input_ids"]
        ]
        assert ids[observed].tolist() == want
        assert int(rollout.turns.calls[i]) == len(tools)
    with torch.no_grad():
        logp = completion_logprobs(model, rollout)
    sampled = rollout.loss_mask
    assert_same_f64(logp * sampled, rollout.old_logp)  # old_logp is 0 where nothing was sampled
    assert bool((rollout.old_logp[rollout.mask & ~sampled] == 0).all())


def test_observation_tokens_get_no_gradient(lookup):
    model, _, _, _, rollout = lookup
    logp = completion_logprobs(model, rollout).detach().requires_grad_()
    advantages = torch.linspace(-1, 1, len(rollout.texts), dtype=torch.float64)
    out = policy_loss(logp, rollout.old_logp, advantages, rollout.loss_mask)
    out.loss.backward()
    observed = rollout.mask & ~rollout.loss_mask
    assert bool(observed.any()) and bool((logp.grad[observed] == 0).all())
    assert bool((logp.grad[rollout.loss_mask] != 0).any())


def test_rewards_see_the_models_turns_as_assistant_text_and_tool_turns_apart(lookup):
    from grouprl.tasks.base import TrainerState
    from grouprl.tasks.rewards.scoring import build_reward_set

    _, tokenizer, task, rows, rollout = lookup
    seen = []

    def spy(completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    rewards = build_reward_set({"spy": 1.0, "correct": 1.0}, task,
                               loader=lambda s, t, device: (s, spy if s == "spy" else task.reward_funcs[s]))  # fmt: skip
    scores = rewards.score(rollout.texts, rows, 4, completion_ids=rollout.completion_id_lists(),
                           state=TrainerState(), transcripts=rollout.turns.transcripts)  # fmt: skip
    for i, completion in enumerate(seen):
        n = int(rollout.lengths[i])
        ids = rollout.completion_ids[i, :n][rollout.loss_mask[i, :n]].tolist()
        own = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(m["content"] for m in completion if m["role"] == "assistant") == own
    # `correct` reads the last assistant turn: a call that answered is scored on what followed
    for i, transcript in enumerate(rollout.turns.transcripts):
        answer = transcript[-1]["content"].rpartition("|")[2]
        expected = float(transcript[-1]["role"] == "assistant" and answer == rows[i // 4]["answer"])
        assert float(scores.by_function["correct"][i]) == expected


def test_tools_that_are_never_called_leave_the_rollout_bit_for_bit(tmp_path, monkeypatch):
    """The tool path adds nothing until a call closes: with a tool the model never calls, the
    bundled arithmetic model samples exactly what it samples without tools, through the same
    forward (the model's own: a Llama's leaner CPU step, `llama_decode`, computes the same
    function in another order of sums and is not taken on the tool path)."""
    monkeypatch.setattr("grouprl.rollout.sampling.llama_step", lambda model: None)
    model, tokenizer = load_model("builtin:arith"), load_tokenizer("builtin:arith")
    prompts = [r["prompt"] for r in get_task("arithmetic").train[:6]]
    handler = TagTools([Tool("zzzz", lambda: "")], tokenizer, max_calls=4)
    plain = sample_groups(model, tokenizer, prompts, group_size=4, max_new_tokens=38, seed=5)
    tooled = sample_groups(model, tokenizer, prompts, group_size=4, max_new_tokens=38, seed=5,
                           tools=handler)  # fmt: skip
    for name in ("completion_ids", "mask", "old_logp", "entropy"):
        assert torch.equal(getattr(plain, name), getattr(tooled, name)), name
    assert plain.texts == tooled.texts and torch.equal(tooled.loss_mask, tooled.mask)
    assert plain.turns is None and int(tooled.turns.calls.sum()) == 0


def test_sft_trains_on_the_models_turns_only():
    tokenizer = load_tokenizer("builtin:arith")
    turns = [("assistant", "<lookup>482</lookup>"), ("tool", "57"), ("assistant", ";|94")]
    ids, attention, labels = encode_batch(tokenizer, ["#482+37="], [turns])
    p = len(tokenizer("#482+37=")["input_ids"])
    trained = (labels[0] != -100).tolist()
    assert trained == [False] * p + [True] * 20 + [False] * 2 + [True] * 4 + [True]  # + EOS
    assert tokenizer.decode(ids[0, p + 20 : p + 22]) == "57" and int(attention.sum()) == len(
        trained
    )


def test_the_lookup_task_learns_to_call_its_tool(tmp_path):
    """GSPO from builtin:lookup: the share of completions that call the tool and the reward
    both rise within 20 steps (measured: call rate 0.31 -> 0.85, reward 0.16 -> 0.62). At lr
    2e-4 this seed's run oscillates since observations are fed in chunks (reward 0.20 -> 0.22,
    greedy pass@1 1.0 -> 0.38; seeds 1 and 2 still learn there, 0.16 -> 0.59 and 0.13 -> 0.38),
    so the test runs at 1e-4, twice the default."""
    run = tmp_path / "lookup"
    assert main(["train", "--task", "lookup", "--steps", "20", "--prompts-per-step", "8",
                 "--lr", "1e-4", "--eval-size", "16", "--eval-samples", "1", "--eval-every", "0",
                 "--threads", "1", "--no-progress", "--save-every", "100", "--output-dir",
                 str(run)]) == 0  # fmt: skip
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    first, last = records[:4], records[-4:]

    def mean(rs, key):
        return sum(r[key] for r in rs) / len(rs)

    assert mean(last, "tool_call_rate") > mean(first, "tool_call_rate") + 0.2, records
    assert mean(last, "reward_mean") > mean(first, "reward_mean") + 0.15, records
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[-1])
    assert {m["role"] for m in sample["transcript"]} <= {"assistant", "tool"}
    assert (run / "plots" / "tools.png").is_file()
