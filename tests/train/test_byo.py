"""Bring your own model, data and verifier, end to end: a chat model with a BPE tokenizer on a
JSONL file, reward files, LoRA (reference, merge, resume), stop strings, long prompts, bf16
bases, `grouprl eval` on the same held-out rows, and one line for each bad input."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import signal

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grouprl.cli import main
from grouprl.config import EvalConfig, TrainConfig, resolve
from grouprl.models import load_model
from grouprl.train import loop
from grouprl.train import run as run_module
from grouprl.train import step as train_step
from grouprl.train.build import build_task
from grouprl.train.nograd import no_grad_logprobs
from numerics import UNMOVED, assert_merged_weights, assert_same_function

TINY = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--eval-size", "4",
        "--eval-samples", "2", "--threads", "1", "--no-progress", "--save-every", "1"]  # fmt: skip
REWARDS = '''
def brevity(completions, solution, trainer_state, **kwargs):
    """TRL style: conversational completions, a dataset column by name."""
    assert len(solution) == len(completions) and trainer_state.global_step >= 0
    return [1.0 - min(len(c[0]["content"]), 40) / 40 for c in completions]


def length(completions, **kwargs):
    """Has variance on any model, so no group is skipped."""
    return [len(c) / 20 for c in completions]


def explode(completions, **kwargs):
    raise RuntimeError("boom")
'''


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("byo")
    rows = [
        {
            "question": [{"role": "user", "content": f"What is {a} plus {a + 3}?"}],
            "solution": f"{a} + {a + 3} = {2 * a + 3}\n#### {2 * a + 3}",
        }
        for a in range(80)
    ]
    (root / "gsm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sums = [{"q": f"{a}+{b}", "total": str(a + b)} for a in range(12, 40) for b in range(3)]
    (root / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sums))
    (root / "my_rewards.py").write_text(REWARDS)
    return root


@pytest.mark.parametrize("algo", ["grpo", "gspo"])
def test_a_chat_model_trains_on_a_jsonl_file_with_a_reward_file(
    chat_model_dir, files, tmp_path, algo
):
    run = tmp_path / algo
    code = main(
        ["train", "--algo", algo, "--model", str(chat_model_dir), "--dataset",
         str(files / "gsm.jsonl"), "--prompt-column", "question", "--answer-column", "solution",
         "--rewards", f"{files / 'my_rewards.py'}:brevity", "1.0", "accuracy", "1.0",
         "--max-new-tokens", "12", "--output-dir", str(run), *TINY]
    )  # fmt: skip
    assert code == 0
    records = metrics(run)
    assert len(records) == 2
    for key in ("reward_brevity", "reward_accuracy", "accuracy", "loss", "skipped_prompts"):
        assert key in records[0], key
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"][0]["role"] == "user"  # conversational prompts stay messages
    final = AutoModelForCausalLM.from_pretrained(run / "final")
    assert final.generation_config.eos_token_id == [2, 0]  # both EOS ids kept
    config = (run / "config.yaml").read_text()
    assert "pass_reward: null" in config and str(files / "my_rewards.py") in config


@pytest.fixture(scope="module")
def lora_runs(files, tmp_path_factory):
    """LoRA on the bundled model from a JSONL with other column names and a template: a
    straight 4-step run, and one interrupted after step 2 and resumed. The policy handed to
    save_final is kept for inspection."""
    root = tmp_path_factory.mktemp("lora")
    base = dict(
        model="builtin:arith",
        dataset=str(files / "sums.jsonl"),
        prompt_template="{q}=",
        answer_column="total",
        rewards={f"{files / 'my_rewards.py'}:length": 1.0, "correct": 0.0},
        max_new_tokens=24,
        lora_r=4,
        lr=2e-2,
        warmup_steps=0,
        steps=4,
        prompts_per_step=4,
        group_size=4,
        eval_size=4,
        eval_samples=2,
        eval_every=0,
        save_every=1,
        progress=False,
        threads=1,
    )
    saved = {}
    original_save_final = run_module.save_final

    def keep(policy, tokenizer, directory, state_dict=None):
        saved[directory.parent.name] = copy.deepcopy(policy)
        original_save_final(policy, tokenizer, directory, state_dict)

    patch = pytest.MonkeyPatch()
    patch.setattr(run_module, "save_final", keep)
    try:
        straight = loop.train(TrainConfig(**base, output_dir=root / "straight"))
        original_collect = loop.collect_batch

        def interrupt_at_step_2(cfg, sampler, step, position):
            if step == 2:
                os.kill(os.getpid(), signal.SIGINT)
            return original_collect(cfg, sampler, step, position)

        patch.setattr(loop, "collect_batch", interrupt_at_step_2)
        broken = loop.train(TrainConfig(**base, output_dir=root / "broken"))
        patch.setattr(loop, "collect_batch", original_collect)
        resumed = loop.train(TrainConfig(**{**base, "resume": broken.run_dir}))
    finally:
        patch.undo()
    return straight, broken, resumed, saved


@pytest.mark.numerics
def test_lora_trains_the_adapters_only(lora_runs):
    straight, _, _, saved = lora_runs
    policy = saved["straight"]
    base = load_model("builtin:arith")
    for name, param in base.named_parameters():
        torch.testing.assert_close(
            policy.get_base_model().get_parameter(name), param, rtol=0, atol=0
        )
    moved = [p for n, p in policy.named_parameters() if "lora_B" in n]
    assert moved and all(p.abs().max() > 1e-4 for p in moved)  # B starts at zero
    step = straight.run_dir / "checkpoints" / "step_000004"
    files = load_file(str(step / "adapter_model.safetensors"))
    assert files and all("lora_" in key for key in files)  # only the adapter is checkpointed
    assert not (step / "model.safetensors").exists()
    # a checkpoint is an adapter directory that names its base: it evaluates as a model (the
    # adapter merged in)
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 6, 15]])
        assert_same_function(load_model(step), policy, base, ids)


@pytest.mark.numerics
def test_lora_final_directory_merged_and_adapter(lora_runs):
    straight, _, _, saved = lora_runs
    ids = torch.tensor([[1, 5, 6, 15, 7, 8, 19]])
    merged = AutoModelForCausalLM.from_pretrained(straight.run_dir / "final")
    assert_merged_weights(merged, saved["straight"])
    with torch.no_grad():
        assert_same_function(merged, saved["straight"], load_model("builtin:arith"), ids)
    assert (straight.run_dir / "final" / "adapter" / "adapter_config.json").is_file()


def test_lora_resume_equals_the_uninterrupted_run(lora_runs):
    straight, broken, resumed, _ = lora_runs
    assert broken.interrupted and broken.steps_done == 3 and resumed.steps_done == 4

    def comparable(run_dir):
        drop = {"step_seconds", "rollout_seconds", "tokens_per_s"}
        return [{k: v for k, v in r.items() if k not in drop} for r in metrics(run_dir)]

    assert comparable(resumed.run_dir) == comparable(straight.run_dir)
    a = load_file(str(straight.run_dir / "final" / "model.safetensors"))
    b = load_file(str(resumed.run_dir / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resuming_with_other_lora_settings_is_one_line(lora_runs, capsys):
    straight = lora_runs[0]
    resume = ["train", "--resume", str(straight.run_dir), "--lora-r", "8", "--steps", "5"]
    assert main(resume) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lora_r would change from 4 to 8" in err[0]
    assert main([*resume, "--allow-change", "lora_r"]) == 2  # allowed, but the weights differ
    err = capsys.readouterr().err.strip().splitlines()
    assert "holds other trainable parameters than this model" in err[-1]


@pytest.mark.numerics
def test_lora_reference_logprobs_are_the_base_models(files, tmp_path, monkeypatch):
    seen = []
    original = train_step.update

    def spy(cfg, policy, optimizer, batch, advantages, ref_logp, **kwargs):
        seen.append((batch.rollout, ref_logp))
        return original(cfg, policy, optimizer, batch, advantages, ref_logp, **kwargs)

    monkeypatch.setattr(train_step, "update", spy)
    loop.train(
        TrainConfig(
            model="builtin:arith", dataset=str(files / "sums.jsonl"), prompt_template="{q}=",
            answer_column="total", rewards={f"{files / 'my_rewards.py'}:length": 1.0},
            max_new_tokens=24, lora_r=4, lr=2e-2, warmup_steps=0, beta=0.1, steps=2,
            prompts_per_step=4,
            group_size=4, eval_size=2, eval_samples=1, eval_every=0, progress=False, threads=1,
            output_dir=tmp_path / "kl",
        )
    )  # fmt: skip
    base = load_model("builtin:arith")
    rollout, ref_logp = seen[-1]  # step 2: the adapter has moved by then
    cfg = resolve(
        TrainConfig(beta=0.1, prompts_per_step=4, group_size=4, lora_r=4), task_max_new_tokens=24
    )  # the run's chunking
    # adapters off, each LoRA layer is its base layer: on the same chunks, the same bits
    assert torch.equal(ref_logp, no_grad_logprobs(cfg, base, rollout, None))
    assert metrics(tmp_path / "kl")[-1]["kl"] > 0


@pytest.mark.numerics
def test_a_bf16_lora_base_recomputes_old_logp(files, tmp_path):
    """Adapters over a bf16 base run under autocast; the trainer's own old_logp makes the first
    update's ratio 1 (a policy that does not move clips nothing)."""
    loop.train(
        TrainConfig(
            algo="gspo", model="builtin:arith", lora_r=4, base_dtype="bf16", lr=1e-12,
            warmup_steps=0, steps=1, prompts_per_step=4, group_size=4, minibatches=2,
            eval_size=2, eval_samples=1, progress=False, threads=1, output_dir=tmp_path / "bf16",
        )
    )  # fmt: skip
    (record,) = metrics(tmp_path / "bf16")
    # the policy does not move at lr 1e-12 (tests/numerics.py: UNMOVED)
    assert abs(record["ratio_min"] - 1) < UNMOVED and abs(record["ratio_max"] - 1) < UNMOVED
    assert record["clip_frac_low"] == 0 and record["clip_frac_high"] == 0


