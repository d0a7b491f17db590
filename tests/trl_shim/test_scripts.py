"""TRL's own scripts run on grouprl with only the import changed (and the hub model replaced by
the tiny Qwen2.5-template chat model, the sizes made small, report_to "none"): TRL's
examples/scripts/grpo_2048.py and gspo.py, its `trl grpo` command's script (trl/scripts/grpo.py,
read from the installed TRL), the dataset-free IncrementEnv of its GRPOTrainer docs, and a
quickstart in their style. The scripts are in scripts/, each run here as `python script.py`;
TRL's parsed scripts with their documented command lines (plus a few steps and short
completions), and `grouprl trl grpo` with the same."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import yaml
from tests.trl_shim.trl_scripts import dataset_dir, trl_grpo_script

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


def run_argv(script: Path, argv: list[str], tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [script.name, *argv])
    runpy.run_path(str(script), run_name="__main__")


#: TRL's documented command line for gspo.py (its docstring), then what the test adds: the
#: tiny model in Qwen3-0.6B's place, 8 optimizer steps (2 of grouprl's) and short completions.
GSPO_ARGV = [
    "--model_name_or_path", "Qwen/Qwen3-0.6B", "--output_dir", "gspo-Qwen3-0.6B",
    "--learning_rate", "1e-5", "--dtype", "bfloat16", "--max_completion_length", "1024",
    "--use_peft", "--lora_target_modules", "q_proj,", "v_proj",  # the shell's "q_proj", "v_proj"
    "--log_completions", "--per_device_train_batch_size", "8", "--num_generations", "8",
    "--importance_sampling_level", "sequence", "--epsilon", "3e-4", "--epsilon_high", "4e-4",
    "--beta", "0.0", "--loss_type", "grpo", "--gradient_accumulation_steps", "2",
    "--steps_per_generation", "8",
]  # fmt: skip


def test_trls_gspo_script_with_its_documented_command_line(model_dir, tmp_path, monkeypatch):
    dataset_dir(tmp_path / "AI-MO" / "NuminaMath-TIR", {"train": 400, "test": 200}, numina=True)
    argv = [*GSPO_ARGV, "--model_name_or_path", model_dir, "--max_steps", "8",
            "--max_completion_length", "16"]  # fmt: skip
    # TRL's documented line quotes "q_proj", with a comma: it names no module, and says so
    with pytest.warns(UserWarning, match="'q_proj,' match no module"):
        run_argv(SCRIPTS / "gspo.py", argv, tmp_path, monkeypatch)
    run = tmp_path / "gspo-Qwen3-0.6B"
    record = yaml.safe_load((run / "config.yaml").read_text())
    # 8 x 8 completions a generation (steps_per_generation 8 x 8 per device): 8 prompts, 4
    # optimizer steps of 16 completions each; GSPO's sequence ratio at TRL's tiny clip
    assert (record["prompts_per_step"], record["minibatches"], record["steps"]) == (8, 4, 2)
    assert (record["ratio_level"], record["clip_low"], record["clip_high"], record["loss_agg"]) == (
        "sequence", 3e-4, 4e-4, "seq_mean_token_mean")  # fmt: skip
    # --dtype bfloat16 (model_init_kwargs) is the LoRA base's; the adapter's targets as given
    assert (record["base_dtype"], record["lora_r"], record["lora_target_modules"]) == (
        "bf16", 16, ["q_proj,", "v_proj"])  # fmt: skip
    assert [m["step"] for m in lines(run / "metrics.jsonl")] == [1, 2]
    assert (run / "adapter_model.safetensors").is_file()  # trainer.save_model(output_dir)


#: `trl grpo`'s documented command line (TRL's docs/source/clis.md), with a local model and
#: dataset, then 2 steps and short completions.
def grpo_argv(model_dir: str) -> list[str]:
    return ["--model_name_or_path", model_dir, "--dataset_name", "sums",
            "--reward_funcs", "accuracy_reward", "--max_steps", "2",
            "--max_completion_length", "16"]  # fmt: skip


def comparable(run: Path) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.endswith(("_seconds", "tokens_per_s"))}
            for m in lines(run / "metrics.jsonl")]  # fmt: skip


def test_trls_grpo_script_and_grouprl_trl_grpo_run_the_same(model_dir, tmp_path, monkeypatch):
    pytest.importorskip("trl")
    from grouprl.cli import main

    pytest.importorskip("math_verify")
    dataset_dir(tmp_path / "sums", {"train": 64, "test": 16})
    script = trl_grpo_script(tmp_path)
    run_argv(script, [*grpo_argv(model_dir), "--output_dir", "by-script"], tmp_path, monkeypatch)
    assert main(["trl", "grpo", *grpo_argv(model_dir), "--output_dir", "by-command"]) == 0
    # the documented YAML form: the same keys in a file
    (tmp_path / "grpo_config.yaml").write_text(yaml.safe_dump({
        "model_name_or_path": model_dir, "dataset_name": "sums",
        "reward_funcs": ["accuracy_reward"], "max_steps": 2, "max_completion_length": 16,
        "output_dir": "by-yaml"}))  # fmt: skip
    assert main(["trl", "grpo", "--config", "grpo_config.yaml"]) == 0
    runs = [tmp_path / name for name in ("by-script", "by-command", "by-yaml")]
    record = yaml.safe_load((runs[0] / "config.yaml").read_text())
    assert (record["group_size"], record["max_new_tokens"], record["steps"]) == (8, 16, 2)
    assert "reward_accuracy_reward" in lines(runs[0] / "metrics.jsonl")[0]
    assert comparable(runs[0]) == comparable(runs[1]) == comparable(runs[2])  # to the bit
    assert all((run / "model.safetensors").is_file() for run in runs)  # save_model(output_dir)


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--num_processes", "4"], "grouprl scales out with torchrun"),
     (["--reward_funcs", "acc_reward"], "not one of accuracy_reward"),
     (["--reward_funcs", "nowhere.fn"], "cannot import it"),
     (["--no_such_flag", "1"], "unknown flags: --no_such_flag 1"),
     (["--dataset_train_split", "training"], "no split 'training'")],
)  # fmt: skip
def test_grouprl_trl_grpo_mistakes_are_one_line(extra, message, model_dir, tmp_path,
                                                monkeypatch, capsys):  # fmt: skip
    pytest.importorskip("trl")
    from grouprl.cli import main

    dataset_dir(tmp_path / "sums", {"train": 8, "test": 4})
    monkeypatch.chdir(tmp_path)
    assert main(["trl", "grpo", *grpo_argv(model_dir), *extra]) == 2
    # grouprl's own lines (datasets prints its progress bars when it first builds a split)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("grouprl")]
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "trainer_output").exists()


def test_grouprl_trl_grpo_takes_a_dotted_reward_from_the_working_directory(
    model_dir, tmp_path, monkeypatch
):
    pytest.importorskip("trl")
    from grouprl.cli import main

    dataset_dir(tmp_path / "sums", {"train": 40, "test": 4})
    (tmp_path / "my_rewards.py").write_text(
        "def short(completions, **kwargs):\n"
        "    return [-len(c[0]['content']) / 16 for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    argv = [*grpo_argv(model_dir)[:4], "--reward_funcs", "my_rewards.short", "--max_steps", "1",
            "--max_completion_length", "8", "--per_device_train_batch_size", "4",
            "--num_generations", "4"]  # fmt: skip
    assert main(["trl", "grpo", *argv]) == 0
    steps = lines(tmp_path / "trainer_output" / "metrics.jsonl")
    assert len(steps) == 1 and steps[0]["reward_short"] < 0


def test_trls_async_grpo_example(model_dir, tmp_path, monkeypatch):
    pytest.importorskip("trl")
    rows = [{"question": f"Tom has {a} apples and buys {b}. How many now?",
             "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a in range(12) for b in range(6)]  # fmt: skip
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("GSM8K", str(tmp_path / "gsm8k.jsonl"))
    with pytest.warns(UserWarning, match="max_staleness=4: grouprl samples every batch"):
        run_script("async_grpo.py", model_dir, tmp_path, monkeypatch)
    run = tmp_path / "async_grpo_gsm8k"
    record = yaml.safe_load((run / "config.yaml").read_text())
    # 16 x 2 completions an optimizer step, groups of TRL's default 8: 4 prompts a step
    assert (record["prompts_per_step"], record["group_size"], record["max_staleness"],
            record["proximal"], record["lr_schedule"]) == (4, 8, 4, "behaviour", "constant")  # fmt: skip
    # batch k sampled by the weights of step max(0, k - 4)
    assert [m["staleness"] for m in lines(run / "metrics.jsonl")] == [0, 1, 2, 3, 4, 4]


def test_grouprl_trl_grpo_says_which_config_keys_it_ignores(tmp_path, monkeypatch, capsys):
    """A config TRL's script does not know (a grouprl run's config.yaml, say): TRL ignores its
    keys silently; grouprl names them."""
    pytest.importorskip("trl")
    from grouprl.cli import main

    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"algo": "gspo", "prompts_per_step": 8}))
    monkeypatch.chdir(tmp_path)
    assert main(["trl", "grpo", "--config", "run.yaml"]) == 2
    err = capsys.readouterr().err
    assert "ignored: algo, prompts_per_step" in err and "give --model_name_or_path" in err


def test_trls_rloo_script_and_grouprl_trl_rloo_run_the_same(model_dir, tmp_path, monkeypatch):
    """TRL's own trl/scripts/rloo.py (its import changed) and `grouprl trl rloo` with the same
    flags: the same run to the bit, with TRL's RLOO semantics (the KL in the reward, logged as
    TRL's kl), and the model saved."""
    pytest.importorskip("trl")
    pytest.importorskip("math_verify")
    import importlib.util

    from grouprl.cli import main

    dataset_dir(tmp_path / "sums", {"train": 64, "test": 16})
    source = Path(importlib.util.find_spec("trl.scripts.rloo").origin).read_text()
    theirs = (
        "    from trl import RLOOTrainer, get_dataset, get_peft_config, get_quantization_config\n"
    )
    assert source.count(theirs) == 1  # TRL's script still imports as it did
    source = source.replace(theirs, theirs + "    from grouprl.trl import RLOOTrainer\n")
    theirs = "    from trl import DatasetMixtureConfig, ModelConfig, RLOOConfig, TrlParser\n"
    assert source.count(theirs) == 1
    source = source.replace(theirs, theirs + "    from grouprl.trl import RLOOConfig\n")
    (tmp_path / "rloo.py").write_text(source)
    argv = [*grpo_argv(model_dir), "--num_generations", "4", "--normalize_advantages"]
    run_argv(tmp_path / "rloo.py", [*argv, "--output_dir", "by-script"], tmp_path, monkeypatch)
    assert main(["trl", "rloo", *argv, "--output_dir", "by-command"]) == 0
    runs = [tmp_path / name for name in ("by-script", "by-command")]
    record = yaml.safe_load((runs[0] / "config.yaml").read_text())
    assert (record["adv_estimator"], record["adv_scale"], record["kl_in_reward"],
            record["group_size"]) == ("rloo", "whiten", True, 4)  # fmt: skip
    metrics = lines(runs[0] / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2] and all("kl" in m for m in metrics)
    assert comparable(runs[0]) == comparable(runs[1])  # to the bit
    assert all((run / "model.safetensors").is_file() for run in runs)
