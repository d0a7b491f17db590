"""Rewards per turn: reward functions (an environment's `get_reward`, an agent's return) may
give a multi-turn completion one reward per model turn; `--adv-estimator process` turns them
into per-token advantages with DeepSeekMath's process supervision (arXiv 2402.03300, §4.1.3).

Hand-computed numbers; the runs check that a per-turn run trains, logs its turns and resumes
bit for bit, and that the estimator without per-turn rewards is GRPO's run bit for bit.
Tolerances: float64 sums of a handful of O(1) values: within 1e-12; float32 tensors: exact
where the values are exact binary fractions."""

from __future__ import annotations

import gzip
import json
import math
import signal

import pytest
import torch
from safetensors.torch import load_file

from grouprl.cli import main
from grouprl.core import process_advantages
from grouprl.errors import UserError
from grouprl.tasks.base import TrainerState
from grouprl.tasks.rewards.scoring import Reward, RewardSet
from grouprl.train.turn_rewards import spread_over_tokens, turn_reward_matrix

NAN = math.nan


def test_a_turn_without_a_reward_of_its_own_gets_the_sum_of_the_turns_after_it():
    # the group's step rewards {0, 1, 0, 0}: mean 1/4, population std sqrt(3)/4; normalised
    # (eps 0): 0 -> -1/sqrt(3), 1 -> sqrt(3). Completion 1: turn 3 sqrt(3), turn 2 (no reward)
    # sqrt(3), turn 1 sqrt(3) - 1/sqrt(3); completion 2: -1/sqrt(3), -1/sqrt(3), -2/sqrt(3).
    rewards = torch.tensor([[[0.0, NAN, 1.0], [0.0, NAN, 0.0]]], dtype=torch.float64)
    r3 = math.sqrt(3)
    want = torch.tensor([[[r3 - 1 / r3, r3, r3], [-2 / r3, -1 / r3, -1 / r3]]], dtype=torch.float64)
    torch.testing.assert_close(process_advantages(rewards, eps=0.0), want, rtol=0, atol=1e-12)


def test_what_the_turns_do_not_place_lands_on_the_last_turn():
    # three completions of 2, 3 and 1 turns; the per-turn functions placed 1.0 on turn 1 of the
    # first, (2, 0, -2) on the second, nothing on the third. Their rewards (the per-turn sums
    # plus the outcome rewards and penalties) are 2.0, 0.0 and 0.5: the rest lands on the last
    # turn; a turn past a completion's own is NaN.
    placed = torch.tensor([[1.0, NAN, NAN], [2.0, 0.0, -2.0], [NAN, NAN, NAN]])
    rewards = torch.tensor([2.0, 0.0, 0.5])
    got = turn_reward_matrix(placed, rewards, [2, 3, 1])
    want = torch.tensor([[1.0, 1.0, NAN], [2.0, 0.0, -2.0], [0.5, NAN, NAN]])
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # an unscored completion stays unscored on every turn; without per-turn rewards, each reward
    # on its completion's last turn (one column when every completion has one turn)
    got = turn_reward_matrix(None, torch.tensor([NAN, 1.0]), [2, 1])
    want = torch.tensor([[NAN, NAN], [1.0, NAN]])
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(turn_reward_matrix(None, torch.tensor([0.5, 1.0]), [1, 1]),
                       torch.tensor([[0.5], [1.0]]))  # fmt: skip
    # a batch joined from rounds where the per-turn rewards were narrower than an episode
    got = turn_reward_matrix(torch.tensor([[0.5, NAN], [NAN, NAN]]), torch.tensor([1.0, 2.0]),
                             [3, 1])  # fmt: skip
    want = torch.tensor([[0.5, NAN, 0.5], [2.0, NAN, NAN]])
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_turn_advantages_spread_over_each_rows_tokens_branches_after_their_first_rows():
    # two episodes of 3 and 1 turns. Episode 0's first row holds turns 0 and 1 (turn 1 starts
    # at token 3), its branch (row 2) turn 2; episode 1 is row 1.
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    got = spread_over_tokens(adv, starts=[[0, 3], [0], [0]], parents=torch.tensor([0]), width=5)
    want = torch.tensor([[1.0, 1.0, 1.0, 2.0, 2.0], [4.0] * 5, [3.0] * 5])
    assert torch.equal(got, want)


def _reward_set():
    def per_turn(completions, num_turns, **_):
        assert num_turns == [2, 3, 1]
        return [[0.5, None], [1, 0, -1], 0.25]  # a number: the completion's reward, no turns

    def outcome(completions, **_):
        return [1.0, 0.0, None]

    return RewardSet([Reward("per_turn", "f", per_turn, 2.0), Reward("outcome", "g", outcome, 1.0)],
                     "outcome")  # fmt: skip