def test_an_fp16_lora_base_trains_with_a_loss_scaler(tmp_path):
    """fp16 forwards scale the loss (torch.amp.GradScaler): gradients stay finite, the
    adapters move, and the scaler's state is checkpointed for an exact resume."""
    summary = loop.train(
        TrainConfig(
            algo="grpo", model="builtin:arith", lora_r=4, base_dtype="fp16", lr=1e-2,
            warmup_steps=0, steps=2, prompts_per_step=4, group_size=4, eval_size=2,
            eval_samples=1, save_every=1, progress=False, threads=1, output_dir=tmp_path / "fp16",
        )
    )  # fmt: skip
    records = metrics(summary.run_dir)
    assert all(0 < r["grad_norm"] < float("inf") for r in records if r["trained_frac"] > 0)
    state = json.loads((summary.run_dir / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["grad_scaler"]["scale"] > 0
    adapter = load_file(str(summary.run_dir / "final" / "adapter" / "adapter_model.safetensors"))
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k)


def test_stop_strings_end_completions(tmp_path):
    run = tmp_path / "stop"
    assert main(["train", "--stop", "+", "--output-dir", str(run), "--steps", "1", *TINY[2:]]) == 0
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["completion"].endswith("+") for s in samples)
    assert metrics(run)[0]["completion_len_max"] <= 4  # "7+" and the like, not whole traces


