"""The training loop end to end on the bundled model: presets, options, resume, Ctrl-C."""

import copy
import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from grouprl.config import TrainConfig, resolve
from grouprl.core import group_advantages, zero_variance_groups
from grouprl.errors import UserError
from grouprl.report.doctor import diagnose
from grouprl.rollout import Rollout
from grouprl.tasks import get_task
from grouprl.train import collect, loop, plan
from grouprl.train import run as run_module
from grouprl.train import step as train_step
from grouprl.train import update as train_update
from grouprl.train.batch import Batch
from grouprl.train.metrics import batch_metrics, sampling_metrics
from grouprl.train.parallel import fsdp
from numerics import F64_SAME, UNMOVED, assert_same_f64, forward_bound, to_float64

SMALL = dict(
    steps=2,
    prompts_per_step=4,
    group_size=4,
    eval_size=4,
    eval_samples=2,
    eval_every=0,
    save_every=1,
    progress=False,
    threads=1,
)


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path, name="run", **overrides):
    cfg = TrainConfig(**{**SMALL, "output_dir": tmp_path / name, **overrides})
    return loop.train(cfg)


@pytest.mark.parametrize("algo", ["grpo", "gspo", "dr_grpo", "dapo"])
def test_every_preset_runs_and_leaves_a_complete_run_directory(tmp_path, algo):
    summary = _run(tmp_path, algo=algo, steps=1)
    run = summary.run_dir
    assert summary.steps_done == 1 and not summary.interrupted
    for name in ("config.yaml", "metrics.jsonl", "eval.jsonl", "samples.jsonl"):
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").iterdir())
    assert (run / "final" / "model.safetensors").is_file()
    assert (run / "plots" / "reward.png").is_file()
    (record,) = _metrics(run)
    for key in (
        "reward_mean", "reward_std", "accuracy", "frac_zero_std", "loss", "clip_frac_low",
        "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max", "approx_kl", "entropy",
        "completion_len_mean", "completion_len_max", "truncated_frac", "tokens_per_s",
        "step_seconds", "lr", "grad_norm",
    ):  # fmt: skip
        assert key in record, key
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1]


def test_options_are_exercised(tmp_path):
    """KL to the reference, dual clip, GSPO-token, RLOO, batch scaling, epochs, cosine schedule,
    truncation masking, overlong penalty, reward weights, top-k/top-p."""
    summary = _run(
        tmp_path,
        algo="grpo",
        beta=0.05,
        dual_clip=3.0,
        ratio_level="sequence_token",
        adv_estimator="rloo",
        adv_scale="batch",
        unbiased_std=True,
        epochs=2,
        minibatches=2,
        lr_schedule="cosine",
        warmup_steps=0,
        max_new_tokens=6,
        mask_truncated=True,
        overlong_penalty=True,
        overlong_cache=2,
        rewards={"correct": 1.0, "format": 0.5},
        top_k=5,
        top_p=0.9,
        micro_batch_size=3,
        gradient_checkpointing=True,
    )
    first, second = _metrics(summary.run_dir)
    # with mask_truncated the loss trains only completions that ended: KL is measured on their
    # tokens, and is null (NaN) on a step where every completion was cut off
    for record in (first, second):
        if record["truncated_frac"] < 1:
            assert record["kl"] >= 0
        else:
            assert record["kl"] is None and record["loss"] == 0
    assert "reward_format" in first
    assert first["truncated_frac"] > 0.5  # 6 tokens is too short for a worked answer
    assert first["completion_len_max"] <= 6
    assert first["lr"] > second["lr"]  # cosine decay over 2 steps


def test_dynamic_sampling_trains_only_on_informative_groups(tmp_path, monkeypatch):
    seen = []
    original = train_step.update

    def spy(cfg, policy, optimizer, batch, advantages, ref_logp, **kwargs):
        seen.append(zero_variance_groups(batch.rewards.view(-1, cfg.group_size)))
        return original(cfg, policy, optimizer, batch, advantages, ref_logp, **kwargs)

    monkeypatch.setattr(train_step, "update", spy)
    summary = _run(tmp_path, algo="dapo", steps=2, max_resample_rounds=2)
    records = _metrics(summary.run_dir)
    assert all(0 <= r["frac_zero_std"] <= 1 and r["sample_rounds"] >= 1 for r in records)
    assert seen and not any(zero.any() for zero in seen)


#: packed micro-batches of at most 255 tokens, the longest row the built-in model's context
#: allows (218 prompt + 38 completion tokens); its rows are ~30, so several share each
PACKED = {"max_tokens_per_micro_batch": 255, "packing": "on"}