def _score(rewards, num_turns):
    rows = [{"prompt": "p"}] * 3
    return rewards.score(["a", "b", "c"], rows, 1, completion_ids=[[1], [2], [3]],
                         state=TrainerState(0, 1), num_turns=num_turns)  # fmt: skip


def test_a_reward_function_gives_each_turn_its_reward():
    scores = _score(_reward_set(), [2, 3, 1])
    # a function's score is its turns' sum; the total weighs them as always
    torch.testing.assert_close(scores.by_function["per_turn"], torch.tensor([0.5, 0.0, 0.25]))
    torch.testing.assert_close(scores.total, torch.tensor([2.0, 0.0, 0.5]))
    want = torch.tensor([[1.0, NAN, NAN], [2.0, 0.0, -2.0], [NAN] * 3], dtype=torch.float64)
    torch.testing.assert_close(scores.turns, want, equal_nan=True)


def test_per_turn_rewards_of_the_wrong_length_are_one_line():
    def too_many(completions, **_):
        return [[1.0, 0.0, 0.0], 0.0, 0.0]

    rewards = RewardSet([Reward("too_many", "f", too_many, 1.0)], "too_many")
    with pytest.raises(UserError, match=r"'too_many' gave completion 0 3 per-turn rewards; it "
                       r"has 2 turns"):  # fmt: skip
        _score(rewards, [2, 3, 1])
    with pytest.raises(UserError, match=r"per-turn rewards .* multi-turn"):
        _score(rewards, None)


def _batch(groups):
    """A batch of groups of 2 rows; `groups`: each group's rows' turn starts and their placed
    per-turn rewards (None: the group's functions placed none)."""
    from grouprl.rollout import Rollout
    from grouprl.rollout.turns import TurnRecord
    from grouprl.train.batch import Batch

    starts = [s for rows, _ in groups for s in rows]
    n, b, t = len(starts), len(groups), 6
    turns = TurnRecord([[] for _ in range(n)], torch.zeros(n, dtype=torch.long),
                       torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.bool),
                       None, starts)  # fmt: skip
    rollout = Rollout(torch.ones(b, 2, dtype=torch.long), torch.ones(b, 2, dtype=torch.bool),
                      torch.ones(n, t, dtype=torch.long), torch.ones(n, t, dtype=torch.bool),
                      torch.zeros(n, t), torch.zeros(n, dtype=torch.bool), ["c"] * n, ["p"] * b,
                      2, 1.0, turns=turns)  # fmt: skip
    parts = [placed for _, placed in groups]
    k = max((len(p[0]) for p in parts if p is not None), default=0)
    placed = None if not k else torch.tensor(
        [row + [NAN] * (k - len(row)) for p, (rows, _) in zip(parts, groups, strict=True)
         for row in (p or [[NAN] * k] * len(rows))], dtype=torch.float64)  # fmt: skip
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25][:n])
    return Batch(rollout, [{}] * b, rewards, {}, turn_rewards=placed)


def test_ranks_with_different_turn_counts_get_the_single_process_advantages():
    """Data parallel: each rank's turn matrix is as wide as its own most turns; gathered, they
    are padded to the job's, and each rank's advantages are the single process's rows."""
    import threading

    from grouprl.config import TrainConfig
    from grouprl.config.resolution import resolve
    from grouprl.train.batch import Batch
    from grouprl.train.parallel.distributed import SINGLE, Dist
    from grouprl.train.step import batch_advantages

    mine = [_batch([([[0, 2, 4], [0]], [[0.5, NAN, 1.0], [0.0, NAN, NAN]])]),
            _batch([([[0], [0, 3]], None)])]  # fmt: skip
    shared, barrier = {}, threading.Barrier(2)

    class TwoRanks(Dist):
        def gather(self, obj):
            shared[self.rank] = obj
            barrier.wait()
            out = [shared[0], shared[1]]
            barrier.wait()
            return out

    cfg = resolve(TrainConfig(algo="grpo", adv_estimator="process", prompts_per_step=2,
                              group_size=2), task_max_new_tokens=6)  # fmt: skip
    got = [None, None]

    def rank(r):
        got[r] = batch_advantages(cfg, mine[r], TwoRanks(rank=r, world_size=2))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    whole = batch_advantages(cfg, Batch.concat(mine), SINGLE)  # (4, 3)
    assert whole.shape == (4, 3) and got[0].shape == got[1].shape == (2, 3)
    assert torch.equal(torch.cat(got), whole)