def test_long_prompts_are_skipped_and_counted(files, tmp_path, capsys):
    long_rows = [{"q": "1" * 40 + f"+{i}", "total": "0"} for i in range(6)]
    rows = long_rows + [{"q": f"{i}+1", "total": str(i + 1)} for i in range(60)]
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "long"
    code = main(
        ["train", "--dataset", str(data), "--prompt-template", "{q}=", "--answer-column",
         "total", "--rewards", "correct", "1", "--max-prompt-length", "20", "--steps", "4",
         "--max-new-tokens", "24",
         "--output-dir", str(run), *TINY[2:]]
    )  # fmt: skip
    assert code == 0
    assert sum(r["skipped_prompts"] for r in metrics(run)) > 0
    assert capsys.readouterr().err.count("over the prompt budget of 20") == 1  # warned once


def test_when_no_prompt_fits_the_line_says_how_long_and_what_to_change(tmp_path, capsys):
    rows = [{"q": "1" * 30 + f"+{i}", "total": "0"} for i in range(40)]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(
        ["train", "--dataset", str(data), "--prompt-template", "{q}=", "--answer-column",
         "total", "--rewards", "correct", "1", "--max-prompt-length", "20", "--steps", "1",
         "--max-new-tokens", "24", "--output-dir", str(tmp_path / "run"), *TINY[2:]]
    )  # fmt: skip
    assert code == 2
    errors = [e for e in capsys.readouterr().err.splitlines() if "error:" in e]
    assert len(errors) == 1, errors
    assert "fits the prompt budget of 20 tokens (--max-prompt-length 20)" in errors[0]
    # the char tokenizer: "1"·30 + "+i=" is 33 characters for i < 10, and a BOS
    assert (
        "the shortest is 34 tokens; raise --max-prompt-length, lower --max-new-tokens or "
        "shorten the prompts" in errors[0]
    ), errors


