"""Prompts are budgeted as sampling renders them: in the chat tool format the tools' schemas are
part of every prompt, so a held-out prompt that fits without them may not fit with them."""

from __future__ import annotations

import json

import pytest

from grouprl.config import TrainConfig
from grouprl.models.tiny import QWEN25_TOOLS, save_tiny_chat_model
from grouprl.train.prompts import prompt_ids, rows_that_fit
from grouprl.train.run import setup_run

TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number to add
        b: the second number to add
    """
    return a + b
'''
REWARDS = "def right(completions, answer, **kw):\n    return [0.0 for _ in completions]\n"


@pytest.fixture(scope="module")
def chat_run_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    _, tokenizer = save_tiny_chat_model(root / "model", template=QWEN25_TOOLS)
    (root / "tools.py").write_text(TOOLS)
    (root / "rewards.py").write_text(REWARDS)
    words = ["add", "the", "numbers", "please", "and", "tell", "me", "sum"]
    rows = [{"prompt": " ".join(words[: 1 + i % 8] * (1 + i // 8)), "answer": "1"}
            for i in range(40)]  # fmt: skip
    for name in ("train", "eval"):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, tokenizer, rows


def test_held_out_prompts_are_budgeted_with_their_tool_schemas(chat_run_files, monkeypatch):
    root, tokenizer, rows = chat_run_files
    monkeypatch.chdir(root)
    cfg = TrainConfig(
        model=str(root / "model"), dataset="train.jsonl", eval_dataset="eval.jsonl",
        rewards={"rewards.py:right": 1.0}, tools=["tools.py:add"], tool_format="chat",
        max_new_tokens=8, eval_size=40, output_dir=root / "run", threads=1, progress=False,
    )  # fmt: skip
    run = setup_run(cfg)
    tools = run.sampler.tools
    bare = [len(prompt_ids(tokenizer, r["prompt"])) for r in rows]
    full = [len(prompt_ids(tokenizer, r["prompt"], tools)) for r in rows]
    assert min(f - b for f, b in zip(full, bare)) > 20  # the schemas are in every prompt
    # a budget that every prompt meets without the schemas, and only some with them
    budget = sorted(full)[len(full) // 2]
    assert max(bare) <= budget < max(full)
    run = setup_run(
        TrainConfig(**{**cfg.__dict__, "max_prompt_length": budget, "output_dir": root / "r2"})
    )
    want = [r for r, n in zip(rows, full) if n <= budget]
    assert 0 < len(want) < len(rows)
    assert run.heldout.rows == want
    assert run.heldout.ids == [prompt_ids(tokenizer, r["prompt"], tools) for r in want]
    assert all(len(ids) <= budget for ids in run.heldout.ids)
    kept, ids, over = rows_that_fit(rows, len(rows), tokenizer, budget, tools)
    assert (kept, ids, len(over)) == (want, run.heldout.ids, len(rows) - len(want))
    assert all(length > budget for length in over)
