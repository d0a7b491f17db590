"""Tool calls inside the decode loop, on a scripted model: exact ids, masks and log-probs.

The scripted model follows a fixed text for each prompt, one character per position (greedily:
the script's next character gets logit 2, every other token 0); the script includes the
observations, which the sampler feeds instead of what the model would write there. So each
case's trajectory is known in advance and written out by hand below as (text, sampled) pieces:
the sampled characters, the observation the tool gives, where it ends, and from them what
`completion_ids`, `mask`, `loss_mask` and `old_logp` are at each position.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from grouprl.messages import ToolRequest
from grouprl.models import load_tokenizer
from grouprl.rollout import sample_groups
from grouprl.tasks.tools.calls import TagTools, Tool, load_tool
from scripted import Scripted


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def echo(text: str) -> str:
    """Say it again."""
    return text


def broken() -> str:
    """Always fails."""
    raise RuntimeError("out of order")


async def later(a: int, b: int) -> int:
    """Add, asynchronously."""
    await asyncio.sleep(0)
    return a + b


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("builtin:arith")


pytestmark = pytest.mark.usefixtures("scripted_cache")


def _run(tokenizer, pieces, tail="", *, tools=(add,), max_calls=4, budget=40, limit=None):
    """Sample the script of `pieces` (then `tail`, what it would write after the expected end)."""
    prompt, script = "#1=", "".join(text for text, _ in pieces) + tail
    model = Scripted(tokenizer, {prompt: script})
    handler = TagTools([Tool(f.__name__, f) for f in tools], tokenizer, max_calls=max_calls,
                       max_response_tokens=limit)  # fmt: skip
    return sample_groups(model, tokenizer, [prompt], group_size=1, max_new_tokens=budget,
                         temperature=0.0, tools=handler)  # fmt: skip


def _expect(tokenizer, rollout, pieces, *, eos=True):
    """Compare with the trajectory `pieces`: (text, sampled) in order, then EOS if `eos`."""
    ids, sampled = [], []
    for text, own in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        sampled += [own] * len(piece)
    if eos:
        ids.append(tokenizer.eos_token_id)
        sampled.append(True)
    width = rollout.completion_ids.shape[1]
    assert rollout.completion_ids[0].tolist() == ids + [rollout.pad_id] * (width - len(ids))
    assert rollout.mask[0].tolist() == [True] * len(ids) + [False] * (width - len(ids))
    loss_mask = sampled + [False] * (width - len(ids))
    assert rollout.loss_mask[0].tolist() == loss_mask
    logp = math.log(math.e**2 / (math.e**2 + len(tokenizer) - 1))  # the scripted token's
    want = torch.tensor([logp if own else 0.0 for own in loss_mask])
    torch.testing.assert_close(rollout.old_logp[0], want, rtol=0, atol=1e-6)  # float32 log


def test_a_valid_call_is_answered_with_forced_untrained_tokens(tokenizer):
    pieces = [("<add>2, 3</add>", True), ("5", False), (";|5", True)]
    r = _run(tokenizer, pieces)
    _expect(tokenizer, r, pieces)
    assert r.turns.transcripts[0] == [
        {"role": "assistant", "content": "<add>2, 3</add>"},
        {"role": "tool", "name": "add", "content": "5", "error": False},
        {"role": "assistant", "content": ";|5"},
    ]
    assert r.texts[0] == "<add>2, 3</add>5;|5" and not bool(r.truncated[0])
    assert (int(r.turns.calls[0]), int(r.turns.failures[0])) == (1, 0)


def test_a_malformed_call_is_an_error_observation(tokenizer):
    error = "error: add(a: int, b: int): missing a required argument: 'b'"
    pieces = [("<add>2</add>", True), (error, False), (";|2", True)]
    r = _run(tokenizer, pieces, budget=90)
    _expect(tokenizer, r, pieces)
    assert (int(r.turns.calls[0]), int(r.turns.failures[0])) == (1, 1)
    assert r.turns.transcripts[0][1]["error"] is True


def test_a_call_inside_an_unclosed_think_is_not_run(tokenizer):
    pieces = [("<think><add>1,1</add></think>|2", True)]
    r = _run(tokenizer, pieces)
    _expect(tokenizer, r, pieces)
    assert int(r.turns.calls[0]) == 0


def test_a_turn_cut_mid_call_runs_nothing_and_is_truncated(tokenizer):
    pieces = [("<add>2,3</", True)]
    r = _run(tokenizer, pieces, "add>5;|5", budget=10)
    _expect(tokenizer, r, pieces, eos=False)
    assert bool(r.truncated[0]) and int(r.turns.calls[0]) == 0


def test_an_observation_that_fits_the_budget_exactly_is_kept(tokenizer):
    pieces = [("<echo>abcd</echo>", True), ("abcd", False)]
    r = _run(tokenizer, pieces, ";|1", tools=(echo,), budget=21)  # 17 + 4
    _expect(tokenizer, r, pieces, eos=False)
    tool, answer = r.turns.transcripts[0][-2:]  # the budget ended it before an answer
    assert bool(r.truncated[0]) and tool["content"] == "abcd" and answer["content"] == ""


def test_an_observation_over_the_budget_is_cut_and_ends_the_trajectory(tokenizer):
    pieces = [("<echo>abcd</echo>", True), ("ab", False)]
    r = _run(tokenizer, pieces, "cd;|1", tools=(echo,), budget=19)
    _expect(tokenizer, r, pieces, eos=False)
    tool, answer = r.turns.transcripts[0][-2:]
    assert bool(r.truncated[0]) and tool["content"] == "ab" and answer["content"] == ""


def test_max_tool_response_tokens_cuts_with_a_marker(tokenizer):
    pieces = [("<echo>abcdefgh</echo>", True), ("abc...", False), (";|1", True)]
    r = _run(tokenizer, pieces, tools=(echo,), limit=6)
    _expect(tokenizer, r, pieces)


def test_max_turns_zero_ends_the_trajectory_at_its_first_call(tokenizer):
    pieces = [("<add>2,3</add>", True)]
    r = _run(tokenizer, pieces, "5;|5", max_calls=0)
    _expect(tokenizer, r, pieces, eos=False)
    assert bool(r.turns.ended_by_turns[0]) and int(r.turns.calls[0]) == 0
    assert not bool(r.truncated[0])  # it ended, by the limit of calls


def test_a_second_call_past_max_turns_ends_the_trajectory(tokenizer):
    pieces = [("<add>1,1</add>", True), ("2", False), (";<add>2,2</add>", True)]
    r = _run(tokenizer, pieces, "4;|4", max_calls=1)
    _expect(tokenizer, r, pieces, eos=False)
    assert bool(r.turns.ended_by_turns[0]) and int(r.turns.calls[0]) == 1


def test_a_tool_that_raises_is_an_error_observation(tokenizer):
    error = "error: broken raised RuntimeError: out of order"
    pieces = [("<broken></broken>", True), (error, False), (";|0", True)]
    r = _run(tokenizer, pieces, tools=(broken,), budget=80)
    _expect(tokenizer, r, pieces)
    assert int(r.turns.failures[0]) == 1


def test_an_async_tool_is_awaited(tokenizer):
    pieces = [("<later>2,3</later>", True), ("5", False), (";|5", True)]
    r = _run(tokenizer, pieces, tools=(later,))
    _expect(tokenizer, r, pieces)


def test_several_calls_in_one_turn_run_in_order_and_their_answers_are_joined(tokenizer):
    """A turn ends at the token that closes a call; a token that closes two (a multi-character
    token, or JSON arguments) runs both, in order, and joins what they say."""
    handler = TagTools([Tool("add", add), Tool("echo", echo)], tokenizer, max_calls=4)
    (answer,) = handler.respond([ToolRequest(0, '<echo>x</echo><add>{"a": 1, "b": 2}</add>', 0)])
    assert answer.ids == tokenizer("x3", add_special_tokens=False)["input_ids"]
    assert [m["content"] for m in answer.messages] == ["x", "3"] and answer.calls == 2
    (over,) = handler.respond([ToolRequest(0, "<echo>a</echo><echo>b</echo>", 3)])
    assert over.calls == 1 and not over.end  # one call of room: it runs; the next ends it


def test_group_rows_keep_their_own_turns(tokenizer):
    """G rows of one prompt, one of them calling: the others are untouched by its turn."""
    model = Scripted(tokenizer, {"#1=": "<add>2,3</add>5;|5", "#2=": "|7"})
    handler = TagTools([Tool("add", add)], tokenizer, max_calls=4)
    r = sample_groups(model, tokenizer, ["#2=", "#1="], group_size=2, max_new_tokens=40,
                      temperature=0.0, tools=handler)  # fmt: skip
    assert r.texts == ["|7", "|7", "<add>2,3</add>5;|5", "<add>2,3</add>5;|5"]
    assert r.turns.calls.tolist() == [0, 0, 1, 1]
    assert r.loss_mask[:2].equal(r.mask[:2]) and not r.loss_mask[2:].equal(r.mask[2:])


def test_tools_load_like_reward_files_and_bad_specs_are_one_line(tmp_path):
    from grouprl.errors import UserError

    (tmp_path / "tools.py").write_text("def mul(a: int, b: int) -> int:\n    return a * b\n")
    tool = load_tool(f"{tmp_path / 'tools.py'}:mul")
    assert tool.name == "mul" and tool.fn(2, 3) == 6
    for spec, match in ((f"{tmp_path / 'tools.py'}:div", "has no function 'div'"),
                        (f"{tmp_path / 'nope.py'}:mul", "does not exist"),
                        ("lookp", "unknown tool 'lookp'")):  # fmt: skip
        with pytest.raises(UserError, match=match):
            load_tool(spec, {"lookup": lambda key: key})
