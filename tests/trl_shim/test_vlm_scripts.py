"""TRL's two vision-language scripts, examples/scripts/grpo_vlm.py and gspo_vlm.py, run on
grouprl with one import added (scripts/), with their documented command lines: the hub model
replaced by a tiny Idefics3 (SmolVLM's architecture; its processor needs no torchvision), the
hub dataset by a local one of its columns (image, problem, solution) under the hub id's path,
which `load_dataset` reads first, and a few steps of short completions.

Their documented lines pass `--max_prompt_length 2048`, which TRL 1.16's GRPOConfig no longer
has (TRL's own parser refuses it too): the test leaves it out. They import TRL's
`get_kbit_device_map`, which TRL 1.16 no longer has: the test gives `trl` one (called only for
quantized models)."""

from __future__ import annotations

import gzip
import io
import json
import runpy
import sys
from pathlib import Path

import pytest
import yaml

from grouprl.models.tiny import save_tiny_vlm

SCRIPTS = Path(__file__).parent / "scripts"
DATASET = Path("lmms-lab") / "multimodal-open-r1-8k-verified"

#: grpo_vlm.py's documented SmolVLM2 line, without --max_prompt_length
GRPO_VLM_ARGV = [
    "--model_name_or_path", "HuggingFaceTB/SmolVLM2-2.2B-Instruct",
    "--output_dir", "grpo-SmolVLM2-2.2B-Instruct", "--learning_rate", "1e-5",
    "--dtype", "bfloat16", "--max_completion_length", "1024", "--use_peft",
    "--lora_target_modules", "q_proj,", "v_proj",  # the shell's "q_proj", "v_proj"
    "--log_completions", "--per_device_train_batch_size", "1",
    "--gradient_accumulation_steps", "2", "--num_generations", "2",
]  # fmt: skip
#: gspo_vlm.py's documented line, without --max_prompt_length
GSPO_VLM_ARGV = [
    "--model_name_or_path", "Qwen/Qwen2.5-VL-3B-Instruct",
    "--output_dir", "gspo-Qwen2.5-VL-3B-Instruct", "--learning_rate", "1e-5",
    "--dtype", "bfloat16", "--max_completion_length", "1024", "--use_peft",
    "--lora_target_modules", "q_proj,", "v_proj", "--log_completions",
    "--per_device_train_batch_size", "8", "--num_generations", "8",
    "--importance_sampling_level", "sequence", "--epsilon", "3e-4", "--epsilon_high", "4e-4",
    "--beta", "0.0", "--loss_type", "grpo", "--gradient_accumulation_steps", "2",
    "--steps_per_generation", "8",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("idefics3")
    save_tiny_vlm(directory, "idefics3")
    return str(directory)


def local_dataset(root: Path, rows: int = 132) -> None:
    """The hub dataset's columns in its layout: a parquet of images (datasets' Image feature,
    PNG bytes), geometry problems and LaTeX solutions, one image too large (the scripts filter
    images of 512 pixels or more)."""
    from datasets import Dataset, Image
    from PIL import Image as Pil
    from PIL import ImageDraw

    images, problems, solutions = [], [], []
    for i in range(rows):
        side = 600 if i == 0 else 64
        picture = Pil.new("L" if i % 2 else "RGB", (side, side), "white")  # some not RGB
        ImageDraw.Draw(picture).rectangle([8, 8, 8 + i % 40, 40], fill="black")
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        images.append({"bytes": buffer.getvalue(), "path": None})
        problems.append(f"How wide is the black box, in pixels? ({i})")
        solutions.append(f"$\\boxed{{{i % 40 + 1}}}$")
    table = Dataset.from_dict({"image": images, "problem": problems, "solution": solutions})
    table = table.cast_column("image", Image())
    (root / DATASET / "data").mkdir(parents=True)
    table.to_parquet(root / DATASET / "data" / "train-00000-of-00001.parquet")


def run(script: str, argv: list[str], tmp_path: Path, monkeypatch) -> Path:
    import trl

    # the scripts import get_kbit_device_map, which TRL 1.16 no longer has (they fail on TRL's
    # own trainer too); they call it only for a quantized model, which these lines never ask
    monkeypatch.setattr(trl, "get_kbit_device_map", lambda: None, raising=False)
    # the scripts set TRACKIO_SPACE_ID in os.environ, where it would outlive the test and send
    # later runs' trackio to a Space: set as they set it, and removed after the test
    monkeypatch.setenv("TRACKIO_SPACE_ID", "trl-trackio")
    local_dataset(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.warns(UserWarning, match="'q_proj,' match no module"):
        runpy.run_path(str(SCRIPTS / script), run_name="__main__")
    return tmp_path / argv[argv.index("--output_dir") + 1]


def test_trls_grpo_vlm_script_with_its_documented_command_line(model_dir, tmp_path, monkeypatch):
    out = run("grpo_vlm.py", [*GRPO_VLM_ARGV, "--model_name_or_path", model_dir,
                              "--max_steps", "2", "--max_completion_length", "12"],
              tmp_path, monkeypatch)  # fmt: skip
    record = yaml.safe_load((out / "config.yaml").read_text())
    assert (record["group_size"], record["base_dtype"], record["lora_target_modules"]) == (
        2, "bf16", ["q_proj,", "v_proj"])  # fmt: skip
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert {"reward_think_format_reward", "reward_accuracy_reward"} <= metrics[0].keys()
    from grouprl.report.sinks import group_file

    with gzip.open(group_file(out, 1)) as f:  # the rows' images reached the prompts
        groups = json.load(f)["groups"]
    assert groups and all(len(g["images"]) == 1 for g in groups)
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["target_modules"] and all("v_proj" in t and "text_model" in t
                                             for t in adapter["target_modules"])  # fmt: skip


def test_trls_gspo_vlm_script_with_its_documented_command_line(model_dir, tmp_path, monkeypatch):
    out = run("gspo_vlm.py", [*GSPO_VLM_ARGV, "--model_name_or_path", model_dir,
                              "--max_steps", "4", "--max_completion_length", "12"],
              tmp_path, monkeypatch)  # fmt: skip
    record = yaml.safe_load((out / "config.yaml").read_text())
    assert (record["ratio_level"], record["clip_low"], record["clip_high"]) == (
        "sequence", 3e-4, 4e-4)  # fmt: skip
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all(m["groups"] > 0 for m in metrics)
