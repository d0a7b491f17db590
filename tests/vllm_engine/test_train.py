"""Training with `--engine vllm`: full fine-tuning and LoRA, 3 steps, a run stopped after 2 and
resumed equal to the straight one bit for bit; the float32 mismatch within rounding; the
engine's bad inputs as one line before anything is written; a TRL script with use_vllm=True,
and TRL's own trl grpo script with use_vllm in server mode."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grouprl.cli import main
from numerics import forward_bound, logit_magnitude
from resumed_runs import straight_and_resumed

TIMES = {"step_seconds", "rollout_seconds", "tokens_per_s"}


def base(vllm_model_dir, files, **extra):
    return dict(
        model=str(vllm_model_dir), engine="vllm", dataset=str(files / "sums.jsonl"),
        rewards={f"{files / 'rewards.py'}:length": 1.0}, max_new_tokens=16, steps=3,
        prompts_per_step=4, group_size=4, eval_size=4, eval_samples=2, eval_every=0,
        save_every=1, progress=False, threads=1, warmup_steps=0, lr=1e-3, log_ratios=4,
        log_ratios_every=1, seed=1, **extra,
    )  # fmt: skip


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=["full", "lora"])
def runs(request, vllm_model_dir, files, tmp_path_factory):
    """A straight 3-step run, and one stopped during step 2 and resumed for step 3."""
    root = tmp_path_factory.mktemp(request.param)
    lora = {"lora_r": 4, "lr": 1e-2} if request.param == "lora" else {}
    straight, broken, resumed = straight_and_resumed({**base(vllm_model_dir, files), **lora}, root)
    return request.param, straight, broken, resumed


def test_three_steps_train_and_a_resumed_run_equals_the_straight_one(runs):
    """Bit for bit: the same completions (vLLM's seeded requests on the same weights and
    batch), the same trainer log-probs, updates and final weights."""
    kind, straight, broken, resumed = runs
    assert straight.steps_done == 3 and broken.interrupted and broken.steps_done == 2
    assert resumed.steps_done == 3 and not resumed.interrupted
    records = metrics(straight.run_dir)
    assert all("logp_mismatch_max" in r and "entropy" not in r for r in records)
    assert records[-1]["grad_norm"] > 0 and records[-1]["trained_frac"] > 0

    def comparable(run_dir):
        return [{k: v for k, v in r.items() if k not in TIMES} for r in metrics(run_dir)]

    assert comparable(resumed.run_dir) == comparable(straight.run_dir)
    samples = [(straight.run_dir / "samples.jsonl").read_text().splitlines()[-1],
               (resumed.run_dir / "samples.jsonl").read_text().splitlines()[-1]]  # fmt: skip
    assert samples[0] == samples[1]
    a = load_file(str(straight.run_dir / "final" / "model.safetensors"))
    b = load_file(str(resumed.run_dir / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), kind


def test_a_float32_runs_mismatch_is_within_float32_rounding(runs, vllm_model_dir):
    """vLLM in float32 against the trainer's float32 forward: every step's largest |Δ log p|
    is within `forward_bound` for the largest logit either the initial or the final policy can
    produce (the weights move little in 3 steps; both bound the ones in between only roughly,
    so the larger is taken and doubled)."""
    _, straight, _, _ = runs
    first = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    last = AutoModelForCausalLM.from_pretrained(straight.run_dir / "final", dtype=torch.float32)
    magnitude = 2 * max(logit_magnitude(first), logit_magnitude(last))
    bound = forward_bound(first.config, magnitude)
    for record in metrics(straight.run_dir):
        assert 0 <= record["logp_mismatch_max"] <= bound, (record["logp_mismatch_max"], bound)
        assert record["logp_mismatch_mean"] <= record["logp_mismatch_max"]
        assert record["logp_mismatch_kl"] >= 0


def test_the_engines_bad_inputs_are_one_line_before_anything_is_written(
    vllm_model_dir, files, tmp_path, capsys
):
    from grouprl.models.tiny import save_tiny_chat_model

    small = tmp_path / "heads16"
    save_tiny_chat_model(small)
    capsys.readouterr()  # its progress bars
    flags = ["--dataset", str(files / "sums.jsonl"), "--rewards",
             f"{files / 'rewards.py'}:length", "1.0", "--engine", "vllm", "--steps", "1"]  # fmt: skip
    cases = [
        (["--model", str(small)], "no kernel for head size 16"),
        (["--model", str(vllm_model_dir), "--vllm-sleep"], "sleep mode needs CUDA"),
        (["--model", str(vllm_model_dir), "--vllm-kv-cache-gb", "0.000001"], "fewer than one"),
        (["--model", str(vllm_model_dir), "--vllm-max-model-length", "4096"], "vLLM cannot run"),
    ]
    for i, (extra, message) in enumerate(cases):
        run = tmp_path / f"run{i}"
        assert main(["train", *flags, *extra, "--output-dir", str(run)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not run.exists()


SCRIPT = Path(__file__).parent / "scripts" / "use_vllm.py"


def test_a_trl_script_with_use_vllm_runs_on_the_vllm_engine(
    vllm_model_dir, files, tmp_path, monkeypatch
):
    monkeypatch.setenv("TINY_MODEL", str(vllm_model_dir))
    monkeypatch.setenv("SUMS", str(files / "sums.jsonl"))
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(SCRIPT), run_name="__main__")
    import yaml

    run = tmp_path / "trainer_output"
    record = yaml.safe_load((run / "config.yaml").read_text())
    assert record["engine"] == "vllm" and record["vllm_gpu_memory_utilization"] == 0.5
    # TRL's default correction, sequence_mask at 3: the product's weight, 0 above 3
    assert (record["correction_weight"], record["correction_weight_high"],
            record["correction_mask"], record["correction_mask_high"]) == (
        "sequence", 3.0, "sequence", 3.0)  # fmt: skip
    steps = metrics(run)
    assert [m["step"] for m in steps] == [1, 2] and "logp_mismatch_mean" in steps[0]
    for m in steps:  # the weights kept are products of ratios at most 3 (the mask's bound)
        assert 0 < m["is_weight_min"] <= m["is_weight_mean"] <= m["is_weight_max"] <= 3
        assert 0 <= m["is_masked_frac"] <= 1
    assert (run / "final" / "model.safetensors").is_file()


def test_trls_grpo_script_with_use_vllm_in_server_mode(vllm_model_dir, tmp_path, monkeypatch):
    """TRL's own trl/scripts/grpo.py (TRL installed here), import changed, with use_vllm in
    server mode: vLLM in a process of its own, no `trl vllm-serve` to start."""
    pytest.importorskip("trl")
    import sys

    import yaml
    from tests.trl_shim.trl_scripts import dataset_dir, trl_grpo_script

    dataset_dir(tmp_path / "sums", {"train": 64, "test": 8})
    script = trl_grpo_script(tmp_path)
    # a random model scores 0 on accuracy: a reward that spreads, by TRL's dotted-path route
    (tmp_path / "spread.py").write_text(
        "def length(completions, **kwargs):\n"
        "    return [len(c[0]['content']) / 40 for c in completions]\n"
    )
    argv = ["--model_name_or_path", str(vllm_model_dir), "--dataset_name", "sums",
            "--reward_funcs", "accuracy_reward", "spread.length", "--max_steps", "2",
            "--max_completion_length", "12", "--per_device_train_batch_size", "4",
            "--num_generations", "4", "--use_vllm", "--vllm_mode", "server",
            "--vllm_importance_sampling_mode", "token_truncate", "--bf16", "false"]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["grpo.py", *argv])
    runpy.run_path(str(script), run_name="__main__")
    run = tmp_path / "trainer_output"
    record = yaml.safe_load((run / "config.yaml").read_text())
    assert (record["engine"], record["vllm_mode"], record["correction_weight"],
            record["correction_weight_high"]) == ("vllm", "server", "token", 3.0)  # fmt: skip
    steps = metrics(run)
    assert [m["step"] for m in steps] == [1, 2]
    # vLLM's process samples the trainer's weights: fp32 log-probs equal to rounding (the
    # float32 test above bounds them; here, far below the truncation at 3)
    assert all(m["logp_mismatch_max"] < 1e-3 and m["is_weight_max"] <= 3 for m in steps)
    assert (run / "model.safetensors").is_file()


def test_trls_rloo_example_with_vllm_colocate(vllm_model_dir, tmp_path, monkeypatch):
    """TRL's examples/scripts/rloo.py (NuminaMath-TIR, LoRA, use_vllm=True colocate,
    steps_per_generation, log_completions) on grouprl: it trains 2 steps with TRL's RLOO
    semantics, saves its model, and its push to the hub is one line."""
    pytest.importorskip("trl")
    import yaml
    from tests.trl_shim.trl_scripts import dataset_dir

    from grouprl.errors import UserError

    monkeypatch.setenv("TINY_MODEL", str(vllm_model_dir))
    monkeypatch.setenv("NUMINA", str(dataset_dir(tmp_path / "numina", {"train": 800, "test": 40},
                                                 numina=True)))  # fmt: skip
    monkeypatch.chdir(tmp_path)
    script = Path(__file__).parents[1] / "trl_shim" / "scripts" / "rloo.py"
    with pytest.raises(UserError, match=r"RLOOTrainer\.push_to_hub: grouprl does not push"):
        runpy.run_path(str(script), run_name="__main__")
    run = tmp_path / "Qwen3-0.6B-RLOO"
    record = yaml.safe_load((run / "config.yaml").read_text())
    assert (record["engine"], record["adv_estimator"], record["ratio_level"],
            record["kl_in_reward"], record["beta"], record["group_size"]) == (
        "vllm", "rloo", "sequence_sum", True, 0.05, 2)  # fmt: skip
    # 8 per device x 8 steps per generation = 64 completions, 32 prompts of 2, in 4 minibatches
    assert (record["prompts_per_step"], record["minibatches"]) == (32, 4)
    steps = metrics(run)
    assert [m["step"] for m in steps] == [1, 2] and all("kl" in m for m in steps)
    assert (run / "adapter_model.safetensors").is_file()  # save_model: the LoRA adapter