@pytest.mark.parametrize("extra", [{}, PACKED], ids=["default", "packed"])
def test_resume_equals_uninterrupted_and_ctrl_c_saves(tmp_path, stop_at, extra):
    straight = _run(tmp_path, "straight", steps=4, **extra)

    # Interrupt the second run with SIGINT during step 3; it must save step 2 and exit cleanly.
    stop_at(2)
    broken = _run(tmp_path, "broken", steps=4, **extra)
    assert broken.interrupted and broken.steps_done == 3
    assert (broken.run_dir / "checkpoints" / "step_000003" / "state.json").is_file()
    assert not (broken.run_dir / "final").exists()
    stop_at(None)

    resumed = loop.train(
        dataclasses.replace(TrainConfig(**SMALL, **extra), resume=broken.run_dir, steps=4)
    )
    assert resumed.steps_done == 4 and not resumed.interrupted

    def comparable(run_dir):
        drop = {"step_seconds", "rollout_seconds", "tokens_per_s"}
        return [{k: v for k, v in r.items() if k not in drop} for r in _metrics(run_dir)]

    assert comparable(resumed.run_dir) == comparable(straight.run_dir)
    a = load_file(str(straight.run_dir / "final" / "model.safetensors"))
    b = load_file(str(resumed.run_dir / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_reward_function_errors_are_user_errors(tmp_path, monkeypatch):
    task = get_task("arithmetic")

    def broken(completions, **kwargs):
        raise ZeroDivisionError("oops")

    def short(completions, **kwargs):
        return [1.0]

    for fn, message in [(broken, "raised ZeroDivisionError: oops"), (short, "returned 1 values")]:
        bad = dataclasses.replace(task, reward_funcs={"correct": fn}, reward_weights={"correct": 1})
        monkeypatch.setattr(run_module, "build_task", lambda opts, bad=bad: bad)
        with pytest.raises(UserError, match=message):
            _run(tmp_path, f"bad-{fn.__name__}", steps=1, eval_size=1)


def test_unknown_reward_name_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="unknown reward 'corect'"):
        _run(tmp_path, rewards={"corect": 1.0})
    assert not (tmp_path / "run").exists()


def test_short_run_raises_the_reward(tmp_path):
    """GSPO from the bundled base policy: the reward of the last steps is clearly above the
    first steps' (measured: 0.47 -> 0.82). With the advantages' sign flipped the same run goes
    0.39 -> 0.03, so a broken gradient sign cannot pass."""
    summary = _run(
        tmp_path, steps=24, prompts_per_step=8, group_size=8, lr=2e-4, save_every=100, seed=3
    )
    rewards = [r["reward_mean"] for r in _metrics(summary.run_dir)]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-6:]) / 6
    assert last > first + 0.2, (first, last, rewards)
    # a healthy short run of the built-in task: the doctor finds nothing to warn about
    assert [f for f in diagnose(summary.run_dir) if f.severity == "warning"] == []


@pytest.mark.numerics
@pytest.mark.parametrize("memory", [{}, {"gradient_checkpointing": True}, {"micro_batch_size": 3}])
def test_bf16_recomputes_old_logp_so_an_unmoved_policy_has_ratio_one(tmp_path, memory):
    """Under bf16 the sampler's log-probs differ from the trainer's by more than GSPO's clip
    range (4e-4); recomputed by the trainer, a policy that does not move (lr 1e-12) sees ratios
    of 1 and clips nothing; also when some groups of a minibatch are skipped (the recompute runs
    on the same rows as the update), and with the update's forward in chunks or checkpointed
    (the recompute takes the same path)."""
    summary = _run(
        tmp_path, algo="gspo", precision="bf16", steps=1, lr=1e-12, warmup_steps=0,
        prompts_per_step=8, group_size=2, minibatches=2, log_ratios=4, log_ratios_every=1,
        **memory,
    )  # fmt: skip
    (record,) = _metrics(summary.run_dir)
    assert 0 < record["trained_frac"] < 1
    assert record["clip_frac_low"] == 0 and record["clip_frac_high"] == 0
    # the recompute runs the update's own forward on the same chunks, and lr 1e-12 leaves the
    # policy's forward as it was (tests/numerics.py: UNMOVED)
    assert abs(record["ratio_min"] - 1) < UNMOVED and abs(record["ratio_max"] - 1) < UNMOVED
    # ratios.jsonl's probe recomputes its old_logp the same way: an unmoved policy logs ~0
    # (a sum over a completion's sampled tokens, each within UNMOVED)
    (probe,) = [json.loads(x) for x in (summary.run_dir / "ratios.jsonl").read_text().splitlines()]
    assert len(probe["log_ratio_sum"]) == 4
    for length, value in zip(probe["lengths"], probe["log_ratio_sum"], strict=True):
        assert abs(value) < length * UNMOVED


def _update_from(policy, cfg, batch, advantages):
    """Parameters after `update` on a copy of `policy` with a fresh AdamW. Its eps is large
    so that rounding noise in near-zero gradients is not blown up to a whole lr-sized step."""
    model = copy.deepcopy(policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.adam_betas, eps=1e-4)
    diagnostics = train_step.update(cfg, model, optimizer, batch, advantages, None)
    return {name: p.detach().clone() for name, p in model.named_parameters()}, diagnostics


