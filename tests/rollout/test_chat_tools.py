"""The chat tool format on a tokenizer trained in the test with a Qwen2.5-style template: a
scripted model's canonical turns give a trajectory whose ids decode to exactly the template's
rendering of the conversation; templates that are not prefix-preserving, or cannot render
tools, are refused in one line; a malformed call is an error observation.

The scripted model (tests/scripted.py) writes, greedily, the ids of each of its turns as the
tokenizer encodes that turn's text alone, and the sampler feeds the observations in between;
the expected trajectory is built from the same pieces, so every id is known in advance.
"""

from __future__ import annotations

import pytest
import torch

from grouprl.errors import UserError
from grouprl.models.tiny import CHATML, QWEN25_TOOLS, save_tiny_chat_model
from grouprl.rollout import sample_groups
from grouprl.rollout.sampling import encode_prompts
from grouprl.tasks.tools.calls import Tool
from grouprl.tasks.tools.chat import ChatTools, parse_calls
from scripted import Scripted


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def no_docstring(a: int) -> int:
    return a


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    _, tok = save_tiny_chat_model(tmp_path_factory.mktemp("qwen_tools"), template=QWEN25_TOOLS)
    return tok


pytestmark = pytest.mark.usefixtures("scripted_cache")


def _handler(tokenizer, template=None, tools=(add,), **limits):
    if template is not None:
        tokenizer = _with_template(tokenizer, template)
    end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return ChatTools([Tool(f.__name__, f) for f in tools], tokenizer, end_ids=end,
                     max_calls=limits.pop("max_calls", 4), **limits)  # fmt: skip


def _with_template(tokenizer, template):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def _call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_trajectory_decodes_to_the_templates_rendering_of_the_conversation(tokenizer):
    """Three model turns (two calls, then one, then the answer) and two observations: the
    prompt and completion ids decode to the template's rendering of that conversation, up to
    the whitespace the template puts after the final end-of-turn token; the model's own
    end-of-turn tokens are trained, the observations' boundary tokens are not."""
    handler = _handler(tokenizer)
    question = [{"role": "user", "content": "What is 2 plus 3, and 10 plus 20, and 5 plus 30?"}]
    first = (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 10, "b": 20}}\n</tool_call><|im_end|>'
    )
    second = '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 30}}\n</tool_call><|im_end|>'
    answer = "They are 5, 30 and 35.<|im_end|>"
    obs1 = handler.observation([("add", "5"), ("add", "30")])
    obs2 = handler.observation([("add", "35")])
    pieces = [(_ids(tokenizer, first), True), (obs1, False), (_ids(tokenizer, second), True),
              (obs2, False), (_ids(tokenizer, answer), True)]  # fmt: skip
    script = [i for ids, _ in pieces for i in ids]
    (prompt,), _ = encode_prompts(tokenizer, [question], tools=handler.schemas)
    model = Scripted(tokenizer, ids={tuple(prompt): [*script, tokenizer.eos_token_id]})
    r = sample_groups(model, tokenizer, [prompt], group_size=2, max_new_tokens=len(script) + 4,
                      temperature=0.0, tools=handler)  # fmt: skip

    n = len(script)
    assert r.completion_ids[0, :n].tolist() == script and int(r.lengths[0]) == n
    assert not bool(r.truncated[0])  # the final <|im_end|> ended it
    trained = [own for ids, own in pieces for _ in ids]
    assert r.loss_mask[0, :n].tolist() == trained
    assert r.completion_ids[1].equal(r.completion_ids[0])
    assert (int(r.turns.calls[0]), int(r.turns.failures[0])) == (3, 0)

    conversation = [
        *question,
        {"role": "assistant", "content": "", "tool_calls": [_call("add", a=2, b=3),
                                                           _call("add", a=10, b=20)]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "add", "content": "30"},
        {"role": "assistant", "content": "", "tool_calls": [_call("add", a=5, b=30)]},
        {"role": "tool", "name": "add", "content": "35"},
        {"role": "assistant", "content": "They are 5, 30 and 35."},
    ]  # fmt: skip
    rendered = tokenizer.apply_chat_template(conversation, tools=handler.schemas, tokenize=False)
    decoded = tokenizer.decode(prompt + script, skip_special_tokens=False)
    assert rendered.startswith(decoded) and rendered[len(decoded) :].strip() == ""
    assert [m["role"] for m in r.turns.transcripts[0]] == ["assistant", "tool", "assistant",
                                                           "tool", "assistant"]  # fmt: skip
    assert r.turns.transcripts[0][1]["content"] == "5\n30"
    assert r.turns.transcripts[0][-1]["content"] == "They are 5, 30 and 35."


