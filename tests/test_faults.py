"""Fault injection: runs stopped by SIGKILL or SIGTERM at random points always resume, never
leave a corrupt checkpoint, and end bit for bit like a run that was never stopped.

`make test` runs FAULT_TRIALS (default 3) points; `make test-faults` runs 20 per signal
(FAULT_TRIALS=20 FAULT_SIGNALS=KILL,TERM). The points and visit numbers come from a seeded RNG,
so a failing trial reruns exactly with its id.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from grouprl.train import checkpoint as ckpt

STEPS, SAVE_EVERY = 4, 2
FLAGS = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--eval-every", "2",
         "--prompts-per-step", "4", "--group-size", "2", "--eval-size", "2",
         "--eval-samples", "1", "--threads", "1", "--no-progress", "--keep-last", "2"]  # fmt: skip
#: Visits each point gets in one run of FLAGS (GSPO: 4 minibatches, one update each).
VISITS = {"sample": STEPS, "update": 4 * STEPS, "checkpoint": 3, "eval": 3}
EXIT = {"KILL": -signal.SIGKILL, "TERM": 143}

TRIALS = int(os.environ.get("FAULT_TRIALS", "3"))
SIGNALS = os.environ.get("FAULT_SIGNALS", "")
CASES = (
    [(sig, i) for sig in SIGNALS.split(",") for i in range(TRIALS)]
    if SIGNALS
    else [("KILL" if i % 2 == 0 else "TERM", i) for i in range(TRIALS)]
)
#: The same with the lookup task's tool (observations fed inside sampling): one trial in `make
#: test`, as many as above in `make test-faults`.
TOOL_CASES = CASES if SIGNALS else CASES[:1]
TOOLS = ["--task", "lookup"]
#: The same for an asynchronous run (the sampler a step ahead, in its own thread).
ASYNC_CASES = TOOL_CASES
ASYNC = ["--max-staleness", "1", "--sampler-threads", "1"]
DROP = {"step_seconds", "rollout_seconds", "tokens_per_s", "sampler_seconds", "update_seconds"}


def grouprl(args, fault=None, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "GROUPRL_FAULT"}
    if fault:
        env["GROUPRL_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "grouprl", "train", *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip


def record(run):
    metrics = [
        {k: v for k, v in json.loads(line).items() if k not in DROP}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
    evals = (run / "eval.jsonl").read_text().splitlines()
    weights = load_file(str(run / "final" / "model.safetensors"))
    return metrics, evals, weights


def _uninterrupted(tmp_path_factory, extra):
    """The uninterrupted run, in this process (one torch thread, as the subprocesses use)."""
    from grouprl.cli import main

    run = tmp_path_factory.mktemp("faults") / "reference"
    assert main(["train", *FLAGS, *extra, "--output-dir", str(run)]) == 0
    return record(run)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _uninterrupted(tmp_path_factory, [])


@pytest.fixture(scope="module")
def tool_reference(tmp_path_factory):
    return _uninterrupted(tmp_path_factory, TOOLS)


@pytest.fixture(scope="module")
def async_reference(tmp_path_factory):
    return _uninterrupted(tmp_path_factory, ASYNC)


@pytest.mark.parametrize(("sig", "trial"), CASES)
def test_a_stopped_run_resumes_to_the_same_end(reference, tmp_path, sig, trial):
    _stop_and_resume(reference, tmp_path, sig, f"fault:{sig}:{trial}", [])


@pytest.mark.parametrize(("sig", "trial"), TOOL_CASES)
def test_a_stopped_run_with_tools_resumes_to_the_same_end(tool_reference, tmp_path, sig, trial):
    _stop_and_resume(tool_reference, tmp_path, sig, f"fault:tools:{sig}:{trial}", TOOLS)


@pytest.mark.parametrize(("sig", "trial"), ASYNC_CASES)
def test_a_stopped_async_run_resumes_to_the_same_end(async_reference, tmp_path, sig, trial):
    _stop_and_resume(async_reference, tmp_path, sig, f"fault:async:{sig}:{trial}", ASYNC)


def _stop_and_resume(reference, tmp_path, sig, seed, extra):
    rng = random.Random(seed)
    point = rng.choice(sorted(VISITS))
    visit = rng.randint(1, VISITS[point])
    run = tmp_path / "run"
    stopped = grouprl([*FLAGS, *extra, "--output-dir", str(run)], fault=f"{point}:{visit}:{sig}")
    context = f"{sig} at {point} visit {visit}: {stopped.stderr[-1500:]}"
    assert stopped.returncode == EXIT[sig], context
    for path in ckpt.list_checkpoints(run):  # nothing half-written ever counts as a checkpoint
        assert ckpt.damage(path) is None, (path, context)
    resumed = grouprl(["--resume", str(run)])
    assert resumed.returncode == 0, (resumed.stderr[-2000:], context)
    metrics, evals, weights = record(run)
    want_metrics, want_evals, want_weights = reference
    assert metrics == want_metrics, context
    assert evals == want_evals, context
    assert weights.keys() == want_weights.keys()
    assert all(torch.equal(weights[k], want_weights[k]) for k in weights), context