NAN = math.nan
# group 0 all right, group 2 all wrong: half the rows carry no signal
HALF = [[1, 1, 1, 1], [1, 0, 0, 1], [0, 0, 0, 0], [0, 1, 0, 0]]
# the whole first minibatch (of 2) has no signal: its optimizer step still counts for AdamW
FIRST_EMPTY = [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1], [0, 1, 0, 0]]
# unscored completions get advantage 0: an unscored group is skipped, a partly scored one is not
UNSCORED = [[NAN, NAN, NAN, NAN], [1, NAN, 0, 1], [0, 0, 0, 0], [0, 1, NAN, 0]]


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("group_rewards", "overrides"),
    [
        (HALF, {"algo": "grpo"}),
        (HALF, {"algo": "grpo", "epochs": 2, "loss_agg": "token_mean", "dual_clip": 1.5}),
        (HALF, {"algo": "dr_grpo", "minibatches": 2, "mask_truncated": True}),
        (FIRST_EMPTY, {"algo": "gspo", "minibatches": 2, "epochs": 2}),
        (
            UNSCORED,
            {"algo": "gspo", "ratio_level": "sequence_token", "loss_agg": "seq_mean_token_sum"},
        ),
    ],
)
def test_skipping_zero_advantage_groups_changes_no_update(group_rewards, overrides, monkeypatch):
    """With beta = 0 a group whose advantages are all 0 has exactly zero gradient, so leaving it
    out of the forward/backward gives the same gradients and parameters, provided the loss keeps
    the full minibatch's token and sequence counts and an all-skipped minibatch still steps
    AdamW. Checked in float64 (the same computation over other shapes: tests/numerics.py); the
    clip fractions are counts over the same tokens, so they are equal exactly."""
    policy, batch = _small_batch(group_rewards, float64=True)  # the same update: float64
    rollout = batch.rollout
    rewards = batch.rewards
    settings = {"prompts_per_step": 4, "group_size": 4, "lr": 1e-3, "max_grad_norm": 0.0}
    cfg = resolve(TrainConfig(**settings, max_new_tokens=20, **overrides), task_max_new_tokens=20)
    if cfg.mask_truncated:
        assert 0 < rollout.truncated.sum() < 16  # 20 tokens cut some completions short
    advantages = group_advantages(rewards.view(4, 4), scale=cfg.adv_scale).reshape(-1)
    seen_rows = []
    original = fsdp.completion_logprobs

    def spy(model, minibatch, **kwargs):
        seen_rows.append(minibatch.completion_ids.shape[0])
        return original(model, minibatch, **kwargs)

    monkeypatch.setattr(fsdp, "completion_logprobs", spy)
    full_cfg = dataclasses.replace(cfg, skip_zero_advantage=False)
    full, full_diag = _update_from(policy, full_cfg, batch, advantages)
    assert sum(seen_rows) == 16 * cfg.epochs
    seen_rows.clear()
    skipped, diag = _update_from(policy, cfg, batch, advantages)
    assert sum(seen_rows) == 8 * cfg.epochs  # only the two groups with a learning signal ran
    assert diag["trained_frac"] == 0.5 and full_diag["trained_frac"] == 1.0
    if cfg.epochs > 1:  # the second pass is off-policy: something is clipped, so this compares
        assert full_diag["clip_frac_low"] + full_diag["clip_frac_high"] > 0
    assert full_diag["grad_norm"] > 0
    # of the full computation despite the skipping (the loss at F64_SAME absolute: a mean of
    # O(1) terms that cancels, see _assert_same_update)
    assert diag["loss"] == pytest.approx(full_diag["loss"], rel=0, abs=F64_SAME)
    assert diag["grad_norm"] == pytest.approx(full_diag["grad_norm"], rel=F64_SAME, abs=0)
    assert (diag["clip_frac_low"], diag["clip_frac_high"]) == (
        full_diag["clip_frac_low"], full_diag["clip_frac_high"],
    )  # fmt: skip
    before = {n: p.detach() for n, p in policy.named_parameters()}
    moved = max(float((full[n] - before[n]).abs().max()) for n in full)
    assert moved > 1e-4  # the update did something
    for name in full:
        assert_same_f64(skipped[name], full[name])


def test_optimizer_is_fused_adamw_over_trainable_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    optimizer = train_update.make_optimizer(
        TrainConfig(lr=1e-3, weight_decay=0.1, adam_betas=(0.9, 0.99)), model
    )
    (group,) = optimizer.param_groups
    assert isinstance(optimizer, torch.optim.AdamW) and group["fused"] is True
    assert group["lr"] == 1e-3 and group["weight_decay"] == 0.1 and group["betas"] == (0.9, 0.99)
    assert [p.shape for p in group["params"]] == [(2, 4), (2,)]


def test_plan_minibatches_keeps_whole_groups_and_the_full_counts():
    b, g, t = 4, 2, 3
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]] * 2, dtype=torch.bool)
    rollout = Rollout(
        prompt_ids=torch.ones(b, 2, dtype=torch.long),
        prompt_mask=torch.ones(b, 2, dtype=torch.bool),
        completion_ids=torch.arange(b * g * t).view(b * g, t),
        mask=mask,
        old_logp=torch.zeros(b * g, t),
        truncated=torch.zeros(b * g, dtype=torch.bool),
        texts=[f"c{i}" for i in range(b * g)],
        prompts=[f"p{i}" for i in range(b)],
        group_size=g,
        temperature=1.0,
    )
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.5, -0.5])  # groups 1, 2: no signal

    def config(**fields):
        return resolve(
            TrainConfig(algo="grpo", prompts_per_step=4, **fields), task_max_new_tokens=3
        )

    cfg = config(minibatches=2, beta=0.0)
    first, second = plan.plan_minibatches(cfg, rollout, advantages, mask)
    assert first.rollout.prompts == ["p0"] and first.rows.tolist() == [0, 1]
    assert second.rollout.prompts == ["p3"] and second.rows.tolist() == [6, 7]
    # counts over all of a minibatch's rows: rows 0-3 hold 3 + 3 tokens, 3 non-empty rows
    assert (int(first.num_tokens), int(first.num_seqs)) == (6, 3)
    assert (int(second.num_tokens), int(second.num_seqs)) == (6, 3)
    assert (first.num_rows, second.num_rows) == (4, 4)  # the whole minibatch, skipped included
    for cfg in (config(minibatches=2, beta=0.0, skip_zero_advantage=False),
                config(minibatches=2, beta=0.1)):  # fmt: skip
        plans = plan.plan_minibatches(cfg, rollout, advantages, mask)
        assert [p.rows.tolist() for p in plans] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    all_zero = plan.plan_minibatches(config(minibatches=4, beta=0.0), rollout, advantages, mask)
    assert [p.rollout is None for p in all_zero] == [False, True, True, False]
    three = dataclasses.replace(config(minibatches=1), minibatches=3)  # what validation refuses
    with pytest.raises(ValueError, match="cannot split 4 prompts into 3"):
        plan.plan_minibatches(three, rollout, advantages, mask)


