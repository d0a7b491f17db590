"""`Rollout.loss_mask`: every consumer that means "trained tokens" reads it, not `mask`.

The rollouts here mark some attended tokens as not sampled (as a tool's observation would be):
position 1 of every completion, and the whole of one completion. Each consumer is shown to
count, train or measure only the loss-mask tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grouprl.config import TrainConfig, resolve
from grouprl.models import load_model, load_tokenizer
from grouprl.rollout import Rollout, sample_groups
from grouprl.tasks import get_task
from grouprl.train import collect
from grouprl.train import step as train_step
from grouprl.train import update as train_update
from grouprl.train.batch import Batch
from grouprl.train.metrics import batch_metrics
from grouprl.train.parallel.distributed import SINGLE


def _observed(rollout: Rollout) -> Rollout:
    """`rollout` with position 1 of every completion and all of completion 2 left out of the
    loss mask (still attended)."""
    loss_mask = rollout.mask.clone()
    loss_mask[:, 1] = False
    loss_mask[2] = False
    return dataclasses.replace(rollout, loss_mask=loss_mask)


@pytest.fixture(scope="module")
def policy_and_batch():
    policy = load_model("builtin:arith").eval()
    tokenizer = load_tokenizer("builtin:arith")
    rows = get_task("arithmetic").train[:4]
    rollout = sample_groups(
        policy, tokenizer, [r["prompt"] for r in rows], group_size=4, max_new_tokens=20, seed=3
    )
    rollout = _observed(rollout)
    assert bool((rollout.mask & ~rollout.loss_mask).any())
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0.0])  # (N,)
    return policy, Batch(rollout, list(rows), rewards, {"correct": rewards}, rewards >= 1)


@pytest.mark.parametrize("algo", ["grpo", "gspo", "dr_grpo", "dapo"])
def test_the_loss_counts_and_trains_only_loss_mask_tokens(policy_and_batch, algo, monkeypatch):
    """The loss sees the loss mask (so GSPO's length normalisation, the aggregation and Dr.
    GRPO's sequence count use it) with the minibatch's loss-mask counts, and the gradient of
    the loss at a token outside it is exactly 0."""
    import copy

    policy, batch = policy_and_batch
    cfg = resolve(TrainConfig(algo=algo, prompts_per_step=4, group_size=4, minibatches=1),
                  task_max_new_tokens=20)  # fmt: skip
    seen = []
    original = train_update.policy_loss

    def spy(logp, old_logp, advantages, mask, **kwargs):
        logp.register_hook(lambda grad: seen.append((mask, kwargs, grad)))
        return original(logp, old_logp, advantages, mask, **kwargs)

    monkeypatch.setattr(train_update, "policy_loss", spy)
    model = copy.deepcopy(policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    advantages = train_step.batch_advantages(cfg, batch, SINGLE)
    train_update.update(cfg, model, optimizer, batch, advantages, None)
    ((mask, kwargs, grad),) = seen
    loss_mask = batch.rollout.loss_mask
    assert torch.equal(mask, loss_mask)
    assert int(kwargs["num_tokens"]) == int(loss_mask.sum())
    assert int(kwargs["num_seqs"]) == int(loss_mask.any(-1).sum())  # completion 2 is not one
    width = grad.shape[1]
    observed = (batch.rollout.mask & ~loss_mask)[:, :width]
    assert bool(grad[observed].eq(0).all()) and bool(grad[loss_mask[:, :width]].ne(0).any())


@pytest.mark.numerics
def test_metrics_lengths_and_entropy_are_over_sampled_tokens():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    loss_mask = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    rollout = Rollout(
        prompt_ids=torch.ones(1, 2, dtype=torch.long),
        prompt_mask=torch.ones(1, 2, dtype=torch.bool),
        completion_ids=torch.zeros(2, 4, dtype=torch.long),
        mask=mask,
        old_logp=torch.zeros(2, 4),
        truncated=torch.zeros(2, dtype=torch.bool),
        texts=["a", "b"],
        prompts=["p"],
        group_size=2,
        temperature=1.0,
        entropy=torch.tensor([[0.2, 9.0, 0.4, 9.0], [0.6, 0.8, 9.0, 9.0]]),  # 9: not sampled
        loss_mask=loss_mask,
    )
    metrics = batch_metrics(Batch(rollout, [{}], torch.tensor([1.0, 0.0]), {}))
    assert metrics["completion_len_mean"] == 2.0  # 2 and 2 sampled, not 3 and 2 (exact)
    assert metrics["completion_len_max"] == 2.0
    # the mean of four float32 values (~6e-8 relative each; approx allows 1e-6)
    assert metrics["entropy"] == pytest.approx((0.2 + 0.4 + 0.6 + 0.8) / 4)


def test_the_overlong_penalty_counts_sampled_tokens(monkeypatch):
    """DAPO's soft penalty judges a completion by the tokens the policy wrote: 8 attended tokens
    of which 4 were sampled sit outside the penalty zone of max 8, cache 4."""
    from grouprl.tasks.data import PromptStream
    from grouprl.tasks.rewards.scoring import build_reward_set

    G, T = 2, 8

    class Engine:
        def sample(self, prompts, *, group_size, max_new_tokens, **kwargs):
            mask = torch.ones(G, T, dtype=torch.bool)
            loss_mask = mask.clone()
            loss_mask[0, 4:] = False  # row 0: 4 sampled + 4 fed; row 1: 8 sampled
            return Rollout(
                prompt_ids=torch.ones(1, 1, dtype=torch.long),
                prompt_mask=torch.ones(1, 1, dtype=torch.bool),
                completion_ids=torch.ones(G, T, dtype=torch.long),
                mask=mask, old_logp=torch.zeros(G, T), truncated=torch.zeros(G, dtype=torch.bool),
                texts=["x", "y"], prompts=["p"], group_size=G, temperature=1.0,
                loss_mask=loss_mask,
            )  # fmt: skip

    rewards = build_reward_set(
        {"zero": 1.0}, None, loader=lambda s, t, device: (s, lambda completions, **kw: [0.0] * 2)
    )
    cfg = resolve(TrainConfig(algo="dapo", prompts_per_step=1, group_size=G, max_new_tokens=T,
                              overlong_cache=4, max_resample_rounds=0), task_max_new_tokens=T)  # fmt: skip
    sampler = collect.Sampler(
        engine=Engine(), tokenizer=None, stream=PromptStream([{"prompt": "p"}], seed=0),
        rewards=rewards, stop=None, budget=None, dtype=None, device=torch.device("cpu"),
    )  # fmt: skip
    monkeypatch.setattr(collect, "prompt_ids", lambda tokenizer, prompt, tools=None, row=None: [1])
    collected = collect.collect_batch(cfg, sampler, 0, 0)
    assert collected.sampled.rewards.tolist() == [0.0, -1.0]


def test_the_ratio_probe_sums_over_sampled_tokens(monkeypatch):
    """ratios.jsonl's Σ_t log ρ_t and lengths cover the loss-mask tokens only."""
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss_mask = torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    sub = Rollout(
        prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.bool),
        completion_ids=torch.zeros(2, 3, dtype=torch.long), mask=mask, old_logp=torch.zeros(2, 3),
        truncated=torch.zeros(2, dtype=torch.bool), texts=["a", "b"], prompts=["p", "q"],
        group_size=1, temperature=1.0, loss_mask=loss_mask,
    )  # fmt: skip
    monkeypatch.setattr(
        train_step, "no_grad_logprobs", lambda cfg, policy, rollout, dtype: torch.ones(2, 3)
    )
    lengths, sums = train_step._probe_ratios(
        None, train_step._Probe(sub, torch.zeros(2, 3), None), None, SINGLE
    )
    assert lengths == [2, 3] and sums == [2.0, 3.0]
