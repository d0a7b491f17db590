"""Rewards per turn, from the scores to the tokens.

A reward function may give a multi-turn completion one reward per model turn (a list: turn k's
reward at k; `grouprl.tasks.rewards.scoring`). An episode's turns are counted over its rows: its
first row's, then those of the rows its split trajectory went on in (`Branches`, in order), so
turn k of a row is turn `offset + k` of its episode. A row's model turns are the spans its
observations separate (`TurnRecord.starts`); a turn cut by the budget or ended by a call past
--max-turns is a turn, even one left with no token.

The completion's reward is its turns' sum: whatever the per-turn functions did not place (the
outcome rewards, DAPO's overlong penalty, a KL in the reward, --reward-clip's cut) lands on its
last turn (`turn_reward_matrix`). An estimator that takes `turn_rewards` (`--adv-estimator
process`) gives each turn its advantage, which each of the turn's tokens trains with
(`spread_over_tokens`); every other estimator sees the completion's reward only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grouprl.rollout import Rollout
from grouprl.rollout.types import Branches


def row_starts(rollout: Rollout) -> list[list[int]]:
    """Where each row's model turns start in its completion ([0] for a single-turn row)."""
    if rollout.turns is None or rollout.turns.starts is None:
        return [[0] for _ in range(rollout.completion_ids.shape[0])]
    return [list(s) for s in rollout.turns.starts]


def episode_turns(rollout: Rollout, branches: Branches | None) -> list[int]:
    """(N,) each row's episode's model turns: its own and its branches' (or, where those are
    not kept, `TurnRecord.later`)."""
    counts = [len(s) for s in row_starts(rollout)]
    if rollout.turns is not None and rollout.turns.later is not None:
        counts = [n + m for n, m in zip(counts, rollout.turns.later, strict=True)]
    if branches is not None:
        more = row_starts(branches.rollout)
        for k, parent in enumerate(branches.parents.tolist()):
            counts[parent] += len(more[k])
    return counts


def turn_reward_matrix(
    placed: torch.Tensor | None,  # (N, K) what the per-turn functions placed, NaN: nothing
    rewards: torch.Tensor,  # (N,) the completions' rewards, as the advantages see them
    turns: Sequence[int],  # (N,) each completion's turns (its episode's)
) -> torch.Tensor:
    """(N, K) turn rewards summing to `rewards` (in their dtype; summed in float64): the placed
    ones, with what they leave of each reward on the completion's last turn; NaN past a
    completion's turns, on a turn no function rewarded, and on every turn of an unscored
    completion. Without per-turn rewards, each reward on its completion's last turn (K = 1, the
    rewards themselves, for single-turn completions)."""
    if placed is None and max(turns, default=1) == 1:
        return rewards.detach().cpu()[:, None].clone()
    if placed is None:  # outcome rewards only: every rank of a multi-turn job is as wide
        placed = torch.full((len(turns), max(turns)), torch.nan, dtype=torch.float64)
    total = rewards.detach().double().cpu()
    # as wide as the longest episode (a round without per-turn rewards may have been joined)
    out = nan_padded(placed.detach().double().cpu(), max(turns, default=1))
    rest = total - out.nan_to_num(0.0).sum(-1)
    for i, n in enumerate(turns):
        if total[i].isnan():
            out[i] = torch.nan
            continue
        last = out[i, n - 1]
        if rest[i] != 0 or last.isnan():  # x + 0.0 is x: a placed reward keeps its bits
            out[i, n - 1] = last.nan_to_num(0.0) + rest[i]
    return out.to(rewards.dtype)


def nan_padded(turns: torch.Tensor, k: int) -> torch.Tensor:
    """(n, K) per-turn values with NaN (no reward) in the columns up to `k` they lack."""
    return torch.nn.functional.pad(turns, (0, max(k - turns.shape[1], 0)), value=torch.nan)


def logged_turns(batch) -> tuple[list[int], torch.Tensor | None]:
    """What the logs show of a batch's turns: each row's episode's turns, and its turn rewards
    as the estimators see them before shaping (None without per-turn rewards)."""
    turns = episode_turns(batch.rollout, batch.branches)
    if batch.turn_rewards is None:
        return turns, None
    return turns, turn_reward_matrix(batch.turn_rewards, batch.rewards, turns)


def spread_over_tokens(
    advantages: torch.Tensor,  # (E, K) each episode's turn advantages
    starts: Sequence[Sequence[int]],  # the trained rows' turn starts: E first rows, branches
    parents: torch.Tensor | None,  # (R − E,) each branch row's episode, or None
    width: int,
) -> torch.Tensor:
    """(R, width): each token of a row gets its turn's advantage (an observation's tokens, not
    trained, its preceding turn's). A branch row's turns follow those of its episode's earlier
    rows."""
    E = advantages.shape[0]
    episodes = list(range(E)) + ([] if parents is None else parents.tolist())
    taken = [0] * E  # the turns each episode's rows so far hold
    index = torch.zeros(len(episodes), width, dtype=torch.long)
    for r, (episode, row) in enumerate(zip(episodes, starts, strict=True)):
        turn = torch.zeros(width, dtype=torch.long)
        for start in row[1:]:
            turn[start:] += 1
        index[r] = taken[episode] + turn
        taken[episode] += len(row)
    index = index.clamp(max=advantages.shape[1] - 1).to(advantages.device)
    return advantages[torch.tensor(episodes, device=advantages.device)].gather(1, index)