def test_branches_train_with_their_parents_advantage_in_their_parents_minibatch():
    """An agent's split trajectory (`Branches`): the batch's rows as groups of one, then each
    branch row, trained in its parent's minibatch with its parent's advantage."""
    from grouprl.rollout.types import Branches

    def rollout(b, g, lengths):
        n, t = b * g, max(lengths)
        mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
        return Rollout(torch.ones(b, 2, dtype=torch.long), torch.ones(b, 2, dtype=torch.bool),
                       torch.ones(n, t, dtype=torch.long), mask, torch.zeros(n, t),
                       torch.zeros(n, dtype=torch.bool), [f"c{i}" for i in range(n)],
                       [f"p{i}" for i in range(b)], g, 1.0)  # fmt: skip

    branches = Branches(rollout(2, 1, [5, 2]), torch.tensor([3, 0]))
    batch = Batch(rollout(2, 2, [1, 2, 3, 4]), [{}, {}], torch.tensor([0.0, 1.0, 1.0, 1.0]), {},
                  branches=branches)  # fmt: skip
    trained, parents = train_step.with_branches(batch)
    assert trained.branches is None and trained.rollout.group_size == 1
    assert trained.rollout.lengths.tolist() == [1, 2, 3, 4, 5, 2]  # own rows keep their places
    assert trained.rollout.texts == ["c0", "c1", "c2", "c3", "c0", "c1"]
    assert parents.tolist() == [3, 0]
    cfg = resolve(TrainConfig(algo="grpo", prompts_per_step=2, minibatches=2, beta=0.0),
                  task_max_new_tokens=5)  # fmt: skip
    advantages = torch.tensor([-1.0, 1.0, 0.0, 0.0])  # group 1 teaches nothing
    given = torch.cat([advantages, advantages[parents]])
    first, second = plan.plan_minibatches(cfg, trained.rollout, given, trained.rollout.mask,
                                          parents=parents)  # fmt: skip
    assert first.rows.tolist() == [0, 1, 5]  # row 0's branch with it
    assert (int(first.num_tokens), int(first.num_seqs), first.num_rows) == (5, 3, 3)
    assert second.rollout is None  # skipped whole, its branch (advantage 0) too
    assert (int(second.num_tokens), int(second.num_seqs), second.num_rows) == (12, 3, 3)
    # the batch of a select keeps its rows' branches, renumbered; a concat offsets them
    assert batch.select_groups([1]).branches.parents.tolist() == [1]
    assert batch.select_groups([0]).branches.parents.tolist() == [0]
    joined = Batch.concat([batch, batch])
    assert joined.branches.parents.tolist() == [3, 0, 7, 4]


@pytest.mark.numerics
def test_entropy_metric_is_the_samplers_and_absent_without_it():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    rollout = Rollout(
        prompt_ids=torch.ones(1, 2, dtype=torch.long),
        prompt_mask=torch.ones(1, 2, dtype=torch.bool),
        completion_ids=torch.zeros(2, 3, dtype=torch.long),
        mask=mask,
        old_logp=torch.zeros(2, 3),
        truncated=torch.zeros(2, dtype=torch.bool),
        texts=["a", "b"],
        prompts=["p"],
        group_size=2,
        temperature=1.0,
        entropy=torch.tensor([[0.5, 0.1, 9.0], [0.3, 9.0, 9.0]]),  # 9 = never read: masked
    )
    batch = Batch(rollout, [{}], torch.tensor([1.0, 0.0]), {})
    # the mean of 0.5, 0.1 and 0.3 held in float32 (~6e-8 relative each; approx allows 1e-6)
    assert batch_metrics(batch)["entropy"] == pytest.approx(0.3)
    batch.rollout = dataclasses.replace(rollout, entropy=None)  # an engine without entropy
    assert "entropy" not in batch_metrics(batch)


def _small_batch(group_rewards, seed=3, float64=False):
    """The bundled policy (in float64 for "the same computation" checks), and a 4 x 4 batch it
    sampled with `group_rewards`."""
    from grouprl.models import load_model, load_tokenizer
    from grouprl.rollout import sample_groups

    policy = load_model("builtin:arith").eval()
    if float64:
        policy = to_float64(policy)
    tokenizer = load_tokenizer("builtin:arith")
    rows = get_task("arithmetic").train[:4]
    rollout = sample_groups(
        policy, tokenizer, [r["prompt"] for r in rows], group_size=4, max_new_tokens=20, seed=seed
    )
    rewards = torch.tensor(group_rewards, dtype=torch.float32).reshape(-1)  # (N,)
    return policy, Batch(rollout, list(rows), rewards, {"correct": rewards})


def _chunking_case(algo, group_rewards):
    """The bundled policy, a 4 x 4 batch with `group_rewards`, its resolved config (GSPO: 2
    minibatches of 2 groups, 2 epochs) and advantages; float64, since these cases check that
    two ways of cutting an update give the same one (tests/numerics.py)."""
    policy, batch = _small_batch(group_rewards, float64=True)
    settings = {"prompts_per_step": 4, "group_size": 4, "lr": 1e-3, "max_grad_norm": 0.0}
    extra = {"minibatches": 2, "epochs": 2} if algo == "gspo" else {}
    cfg = resolve(
        TrainConfig(algo=algo, **settings, max_new_tokens=20, **extra), task_max_new_tokens=20
    )
    advantages = group_advantages(batch.rewards.view(4, 4), scale=cfg.adv_scale).reshape(-1)
    return policy, batch, cfg, advantages


def _record_passes(monkeypatch, buckets: list | None = None):
    """A list that gets (rows, longest completion) of every forward the update runs; `buckets`
    gets each one's row buckets (None: all rows at the longest's width)."""
    passes = []
    original = fsdp.completion_logprobs

    def spy(model, rollout, **kwargs):
        passes.append((rollout.completion_ids.shape[0], int(rollout.lengths.max())))
        if buckets is not None:
            buckets.append(kwargs.get("buckets"))
        return original(model, rollout, **kwargs)

    monkeypatch.setattr(fsdp, "completion_logprobs", spy)
    return passes


