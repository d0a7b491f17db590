"""Asynchronous rollouts (`--max-staleness K`, `grouprl.train.async_sampler`): batch k is sampled by
version max(0, k − K), always; an overlapped run equals its sequential simulation bit for bit,
resumes to the same end, and stops cleanly on the sampler's errors and on signals."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import torch
from safetensors.torch import load_file

from grouprl.cli import main
from grouprl.errors import UserError
from grouprl.train import async_sampler, loop
from grouprl.train import checkpoint as ckpt

TINY = ["--prompts-per-step", "4", "--group-size", "4", "--eval-size", "4", "--eval-samples",
        "1", "--threads", "1", "--sampler-threads", "1", "--no-progress", "--eval-every", "2",
        "--lr", "3e-4", "--warmup-steps", "0"]  # fmt: skip
TIMING = {"step_seconds", "rollout_seconds", "tokens_per_s", "sampler_seconds", "update_seconds"}


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def untimed(path):
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows(path)]


def weights(run):
    return load_file(str(run / "final" / "model.safetensors"))


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def sampler_threads():
    return [t for t in threading.enumerate() if t.name == "grouprl-sampler"]


def train(run, *flags):
    return main(["train", "--output-dir", str(run), *TINY, *flags])


@pytest.mark.parametrize("staleness", [1, 2])
def test_an_overlapped_run_equals_its_sequential_simulation(tmp_path, monkeypatch, staleness):
    flags = ["--steps", "5", "--max-staleness", str(staleness)]
    assert train(tmp_path / "overlapped", *flags) == 0
    monkeypatch.setenv("GROUPRL_SEQUENTIAL_AHEAD", "1")
    assert train(tmp_path / "sequential", *flags) == 0
    a, b = tmp_path / "overlapped", tmp_path / "sequential"
    assert untimed(a / "metrics.jsonl") == untimed(b / "metrics.jsonl")
    assert rows(a / "eval.jsonl") == rows(b / "eval.jsonl")
    assert rows(a / "samples.jsonl") == rows(b / "samples.jsonl")
    assert same_weights(weights(a), weights(b))
    lags = [row["staleness"] for row in rows(a / "metrics.jsonl")]
    assert lags == [min(k, staleness) for k in range(5)]
    assert not sampler_threads()  # the sampler's thread ended with the run


def test_batch_k_is_sampled_by_a_copy_of_version_k_minus_K(tmp_path, monkeypatch):
    """What the sampler's copy holds when it samples batch k is checkpoint max(0, k − 2)'s
    model, to the bit (every step is checkpointed here to have each version on disk)."""
    seen = {}
    original = async_sampler.collect_batch

    def collect(cfg, sampler, step, position):
        model = sampler.engine.model
        seen[step] = {k: v.clone() for k, v in model.state_dict().items()}
        return original(cfg, sampler, step, position)

    monkeypatch.setattr(async_sampler, "collect_batch", collect)
    run = tmp_path / "run"
    assert train(run, "--steps", "4", "--max-staleness", "2", "--save-every", "1",
                 "--keep-last", "10") == 0  # fmt: skip
    assert sorted(seen) == [0, 1, 2, 3]
    for step, state in seen.items():
        version = max(0, step - 2)
        saved = load_file(
            str(ckpt.checkpoint_dir(run) / f"step_{version:06d}" / "model.safetensors")
        )
        assert all(torch.equal(state[k], saved[k]) for k in saved), step
    assert any(not torch.equal(seen[3][k], seen[0][k]) for k in seen[0])  # it moved


def test_a_resumed_async_run_ends_like_the_uninterrupted_one(tmp_path, monkeypatch):
    """SIGTERM mid-run: the checkpoint keeps the version the in-flight batch needs, and the
    resumed run samples it again exactly."""
    flags = ["--steps", "5", "--max-staleness", "1"]
    straight = tmp_path / "straight"
    assert train(straight, *flags) == 0
    original = loop.take_batch

    def take(run, state):
        if state.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(run, state)

    monkeypatch.setattr(loop, "take_batch", take)
    broken = tmp_path / "broken"
    assert train(broken, *flags) == 143
    saved = ckpt.latest_checkpoint(broken)
    assert saved.name == "step_000004"
    assert sorted(ckpt.load_sampler_versions(saved)) == [3]  # batch 4's version
    monkeypatch.setattr(loop, "take_batch", original)
    assert main(["train", "--resume", str(broken)]) == 0
    assert untimed(broken / "metrics.jsonl") == untimed(straight / "metrics.jsonl")
    assert rows(broken / "eval.jsonl") == rows(straight / "eval.jsonl")
    assert same_weights(weights(broken), weights(straight))


def test_an_error_in_the_sampler_ends_the_run_in_one_line_and_saves(tmp_path, monkeypatch, capsys):
    original = async_sampler.collect_batch

    def collect(cfg, sampler, step, position):
        if step == 2:
            raise UserError("reward function 'x' raised ValueError: boom")
        return original(cfg, sampler, step, position)

    monkeypatch.setattr(async_sampler, "collect_batch", collect)
    run = tmp_path / "run"
    assert train(run, "--steps", "4", "--max-staleness", "1") == 2
    assert "reward function 'x' raised ValueError: boom" in capsys.readouterr().err
    assert ckpt.latest_checkpoint(run).name == "step_000002"
    assert not sampler_threads()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--correction", "token_tis"], "nothing to correct"),
        (["--max-staleness", "1", "--proximal", "behaviour", "--correction", "token_tis"],
         "counts the sampler's gap twice"),
        (["--max-staleness", "1", "--correction-mask-high", "2"], "bound a mask that is not"),
        (["--max-staleness", "1", "--correction", "icepop", "--correction-mask-low", "3"],
         "low < high"),
        (["--max-staleness", "-1"], "max_staleness must be >= 0"),
        (["--max-staleness", "1", "--proximal", "behaviour", "--correction", "icepop"],
         "counts the sampler's gap twice"),  # IcePop is a weight: ρ inside its band
        (["--minibatches", "1", "--off-policy-mask", "0.5"], "no drift to mask"),
        (["--vllm-mode", "server"], "--vllm-mode says where"),
    ],
)  # fmt: skip
def test_incompatible_off_policy_options_are_one_line(tmp_path, capsys, flags, message):
    run = tmp_path / "run"
    assert train(run, "--steps", "2", *flags) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and "Traceback" not in err
    assert not run.exists()


def test_the_off_policy_mask_acts_on_the_drift_of_later_minibatches(tmp_path):
    """On grouprl's own fp32 sampler the first minibatch trains the policy that sampled (drift
    0 to rounding, nothing masked at δ = 0.05); the second, after an update at lr 0.05, has
    drifted, and some of its negative-advantage completions are masked."""
    run = tmp_path / "run"
    assert train(run, "--steps", "1", "--minibatches", "2", "--lr", "0.05",
                 "--off-policy-mask", "0.05") == 0  # fmt: skip
    (step,) = rows(run / "metrics.jsonl")
    assert 0 < step["is_masked_frac"] < 1 and step["is_weight_max"] == 1.0  # a mask: no weight


def test_a_resume_that_raises_the_staleness_is_refused_in_one_line(tmp_path, capsys):
    """A synchronous checkpoint at step 2 keeps no version 1, which batch 2 needs at K = 1."""
    run = tmp_path / "run"
    assert train(run, "--steps", "2") == 0
    assert main(["train", "--resume", str(run), "--steps", "4", "--max-staleness", "1",
                 "--allow-change", "max_staleness"]) == 2  # fmt: skip
    err = " ".join(capsys.readouterr().err.split())
    assert "versions 1 of the weights, which this checkpoint does not keep" in err
    assert ckpt.latest_checkpoint(run).name == "step_000002"
