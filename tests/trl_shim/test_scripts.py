"""TRL's own scripts run on grouprl with only the import changed (and the hub model replaced by
the tiny Qwen2.5-template chat model, the sizes made small, report_to "none"): TRL's
examples/scripts/grpo_2048.py, the dataset-free IncrementEnv of its GRPOTrainer docs, and a
quickstart in their style. The scripts are in scripts/, each run here as `python script.py`."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import yaml

from grouprl.models.tiny import QWEN25_TOOLS, save_tiny_chat_model

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen25")
    save_tiny_chat_model(directory, template=QWEN25_TOOLS)
    return str(directory)


def run_script(name: str, model_dir: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TINY_MODEL", model_dir)
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(SCRIPTS / name), run_name="__main__")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_grpo_2048(model_dir, tmp_path, monkeypatch):
    plumbing = "logging_steps=1, trackio_space_id='trl-2048', num_completions_to_print=2"
    with pytest.warns(UserWarning, match=plumbing):
        run_script("grpo_2048.py", model_dir, tmp_path, monkeypatch)
    run = tmp_path / "trainer_output"
    record = yaml.safe_load((run / "config.yaml").read_text())
    # 4 x 2 completions an optimizer step = one group of 8; one optimizer step per rollout
    assert (record["prompts_per_step"], record["group_size"], record["steps"]) == (1, 8, 2)
    assert record["tool_format"] == "chat" and record["environment"] == "live:Game2048Env"
    assert record["lora_target_modules"] == ["q_proj", "v_proj"]  # peft's default for Qwen2
    assert record["chat_template_kwargs"] == {"enable_thinking": False}
    steps = lines(run / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2] and "reward_reward_score" in steps[0]
    assert (run / "final" / "model.safetensors").is_file()


def test_the_dataset_free_increment_env(model_dir, tmp_path, monkeypatch):
    run_script("increment_env.py", model_dir, tmp_path, monkeypatch)
    run = tmp_path / "trainer_output"
    record = yaml.safe_load((run / "config.yaml").read_text())
    assert record["dataset"] is None and record["environment"] == "live:IncrementEnv"
    steps = lines(run / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2] and "reward_IncrementEnv" in steps[0]


def test_a_quickstart(model_dir, tmp_path, monkeypatch):
    run_script("quickstart.py", model_dir, tmp_path, monkeypatch)
    run = tmp_path / "quickstart-grpo"
    record = yaml.safe_load((run / "config.yaml").read_text())
    assert (record["lr"], record["lora_r"], record["lora_target_modules"]) == (1e-5, 8, None)
    steps = lines(run / "metrics.jsonl")
    assert len(steps) == 3 and {"reward_reward_len", "reward_reward_correct"} <= set(steps[0])
    # trainer.save_model(output_dir): a LoRA run's adapter, as TRL saves it (final/: merged)
    assert (run / "adapter_config.json").is_file() and (run / "adapter_model.safetensors").is_file()
    assert (run / "final" / "model.safetensors").is_file()
