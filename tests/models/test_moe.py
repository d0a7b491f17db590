"""Mixture-of-experts models train through the paths dense models use: tiny Qwen3-MoE, OLMoE
and Mixtral models (transformers' fused experts and top-k routers), full fine-tuning and LoRA,
3 steps each; the checkpoint keeps transformers' per-expert keys and loads back, a LoRA run's
merged weights computing what its adapter does; a stopped run resumes bit for bit.

Tolerance: merged weights against the adapter on the base model are two float32 forwards of
the same function (`numerics.forward_bound`)."""

from __future__ import annotations

import signal

import pytest
import torch
from safetensors.torch import load_file

from grouprl.cli import main
from grouprl.models.tiny import MOE_FAMILIES, save_tiny_moe_model
from numerics import forward_bound

FLAGS = ["--task", "arithmetic", "--steps", "3", "--prompts-per-step", "4", "--minibatches", "1",
         "--group-size", "4", "--max-new-tokens", "8", "--eval-every", "0", "--eval-size", "2",
         "--eval-samples", "1", "--no-progress", "--threads", "1", "--save-every", "1",
         "--lr", "1e-3", "--log-ratios", "0"]  # fmt: skip
#: a checkpoint's key of layer 0's first expert, as transformers writes it per expert
EXPERT_KEY = {"qwen3_moe": "model.layers.0.mlp.experts.0.down_proj.weight",
              "olmoe": "model.layers.0.mlp.experts.0.down_proj.weight",
              "mixtral": "model.layers.0.block_sparse_moe.experts.0.w2.weight"}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny models, and a reward that varies with what a random model writes."""
    root = tmp_path_factory.mktemp("moe")
    for family in MOE_FAMILIES:
        save_tiny_moe_model(root / family, family)
    (root / "rewards.py").write_text(
        "def varies(completions, **_):\n    return [len(c) % 3 / 2 for c in completions]\n"
    )
    return root


def _flags(models):
    return [*FLAGS, "--rewards", f"{models / 'rewards.py'}:varies", "1"]


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_moe_model_trains_and_its_checkpoint_loads_back(models, tmp_path, family, lora):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    extra = ["--lora-r", "4", "--lora-alpha", "8"] if lora else []
    assert main(["train", "--model", str(models / family), *_flags(models), *extra,
                 "--output-dir", str(out)]) == 0  # fmt: skip
    before = load_file(str(models / family / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    assert after.keys() == before.keys() and EXPERT_KEY[family] in after  # per-expert keys
    moved = [k for k in after if not torch.equal(after[k], before[k])]
    assert any(".experts." in k for k in moved)  # the experts trained (LoRA: merged into them)
    assert any(".self_attn." in k for k in moved)
    final = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    with torch.no_grad():
        merged = final(ids).logits
    if lora:  # the merged weights compute what the adapter on the base model computes
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(models / family)
        adapted = PeftModel.from_pretrained(base, out / "final" / "adapter").eval()
        with torch.no_grad():
            want = adapted(ids).logits
        bound = forward_bound(final.config, float(want.abs().max()))
        torch.testing.assert_close(merged, want, rtol=0, atol=bound)


@pytest.mark.parametrize("extra", [[], ["--lora-r", "4", "--lora-alpha", "8"],
                                   ["--routing-replay", "r3", "--router-aux-loss-coef", "0.01",
                                    "--minibatches", "2"]], ids=["full", "lora", "r3"])  # fmt: skip
def test_a_moe_run_stopped_and_resumed_ends_bit_for_bit(models, tmp_path, stop_at, extra):
    """Full fine-tuning's checkpoints hold the experts one a key (transformers' layout on disk):
    a resumed run reads them back into the fused experts. With routes replayed from the
    sampler and the balancing loss on, the same."""
    args = ["train", "--model", str(models / "qwen3_moe"), *_flags(models), *extra]
    assert main([*args, "--output-dir", str(tmp_path / "whole")]) == 0
    stop_at(2, signal.SIGINT)
    assert main([*args, "--output-dir", str(tmp_path / "cut")]) == 130
    stop_at(None)
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0
    got, want = (load_file(str(tmp_path / d / "final" / "model.safetensors"))
                 for d in ("cut", "whole"))  # fmt: skip
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_lora_on_a_moe_model_is_refused_for_vllm_in_one_line(models, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--model", str(models / "qwen3_moe"), *_flags(models), "--lora-r", "4",
            "--engine", "vllm", "--output-dir", str(out)]  # fmt: skip
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "adapters act on parameters" in err[0] and not out.exists()


def _metrics(run):
    import json

    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("replay", ["off", "r2", "r3"])
def test_routing_is_watched_and_replayed_in_training(models, tmp_path, replay):
    """Every step logs how much routing moved, per layer; with R2 or R3 (two minibatches, so
    the second one's forward comes after an optimizer step) the run trains with the routes
    replayed, and the balancing loss is logged where weighted."""
    out = tmp_path / "run"
    args = ["train", "--model", str(models / "qwen3_moe"), *_flags(models), "--lr", "1e-2",
            "--minibatches", "2", "--routing-replay", replay, "--router-aux-loss-coef", "0.01",
            "--output-dir", str(out)]  # fmt: skip
    assert main(args) == 0
    lines = _metrics(out)
    assert len(lines) == 3
    for line in lines:
        for name in ("routing_update_changed", "routing_sampler_changed"):
            layers = [line[f"{name}_layer{i}"] for i in range(2)]
            assert all(0 <= x <= 1 for x in layers) and min(layers) <= line[name] <= max(layers)
        assert line["routing_sampler_changed"] == 0  # fp32: the sampler routes as the trainer
        assert 1.9 < line["router_aux_loss"] < 4  # top-2: 2 when balanced, up to 4
    assert max(line["routing_update_changed"] for line in lines) > 0  # lr 1e-2 moves routes


def test_routing_options_on_a_dense_model_are_refused_in_one_line(tmp_path, capsys):
    from grouprl.models.tiny import save_tiny_chat_model

    save_tiny_chat_model(tmp_path / "dense")
    for flags, says in ((["--routing-replay", "r2"], "drop --routing-replay"),
                        (["--router-aux-loss-coef", "0.1"], "drop --router-aux-loss-coef")):  # fmt: skip
        out = tmp_path / "run"
        assert main(["train", "--model", str(tmp_path / "dense"), *FLAGS, *flags,
                     "--output-dir", str(out)]) == 2  # fmt: skip
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1 and "not a mixture-of-experts model" in err[0] and says in err[0]
        assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "says"),
    [(["--routing-replay", "r3", "--engine", "vllm"], "--routing-replay r2"),
     (["--routing-replay", "r2", "--gradient-checkpointing"], "drop one of the two")],
    ids=["r3-from-vllm", "replay-recomputed"],
)  # fmt: skip
def test_replay_that_cannot_hold_is_refused_in_one_line(models, tmp_path, capsys, flags, says):
    out = tmp_path / "run"
    assert main(["train", "--model", str(models / "qwen3_moe"), *FLAGS, *flags,
                 "--output-dir", str(out)]) == 2  # fmt: skip
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and says in err[0] and not out.exists()


@pytest.mark.parametrize(
    "extra",
    [["--precision", "bf16", "--micro-batch-size", "4"],
     ["--packing", "on", "--max-tokens-per-micro-batch", "256", "--max-prompt-length", "64"],
     ["--packing", "on", "--routing-replay", "r2", "--minibatches", "2"],
     ["--max-staleness", "1", "--routing-replay", "r3"]],
    ids=["bf16-micro-batches", "packed", "packed-but-replayed", "async-r3"],
)  # fmt: skip
def test_a_moe_model_trains_through_the_other_paths(models, tmp_path, extra):
    """bf16 with micro-batches (the trainer recomputes old log-probs: the sampler's routes
    then may differ from the trainer's), packed token-budget micro-batches, replay with packing
    asked (replay runs each row whole instead), and R3 from the asynchronous sampler's copy of
    the policy (a step behind: its routes are an older policy's)."""
    out = tmp_path / "run"
    assert main(["train", "--model", str(models / "qwen3_moe"), *_flags(models), *extra,
                 "--output-dir", str(out)]) == 0  # fmt: skip
    lines = _metrics(out)
    assert len(lines) == 3 and all(line["grad_norm"] > 0 for line in lines)
    for name in ("routing_update_changed", "routing_sampler_changed"):  # every sampler records
        assert all(0 <= line[name] <= 1 for line in lines), name


def test_a_moe_model_trains_sharded_with_routes_replayed(models, tmp_path):
    """FSDP2 on 2 processes: the routers are probed before sharding, the sampler records routes
    in lockstep, R2 replays them under sharded weights, and the routing metrics sum both
    ranks' tokens."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "-m", "grouprl", "train", "--model", str(models / "qwen3_moe"),
               *_flags(models), "--steps", "2", "--strategy", "fsdp", "--routing-replay", "r2",
               "--minibatches", "2", "--output-dir", "run"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all(0 <= line["routing_update_changed"] <= 1 for line in lines)
    assert all(line["routing_sampler_changed"] == 0 for line in lines)
