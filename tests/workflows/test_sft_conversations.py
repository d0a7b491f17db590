"""`grouprl sft --data`: conversations with tool calls (TRL's conversational SFT shape) encoded
exactly as `grouprl train` samples them, loss on the assistant's tokens only, LoRA merged into
a model training starts from."""

from __future__ import annotations

import json

import pytest

from grouprl.cli import main
from grouprl.config import TrainConfig
from grouprl.errors import UserError
from grouprl.models import load_tokenizer
from grouprl.models.tiny import QWEN25_TOOLS, save_tiny_chat_model
from grouprl.tasks.data import RowFormat, dataset_task
from grouprl.tasks.tools.calls import load_tools
from grouprl.tasks.tools.conversations import encode_chat, encode_tags
from grouprl.tasks.tools.prompt import DEFAULT_TEMPLATE, describe_tools
from grouprl.train.build import build_tools
from grouprl.train.prompts import prompt_ids
from grouprl.workflows.sft import SFTConfig, padded, train_sft

SYSTEM = "Answer with the number."
TOOL = f"{__file__}:multiply"


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a * b


def conversation(a: int, b: int) -> dict:
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return {"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What is {a} times {b}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": str(a * b)},
        {"role": "assistant", "content": f" The answer is {a * b}."},
    ]}  # fmt: skip


def _encoder(tokenizer):
    from grouprl.rollout import encode_prompts

    return lambda messages, schemas: encode_prompts(tokenizer, [messages], tools=schemas)[0][0]


def _texts(tokenizer, encoded) -> tuple[str, str]:
    """What carries loss and what does not, each decoded as one string."""
    own = [i for ids, trained in encoded.pieces if trained for i in ids]
    fed = [i for ids, trained in encoded.pieces if not trained for i in ids]
    return tokenizer.decode(own), tokenizer.decode(fed)


def test_tags_conversations_are_what_training_samples(chat_model_dir, tmp_path):
    tokenizer = load_tokenizer(chat_model_dir)
    description = describe_tools(load_tools([TOOL]), DEFAULT_TEMPLATE)
    encoded = encode_tags(tokenizer, conversation(6, 7), description, "row 0", _encoder(tokenizer))
    own, fed = _texts(tokenizer, encoded)
    assert own == f"<multiply>6, 7</multiply> The answer is 42.{tokenizer.eos_token}"
    assert fed == "42"
    # the prompt: the ids `grouprl train` feeds for this question with this tool and system
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"prompt": "What is 6 times 7?", "answer": "42"}) + "\n")
    fmt = RowFormat(chat_template=True, system_prompt=SYSTEM)
    task = dataset_task(str(data), fmt, eval_source=str(data))
    cfg = TrainConfig(model=str(chat_model_dir), dataset=str(data), tools=[TOOL])
    tools = build_tools(cfg, task, tokenizer)
    assert encoded.prompt == prompt_ids(tokenizer, task.train[0]["prompt"], tools)


def test_chat_conversations_train_the_assistant_turns_only(tmp_path):
    _, tokenizer = save_tiny_chat_model(tmp_path / "m", template=QWEN25_TOOLS)
    schemas = [json.loads(json.dumps(s)) for s in [_schema()]]
    encoded = encode_chat(tokenizer, conversation(6, 7), schemas, "row 0", _encoder(tokenizer))
    own, fed = _texts(tokenizer, encoded)
    whole = tokenizer.apply_chat_template(conversation(6, 7)["messages"], tools=schemas,
                                          tokenize=False)  # fmt: skip
    assert whole.startswith(tokenizer.decode(encoded.prompt + [i for ids, _ in encoded.pieces
                                                                for i in ids]))  # fmt: skip
    assert own == ('<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n'
                   "</tool_call><|im_end|> The answer is 42.<|im_end|>")  # fmt: skip
    assert "<tool_response>\n42\n</tool_response>" in fed and "<|im_start|>assistant" in fed


def _schema() -> dict:
    from grouprl.tasks.tools.chat import tool_schema

    return tool_schema(load_tools([TOOL])[0])


def test_a_warm_start_from_conversations_is_a_model_training_starts_from(chat_model_dir, tmp_path):
    data = tmp_path / "calls.jsonl"
    data.write_text("".join(json.dumps(conversation(a, a + 3)) + "\n" for a in range(10, 30)))
    out = tmp_path / "warm"
    result = train_sft(SFTConfig(output_dir=out, data=str(data), model=str(chat_model_dir),
                                 tools=[TOOL], lora_r=4, steps=8, batch_size=4, lr=1e-2,
                                 warmup_steps=1, log_every=0, progress=False, threads=1))  # fmt: skip
    assert result.final_loss < result.first_loss
    assert (out / "adapter" / "adapter_config.json").is_file()  # the adapter alone, besides
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a} times 3?", "answer": str(3 * a)})
                               + "\n" for a in range(12)))  # fmt: skip
    assert main(["train", "--model", str(out), "--dataset", str(prompts), "--chat-template",
                 "--tools", TOOL, "--rewards", "accuracy", "1.0", "--steps", "1",
                 "--prompts-per-step", "4", "--group-size", "2", "--max-new-tokens", "8",
                 "--eval-every", "0", "--no-progress", "--output-dir", str(tmp_path / "rl")]) == 0  # fmt: skip


def test_loss_masks_follow_the_pieces():
    ids, attention, labels = padded([[1, 2], [3]], [[([4, 5], True), ([6], False)],
                                                    [([7], True)]], pad_id=0)  # fmt: skip
    assert ids.tolist() == [[1, 2, 4, 5, 6], [3, 7, 0, 0, 0]]
    assert labels.tolist() == [[-100, -100, 4, 5, -100], [-100, 7, -100, -100, -100]]
    assert attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


@pytest.mark.parametrize(("messages", "match"), [
    ([{"role": "user", "content": "hi"}], "no assistant message"),
    ([{"role": "tool", "content": "1"}, {"role": "assistant", "content": "1"}], "prompt"),
    ([{"role": "robot", "content": "1"}], "role of"),
])  # fmt: skip
def test_malformed_conversations_are_one_line(chat_model_dir, tmp_path, messages, match):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"messages": messages}) + "\n")
    with pytest.raises(UserError, match=match):
        train_sft(SFTConfig(output_dir=tmp_path / "o", data=str(data), model=str(chat_model_dir),
                            steps=1, progress=False))  # fmt: skip


def test_conversations_need_a_chat_model(tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps(conversation(2, 3)) + "\n")
    for model, match in ((None, "needs --model"), ("builtin:arith", "no chat template")):
        with pytest.raises(UserError, match=match):
            train_sft(SFTConfig(output_dir=tmp_path / "o", data=str(data), model=model, steps=1,
                                progress=False))  # fmt: skip
