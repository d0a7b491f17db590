"""The tags format's description of the tools (`--tool-prompt`): what the default says, where it
goes (a chat prompt's system message, before a plain prompt), and which runs get it."""

from __future__ import annotations

import json

import pytest

from grouprl.config import TrainConfig
from grouprl.errors import UserError
from grouprl.models import load_tokenizer
from grouprl.tasks import get_task
from grouprl.tasks.tools.calls import Tool
from grouprl.tasks.tools.prompt import DEFAULT_TEMPLATE, describe_tools, with_tool_prompt
from grouprl.train.build import build_tools
from grouprl.train.prompts import prompt_ids


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a * b


def shout(text):  # no type hints, no docstring: the tags format takes it all the same
    return text.upper()


def test_the_default_description_says_how_to_call_and_lists_each_tool():
    text = describe_tools([Tool("multiply", multiply), Tool("shout", shout)], DEFAULT_TEMPLATE)
    assert (
        text
        == (
            "You can call tools: write a tool's name as a tag around its arguments, e.g. "
            "<multiply>a, b</multiply>; its result follows.\n"
            "- multiply(a: integer, b: integer): Multiply two whole numbers.\n"
            "    a: the first number\n"
            "    b: the second number\n"
            "- shout(text: string): "
        ).strip()
    )


def test_the_description_goes_where_the_prompt_takes_instructions():
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert with_tool_prompt(system, "TOOLS") == [
        {"role": "system", "content": "Be brief.\n\nTOOLS"},
        {"role": "user", "content": "Hi"},
    ]
    user = [{"role": "user", "content": "Hi"}]
    assert with_tool_prompt(user, "TOOLS") == [{"role": "system", "content": "TOOLS"}, *user]
    assert with_tool_prompt("7*8=", "TOOLS") == "TOOLS\n\n7*8="
    assert with_tool_prompt([5, 6], "TOOLS") == [5, 6]  # token ids are fed as given
    assert system[0]["content"] == "Be brief."  # the row is not changed


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} times 7?", "answer": str(7 * i)})
                            + "\n" for i in range(20)))  # fmt: skip
    return path


def _tools(chat_model_dir, dataset, **options):
    from grouprl.tasks.data import RowFormat, dataset_task

    cfg = TrainConfig(model=str(chat_model_dir), dataset=str(dataset), chat_template=True,
                      tools=[f"{__file__}:multiply"], **options)  # fmt: skip
    task = dataset_task(str(dataset), RowFormat(chat_template=True))
    return build_tools(cfg, task, load_tokenizer(chat_model_dir)), task


def test_a_run_describes_its_tools_in_the_prompts_it_samples(chat_model_dir, dataset, tmp_path):
    tokenizer = load_tokenizer(chat_model_dir)
    tools, task = _tools(chat_model_dir, dataset)
    row = task.train[0]["prompt"]
    described = tokenizer.decode(prompt_ids(tokenizer, row, tools))
    assert tools.description in described and described.index(tools.description) < described.index(
        "times 7")  # fmt: skip
    none, _ = _tools(chat_model_dir, dataset, tool_prompt="none")
    assert none.description is None
    assert tokenizer.decode(prompt_ids(tokenizer, row, none)) == tokenizer.decode(
        prompt_ids(tokenizer, row))  # fmt: skip
    template = tmp_path / "tools.jinja"
    template.write_text("{% for t in tools %}[{{ t.function.name }}]{% endfor %}")
    own, _ = _tools(chat_model_dir, dataset, tool_prompt=str(template))
    assert own.description == "[multiply]"


def test_models_without_a_chat_template_read_their_own_prompts_unless_told():
    """A base or character-level model (the built-in policies) gets no description by default:
    lookup's tool is taught by its warm start, its prompts stay the ones it was trained on;
    `--tool-prompt default` puts it before them all the same."""
    task, tokenizer = get_task("lookup"), load_tokenizer("builtin:lookup")
    tools = build_tools(TrainConfig(task="lookup"), task, tokenizer)
    assert tools.description is None
    assert prompt_ids(tokenizer, "#4+5=", tools) == prompt_ids(tokenizer, "#4+5=")
    told = build_tools(TrainConfig(task="lookup", tool_prompt="default"), task, tokenizer)
    assert told.description.startswith("You can call tools")
    assert tokenizer.decode(prompt_ids(tokenizer, "#4+5=", told), skip_special_tokens=True) == (
        f"{told.description}\n\n#4+5=")  # fmt: skip


@pytest.mark.parametrize(("options", "match"), [
    ({"tool_prompt": "missing.jinja"}, "no such file"),
    ({"tool_format": "chat", "tool_prompt": "none"}, "chat template describes"),
])  # fmt: skip
def test_mistakes_are_one_line(chat_model_dir, dataset, options, match):
    with pytest.raises(UserError, match=match):
        _tools(chat_model_dir, dataset, **options)


def test_a_template_that_does_not_render_is_one_line(chat_model_dir, dataset, tmp_path):
    template = tmp_path / "bad.jinja"
    template.write_text("{{ tools[0].function.nope }}")
    with pytest.raises(UserError, match="does not render"):
        _tools(chat_model_dir, dataset, tool_prompt=str(template))
