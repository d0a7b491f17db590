"""--kl-in-reward in a run: the penalty reads the log-probs the update's ratio starts from. With
the trainer's own fp32 sampler those are the sampled ones; for a batch sampled by an older
version (--max-staleness 1) they are the trainer's recompute, as TRL's RLOOTrainer computes its
old log-probs with the trainer's forward."""

from __future__ import annotations

import torch

from grouprl.config import TrainConfig
from grouprl.train import loop, step


def test_the_kl_penalty_reads_the_ratios_old_log_probs(tmp_path, monkeypatch):
    seen = []
    penalty = step.kl_reward_penalty

    def recorded(old_logp, ref_logp, mask):
        seen.append(old_logp.clone())
        return penalty(old_logp, ref_logp, mask)

    batches = []
    shaped = step._shaped

    def shaping(cfg, batch, ref_logp, old_logp):
        batches.append(batch.rollout)
        return shaped(cfg, batch, ref_logp, old_logp)

    monkeypatch.setattr(step, "kl_reward_penalty", recorded)
    monkeypatch.setattr(step, "_shaped", shaping)
    cfg = TrainConfig(steps=3, prompts_per_step=4, group_size=4, minibatches=1,
                      max_new_tokens=8, eval_every=0, eval_size=4, progress=False, threads=1,
                      beta=0.1, kl_in_reward=True, max_staleness=1, lr=1e-2,
                      output_dir=tmp_path / "run")  # fmt: skip
    result = loop.train(cfg)
    assert result.steps_done == 3 and len(seen) == 3
    first, later = batches[0], batches[2]
    assert torch.equal(seen[0], first.old_logp)  # version 0 sampled it: the trainer's own
    stale = later.loss_mask
    assert later.behaviour_logp is not None  # sampled by version 1, trained by version 2
    assert not torch.allclose(seen[2][stale], later.old_logp[stale])  # the trainer's recompute
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    assert all('"kl":' in line for line in lines) and len(lines) == 3  # TRL's per-token kl
