"""Tasks: prompts with reference answers, and the reward functions that score completions.

`get_task(name, **knobs)` builds a task from the `TASKS` registry (name -> factory). The
built-in tasks are `arithmetic` (see `grouprl.tasks.arithmetic` for its format and splits) and
`lookup`, a tool-use task (`grouprl.tasks.lookup`); `reasoning_gym:NAME` is any of
reasoning-gym's generators (`grouprl.tasks.reasoning_gym`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from grouprl.errors import UserError
from grouprl.tasks.arithmetic import arithmetic_task
from grouprl.tasks.base import SPLITS, RewardFn, Task
from grouprl.tasks.code_task import code_task
from grouprl.tasks.lookup import lookup_task
from grouprl.tasks.reasoning_gym import PREFIX as RG_PREFIX
from grouprl.tasks.reasoning_gym import reasoning_gym_task
from grouprl.tasks.rewards import REWARDS
from grouprl.tasks.verifiers_env import PREFIX as VF_PREFIX
from grouprl.tasks.verifiers_env import verifiers_task

#: Task factories by name; each takes keyword knobs and returns a Task.
TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": arithmetic_task,
    "lookup": lookup_task,
    "code": code_task,
}


def get_task(name: str, **knobs) -> Task:
    """Build the task `name` with its knobs; an unknown name or knob raises UserError.
    `reasoning_gym:NAME` is reasoning-gym's generator NAME (`grouprl.tasks.reasoning_gym`;
    knobs: its `config` and the run's `seed`)."""
    if name.startswith(RG_PREFIX):
        return reasoning_gym_task(name.removeprefix(RG_PREFIX), **knobs)
    if name.startswith(VF_PREFIX):
        return verifiers_task(name.removeprefix(VF_PREFIX), **knobs)
    factory = TASKS.get(name)
    if factory is None:
        raise UserError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}, "
                        "reasoning_gym:NAME, verifiers:ENV")  # fmt: skip
    params = inspect.signature(factory).parameters
    unknown = sorted(set(knobs) - set(params))
    if unknown:
        raise UserError(
            f"task {name!r} has no knob {', '.join(map(repr, unknown))}; "
            f"valid knobs: {', '.join(params)}"
        )
    return factory(**knobs)


__all__ = ["REWARDS", "SPLITS", "TASKS", "RewardFn", "Task", "get_task"]