def test_eval_scores_the_rows_train_holds_out(chat_model_dir, files, capsys):
    data = dict(dataset=str(files / "gsm.jsonl"), prompt_column="question",
                answer_column="solution", rewards={"accuracy": 1.0})  # fmt: skip
    held_train = build_task(TrainConfig(**data)).heldout
    held_eval = build_task(EvalConfig(**data)).heldout
    assert [r["prompt"] for r in held_train] == [r["prompt"] for r in held_eval]
    code = main(
        ["eval", "--model", str(chat_model_dir), "--dataset", data["dataset"], "--prompt-column",
         "question", "--answer-column", "solution", "--rewards", "accuracy", "1", "--limit", "5",
         "--samples", "2", "--max-new-tokens", "6", "--json", "--threads", "1"]
    )  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n"] == 5 and out["pass_reward"] == "accuracy" and out["split"] == "heldout"


def _bad(files, chat_model_dir, tmp_path):
    gsm, rewards = str(files / "gsm.jsonl"), f"{files / 'my_rewards.py'}"
    chat = ["--model", str(chat_model_dir), "--dataset", gsm, "--prompt-column", "question"]
    return [
        (["--dataset", gsm], "--dataset needs --rewards"),
        (["--task", "arithmetic", "--dataset", gsm, "--rewards", "accuracy", "1"],
         "--task arithmetic and --dataset are exclusive"),
        ([*chat[:4], "--rewards", "accuracy", "1"], r"no column 'prompt' \(columns: question, solution\)"),
        ([*chat, "--rewards", "accuracy", "1"], "reward 'accuracy' needs a column 'answer'"),
        ([*chat, "--answer-column", "solution", "--rewards", f"{rewards}:nope", "1"],
         "has no function 'nope'"),
        ([*chat, "--answer-column", "soluton", "--rewards", "accuracy", "1"],
         r"no column 'soluton' .* --answer-column"),
        (["--dataset", str(tmp_path / "none.jsonl"), "--rewards", "accuracy", "1"], "does not exist"),
        (["--dataset", gsm, "--prompt-column", "question", "--answer-column", "solution",
          "--rewards", "accuracy", "1", "--max-new-tokens", "16"],
         "prompts are chat messages but the tokenizer has no chat template"),
        (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "tpu"],
         "device"),
        (["--model", "no-such-org/no-such-model"], "neither a local directory nor a hub id found"),
        (["--lora-r", "4", "--lora-target-modules", "nope_proj"], "cannot add LoRA adapters"),
        (["--eval-dataset", gsm], "--eval-dataset applies to --dataset"),
        ([*chat, "--answer-column", "solution", "--rewards", "accuracy", "1", "--eval-dataset",
          str(files / "." / "gsm.jsonl")], "evaluation would score training prompts"),
        ([*chat, "--answer-column", "solution", "--rewards", f"{rewards}:explode", "1", "--steps",
          "1"], r"reward function 'explode' raised RuntimeError: boom"),
    ]  # fmt: skip


