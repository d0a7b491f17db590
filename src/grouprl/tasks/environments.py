"""Environments: stateful tasks in TRL's `environment_factory` shape (`--environment
path/env.py:Class`, or `package.module:Class`).

The class is instantiated with no arguments, once per rollout (G per prompt), and used thus:

- `reset(self, **row) -> str | None` starts an episode from the dataset row (every column,
  `prompt` included). Text it returns is appended to the prompt as TRL appends it: to the
  content of the prompt's last message (the user turn the model answers) for chat prompts, to
  the end of the string for string prompts. If `reset` takes a `seed` keyword it gets one, the
  same for the G rollouts of a prompt, drawn from the run's seed, the step and the row (so a
  resumed or a torchrun run gives every group the same seeds).
- Every public method (not starting with `_`; not `reset`, `get_reward` or `step`) is a tool,
  bound to the rollout's instance, in the run's `--tool-format`.
- `get_reward(self) -> float | None`, if defined, scores the finished rollout: a reward named
  after the class (metric `reward_<Class>`), with weight 1 unless `--rewards` weights it.
- `step(self, text) -> str | None`, if defined, plays games whose action is a whole turn: a
  model turn that ends (EOS or a stop string) without a tool call is passed to `step`, and what
  it returns is the next observation (None: the episode is over). Steps count against
  `--max-turns`, as tool calls do.

The group shares its initial state: its G instances are reset from the same row with the same
seed, and their initial prompts must come out identical (the prompt is prefilled once for the
group); if they differ, `reset` used randomness it was not given, and the run stops with one
line saying so. Rollouts then differ only by what the model does and the environment answers.
Reward functions receive the instances as `environments=` (one per completion), as TRL passes
them.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grouprl.errors import UserError
from grouprl.messages import is_conversational
from grouprl.tasks.specs import is_file_spec
from grouprl.tasks.tools import Tool

#: Methods of an environment that are not tools.
NOT_TOOLS = frozenset({"reset", "get_reward", "step"})


@dataclass(frozen=True)
class Environment:
    """An environment class and what it offers."""

    cls: type
    spec: str
    methods: tuple[str, ...]  # its tools
    has_reward: bool
    has_step: bool
    takes_seed: bool

    @property
    def name(self) -> str:
        return self.cls.__name__

    def tools_of(self, instance: Any) -> dict[str, Tool]:
        return {m: Tool(m, getattr(instance, m)) for m in self.methods}

    def reward(self) -> Callable[..., list[float | None]]:
        """A reward function that reads each rollout's `get_reward()` (named after the class)."""

        def reward(completions, environments, **_):
            return [env.get_reward() for env in environments]

        reward.__name__ = self.name
        return reward

    def start(self, rows: Sequence[dict], group_size: int, seeds: Sequence[int]) -> Episodes:
        """One instance per rollout (`group_size` per row), reset from its row (with the row's
        seed when `reset` takes one); the rows' prompts with what `reset` returned."""
        instances, prompts = [], []
        for g, (row, seed) in enumerate(zip(rows, seeds, strict=True)):
            texts = []
            for _ in range(group_size):
                env = self.new()
                kwargs = {**row, "seed": seed} if self.takes_seed else dict(row)
                try:
                    text = env.reset(**kwargs)
                except Exception as err:
                    raise UserError(
                        f"environment {self.name}.reset raised {type(err).__name__}: {err}; fix "
                        f"it (reset(**row) gets every column of the row: {', '.join(row)})"
                    ) from None
                if text is not None and not isinstance(text, str):
                    raise UserError(
                        f"environment {self.name}.reset returned a {type(text).__name__}; "
                        "return the text to add to the prompt, or None"
                    )
                instances.append(env)
                texts.append(text)
            if any(t != texts[0] for t in texts):
                hint = (
                    "use the seed it is given"
                    if self.takes_seed
                    else "take a seed keyword in reset and draw from it"
                )
                raise UserError(
                    f"environment {self.name}: the {group_size} rollouts of prompt {g} were "
                    f"reset to different states ({texts[0]!r} vs "
                    f"{next(t for t in texts if t != texts[0])!r}); a group must share its "
                    f"initial state (its advantages compare the rollouts), so {hint}"
                )
            prompts.append(with_reset_text(row["prompt"], texts[0]))
        return Episodes(self, instances, prompts)

    def new(self) -> Any:
        """A fresh instance (the class takes no arguments)."""
        try:
            return self.cls()
        except Exception as err:
            raise UserError(
                f"environment {self.name}() raised {type(err).__name__}: {err}; the class is "
                "instantiated with no arguments, once per rollout"
            ) from None


@dataclass(frozen=True)
class Episodes:
    """A rollout's environments (one per completion row) and its rows' starting prompts."""

    environment: Environment
    instances: list[Any]
    prompts: list[Any]

    def row_tools(self) -> list[dict[str, Tool]]:
        return [self.environment.tools_of(env) for env in self.instances]

    def steps(self) -> list[Callable[[str], str | None]] | None:
        if not self.environment.has_step:
            return None
        return [env.step for env in self.instances]


def with_reset_text(prompt: Any, text: str | None) -> Any:
    """A prompt with `reset`'s text appended (see the module docstring); a new object."""
    if not text:
        return prompt
    if is_conversational(prompt):
        last = dict(prompt[-1])
        last["content"] = str(last.get("content", "")) + text
        return [*prompt[:-1], last]
    if isinstance(prompt, str):
        return prompt + text
    raise UserError("an environment's reset text can be added to string or chat prompts only")


def group_seed(*parts: Any) -> int:
    """A 31-bit seed from the run's seed, the step and the row: the same on every rank and
    across a resume."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


def load_environment(spec: str) -> Environment:
    """The environment a spec names (path/to/env.py:Class or package.module:Class)."""
    import importlib

    from grouprl.tasks.scoring import import_file

    where, _, attr = spec.rpartition(":")
    if is_file_spec(spec):
        path = Path(where).expanduser()
        if not path.is_file():
            raise UserError(f"environment file {path} does not exist (from --environment {spec})")
        module = import_file(path, "environment")
    elif where and attr:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise UserError(f"cannot import module {where!r} for --environment: {err}") from None
    else:
        raise UserError(
            f"--environment {spec!r}: give a file and class (path/to/env.py:MyEnv) or a "
            "module and class (package.module:MyEnv)"
        )
    cls = getattr(module, attr, None)
    if cls is None:
        found = sorted(k for k, v in vars(module).items() if inspect.isclass(v) and
                       v.__module__ == module.__name__)  # fmt: skip
        raise UserError(
            f"{where} has no class {attr!r}; classes found: {', '.join(found) or 'none'}"
        )
    if not inspect.isclass(cls):
        raise UserError(f"--environment {spec}: {attr} is a {type(cls).__name__}, not a class")
    if not callable(getattr(cls, "reset", None)):
        raise UserError(
            f"environment {cls.__name__} has no reset method; define reset(self, **row) that "
            "starts an episode and returns the text to add to the prompt (or None)"
        )
    methods = tuple(
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in NOT_TOOLS
    )
    has_step = callable(getattr(cls, "step", None))
    if not methods and not has_step:
        raise UserError(
            f"environment {cls.__name__} has neither public methods (its tools) nor a "
            "step(self, text) method; give it at least one"
        )
    try:
        params = inspect.signature(cls.reset).parameters
    except (TypeError, ValueError):
        params = {}
    return Environment(
        cls=cls,
        spec=spec,
        methods=methods,
        has_reward=callable(getattr(cls, "get_reward", None)),
        has_step=has_step,
        takes_seed="seed" in params,
    )