def _assert_same_update(got, got_diag, want, want_diag):
    """The same parameters and diagnostics to float64 reordering (tests/numerics.py); clip
    fractions are counts over the same tokens, so equal exactly."""
    for name in want:
        assert_same_f64(got[name], want[name])
    # means of per-token terms of size O(1) (advantages, ratios): compared at F64_SAME absolute,
    # since an on-policy loss is a cancellation that rounds to ~1e-17 either way
    for key in ("loss", "ratio_mean", "approx_kl"):
        assert got_diag[key] == pytest.approx(want_diag[key], rel=0, abs=F64_SAME), key
    assert got_diag["grad_norm"] == pytest.approx(want_diag["grad_norm"], rel=F64_SAME, abs=0)
    for key in ("clip_frac_low", "clip_frac_high"):
        assert got_diag[key] == want_diag[key], key


@pytest.mark.numerics
@pytest.mark.parametrize("micro", [1, 3, 4, 6, 16])
@pytest.mark.parametrize("algo", ["grpo", "gspo", "dapo"])
def test_micro_batches_give_the_unchunked_update(micro, algo, monkeypatch):
    """Chunks of `micro` completions (sub-groups sharing their prompt when micro < G), each
    dividing by the whole minibatch's counts: the same parameters as one forward/backward."""
    policy, batch, cfg, advantages = _chunking_case(
        algo, [[1, 0, 0, 1], [1, 1, 1, 1], [0, 1, 0, 0], [1, 1, 0, 1]]
    )
    passes = _record_passes(monkeypatch)
    whole, whole_diag = _update_from(policy, cfg, batch, advantages)
    passes.clear()
    chunked, diag = _update_from(
        policy, dataclasses.replace(cfg, micro_batch_size=micro), batch, advantages
    )
    sizes = [rows for rows, _ in passes]
    assert max(sizes) <= micro and sum(sizes) == 12 * cfg.epochs  # one all-right group skipped
    before = {n: p.detach() for n, p in policy.named_parameters()}
    assert max(float((whole[n] - before[n]).abs().max()) for n in whole) > 1e-4
    _assert_same_update(chunked, diag, whole, whole_diag)


@pytest.mark.numerics
@pytest.mark.parametrize("packing", ["on", "off"])
@pytest.mark.parametrize("algo", ["grpo", "gspo", "dapo"])
def test_token_budget_micro_batches_give_the_unchunked_update(algo, packing, monkeypatch):
    """Rows bin-packed under a token budget (rows of different groups in one micro-batch, each
    with its own prompt; one packed sequence each, or padded), each pass dividing by the whole
    minibatch's counts: the same parameters as one forward/backward."""
    policy, batch, cfg, advantages = _chunking_case(
        algo, [[1, 0, 0, 1], [1, 1, 1, 1], [0, 1, 0, 0], [1, 1, 0, 1]]
    )
    cut = torch.tensor([20, 3, 20, 7, 18, 1, 9, 18, 10, 2, 10, 5, 20, 20, 4, 11])  # (16,)
    mask = batch.rollout.mask & (torch.arange(batch.rollout.mask.shape[1])[None] < cut[:, None])
    batch = dataclasses.replace(batch, rollout=dataclasses.replace(batch.rollout, mask=mask,
                                                                   loss_mask=mask))  # fmt: skip
    whole, whole_diag = _update_from(policy, cfg, batch, advantages)
    tokens = plan.row_tokens(batch.rollout)  # (16,) prompt + completion − 1
    budget = 3 * int(tokens.max())
    passes = []
    original = fsdp.completion_logprobs

    def spy(model, rollout, **kwargs):
        packs = kwargs.get("packs")
        packed = packs is not None
        forwarded = plan.row_tokens(rollout)  # what the forward computes: lines × the longest
        lines = [forwarded[p] for p in packs] if packed else [t[None] for t in forwarded]
        passes.append(len(lines) * max(int(line.sum()) for line in lines))
        assert packed == (packing == "on") and rollout.group_size == 1
        return original(model, rollout, **kwargs)

    monkeypatch.setattr(fsdp, "completion_logprobs", spy)
    budgeted = dataclasses.replace(cfg, max_tokens_per_micro_batch=budget, packing=packing)
    chunked, diag = _update_from(policy, budgeted, batch, advantages)
    assert max(passes) <= budget and len(passes) > cfg.minibatches * cfg.epochs
    _assert_same_update(chunked, diag, whole, whole_diag)


def test_token_chunks_are_first_fit_decreasing_and_name_a_row_over_the_budget():
    # rows forward 2 (prompt) + length − 1 positions: 11 3 6 2 9 5 (an empty row: the prompt)
    rollout = _rollout_of_lengths([10, 2, 5, 0, 8, 4], group_size=2, width=10)
    assert plan.row_tokens(rollout).tolist() == [11, 3, 6, 2, 9, 5]
    rows = torch.arange(6) + 100  # the rows' places in the step's rollout
    # lines of ≤ 12, rows in decreasing order into the first that fits: [11] [9 3] [6 5] [2];
    # lines in decreasing order into chunks of ≤ 24 (lines × the longest): [9 3 | 11] [6 5 | 2]
    packed = plan.token_chunks(rollout, rows, 24, 12)
    assert [c.rows.tolist() for c in packed] == [[104, 101, 100], [102, 105, 103]]
    assert [[p.tolist() for p in c.packs] for c in packed] == [[[0, 1], [2]], [[0, 1], [2]]]
    assert all(c.rollout.group_size == 1 for c in packed)
    assert torch.equal(packed[1].rollout.completion_ids, rollout.completion_ids[[2, 5, 3]])
    whole = plan.token_chunks(rollout, rows, None, 12)  # no budget: every line in one forward
    assert [c.rows.tolist() for c in whole] == [[104, 101, 100, 102, 105, 103]]
    # padded, rows × the chunk's longest ≤ 14: [11] [9] [6 5] [3 2]
    padded = plan.token_chunks(rollout, rows, 14, None)
    assert [c.rows.tolist() for c in padded] == [[100], [104], [102, 105], [101, 103]]
    assert all(c.packs is None for c in padded)
    with pytest.raises(
        UserError,
        match=r"--max-tokens-per-micro-batch 10 is smaller than a row: "
        r"its prompt and completion are 12 tokens \(11 forwarded\)",
    ):
        plan.token_chunks(rollout, rows, 10, 12)  # fmt: skip


