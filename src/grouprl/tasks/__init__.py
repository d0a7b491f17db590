"""Tasks: prompts with reference answers, and the reward functions that score completions.

`get_task(name, **knobs)` builds a task from the `TASKS` registry (name -> factory). The rooms:

- here: the task interface and reward calls (`base`), datasets (`data`), how rewards and tools
  are named (`specs`), live objects from Python (`live`), the user's own code (`loading`);
- `rewards/`: the reward functions and scoring a batch with them;
- `tools/`: tools, call formats, environments and a run's tool use;
- `ecosystems/`: reasoning-gym's generators (`reasoning_gym:NAME`) and verifiers environments
  (`verifiers:ENV`);
- `builtin/`: the tasks grouprl ships, `arithmetic` (its format and splits), `lookup` (a
  tool-use task) and `code`.

Two modules that users name from their code or in `--rewards module:function` kept their old
names for a release (`MOVED`): `grouprl.tasks.code_rewards` and `grouprl.tasks.math_rewards`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import sys
from collections.abc import Callable

from grouprl.errors import UserError
from grouprl.tasks.base import SPLITS, RewardFn, Task
from grouprl.tasks.builtin.arithmetic import arithmetic_task
from grouprl.tasks.builtin.code import code_task
from grouprl.tasks.builtin.dots import dots_task
from grouprl.tasks.builtin.lookup import lookup_task
from grouprl.tasks.ecosystems.reasoning_gym import PREFIX as RG_PREFIX
from grouprl.tasks.ecosystems.reasoning_gym import reasoning_gym_task
from grouprl.tasks.ecosystems.verifiers import PREFIX as VF_PREFIX
from grouprl.tasks.ecosystems.verifiers import verifiers_task
from grouprl.tasks.rewards.arithmetic import REWARDS

#: Task factories by name; each takes keyword knobs and returns a Task.
TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": arithmetic_task,
    "lookup": lookup_task,
    "code": code_task,
    "dots": dots_task,
}


def get_task(name: str, **knobs) -> Task:
    """Build the task `name` with its knobs; an unknown name or knob raises UserError.
    `reasoning_gym:NAME` is reasoning-gym's generator NAME (`grouprl.tasks.ecosystems.reasoning_gym`;
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


#: Old module names that still import, each as the module it became.
MOVED = {
    "grouprl.tasks.code_rewards": "grouprl.tasks.rewards.code",
    "grouprl.tasks.math_rewards": "grouprl.tasks.rewards.math",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a `MOVED` name as a module holding the same objects as the module it became (a
    function imported either way is the same function; the new module itself is untouched)."""

    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module) -> None:
        moved = importlib.import_module(MOVED[module.__name__])
        module.__dict__.update({k: v for k, v in vars(moved).items() if not k.startswith("__")})
        module.__doc__ = f"Moved to {moved.__name__}; this name imports for a release."


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())

__all__ = ["REWARDS", "SPLITS", "TASKS", "RewardFn", "Task", "get_task"]
