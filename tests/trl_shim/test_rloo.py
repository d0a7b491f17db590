"""TRL's RLOOTrainer on grouprl: RLOOConfig is TRL 1.16's, field for field; its options carry TRL's
RLOO semantics; on a fixed batch the advantages equal TRL's computation and the loss equals TRL's
own `RLOOTrainer._compute_loss` (TRL installed; float64, so "equal" is the same computation)."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import pytest
import torch

from grouprl.config import TrainConfig, resolve
from grouprl.config.validation import loss_options
from grouprl.core import group_advantages, kl_reward_penalty, policy_loss
from grouprl.errors import UserError
from grouprl.trl import RLOO_FIELDS, RLOOConfig
from grouprl.trl.rloo import rloo_options_from
from numerics import F64_SAME, to_float64

trl = pytest.importorskip("trl")


def test_rloo_config_is_trls_field_for_field():
    theirs = {}
    for f in dataclasses.fields(trl.RLOOConfig):
        theirs[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    ours = {f.name: getattr(RLOOConfig(), f.name) for f in dataclasses.fields(RLOOConfig)}
    assert list(ours) == list(theirs) and ours == theirs
    assert list(RLOO_FIELDS) == list(theirs)


def test_rloo_options_are_trls_rloo_not_grpo():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # RLOO's defaults are nothing to warn about
        o = rloo_options_from(RLOOConfig(bf16=False), rows=64)
    assert (o["adv_estimator"], o["adv_scale"], o["ratio_level"], o["loss_agg"]) == (
        "rloo", "none", "sequence_sum", "seq_mean_token_mean")  # fmt: skip
    assert (o["beta"], o["kl_in_reward"], o["group_size"], o["clip_low"], o["clip_high"]) == (
        0.05, True, 2, 0.2, 0.2)  # fmt: skip
    assert not any(k.startswith("correction") for k in o)
    vllm = rloo_options_from(RLOOConfig(bf16=False, use_vllm=True), rows=64)
    assert vllm["engine"] == "vllm" and not any(k.startswith("correction") for k in vllm)
    norm = rloo_options_from(RLOOConfig(bf16=False, normalize_advantages=True, beta=0.0,
                                        reward_clip_range=(-1.0, 2.0)), rows=64)  # fmt: skip
    assert (norm["adv_scale"], norm["unbiased_std"], norm["kl_in_reward"], norm["reward_clip"]) == (
        "whiten", True, False, (-1.0, 2.0))  # fmt: skip
    resolve(TrainConfig(**norm), task_max_new_tokens=8)  # a valid run
    for kwargs, message in [({"num_generations": 1}, "RLOOConfig\\(num_generations=1\\)"),
                            ({"reward_clip_range": (1.0, 0.0)}, "min < max"),
                            ({"beta": -1.0}, ">= 0")]:  # fmt: skip
        with pytest.raises(UserError, match=message):
            rloo_options_from(RLOOConfig(bf16=False, **kwargs), rows=64)


def trl_advantages(rewards, old, ref, mask, beta, clip, normalize, G):
    """TRL 1.16 RLOOTrainer._generate_and_score_completions' advantages, transcribed: rewards
    clamped, the summed k1 KL subtracted, the leave-one-out baseline over scorable siblings,
    optionally whitened with the NaN-aware sample std (trl's nanstd), NaN to 0."""
    from trl.trainer.utils import nanstd

    if clip:
        rewards = rewards.clamp(min=clip[0], max=clip[1])
    if beta != 0.0:
        rewards = rewards - beta * ((old - ref) * mask).sum(-1)
    grouped = rewards.view(-1, G)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    advantages = rewards - ((total - grouped) / (counts - 1)).view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from grouprl.models.tiny import save_tiny_chat_model

    directory = tmp_path_factory.mktemp("rloo_model")
    model, tokenizer = save_tiny_chat_model(directory)
    return directory, to_float64(model), tokenizer


@pytest.mark.parametrize("normalize", [False, True])
def test_the_shims_advantages_and_loss_equal_trls_rloo_on_a_fixed_batch(tiny, tmp_path, normalize):
    from datasets import Dataset

    _, reference, tokenizer = tiny
    G, B, T = 4, 3, 6
    generator = torch.Generator().manual_seed(0)
    policy = copy.deepcopy(reference)
    with torch.no_grad():  # the policy has moved from the reference: the KL is not 0
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    prompt_ids = torch.randint(3, 250, (B * G, 4), generator=generator)
    completion_ids = torch.randint(3, 250, (B * G, T), generator=generator)
    lengths = torch.tensor([6, 5, 3, 6, 1, 6, 4, 2, 6, 5, 6, 3])
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (N, T)
    rewards = torch.tensor([1.0, 0.0, 2.5, 0.5, 1.0, float("nan"), 0.0, 3.0, -2.0, 1.0, 1.0, 0.2],
                           dtype=torch.float64)  # fmt: skip

    def per_token(model):
        ids = torch.cat([prompt_ids, completion_ids], 1)
        with torch.no_grad():
            logits = model(ids).logits[:, 3:-1].log_softmax(-1)
        return logits.gather(-1, completion_ids[..., None])[..., 0]  # (N, T)

    old, ref = per_token(policy), per_token(reference)
    args = RLOOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none",
                      num_generations=G, per_device_train_batch_size=G, beta=0.05,
                      normalize_advantages=normalize, reward_clip_range=(-1.0, 2.0))  # fmt: skip
    options = rloo_options_from(args, rows=64)
    cfg = resolve(TrainConfig(**options), task_max_new_tokens=T)
    # grouprl: the reward shaping the trainer applies, then the estimator
    shaped = rewards.clamp(*cfg.reward_clip) - cfg.beta * kl_reward_penalty(old, ref, mask)
    ours = group_advantages(shaped.view(B, G), scale=cfg.adv_scale, estimator=cfg.adv_estimator,
                            eps=cfg.adv_eps, unbiased_std=cfg.unbiased_std).reshape(-1)  # fmt: skip
    theirs = trl_advantages(rewards, old, ref, mask.double(), 0.05, (-1.0, 2.0), normalize, G)
    # TRL's nanstd divides integer counts, count / (count − 1), which torch gives as float32:
    # its variance is off by at most 2^-24 relative, its std by 2^-25, so each whitened
    # advantage is within |Â|·2^-24 of the exact one; without whitening, the same computation
    rtol = 2.0**-24 if normalize else F64_SAME
    assert torch.allclose(ours, theirs, rtol=rtol, atol=F64_SAME), (ours - theirs).abs().max()

    # the loss of a moved policy against `old`: TRL's own _compute_loss
    targs = trl.RLOOConfig(output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True,
                           report_to="none", num_generations=G, per_device_train_batch_size=G,
                           beta=0.0, logging_steps=1)  # fmt: skip
    moved = copy.deepcopy(policy)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    data = Dataset.from_list([{"prompt": "1+1="}] * 8)
    trainer = trl.RLOOTrainer(model=moved, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                              args=targs, train_dataset=data, processing_class=tokenizer)  # fmt: skip
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
              "completion_ids": completion_ids, "completion_mask": mask.long(),
              "old_logps": (old * mask).sum(1), "advantages": ours}  # fmt: skip
    # TRL's own _compute_loss on the moved policy's float64 log-probs (its fused head would
    # round them to float32, a difference of the log-prob path, not of RLOO's loss)
    logp = per_token(moved)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (
        logp,
        torch.zeros_like(logp),
        None,
    )
    theirs_loss = float(trainer._compute_loss(trainer.model, inputs))
    out = policy_loss(logp, old, ours, mask, options=loss_options(cfg))
    assert math.isclose(float(out.loss), theirs_loss, rel_tol=F64_SAME, abs_tol=F64_SAME)
    assert float(out.stats.ratio_max) > 1.2  # the ratio moved past the clip: it was tested


def test_a_config_of_another_trainer_is_one_line():
    """GRPOConfig handed to the RLOO shim (TRL's own mistake of the kind: fields RLOO has and
    GRPO lacks), and RLOOConfig to the GRPO one: each names the config it takes."""
    from grouprl.trl import GRPOConfig
    from grouprl.trl.config import options_from

    with pytest.raises(UserError, match=r"args= takes grouprl.trl.RLOOConfig"):
        rloo_options_from(GRPOConfig(bf16=False), rows=64)
    with pytest.raises(UserError, match=r"args= takes grouprl.trl.GRPOConfig"):
        options_from(RLOOConfig(bf16=False), rows=64)