def test_auto_packing_packs_where_its_cost_model_says_it_pays():
    """`--packing auto` on a CPU: 32 rows of one (G = 1, nothing to share) whose lengths spread
    from 16 to 512 are packed; a group of equal lengths behind a long shared prompt is not."""
    from grouprl.config.training import ComputeOptions

    cfg = ComputeOptions(packing="auto")
    shape = plan.Shape(packs=True, pair_cost=3e-4, overhead=2048)
    lengths = [int(16 * 32 ** (i / 31)) for i in range(32)]  # 16 … 512, log-spread
    spread = _rollout_of_lengths(lengths[::2] + lengths[1::2], group_size=1, width=512)
    rows = torch.arange(32)
    chunks = plan.plan_rows(cfg, spread, rows, 2048, shape)
    assert all(c.packed for c in chunks)  # cost 6,380 positions against the widths' 7,431
    assert sorted(torch.cat([c.rows for c in chunks]).tolist()) == list(range(32))
    even = _rollout_of_lengths([16] * 8, group_size=8, width=16)
    even = dataclasses.replace(even, prompt_ids=torch.ones(1, 45, dtype=torch.long),
                               prompt_mask=torch.ones(1, 45, dtype=torch.bool))  # fmt: skip
    assert not any(c.packed for c in plan.plan_rows(cfg, even, torch.arange(8), 2048, shape))
    off = ComputeOptions(packing="off")
    assert not any(c.packed for c in plan.plan_rows(off, spread, rows, 2048, shape))
    cannot = dataclasses.replace(shape, packs=False)
    assert not any(c.packed for c in plan.plan_rows(cfg, spread, rows, 2048, cannot))


def _rollout_of_lengths(lengths: list[int], group_size: int, width: int) -> Rollout:
    """A rollout whose completions (of 2-token prompts p0, p1, ...) have these lengths."""
    n, b = len(lengths), len(lengths) // group_size
    return Rollout(
        prompt_ids=torch.ones(b, 2, dtype=torch.long),
        prompt_mask=torch.ones(b, 2, dtype=torch.bool),
        completion_ids=torch.zeros(n, width, dtype=torch.long),
        mask=torch.arange(width)[None] < torch.tensor(lengths)[:, None],
        old_logp=torch.zeros(n, width),
        truncated=torch.zeros(n, dtype=torch.bool),
        texts=[f"c{i}" for i in range(n)],
        prompts=[f"p{i}" for i in range(b)],
        group_size=group_size,
        temperature=1.0,
    )


def test_width_chunks_group_by_longest_completion_where_it_pays():
    longest = [10, 100, 12, 98]  # per group; each group's other row is 1 token
    rollout = _rollout_of_lengths([x for n in longest for x in (n, 1)], group_size=2, width=100)
    rows = torch.arange(8) + 8  # as if this were the step's second minibatch
    # one pass: 8 rows x 100 + 50 = 850; groups {1, 3} and {2, 0}: 4 x 100 + 4 x 12 + 2 x 50 =
    # 548; three passes {1}, {3}, {2, 0}: 200 + 196 + 48 + 150 = 594
    wide, narrow = plan.width_chunks(rollout, rows, overhead=50)
    assert wide.rollout.prompts == ["p1", "p3"] and wide.rows.tolist() == [10, 11, 14, 15]
    assert narrow.rollout.prompts == ["p2", "p0"] and narrow.rows.tolist() == [12, 13, 8, 9]
    assert torch.equal(narrow.rollout.mask, rollout.mask[[4, 5, 0, 1]])
    # and in each, the 1-token rows at a width of their own (5 per width): wide 2 x 100 + 2 + 10
    # against 4 x 100 + 5, narrow 2 x 12 + 2 + 10 against 4 x 12 + 5
    for chunk in (wide, narrow):
        assert [b.tolist() for b in chunk.buckets] == [[0, 2], [1, 3]]
    # at 1,000 per pass a split saves less than it costs: one chunk, the order kept
    (whole,) = plan.width_chunks(rollout, rows, overhead=1000)
    assert whole.rollout is rollout and whole.rows.tolist() == rows.tolist()
    # the bundled 1M model: a pass costs tens of thousands of positions, so it never splits
    from grouprl.models import load_model

    assert plan.pass_overhead(load_model("builtin:arith")) > 30_000


def test_rows_of_a_pass_run_at_widths_of_their_own_where_it_pays():
    """Groups too alike to split into passes, but rows of 1-3 tokens beside rows of ~30 in
    each: the pass runs them in two buckets, at a width's cost of `overhead` / 10."""
    rollout = _rollout_of_lengths([30, 2, 29, 1, 2, 31, 1, 3], group_size=4, width=31)
    rows = torch.arange(8)
    # passes at 1,000 each: one (8 x 31 + 1,000 = 1,248) against two (4 x 31 + 4 x 30 + 2,000);
    # widths at 100 each, rows sorted 31 30 29 3 2 2 1 1: one (8 x 31 + 100 = 348), two
    # ({31, 30, 29}, the rest: 3 x 31 + 5 x 3 + 200 = 308), three (93 + 3 + 4 x 2 + 300 = 404)
    (chunk,) = plan.width_chunks(rollout, rows, overhead=1000)
    assert chunk.rollout is rollout
    assert [b.tolist() for b in chunk.buckets] == [[5, 0, 2], [7, 1, 4, 3, 6]]
    # widths at 200: one (448) against two (508): all rows at the longest's width
    (chunk,) = plan.width_chunks(rollout, rows, overhead=2000)
    assert chunk.buckets is None


