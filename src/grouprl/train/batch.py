"""A step's training data: sampled groups with their rewards, selectable and joinable by group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from grouprl.rollout import Rollout
from grouprl.rollout.types import Branches
from grouprl.train.turn_rewards import nan_padded


@dataclass
class Batch:
    """One step's training data: whole groups, group-contiguous."""

    rollout: Rollout
    rows: list[dict]  # (B,) task rows of the prompts
    rewards: torch.Tensor  # (N,) weighted reward, NaN = unscored
    by_function: dict[str, torch.Tensor]  # name -> (N,) raw scores, NaN = None
    passed: torch.Tensor | None = None  # (N,) bool: the pass reward's score >= 1
    extra: dict[str, list[Any]] = field(default_factory=dict)  # log_extra columns, (N,) each
    baselines: torch.Tensor | None = None  # (B,) ReMax: the reward of each prompt's greedy one
    branches: Branches | None = None  # rows split trajectories went on in (agent programs)
    turn_rewards: torch.Tensor | None = None  # (N, K) weighted per-turn rewards, NaN: none

    def select_groups(self, groups: list[int]) -> Batch:
        idx = self.rollout.group_rows(groups)  # (b·G,)
        keep = idx.tolist()
        return Batch(
            self.rollout.select_groups(groups),
            [self.rows[g] for g in groups],
            self.rewards[idx],
            {name: r[idx] for name, r in self.by_function.items()},
            None if self.passed is None else self.passed[idx],
            {name: [values[i] for i in keep] for name, values in self.extra.items()},
            None if self.baselines is None else self.baselines[groups],
            None if self.branches is None else self.branches.select(idx),
            None if self.turn_rewards is None else self.turn_rewards[idx],
        )

    def to(self, device: torch.device | str) -> Batch:
        """The batch with its rollout on `device` (rewards and scores stay on the CPU)."""
        branches = None if self.branches is None else self.branches.to(device)
        return Batch(self.rollout.to(device), self.rows, self.rewards, self.by_function,
                     self.passed, self.extra, self.baselines, branches,
                     self.turn_rewards)  # fmt: skip

    @staticmethod
    def concat(parts: list[Batch]) -> Batch:
        if len(parts) == 1:
            return parts[0]
        has_passed = all(p.passed is not None for p in parts)
        return Batch(
            Rollout.concat([p.rollout for p in parts]),
            [row for p in parts for row in p.rows],
            torch.cat([p.rewards for p in parts]),
            {
                name: torch.cat([p.by_function[name] for p in parts])
                for name in parts[0].by_function
            },
            torch.cat([p.passed for p in parts]) if has_passed else None,
            {
                name: [v for p in parts for v in p.extra[name]]
                for name in parts[0].extra
                if all(name in p.extra for p in parts)
            },
            (torch.cat([p.baselines for p in parts])
             if all(p.baselines is not None for p in parts) else None),
            Branches.concat([(p.branches, len(p.rewards)) for p in parts]),
            _turns([(p.turn_rewards, len(p.rewards)) for p in parts]),
        )  # fmt: skip


def _turns(parts: list[tuple[torch.Tensor | None, int]]) -> torch.Tensor | None:
    """The parts' per-turn rewards as one (N, K), NaN-padded (a part without any: all NaN)."""
    if all(t is None for t, _ in parts):
        return None
    given = [torch.zeros(n, 0, dtype=torch.float64) if t is None else t for t, n in parts]
    k = max(t.shape[1] for t in given)
    return torch.cat([nan_padded(t, k) for t in given])