def test_bad_inputs_are_one_line_and_touch_no_earlier_run(chat_model_dir, files, tmp_path, capsys):
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "config.yaml").write_text("algo: gspo\n")
    (earlier / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {p.name: p.read_bytes() for p in earlier.iterdir()}
    for i, (flags, message) in enumerate(_bad(files, chat_model_dir, tmp_path)):
        out = tmp_path / f"new{i}"
        code = main(["train", *flags, "--output-dir", str(out), *TINY[2:]])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, flags
        assert err[-1].startswith("grouprl train: error:"), err
        assert re.search(message, err[-1]), (message, err[-1])
        if "explode" not in message:  # caught before anything is printed or written
            assert len(err) == 1 and not out.exists(), (flags, err)
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == before


def test_bad_eval_inputs_are_one_line(files, capsys):
    code = main(["eval", "--dataset", str(files / "gsm.jsonl"), "--rewards", "accuracy", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no column 'prompt'" in err[0]


def test_the_run_records_what_ran(files, tmp_path):
    summary = loop.train(
        TrainConfig(
            model="builtin:arith", dataset=str(files / "sums.jsonl"), prompt_template="{q}=",
            answer_column="total", rewards={"correct": 1.0}, lora_r=2, steps=1, max_new_tokens=30,
            prompts_per_step=4, group_size=2, eval_size=2, eval_samples=1, progress=False,
            threads=1, output_dir=tmp_path / "rec", micro_batch_size=2,
        )
    )  # fmt: skip
    from grouprl.config import from_mapping, load_yaml

    saved = from_mapping(load_yaml(summary.run_dir / "config.yaml"), source="x")
    assert saved.lora_alpha == 4.0 and saved.max_new_tokens == 30 and saved.task is None
    assert saved.dataset == str(files / "sums.jsonl") and saved.model == "builtin:arith"
    assert dataclasses.asdict(saved)["rewards"] == {"correct": 1.0}


def test_the_shipped_example_runs_as_documented(tmp_path, monkeypatch, capsys):
    """examples/byo_arith/config.yaml from the project root (its paths are relative to it),
    shortened; eval_size above the held-out rows warns once."""
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    run = tmp_path / "example"
    code = main(
        ["train", "--config", "examples/byo_arith/config.yaml", "--steps", "2", "--eval-size",
         "1000", "--eval-samples", "1", "--prompts-per-step", "4", "--group-size", "4",
         "--output-dir", str(run), "--threads", "1", "--no-progress"]
    )  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err
    assert err.count("eval_size 1000 is more than the") == 1
    record = metrics(run)[0]
    assert "reward_correct_total" in record and "reward_shows_work" in record
    assert (run / "final" / "adapter" / "adapter_config.json").is_file()


def test_a_dataset_brings_a_256_token_budget(files):
    opts = {"dataset": str(files / "gsm.jsonl"), "prompt_column": "question"}
    task = build_task(TrainConfig(**opts, rewards={"accuracy": 1.0}))
    assert task.max_new_tokens == 256


def test_the_smollm2_example_config_is_valid_on_a_tiny_chat_model(
    tmp_path, monkeypatch, chat_model_dir
):
    """examples/smollm2/config.yaml (its real model downloads 98 MB, so not here) on a tiny
    local chat model with the same ChatML template: its data, rewards, template and system
    prompt train two steps."""
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    run = tmp_path / "smollm2"
    assert main(["train", "--config", "examples/smollm2/config.yaml", "--model",
                 str(chat_model_dir), "--steps", "2", "--eval-size", "2", "--eval-samples", "1",
                 "--output-dir", str(run), "--threads", "1", "--no-progress"]) == 0  # fmt: skip
    record = metrics(run)[0]
    assert {"reward_right_number", "reward_terse", "reward_only_number"} <= record.keys()
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"][0] == {"role": "system",
                                   "content": "You are a calculator. Reply with only the number."}  # fmt: skip