def test_observations_hold_the_boundary_tokens_between_turns(tokenizer):
    """After the model's <|im_end|>: the newline, the user turn of results, and the next
    assistant header, all in the observation's ids (verl #3720 lost the first of them)."""
    text = tokenizer.decode(_handler(tokenizer).observation([("add", "5")]))
    assert text == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n" \
                   "<|im_start|>assistant\n"  # fmt: skip


def test_a_malformed_call_is_an_error_observation_and_decoding_goes_on(tokenizer):
    handler = _handler(tokenizer)
    from grouprl.messages import ToolRequest

    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 2,}}\n</tool_call>'
    (answer,) = handler.respond([ToolRequest(0, bad, 0, at_end=True)])
    assert (answer.calls, answer.failures, answer.end) == (1, 1, False)
    assert answer.messages[0]["content"].startswith("error: the tool call is not valid JSON")
    assert answer.ids == handler.observation([("", answer.messages[0]["content"])])
    (unknown,) = handler.respond([ToolRequest(0, '<tool_call>{"name": "mul"}</tool_call>', 0,
                                              at_end=True)])  # fmt: skip
    assert unknown.messages[0]["content"] == "error: no tool named 'mul'"
    (final,) = handler.respond([ToolRequest(0, "It is 5.", 0, at_end=True)])
    assert final.ids == [] and not final.calls  # no call: the answer, the trajectory ends


def test_calls_are_parsed_in_both_conventions():
    hermes = 'x <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> y'
    assert [(c.name, c.args) for c in parse_calls(hermes, "hermes")] == [
        ("add", '{"a": 1, "b": 2}')
    ]
    assert parse_calls("<think><tool_call>{}</tool_call>", "hermes") == []  # still thinking
    (unclosed,) = parse_calls('<tool_call>{"name": "add"', "hermes")
    assert "never closed" in unclosed.error
    llama = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert [(c.name, c.args) for c in parse_calls(llama, "llama3")] == [("add", '{"a": 1, "b": 2}')]
    assert parse_calls("The answer is 3.", "llama3") == []
    (bad,) = parse_calls('{"name": add}', "llama3")
    assert bad.error.startswith("the tool call is not valid JSON")


# A Qwen3-style template: earlier assistant turns lose their <think> blocks once a later one
# follows, so the ids a trajectory holds are not the conversation's.
DROPS_THINKING = QWEN25_TOOLS.replace(
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}",
    "{%- if message.content %}{{- '\\n' + (message.content.split('</think>')[-1] if not "
    "loop.last else message.content) }}{%- endif %}",
).replace(
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content.split('</think>')[-1] if "
    "message.role == 'assistant' and not loop.last else message.content) + '<|im_end|>\\n' }}",
)


@pytest.mark.parametrize(
    ("template", "tools", "match"),
    [
        (CHATML, (add,), "does not render tool calls"),
        (DROPS_THINKING, (add,), "is not prefix-preserving"),
        (None, (no_docstring,), "tool 'no_docstring': Cannot generate JSON schema"),
    ],
    ids=["no-tool-support", "not-prefix-preserving", "no-docstring"],
)
def test_templates_and_tools_the_chat_format_cannot_use_are_one_line(
    tokenizer, template, tools, match
):
    assert DROPS_THINKING != QWEN25_TOOLS  # the replacements above took
    with pytest.raises(UserError, match=match) as err:
        _handler(tokenizer, template, tools)
    assert "\n" not in str(err.value)


def test_a_long_result_is_cut_before_it_is_rendered(tokenizer):
    handler = _handler(tokenizer, max_response_tokens=4)
    from grouprl.messages import ToolRequest

    def echo(text: str) -> str:
        """Say it again.

        Args:
            text: What to say.
        """
        return text

    handler = _handler(tokenizer, tools=(echo,), max_response_tokens=4)
    call = '<tool_call>{"name": "echo", "arguments": {"text": "abcdefghijklmnop"}}</tool_call>'
    (answer,) = handler.respond([ToolRequest(0, call, 0, at_end=True)])
    content = answer.messages[0]["content"]
    assert content.endswith("...") and len(_ids(tokenizer, content)) <= 4 + 1
    assert torch.tensor(answer.ids).numel() > 4  # the boundary tokens are not cut
