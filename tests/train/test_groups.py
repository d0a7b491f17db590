"""The viewer's records (`grouprl.train.groups`): whole groups, token by token, as the loss saw
them. Checked against what the run logged by other roads: the clip fractions of metrics.jsonl
(counted by the loss itself), and the final policy's log-probs recomputed in float64.

Tolerances: the records keep 7 significant digits (`DIGITS`), so a stored value is off by at most
5e-7 of its magnitude; two forwards of the same function over other shapes differ by at most
`forward_bound` (tests/numerics.py)."""

from __future__ import annotations

import gzip
import json
import math

import pytest
import torch

from grouprl.config import TrainConfig
from grouprl.models import load_model, load_tokenizer
from grouprl.report.sinks import group_file, group_steps, truncate_groups, write_json_gz
from grouprl.train import loop
from grouprl.train.groups import DIGITS, vocabulary
from numerics import forward_bound, logit_magnitude, to_float64

STORED = 0.5 * 10 ** (1 - DIGITS)  # a stored value's relative rounding
SMALL = dict(prompts_per_step=4, group_size=4, eval_size=4, eval_samples=2, eval_every=0,
             save_every=10, progress=False, threads=1, log_groups=4, log_groups_every=1)  # fmt: skip


def _records(run_dir):
    return {s: json.loads(gzip.decompress(group_file(run_dir, s).read_bytes()))
            for s in group_steps(run_dir)}  # fmt: skip


