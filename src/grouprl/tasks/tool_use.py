"""A run's tool use: its call format with its tools and limits, and its environment, if any.

`ToolUse.rollout(rows, group_size, *seed_parts)` is what the trainer and `eval` ask before each
rollout: the prompts to sample from (with the environments' reset text), the handler that
answers that rollout's calls (each row's tools bound to its own environment), and the
environments, which reward functions then receive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grouprl.tasks.environments import Environment, group_seed
from grouprl.tasks.tools import ToolHandler


@dataclass(frozen=True)
class RolloutStart:
    """What one rollout samples with: prompts, the call handler, the environments (or None)."""

    prompts: list[Any]
    handler: ToolHandler
    environments: list[Any] | None


@dataclass(frozen=True)
class ToolUse:
    handler: ToolHandler
    environment: Environment | None = None

    @property
    def schemas(self) -> list[dict] | None:
        """The tools' JSON schemas the chat template renders into prompts (chat format)."""
        return getattr(self.handler, "schemas", None)

    def rollout(self, rows: Sequence[dict], group_size: int, *seed_parts: Any) -> RolloutStart:
        """`seed_parts` (the run's seed, the step, ...) and each row give its group's seed."""
        prompts = [row["prompt"] for row in rows]
        if self.environment is None:
            return RolloutStart(prompts, self.handler, None)
        seeds = [group_seed(*seed_parts, row) for row in rows]
        episodes = self.environment.start(rows, group_size, seeds)
        handler = self.handler.for_rollout(
            episodes.row_tools(), episodes.steps(), episodes.instances
        )
        return RolloutStart(episodes.prompts, handler, episodes.instances)