@pytest.mark.numerics
@pytest.mark.parametrize("algo", ["grpo", "gspo"])
def test_width_chunks_give_the_unsplit_update(algo, monkeypatch):
    """Groups sorted by their longest completion and cut into passes, and rows within a pass at
    widths of their own: the same parameters."""
    policy, batch, cfg, advantages = _chunking_case(
        algo, [[1, 0, 0, 1], [1, 1, 0, 1], [0, 1, 0, 0], [1, 0, 0, 1]]
    )
    # the sampled rows of a group are alike in length; end some early, as a row that answers
    # at once beside one that works longer does
    cut = torch.tensor([20, 3, 20, 7, 18, 1, 9, 18, 10, 2, 10, 5, 20, 20, 4, 11])  # (16,)
    mask = batch.rollout.mask & (torch.arange(batch.rollout.mask.shape[1])[None] < cut[:, None])
    rollout = dataclasses.replace(batch.rollout, mask=mask, loss_mask=mask)
    batch = dataclasses.replace(batch, rollout=rollout)
    passes = _record_passes(monkeypatch)
    whole, whole_diag = _update_from(policy, cfg, batch, advantages)
    assert len(passes) == cfg.minibatches * cfg.epochs  # the 1M model never splits
    passes.clear()
    buckets = []
    _record_passes(monkeypatch, buckets)
    monkeypatch.setattr(plan, "pass_overhead", lambda model: 1)
    split, diag = _update_from(policy, cfg, batch, advantages)
    widths = [width for _, width in passes]
    assert len(widths) > cfg.minibatches * cfg.epochs and len(set(widths)) > 1
    # and within passes, rows of different lengths at widths of their own
    assert sum(b is not None for b in buckets) > 1
    _assert_same_update(split, diag, whole, whole_diag)


@pytest.mark.numerics
def test_gradient_checkpointing_takes_effect_in_eval_mode():
    """transformers checkpoints only layers in training mode; `recomputing` puts the layers
    (not their submodules) in it, so far less is saved for backward, with the same gradients."""
    import contextlib

    from grouprl.models import activation_checkpointing as checkpointing

    policy, batch = _small_batch([[1, 0, 0, 1]] * 4)
    # float64: the claim is "the same computation", and the two paths differ in summation order
    # only (checkpointing runs the N full sequences, the plain path shares each prompt), so
    # compare where rounding is invisible (tests/numerics.py)
    policy = to_float64(policy)
    checkpointing.enable(policy)
    policy.eval()

    def saved_bytes_and_grads(context):
        policy.zero_grad(set_to_none=True)
        storages, total = set(), 0

        def pack(t):
            nonlocal total
            storage = t.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
            logp = fsdp.completion_logprobs(policy, batch.rollout)
        assert logp.dtype == torch.float64
        logp.sum().backward()
        return total, {n: p.grad.clone() for n, p in policy.named_parameters()}

    # checkpointed first: the first log-prob call of a model probes its head, which must not
    # reset the layers' modes
    kept, grads = saved_bytes_and_grads(checkpointing.recomputing(policy))
    plain, plain_grads = saved_bytes_and_grads(contextlib.nullcontext())
    assert kept < plain / 3, (kept, plain)
    assert not any(m.training for m in policy.modules())  # back in eval mode after the context
    for name in grads:
        assert_same_f64(grads[name], plain_grads[name])


@pytest.mark.numerics
def test_dynamic_sampling_filters_on_the_pass_reward_and_logs_everything_sampled(monkeypatch):
    """DAPO drops groups whose completions all pass or all fail, judged by the pass reward, not
    the shaped total: an all-correct group whose lengths differ only in the overlong penalty
    is dropped. The step's metrics describe everything sampled; `*_kept` what was trained."""
    from grouprl.tasks.data import PromptStream
    from grouprl.tasks.rewards.scoring import build_reward_set

    G, T = 4, 8

    class ScriptedEngine:
        def sample(self, prompts, *, group_size, max_new_tokens, **kwargs):
            b = len(prompts)
            lengths = torch.tensor([8, 2, 3, 2] * b)  # 8: in the overlong zone (penalty -1)
            mask = torch.arange(T)[None, :] < lengths[:, None]
            return Rollout(
                prompt_ids=torch.ones(b, 1, dtype=torch.long),
                prompt_mask=torch.ones(b, 1, dtype=torch.bool),
                completion_ids=torch.ones(b * G, T, dtype=torch.long),
                mask=mask,
                old_logp=torch.zeros(b * G, T),
                truncated=lengths == T,
                texts=["x"] * (b * G),
                prompts=list(map(str, prompts)),
                group_size=G,
                temperature=1.0,
            )

    # prompt "a": every completion right; prompt "b": half right
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "0"}]
    verdict = {"1": [1.0] * G, "0": [1.0, 0.0, 1.0, 0.0]}

    def right(completions, answer, **kwargs):
        return [v for a in answer[::G] for v in verdict[a]]

    rewards = build_reward_set({"right": 1.0}, None, loader=lambda s, t, device: (s, right))
    cfg = resolve(
        TrainConfig(algo="dapo", prompts_per_step=2, group_size=G, max_new_tokens=T,
                    overlong_cache=4, max_resample_rounds=0),
        task_max_new_tokens=T,
    )  # fmt: skip
    sampler = collect.Sampler(
        engine=ScriptedEngine(), tokenizer=None, stream=PromptStream(rows, seed=0),
        rewards=rewards, stop=None, budget=None, dtype=None, device=torch.device("cpu"),
    )  # fmt: skip
    monkeypatch.setattr(collect, "prompt_ids", lambda tokenizer, prompt, tools=None, row=None: [1])
    collected = collect.collect_batch(cfg, sampler, 0, 0)
    kept, stats, sampled = collected.kept, sampling_metrics(collected), collected.sampled
    assert collected.filtered and collected.position == 2
    assert sampled.rollout.num_prompts == 2
    assert [r["prompt"] for r in kept.rows] == ["b"]  # "a" all pass despite its penalties
    assert stats["groups"] == 1 and stats["frac_zero_std"] == 0.0  # both had reward variance
    metrics = batch_metrics(sampled)
    assert metrics["accuracy"] == 6 / 8  # a mean of 0/1 values: exact in float32
    assert batch_metrics(kept)["accuracy"] == 2 / 4
    # a step where every group is decided keeps nothing, and says why, once
    warnings = []
    sampler.warn, sampler.stream = warnings.append, PromptStream(rows[:1], seed=0)
    for step in (1, 2):
        collected = collect.collect_batch(cfg, sampler, step, 0)
        assert collected.kept is None and sampling_metrics(collected)["groups"] == 0
    assert len(warnings) == 1 and "dynamic sampling kept no group at step 2" in warnings[0]


