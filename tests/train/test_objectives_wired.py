"""Each objective reaches the loss through the trainer: one update of `grouprl train`'s step, on
a sampled batch, calls core's policy_loss with that objective, and the gradient it gets at the
log-probs is the gradient of core's function on the same batch (recomputed here); the knobs of
another objective, or a clip range for one no clip bounds, are one line."""

from __future__ import annotations

import copy

import pytest
import torch

from grouprl.config import TrainConfig, resolve
from grouprl.config.validation import loss_options
from grouprl.core import policy_loss
from grouprl.errors import UserError
from grouprl.models import load_model, load_tokenizer
from grouprl.rollout import sample_groups
from grouprl.tasks import get_task
from grouprl.train import step as train_step
from grouprl.train import update as train_update
from grouprl.train.batch import Batch
from grouprl.train.parallel.distributed import SINGLE


@pytest.fixture(scope="module")
def policy_and_batch():
    policy = load_model("builtin:arith").eval()
    rows = get_task("arithmetic").train[:4]
    rollout = sample_groups(policy, load_tokenizer("builtin:arith"), [r["prompt"] for r in rows],
                            group_size=4, max_new_tokens=20, seed=5)  # fmt: skip
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0.0])
    return policy, Batch(rollout, list(rows), rewards, {"correct": rewards}, rewards >= 1)


@pytest.fixture
def seen(monkeypatch):
    """Every call of the trainer's policy_loss: its inputs, options and the gradient it gave
    the log-probs."""
    calls = []
    original = train_update.policy_loss

    def spy(logp, old_logp, advantages, mask, **kwargs):
        logp.register_hook(lambda grad: calls.append((logp.detach(), old_logp, advantages, mask,
                                                      kwargs, grad)))  # fmt: skip
        return original(logp, old_logp, advantages, mask, **kwargs)

    monkeypatch.setattr(train_update, "policy_loss", spy)
    return calls


def recomputed(call) -> torch.Tensor:
    """core's gradient at the call's inputs."""
    logp, old, adv, mask, kwargs, _ = call
    x = logp.clone().requires_grad_(True)
    policy_loss(x, old, adv, mask, **kwargs).loss.backward()
    return x.grad


@pytest.mark.parametrize(("algo", "objective"), [("cispo", "cispo"), ("sapo", "sapo"),
                         ("gmpo", "gmpo"), ("luspo", "clip"), ("vespo", "vespo")])  # fmt: skip