def _metrics(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").open())}


@pytest.fixture(scope="module")
def gspo_run(tmp_path_factory):
    """GSPO's 4 minibatches with a learning rate that moves the sequence ratios past its clip,
    every group of every step watched."""
    out = tmp_path_factory.mktemp("groups") / "gspo"
    loop.train(TrainConfig(**SMALL, algo="gspo", steps=3, lr=1e-3, output_dir=out))
    return out


def test_every_logged_step_holds_every_group_whole(gspo_run):
    records = _records(gspo_run)
    assert sorted(records) == [1, 2, 3]
    tokenizer = load_tokenizer("builtin:arith")
    for step, record in records.items():
        assert record["step"] == step and record["level"] == "sequence"
        assert (record["clip_low"], record["clip_high"]) == (3e-4, 4e-4)
        assert record["updates_per_batch"] == 4
        assert [g["index"] for g in record["groups"]] == [0, 1, 2, 3]
        for group in record["groups"]:
            assert len(group["completions"]) == 4
            assert (
                tokenizer.decode(group["prompt_ids"], skip_special_tokens=True) == group["prompt"]
            )
            for c in group["completions"]:
                n = len(c["ids"])
                assert n > 0 and all(
                    len(c[k]) == n
                    for k in ("trained_mask", "sampler_logp", "after_logp", "entropy")
                )
                assert tokenizer.decode(c["ids"], skip_special_tokens=True) == c["text"]
                if group["trained"]:
                    assert all(len(c[k]) == n for k in ("logp", "old_logp", "ratio", "bound"))


@pytest.mark.numerics
def test_the_sequence_ratio_and_the_clip_are_the_losss(gspo_run):
    """Each trained completion's ratio is GSPO's exp(mean_t (log π − log π_old)) on every token,
    and the clip acted exactly where Â > 0 and s > 1 + 4e-4 or Â < 0 and s < 1 − 3e-4."""
    acted = 0
    for record in _records(gspo_run).values():
        for group in record["groups"]:
            for c in (c for c in group["completions"] if "logp" in c):
                trained = [t for t, m in enumerate(c["trained_mask"]) if m]
                diffs = [c["logp"][t] - c["old_logp"][t] for t in trained]
                s = math.exp(sum(diffs) / len(diffs))
                largest = max(abs(c["logp"][t]) for t in trained)
                tol = 4 * STORED * max(largest, 1.0)  # two stored log-probs and the ratio
                assert all(abs(c["ratio"][t] - s) <= tol for t in trained), (c["ratio"], s)
                a = c["advantage"]
                want = 2 if a > 0 and s > 1 + 4e-4 else 1 if a < 0 and s < 1 - 3e-4 else 0
                if min(abs(s - (1 + 4e-4)), abs(s - (1 - 3e-4))) > tol:  # not on the edge
                    assert {c["bound"][t] for t in trained} == {want}
                acted += sum(1 for t in trained if c["bound"][t])
    assert acted > 0  # the clip acted somewhere, so the check above could fail


@pytest.mark.numerics
def test_the_clipped_tokens_are_the_ones_metrics_counted(gspo_run):
    """With every group watched and one epoch each token is in exactly one update, so the record's
    clipped tokens over its trained tokens are metrics.jsonl's clip fractions (the loss's own
    count), to float64 division."""
    metrics = _metrics(gspo_run)
    for step, record in _records(gspo_run).items():
        completions = [c for g in record["groups"] for c in g["completions"]]
        tokens = sum(sum(c["trained_mask"]) for c in completions)
        for side, name in ((1, "clip_frac_low"), (2, "clip_frac_high")):
            clipped = sum(1 for c in completions for t, b in enumerate(c.get("bound", []))
                          if b == side and c["trained_mask"][t])  # fmt: skip
            assert clipped / tokens == pytest.approx(metrics[step][name], rel=1e-12, abs=1e-15)


@pytest.mark.numerics
def test_on_policy_ratios_are_one_and_after_the_step_is_the_final_policy(tmp_path):
    """GRPO's one on-policy update: the loss's log-probs are the sampler's (a full forward against
    a cached decode: `forward_bound` apart), so every ratio is 1 and nothing is clipped. After a
    one-step run the log-probs after the step are the final policy's, recomputed here in float64
    on each completion with its prompt (a float32 forward is `forward_bound` from it)."""
    out = tmp_path / "grpo"
    loop.train(TrainConfig(**SMALL, algo="grpo", steps=1, lr=1e-2, output_dir=out))
    (record,) = _records(out).values()
    model = to_float64(load_model(str(out / "final"))).eval()
    per_token = forward_bound(model.config, logit_magnitude(model))
    moved = 0.0
    for group in record["groups"]:
        for c in group["completions"]:
            trained = [t for t, m in enumerate(c["trained_mask"]) if m]
            for t in trained if "logp" in c else ():  # (a zero-variance group is not trained)
                stored = 2 * STORED * abs(c["sampler_logp"][t])
                assert abs(c["logp"][t] - c["sampler_logp"][t]) <= per_token + stored
                assert c["bound"][t] == 0
            ids = torch.tensor([group["prompt_ids"] + c["ids"]])
            with torch.no_grad():
                logp = model(ids).logits[0, :-1].log_softmax(-1)  # (L - 1, V): the next token's
            start = len(group["prompt_ids"]) - 1
            want = logp[start:].gather(-1, ids[0, start + 1 :, None])[:, 0]  # (len(c),)
            for t in trained:
                tol = per_token + STORED * abs(float(want[t]))
                assert abs(c["after_logp"][t] - float(want[t])) <= tol, (t, c["after_logp"][t])
                moved = max(moved, abs(c["after_logp"][t] - c["sampler_logp"][t]))
    assert moved > 10 * per_token  # the step moved them: a record of the old policy would fail


def test_vocabulary_is_each_ids_own_decode():
    tokenizer = load_tokenizer("builtin:arith")
    vocab = vocabulary(tokenizer)
    assert len(vocab["pieces"]) == len(tokenizer)
    for i in (0, tokenizer.eos_token_id, len(tokenizer) - 1):
        assert vocab["pieces"][i] == tokenizer.decode([i], skip_special_tokens=False)
    assert tokenizer.eos_token_id in vocab["special"]


def test_a_resumed_run_drops_the_records_after_its_checkpoint(tmp_path):
    for step in (5, 10, 15):
        write_json_gz(group_file(tmp_path, step), {"step": step})
    (tmp_path / "groups" / "step_000020.json.gz.tmp").write_bytes(b"half")  # a killed write
    truncate_groups(tmp_path, keep_through_step=10)
    assert group_steps(tmp_path) == [5, 10]


def test_the_first_and_the_last_step_are_always_logged():
    """A run shorter than --log-groups-every (10) still has groups to show: its first and its
    last step, then every 10th."""
    from types import SimpleNamespace

    from grouprl.config import resolve
    from grouprl.train.groups import watch_groups

    cfg = resolve(TrainConfig(steps=25, log_groups=2), task_max_new_tokens=8)
    batch = SimpleNamespace(rows=[0] * 4, rollout=SimpleNamespace(group_size=2))
    dist = SimpleNamespace(world_size=1)
    logged = [s + 1 for s in range(25) if watch_groups(cfg, s, batch, None, dist) is not None]
    assert logged == [1, 10, 20, 25]
    short = resolve(TrainConfig(steps=3, log_groups=2), task_max_new_tokens=8)
    assert [s + 1 for s in range(3) if watch_groups(short, s, batch, None, dist)] == [1, 3]
    none = resolve(TrainConfig(steps=3, log_groups=0), task_max_new_tokens=8)
    assert not any(watch_groups(none, s, batch, None, dist) for s in range(3))