def test_non_finite_updates_are_skipped_and_a_run_of_them_stops(tmp_path, monkeypatch, capsys):
    """A step whose loss is NaN skips its optimizer step (the weights stay as they were); the
    run stops with one line after max_nonfinite_steps such steps in a row."""
    from grouprl.cli import main

    original = train_update.policy_loss
    bad_steps = set()

    def sometimes_nan(*args, **kwargs):
        out = original(*args, **kwargs)
        if calls.append(1) or len(calls) in bad_steps:
            return dataclasses.replace(out, loss=out.loss * math.nan)
        return out

    calls = []
    monkeypatch.setattr(train_update, "policy_loss", sometimes_nan)
    flags = ["--algo", "grpo", "--prompts-per-step", "4", "--group-size", "4", "--eval-size",
             "2", "--eval-samples", "1", "--threads", "1", "--no-progress", "--save-every", "1",
             "--lr", "1e-3", "--warmup-steps", "0", "--keep-last", "10"]  # fmt: skip
    bad_steps.update({2})
    run = tmp_path / "one_bad"
    assert main(["train", "--steps", "3", "--output-dir", str(run), *flags]) == 0
    records = _metrics(run)
    assert [r["nonfinite_updates"] for r in records] == [0, 1, 0]
    assert "step 2: non-finite loss or gradient; 1 update(s) skipped" in " ".join(
        capsys.readouterr().err.split()
    )
    w1 = load_file(str(run / "checkpoints" / "step_000001" / "model.safetensors"))
    w2 = load_file(str(run / "checkpoints" / "step_000002" / "model.safetensors"))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # the NaN step changed nothing
    calls.clear()
    bad_steps.clear()
    bad_steps.update({2, 3, 4})
    run = tmp_path / "three_bad"
    assert main(["train", "--steps", "6", "--max-nonfinite-steps", "3", "--output-dir", str(run),
                 *flags]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert "3 steps in a row (to step 4) had a non-finite loss or gradient" in err[-1]
    final = load_file(str(run / "checkpoints" / "step_000004" / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in final.values())


@pytest.mark.numerics
def test_ratios_jsonl_measures_how_far_the_step_moved_its_completions(tmp_path):
    """ratios.jsonl holds log_ratios completions every log_ratios_every steps, with their lengths
    and Σ_t log ρ_t after the step's update: about 0 when the policy did not move (lr 1e-12: the
    trainer's forward and the sampler's KV-cached decode agree to float32 rounding, bounded by
    `numerics.forward_bound` over the completion's tokens), clearly not 0 after an on-policy
    GRPO step at a large learning rate (inside that update the ratio is exactly 1)."""
    from grouprl.models import load_model

    model = load_model("builtin:arith")
    prompts = torch.tensor([[1, *range(5, 15)]])  # digits and operators: the task's alphabet
    with torch.no_grad():
        largest = float(model(input_ids=prompts).logits.abs().max())
    assert largest < 25  # the bundled model's logits (about 12): 25 is the bound's magnitude
    sums, bounds = {}, {}
    for lr in (1e-12, 1e-2):
        summary = _run(tmp_path, name=f"lr{lr}", algo="grpo", lr=lr, steps=2, log_ratios=6,
                       log_ratios_every=2, warmup_steps=0)  # fmt: skip
        records = [
            json.loads(x) for x in (summary.run_dir / "ratios.jsonl").read_text().splitlines()
        ]
        assert [r["step"] for r in records] == [2]
        (record,) = records
        assert len(record["lengths"]) == len(record["log_ratio_sum"]) == 6
        assert all(1 <= n <= 38 for n in record["lengths"])
        sums[lr] = max(abs(v) for v in record["log_ratio_sum"])
        bounds[lr] = forward_bound(model.config, 25.0, tokens=max(record["lengths"]))
    assert sums[1e-12] < bounds[1e-12], (sums, bounds)  # ~0.2; measured ~1e-6
    assert sums[1e-2] > 10 * bounds[1e-2], (sums, bounds)  # measured ~60


def test_the_doctor_warns_live_once_per_finding(tmp_path, capsys):
    """A reward nothing passes makes every group all-wrong: at the first evaluation with enough
    steps the doctor prints one warning line, and not again at the next evaluation."""
    (tmp_path / "never.py").write_text(
        "def never(completions, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    _run(tmp_path, rewards={f"{tmp_path / 'never.py'}:never": 1.0}, steps=12, eval_every=5,
         algo="grpo", prompts_per_step=2, group_size=2, save_every=100, log_ratios=0)  # fmt: skip
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "doctor:" in line]
    assert len(lines) == 1 and "every completion fails" in lines[0], err
    assert "--dynamic-sampling" in err


def test_freed_cpu_memory_is_kept_for_reuse_only_on_a_cpu():
    """glibc's mallopt takes the settings on a Linux CPU run; any other device is left alone."""
    import sys

    from grouprl.train.build import keep_freed_memory

    assert keep_freed_memory(torch.device("meta")) is False
    assert keep_freed_memory(torch.device("cpu")) is sys.platform.startswith("linux")
