"""`grouprl generate`: the prompt the model is shown is the one `train` feeds for the same row
and options; --samples; a run directory means its final policy, or its newest checkpoint (a
LoRA checkpoint: the recorded base plus the adapter)."""

from __future__ import annotations

import json
import shutil

import pytest

from grouprl.cli import main
from grouprl.config import TrainConfig
from grouprl.models import load_tokenizer
from grouprl.train.build import build_task
from grouprl.train.prompts import prompt_ids

TINY = ["--prompts-per-step", "4", "--group-size", "2", "--eval-size", "2", "--eval-samples",
        "1", "--threads", "1", "--no-progress", "--log-ratios", "0"]  # fmt: skip


def _generate(capsys, *args):
    assert main(["generate", "--json", "--threads", "1", *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    sums = [{"q": f"{a}+{b}", "total": str(a + b)} for a in range(12, 60) for b in range(3)]
    (root / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sums))
    chats = [{"question": [{"role": "user", "content": f"What is {a} plus 3?"}]} for a in range(90)]
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    return root


@pytest.mark.parametrize("case", ["template", "chat_system", "prompt_chat_system"])
def test_the_prompt_shown_is_the_one_train_feeds(data, chat_model_dir, capsys, case):
    if case == "template":
        options = {"model": "builtin:arith", "dataset": str(data / "sums.jsonl"),
                   "prompt_template": "{q}=", "answer_column": "total"}  # fmt: skip
    else:
        options = {"model": str(chat_model_dir), "dataset": str(data / "chats.jsonl"),
                   "prompt_column": "question", "system_prompt": "Answer briefly."}  # fmt: skip
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    train_cfg = TrainConfig(**options, max_new_tokens=8)
    tokenizer = load_tokenizer(options["model"])
    heldout = build_task(train_cfg).heldout
    if case == "prompt_chat_system":  # a typed prompt, sent as a user message like a string row
        text = "What is 4 plus 3?"
        shown = _generate(capsys, "--model", str(chat_model_dir), "--prompt", text,
                          "--chat-template", "--system-prompt", "Answer briefly.",
                          "--max-new-tokens", "4")  # fmt: skip
        messages = [{"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": text}]  # fmt: skip
        expected = [tokenizer.decode(prompt_ids(tokenizer, messages), skip_special_tokens=False)]
        assert "<|im_start|>system" in expected[0]
    else:
        shown = _generate(capsys, *flags, "--max-new-tokens", "8", "--limit", "2")
        expected = [tokenizer.decode(prompt_ids(tokenizer, r["prompt"]), skip_special_tokens=False)
                    for r in list(heldout)[:2]]  # fmt: skip
    assert [s["prompt"] for s in shown] == expected


def test_samples_and_a_run_directory_means_its_final_policy(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--steps", "1", "--output-dir", str(run), *TINY]) == 0
    capsys.readouterr()
    args = ["--limit", "2", "--samples", "3", "--temperature", "0.7", "--seed", "5"]
    from_run = _generate(capsys, "--model", str(run), *args)
    assert [len(r["completions"]) for r in from_run] == [3, 3]
    assert from_run == _generate(capsys, "--model", str(run / "final"), *args)


def test_a_lora_run_without_final_uses_its_newest_checkpoint_on_the_recorded_base(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--steps", "2", "--lora-r", "4", "--lr", "2e-2", "--warmup-steps", "0",
                 "--save-every", "1", "--output-dir", str(run), *TINY]) == 0  # fmt: skip
    capsys.readouterr()
    args = ["--limit", "3", "--temperature", "0"]
    final = _generate(capsys, "--model", str(run / "final"), *args)
    base = _generate(capsys, "--model", "builtin:arith", *args)
    shutil.rmtree(run / "final")
    newest = _generate(capsys, "--model", str(run), *args)
    assert newest == final  # the adapter of step 2 on the recorded base: the final policy
    assert newest != base  # and not the base alone
