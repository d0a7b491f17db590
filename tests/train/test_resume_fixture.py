"""A run directory written by an earlier version (tests/fixtures/resume_v1, see its README)
resumes exactly as that version continued it: the same sampled token ids at every step, the
same held-out numbers, and every logged float within a rounding bound."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from grouprl.cli import main
from grouprl.models import load_model
from numerics import forward_bound

FIXTURE = Path(__file__).parent.parent / "fixtures" / "resume_v1"
#: Timings: never the same twice.
TIMES = {"step_seconds", "rollout_seconds", "tokens_per_s"}
#: Computed from the policy's log-probs (forwards in float32): the rest of a step's metrics
#: follow from the sampled ids and the rewards alone, and must be equal.
FROM_LOGPROBS = {"loss", "ratio_mean", "ratio_min", "ratio_max", "approx_kl", "kl", "entropy"}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _record_sampled_ids(monkeypatch) -> list[dict]:
    """Every training step's sampled completion ids, as the loop collects them."""
    from grouprl.train import loop

    seen, original = [], loop.collect_batch

    def collect(cfg, sampler, step, position):
        collected = original(cfg, sampler, step, position)
        seen.append({"step": step, "ids": collected.sampled.rollout.completion_id_lists()})
        return collected

    monkeypatch.setattr(loop, "collect_batch", collect)
    return seen


def _logit_magnitude(ids: list[dict]) -> float:
    """The largest |logit| of the run's model over the sequences it sampled."""
    model = load_model("builtin:arith", dtype=torch.float32)
    rows = [row for step in ids for row in step["ids"]]
    width = max(len(r) for r in rows)
    batch = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        return float(model(input_ids=batch).logits.abs().max())


@pytest.mark.numerics
def test_the_committed_run_resumes_as_it_was_continued(tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE / "run", run)
    seen = _record_sampled_ids(monkeypatch)
    threads = torch.get_num_threads()  # the suite's (conftest), not the run's recorded 1
    assert main(["train", "--resume", str(run), "--threads", str(threads)]) == 0

    expected_ids = json.loads((FIXTURE / "expected" / "ids.json").read_text())
    assert [s["step"] for s in seen] == [2, 3]  # steps 0 and 1 were done before the stop
    assert seen == expected_ids[2:]  # sampled token ids: exactly
    assert _lines(run / "eval.jsonl") == _lines(FIXTURE / "expected" / "eval.jsonl")

    # Floats from log-probs: the resumed steps' forwards run on weights that another CPU (or
    # thread count) rounded differently. Bound: a log-prob of two forwards of the same function
    # differs by at most `forward_bound` at the model's largest logit; a ratio exp(Δ) near 1 and
    # a KL estimate by about as much (the k3 estimate is second order in Δ). The gradient norm
    # is a sum of the same products: relative to its size, forward_bound at magnitude 1. Two
    # resumed steps: twice each.
    config = load_model("builtin:arith").config
    logp_bound = 2 * forward_bound(config, _logit_magnitude(expected_ids))
    relative = 2 * forward_bound(config, 1.0)
    got, want = _lines(run / "metrics.jsonl"), _lines(FIXTURE / "expected" / "metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2, 3, 4]
    for mine, theirs in zip(got, want):
        assert mine.keys() == theirs.keys(), mine["step"]
        for key in mine.keys() - TIMES:
            a, b = mine[key], theirs[key]
            if key in FROM_LOGPROBS:
                assert math.isclose(a, b, rel_tol=0, abs_tol=logp_bound), (mine["step"], key)
            elif key == "grad_norm":
                assert math.isclose(a, b, rel_tol=relative), (mine["step"], key)
            else:
                assert a == b, (mine["step"], key, a, b)