# --- runs ------------------------------------------------------------------------------------

ENV = '''
import random


class Lookup:
    """A key-value lookup: each call earns 0.5 when it asks for the episode's key (-0.5 when
    not); the answer turn earns 1 when right. Per-turn rewards: one per turn it saw."""

    def reset(self, **kwargs):
        self.key = random.randint(100, 999)
        self.addend = random.randint(10, 99)
        self.value = random.randint(10, 99)
        self.turns = []
        return f"#{self.key}+{self.addend}="

    def lookup(self, key: int) -> int:
        """The value stored under a key.

        Args:
            key: the key to look up.

        Returns:
            The value under the key.
        """
        self.turns.append(0.5 if key == self.key else -0.5)
        if key != self.key:
            raise KeyError(f"no key {key}")
        return self.value

    def step(self, text):
        tail = text.rpartition("|")[2].strip()
        self.turns.append(1.0 if tail.isdigit() and int(tail) == self.value + self.addend else 0.0)
        return None

    def get_reward(self):
        return list(self.turns)
'''
FLAGS = ["--model", "builtin:lookup", "--max-new-tokens", "48", "--steps", "3",
         "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0", "--save-every",
         "1", "--no-progress", "--threads", "1", "--log-ratios", "0", "--seed", "5",
         "--eval-size", "4", "--eval-samples", "2",
         "--log-groups", "2", "--log-groups-every", "1"]  # fmt: skip
DROP = {"step_seconds", "rollout_seconds", "tokens_per_s"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    path = tmp_path_factory.mktemp("turns") / "env.py"
    path.write_text(ENV)
    return ["--environment", f"{path}:Lookup", "--adv-estimator", "process"]


def _logs(run):
    metrics = [{k: v for k, v in json.loads(line).items() if k not in DROP}
               for line in (run / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    return metrics, (run / "samples.jsonl").read_text()


def _weights(run):
    return load_file(str(run / "final" / "model.safetensors"))


def test_a_per_turn_run_gives_each_turn_its_advantage_and_resumes_bit_for_bit(
    env, tmp_path, stop_at
):
    args = [*env, *FLAGS]
    assert main(["train", *args, "--output-dir", str(tmp_path / "whole")]) == 0
    samples = [json.loads(line) for line in (tmp_path / "whole" / "samples.jsonl").open()]
    multi = [s for s in samples if len(s["turn_rewards"]) > 1]
    assert multi, "the model called the tool: some completions have several turns"
    for s in samples:  # the completion's reward is its turns' sum
        given = [r for r in s["turn_rewards"] if r is not None]
        assert math.isclose(s["reward"], sum(given), abs_tol=1e-6)
        assert len(s["turn_advantages"]) == len(s["turn_rewards"])
        assert s["advantage"] == s["turn_advantages"][0]
    # the viewer's groups: per-turn rewards, and token advantages that change at a turn
    records = [
        json.loads(gzip.decompress(path.read_bytes()))
        for path in sorted((tmp_path / "whole" / "groups").glob("step_*.json.gz"))
    ]
    assert len(records) == 3
    completions = [c for r in records for g in r["groups"] for c in g["completions"]]
    assert all("turn_rewards" in c for c in completions)
    changing = [
        c
        for c in completions
        if c.get("token_advantages")
        and len({a for a, m in zip(c["token_advantages"], c["trained_mask"]) if m}) > 1
    ]
    assert changing, "some completion's turns were trained with different advantages"
    stop_at(2, signal.SIGINT)
    assert main(["train", *args, "--output-dir", str(tmp_path / "cut")]) == 130
    stop_at(None)
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0
    assert _logs(tmp_path / "cut") == _logs(tmp_path / "whole")
    got, want = _weights(tmp_path / "cut"), _weights(tmp_path / "whole")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_the_process_estimator_without_per_turn_rewards_is_grpo_bit_for_bit(tmp_path):
    flags = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--eval-every",
             "0", "--no-progress", "--threads", "1", "--log-ratios", "0", "--seed", "3",
             "--max-new-tokens", "8", "--eval-size", "4", "--eval-samples", "2"]  # fmt: skip
    for name in ("grpo", "process"):
        assert main(["train", *flags, "--adv-estimator", name,
                     "--output-dir", str(tmp_path / name)]) == 0  # fmt: skip
    assert _logs(tmp_path / "grpo") == _logs(tmp_path / "process")
    got, want = _weights(tmp_path / "process"), _weights(tmp_path / "grpo")
    assert all(torch.equal(got[k], want[k]) for k in got)
