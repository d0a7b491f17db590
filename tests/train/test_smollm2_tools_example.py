"""examples/smollm2_tools as its README runs it (warm start from its conversations, then RL with
its config), on a tiny local chat model with SmolLM2's ChatML template instead of the 98 MB
GGUF file: its data, tool, description, reward and warm start fit together."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from grouprl.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/smollm2_tools"


def test_the_warm_start_and_the_run_of_the_example(tmp_path, monkeypatch, chat_model_dir):
    monkeypatch.chdir(ROOT)
    warm, run = tmp_path / "sft", tmp_path / "rl"
    assert main(["sft", "--data", f"{EXAMPLE}/warmstart.jsonl", "--model", str(chat_model_dir),
                 "--tools", f"{EXAMPLE}/tools.py:multiply", "--lora-r", "8", "--steps", "2",
                 "--batch-size", "4", "--threads", "1", "--no-progress",
                 "--output-dir", str(warm)]) == 0  # fmt: skip
    assert main(["train", "--config", f"{EXAMPLE}/config.yaml", "--model", str(warm),
                 "--steps", "2", "--eval-size", "2", "--eval-samples", "1", "--threads", "1",
                 "--no-progress", "--output-dir", str(run)]) == 0  # fmt: skip
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert {"reward_right_number", "tool_call_rate"} <= record.keys()
    config = yaml.safe_load((run / "config.yaml").read_text())
    (tool,) = config["tools"]  # recorded with its absolute path
    assert tool == f"{ROOT / EXAMPLE}/tools.py:multiply" and config["tool_prompt"] == "auto"


def test_the_reward_reads_the_models_last_words_never_the_tools():
    import importlib.util

    spec = importlib.util.spec_from_file_location("rewards", ROOT / EXAMPLE / "rewards.py")
    rewards = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rewards)
    said = [{"role": "assistant", "content": "<multiply>35, 27</multiply>"},
            {"role": "tool", "content": "945"}, {"role": "assistant", "content": " It is 945."}]  # fmt: skip
    silent = [*said[:2], {"role": "assistant", "content": ""}]
    grouped = [{"role": "assistant", "content": "That is 15,244 beads."}]
    rambling = [*said[:2], {"role": "assistant", "content": " It is 945. " + "And so on. " * 4}]
    answers = ["945", "945", "15244", "944", "945"]
    replies = [said, silent, grouped, "945", rambling]
    lengths = [[0] * n for n in (20, 12, 47, 5, 48)]  # the rambling one ran into the budget
    assert rewards.right_number(replies, answers, lengths) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert rewards.right_number(["1,2"], ["12"], [[0]]) == [0.0]  # commas group digits in threes
