"""--algo gdpo in the trainer: the batch's per-reward scores (and the overlong penalty) reach
`gdpo_advantages`; the flags that contradict it are one line."""

from __future__ import annotations

import json

import pytest
import torch

from grouprl.cli import main
from grouprl.config import TrainConfig, resolve
from grouprl.core import gdpo_advantages, overlong_penalty
from grouprl.errors import UserError
from grouprl.train.batch import Batch
from grouprl.train.parallel.distributed import SINGLE
from grouprl.train.step import batch_advantages

TINY = ["--prompts-per-step", "4", "--group-size", "4", "--eval-size", "2", "--eval-samples",
        "1", "--threads", "1", "--no-progress", "--log-ratios", "0"]  # fmt: skip


def _batch(rewards, second, lengths):
    class Rollout:
        sampled_lengths = torch.tensor(lengths)

    r, s = torch.tensor(rewards).reshape(-1), torch.tensor(second).reshape(-1)
    return Batch(Rollout(), [{}, {}], r + 0.5 * s, {"correct": r, "format": s})


def test_the_batch_advantages_are_gdpo_of_each_reward_and_the_penalty():
    cfg = resolve(TrainConfig(algo="gdpo", prompts_per_step=2, group_size=2, max_new_tokens=8,
                              overlong_penalty=True), task_max_new_tokens=8)  # fmt: skip
    batch = _batch([[0.0, 1.0], [1.0, 1.0]], [[1.0, 0.0], [0.0, 1.0]], [3, 8, 5, 5])
    weights = {"correct": 1.0, "format": 0.5, "unused": 0.0}
    got = batch_advantages(cfg, batch, SINGLE, weights)
    penalty = overlong_penalty(torch.tensor([3, 8, 5, 5]), max_len=8, cache_len=cfg.overlong_cache)
    columns = torch.stack([batch.by_function["correct"], batch.by_function["format"], penalty], -1)
    expected = gdpo_advantages(columns.double().view(2, 2, 3), [1.0, 0.5, 1.0]).reshape(-1)
    assert penalty.abs().sum() > 0  # the second completion is in the penalty zone
    assert torch.equal(got, expected.float())


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"algo": "gdpo", "adv_estimator": "rloo"}, "--algo gdpo is its own advantage estimator"),
        ({"adv_estimator": "gdpo", "adv_scale": "batch"}, "drop --adv-scale"),
        ({"algo": "gdpo", "adv_scale": "none"}, "drop --adv-scale"),
    ],
)
def test_flags_that_contradict_gdpo_are_one_line(settings, message):
    with pytest.raises(UserError, match=message):
        resolve(TrainConfig(**settings), task_max_new_tokens=8)


def test_a_gdpo_run_with_two_rewards_trains_and_resumes_its_config(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--algo", "gdpo", "--rewards", "correct", "1.0", "format", "0.5",
                 "--steps", "2", "--output-dir", str(run), *TINY]) == 0  # fmt: skip
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").open()] == [1, 2]
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 0  # the saved config resolves
