"""A run's tool use: its call format with its tools and limits, and its environment, if any.

`ToolUse.rollout(rows, group_size, *seed_parts, keys=...)` is what the trainer and `eval` ask
before each rollout: the prompts to sample from (with the environments' reset text), the
handler that answers that rollout's calls (each row's tools bound to its own environment), the
environments, which reward functions then receive, and the rows as rewards see them.

A group's seed comes from `seed_parts` (the run's seed, the step, ...) and the group's key: its
row, or for episodes (an environment that owns the data, or a dataset whose rows are all one
prompt) an `Episode`, its position in the run's stream of episodes. Episode seeds are even for
training and odd for held-out evaluation, so no evaluation episode is ever one trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grouprl.tasks.tools.calls import ToolHandler
from grouprl.tasks.tools.environments import Environment, group_seed


@dataclass(frozen=True)
class Episode:
    """A fresh episode's key: its index in the run's stream of training episodes, or in the
    held-out evaluation's."""

    index: int
    held_out: bool = False

    def seed(self, *seed_parts: Any) -> int:
        """Training episodes' seeds are even, held-out ones' odd: the two never meet."""
        return (group_seed(*seed_parts, "episode", self.index) & ~1) | int(self.held_out)


@dataclass(frozen=True)
class RolloutStart:
    """What one rollout samples with: prompts, the call handler, the environments (or None),
    and the rows as reward functions see them."""

    prompts: list[Any]
    handler: ToolHandler
    environments: list[Any] | None
    rows: list[dict]


@dataclass(frozen=True)
class ToolUse:
    handler: ToolHandler
    environment: Environment | None = None
    chat: bool = False  # the model has a chat template: a reset's prompt is a user message
    description: str | None = None  # the tags format's description of the tools (tool_prompt)

    @property
    def schemas(self) -> list[dict] | None:
        """The tools' JSON schemas the chat template renders into prompts (chat format)."""
        return getattr(self.handler, "schemas", None)

    def rollout(
        self,
        rows: Sequence[dict],
        group_size: int,
        *seed_parts: Any,
        keys: Sequence[Any] | None = None,
    ) -> RolloutStart:
        """`seed_parts` (the run's seed, the step, ...) and each row's key (default: the row)
        give its group's seed."""
        rows = list(rows)
        if self.environment is None:
            return RolloutStart([row["prompt"] for row in rows], self.handler, None, rows)
        seeds = [
            key.seed(*seed_parts) if isinstance(key, Episode) else group_seed(*seed_parts, key)
            for key in (keys if keys is not None else rows)
        ]
        episodes = self.environment.start(rows, group_size, seeds, chat=self.chat)
        handler = self.handler.for_rollout(
            episodes.row_tools(), episodes.steps(), episodes.instances
        )
        return RolloutStart(episodes.prompts, handler, episodes.instances, episodes.rows)

    def sampled(self, rollout: Any, handler: Any, resample: Any = None) -> Any:
        """After a rollout is sampled with `handler` (its `RolloutStart.handler`), before it
        is scored: nothing here (an environment that drives its own rollouts finishes them; an
        agent program's split trajectories are sampled by `resample` and returned as
        `Branches`). Returns None: no branches."""
        return None

    def scored(self, environments: Sequence[Any] | None) -> None:
        """A rollout's environments once its rewards are computed: back to the environment's
        kept instances, for the next rollouts (`Environment.release`)."""
        if self.environment is not None and environments:
            self.environment.release(environments)
