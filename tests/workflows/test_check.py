"""`grouprl check`: the numbers it reports are the ones a direct computation on the same groups
gives, it finds the runs that would not learn (exit 1), it writes nothing, and it leaves the
weights as they were."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from grouprl.cli import main
from grouprl.config import parse_train_args
from grouprl.train.run import setup_run
from grouprl.workflows.check import CheckOptions, measure, no_gradient_share

VAULT = f"{Path(__file__).resolve().parents[2] / 'examples' / 'vault' / 'env.py'}:Vault"
TINY = ["--prompts-per-step", "4", "--group-size", "4", "--eval-size", "2", "--threads", "1",
        "--check-steps", "1"]  # fmt: skip


def _check(capsys, *args):
    code = main(["check", "--json", *TINY, *args])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_the_no_gradient_share_follows_the_beta_posterior_formula():
    # k = 0 of n = 2: p ~ Beta(1/2, 5/2); E[p²] = (1/2·3/2)/(3·4), E[(1-p)²] = (5/2·7/2)/(3·4)
    assert no_gradient_share(0, 2, 2) == pytest.approx((0.75 + 8.75) / 12, rel=1e-12)
    # k = 1 of 2: symmetric, E[p²] = E[(1-p)²] = (3/2·5/2)/(3·4)
    assert no_gradient_share(1, 2, 2) == pytest.approx(2 * 3.75 / 12, rel=1e-12)
    # more samples that all pass make all-pass groups likelier
    assert no_gradient_share(8, 8, 4) > no_gradient_share(2, 2, 4) > 0.5


def test_check_on_the_built_in_task_finds_nothing_and_its_numbers_are_recomputable(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    code, report = _check(capsys, "--second-temperature", "0.5")
    assert code == 0 and not report["would_not_learn"]
    assert report["second_temperature"]["temperature"] == 0.5  # measured there, not extrapolated
    assert 0 <= report["second_temperature"]["measured_no_gradient"] <= 1
    assert [f for f in report["findings"] if f["severity"] == "warning"] == []
    counts = report["pass_counts"]
    assert len(counts) == 4 and all(n == 4 for _, n in counts)
    # the built-in rewards: correct x1 (format x0), so a group has no gradient iff all or none pass
    assert report["measured_no_gradient"] == sum(k in (0, n) for k, n in counts) / len(counts)
    for g, share in report["predicted_no_gradient"].items():
        assert share == pytest.approx(
            sum(no_gradient_share(k, n, int(g)) for k, n in counts) / len(counts), rel=1e-12
        )
    passes = sum(k for k, _ in counts)
    assert report["rewards"]["correct"]["mean"] == pytest.approx(passes / 16, rel=1e-12)
    assert report["prompts"][0]["rendered"].startswith("<bos>")  # special tokens shown
    assert report["timing"]["seconds_per_step"] > 0 and report["memory"]["peak_gb"] > 0
    assert list(tmp_path.iterdir()) == []  # nothing written: no runs/ directory


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--max-new-tokens", "2"], "all_truncated"),
        (["--rewards", "REWARDS:always", "1.0"], "no_gradient"),
        (["--rewards", "REWARDS:tagged", "1.0"], "never_passes"),
    ],
)
def test_a_run_that_would_not_learn_is_found_and_exits_1(tmp_path, capsys, args, code):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def always(completions, **kw):\n    return [1.0 for _ in completions]\n\n"
        "def tagged(completions, **kw):\n"
        "    return [1.0 if '<answer>' in c else 0.0 for c in completions]\n"
    )
    args = [a.replace("REWARDS", str(rewards)) for a in args]
    exit_code, report = _check(capsys, *args)
    assert exit_code == 1 and report["would_not_learn"]
    assert code in [f["code"] for f in report["findings"] if f["severity"] == "warning"]
    if code == "never_passes":  # with the completions that show why
        found = next(f for f in report["findings"] if f["code"] == code)
        assert found["examples"] and all(
            "<answer>" not in e["completion"] for e in found["examples"]
        )


def test_check_leaves_an_existing_run_untouched_and_bad_flags_are_trains_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--steps", "1", "--output-dir", str(run), *TINY[:-2], "--eval-samples",
                 "1", "--no-progress"]) == 0  # fmt: skip
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["check", "--output-dir", str(run), *TINY]) == 2
    check_err = capsys.readouterr().err
    assert main(["train", "--output-dir", str(run), *TINY[:-2]]) == 2
    assert capsys.readouterr().err == check_err.replace("grouprl check:", "grouprl train:")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert main(["check", *TINY, "--group-size", "1"]) == 2
    assert "group_size must be at least 2" in capsys.readouterr().err


def test_check_never_steps_the_optimizer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = setup_run(parse_train_args(TINY[:-2]))
    before = {n: p.detach().clone() for n, p in run.policy.named_parameters()}
    report = measure(run, CheckOptions(steps=1))
    assert report.timing["update_completions"] > 0
    after = dict(run.policy.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert run.optimizer.state == {}  # AdamW never stepped: no moments


@pytest.mark.parametrize(
    "args",
    [
        ["--beta", "0.04"],
        ["--lora-r", "2", "--beta", "0.04"],
        ["--algo", "dapo"],
        ["--task", "lookup", "--environment", VAULT],
        ["--precision", "bf16"],
        ["--micro-batch-size", "3", "--algo", "grpo", "--minibatches", "2"],
    ],
    ids=["kl", "lora-kl", "dynamic-sampling", "environment", "bf16", "micro-batches"],
)
def test_check_measures_the_step_train_takes(tmp_path, monkeypatch, capsys, args):
    """check runs the training step itself (grouprl.train.step.learn), so whatever train takes
    check measures: the KL term's reference forward, LoRA's base as the reference, dynamic
    sampling, tools from an environment, bf16 forwards, micro-batches."""
    monkeypatch.chdir(tmp_path)
    code, report = _check(capsys, *args)
    assert code in (0, 1), report
    step = report["step"]
    assert step["groups"] >= 0 and step["nonfinite_updates"] == 0
    if "--beta" in args:
        assert math.isfinite(step["kl"]) and step["kl"] >= 0  # the reference log-probs ran
    else:
        assert "kl" not in step
    if "--environment" in args:
        assert "reward_Vault" in step and "tool_calls_mean" in step
    assert report["timing"]["update_seconds"] > 0 and report["memory"]["peak_gb"] > 0
    if "--micro-batch-size" in args:
        assert report["memory"]["completions_per_forward"] == 3
    assert list(tmp_path.iterdir()) == []


@pytest.mark.numerics
def test_check_certifies_the_fp32_sampler_is_the_trainer_and_measures_bf16(tmp_path, monkeypatch,
                                                                            capsys):  # fmt: skip
    """grouprl's sampler in fp32 computes the trainer's log-probs to the float32 bound of two
    forwards of one function (`forward_bound`, from the weights' logit bound); under bf16 the
    gap is measured and is far larger (bf16 keeps 8 bits of mantissa)."""
    from grouprl.models import load_model
    from numerics import forward_bound, logit_magnitude

    monkeypatch.chdir(tmp_path)
    model = load_model("builtin:arith")
    bound = forward_bound(model.config, logit_magnitude(model))
    code, report = _check(capsys)
    mm = report["mismatch"]
    assert code == 0 and mm["sampler"] == "hf" and mm["tokens"] > 0
    assert mm["logp_mismatch_max"] <= bound
    assert not any(f["code"] == "logp_mismatch" for f in report["findings"])
    _, report = _check(capsys, "--precision", "bf16")
    assert report["mismatch"]["sampler"] == "hf bf16"
    assert report["mismatch"]["logp_mismatch_max"] > bound  # not the same function any more


def test_a_large_mismatch_is_a_finding_that_names_a_correction(tmp_path, monkeypatch, capsys):
    """From a KL of 1e-4 per token check suggests a correction (info), from 1e-2 it warns."""
    from grouprl.workflows import check as preflight

    monkeypatch.chdir(tmp_path)
    for kl, severity in ((5e-4, "info"), (2e-2, "warning")):
        monkeypatch.setattr(preflight, "_mismatch", lambda run, collected, kl=kl: {
            "logp_mismatch_mean": 0.01, "logp_mismatch_max": 0.5, "logp_mismatch_kl": kl,
            "tokens": 100, "sampler": "vllm"})  # fmt: skip
        code, report = _check(capsys)
        assert code == 0  # a gap to correct, not a run that would not learn
        (finding,) = [f for f in report["findings"] if f["code"] == "logp_mismatch"]
        assert finding["severity"] == severity and "--correction token_tis" in finding["suggestion"]
        assert f"{kl:.2e}" in finding["evidence"]


def test_async_on_a_shared_device_is_an_info_finding_with_its_measure(tmp_path, monkeypatch,
                                                                       capsys):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    _, report = _check(capsys)
    assert not any(f["code"] == "async_shared_device" for f in report["findings"])
    code, report = _check(capsys, "--max-staleness", "1")
    (finding,) = [f for f in report["findings"] if f["code"] == "async_shared_device"]
    assert code == 0 and finding["severity"] == "info"
    assert "0.85-0.99x" in finding["evidence"] and "--vllm-server" in finding["suggestion"]