def test_an_update_trains_cores_objective(policy_and_batch, algo, objective, seen):
    policy, batch = policy_and_batch
    cfg = resolve(TrainConfig(algo=algo, prompts_per_step=4, group_size=4, lr=1e-2),
                  task_max_new_tokens=20)  # fmt: skip
    model = copy.deepcopy(policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    advantages = train_step.batch_advantages(cfg, batch, SINGLE)
    train_update.update(cfg, model, optimizer, batch, advantages, None)
    assert len(seen) == cfg.minibatches == 4  # the last ones off-policy
    for call in seen:
        options = call[4]["options"]
        assert options == loss_options(cfg) and options.objective == objective
        assert torch.equal(recomputed(call), call[5])
    last_logp, last_old, *_ = seen[-1]
    assert not torch.equal(last_logp, last_old)  # the last minibatch was off-policy


@pytest.mark.parametrize(("algo", "flags", "expected"), [
    ("cispo", ["--cispo-cap", "3"], {"objective": "cispo", "cispo_cap": 3.0}),
    ("sapo", ["--sapo-tau-neg", "2"], {"objective": "sapo", "sapo_tau_neg": 2.0}),
    ("gmpo", [], {"objective": "gmpo", "clip_low": 0.4, "clip_high": 0.4}),
    ("luspo", [], {"objective": "clip", "agg": "seq_mean_token_sum", "level": "sequence"}),
    ("vespo", ["--vespo-k-neg", "4"], {"objective": "vespo", "vespo_k_neg": 4.0}),
])  # fmt: skip
def test_the_command_line_trains_cores_objective(algo, flags, expected, tmp_path, seen):
    """`grouprl train --algo X --steps 1`: every update of the step calls core's loss with the
    flags' objective and knobs, and core's function on the same inputs gives its gradient."""
    from grouprl.cli import main

    assert main(["train", "--algo", algo, *flags, "--steps", "1", "--prompts-per-step", "4",
                 "--group-size", "4", "--eval-size", "2", "--eval-samples", "1", "--no-progress",
                 "--report-to", "none", "--output-dir", str(tmp_path / "run")]) == 0  # fmt: skip
    assert seen
    for call in seen:
        options = call[4]["options"]
        assert {k: getattr(options, k) for k in expected} == expected
        assert torch.equal(recomputed(call), call[5])


def test_knobs_of_another_objective_are_one_line():
    def run(**options):
        return resolve(TrainConfig(**options), task_max_new_tokens=8)

    assert run(algo="sapo").sapo_tau_neg == 1.05 and run(algo="sapo").cispo_cap is None
    assert run(algo="cispo", cispo_cap=3.0).cispo_cap == 3.0
    with pytest.raises(UserError, match="--sapo-tau-pos is a knob of --objective sapo"):
        run(algo="grpo", sapo_tau_pos=2.0)
    with pytest.raises(UserError, match="--clip-high does not apply to --objective cispo"):
        run(algo="cispo", clip_high=0.3)
    with pytest.raises(UserError, match="needs ratio level 'token'"):
        run(algo="vespo", ratio_level="sequence")
    assert run(algo="grpo", objective="sapo").objective == "sapo"  # any preset, any objective


@pytest.mark.parametrize("algo", ["reinforce_pp", "reinforce_pp_baseline", "opo", "gpg",
                                  "grpo_passk"])  # fmt: skip
def test_an_update_trains_on_verls_other_estimators(policy_and_batch, algo, seen):
    """The trainer's advantages are core's estimator on the batch's rewards and trained-token
    counts (over the whole batch), and each update's gradient is core's loss on them."""
    from grouprl.core import estimators

    policy, batch = policy_and_batch
    cfg = resolve(TrainConfig(algo=algo, prompts_per_step=4, group_size=4, lr=1e-2),
                  task_max_new_tokens=20)  # fmt: skip
    rewards, lengths = batch.rewards.view(4, 4), batch.rollout.sampled_lengths.view(4, 4)
    expected = {
        "reinforce_pp": lambda: estimators.reinforce_pp_advantages(rewards, lengths, baseline=False),
        "reinforce_pp_baseline": lambda: estimators.reinforce_pp_advantages(rewards, lengths,
                                                                            baseline=True),
        "opo": lambda: estimators.opo_advantages(rewards, lengths),
        "gpg": lambda: estimators.gpg_advantages(rewards),
        "grpo_passk": lambda: estimators.passk_advantages(rewards, eps=cfg.adv_eps,
                                                          unbiased_std=cfg.unbiased_std),
    }[algo]().reshape(-1).float()  # fmt: skip
    advantages = train_step.batch_advantages(cfg, batch, SINGLE)
    assert torch.equal(advantages, expected) and advantages.abs().sum() > 0
    model = copy.deepcopy(policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    train_update.update(cfg, model, optimizer, batch, advantages, None)
    assert seen
    for call in seen:
        assert call[4]["options"].objective == ("gpg" if algo == "gpg" else "clip")
        assert torch.equal(recomputed(call), call[5])


@pytest.mark.parametrize(("options", "message"), [
    ({"algo": "opo", "minibatches": 2}, "opo's baseline is optimal only exactly on-policy"),
    ({"algo": "opo", "beta": 0.04}, "no KL term"),
    ({"algo": "reinforce_pp", "adv_scale": "group"}, "whitens over the batch's tokens"),
    ({"algo": "grpo", "adv_estimator": "gpg", "adv_scale": "batch"}, "gpg scales by the share"),
    ({"algo": "grpo_passk", "adv_scale": "batch"}, "grpo_passk divides"),
])  # fmt: skip
def test_estimators_refuse_what_they_cannot_do_in_one_line(options, message):
    with pytest.raises(UserError, match=message):
        resolve(TrainConfig(prompts_per_step=4, group_size=4, **options), task_max_new_tokens=8)
