"""Environments: stateful tasks in TRL's `environment_factory` shape (`--environment
path/env.py:Class`, or `package.module:Class`).

The class is instantiated with no arguments, one instance per rollout running at once (G per
prompt), and used thus:

- `reset(self, **row) -> str | None` starts an episode from the dataset row (every column,
  `prompt` included). Text it returns is appended to the prompt as TRL appends it: to the
  content of the prompt's last message (the user turn the model answers) for chat prompts, to
  the end of the string for string prompts. If `reset` takes a `seed` keyword it gets one, the
  same for the G rollouts of a prompt, drawn from the run's seed, the step and the row (so a
  resumed or a torchrun run gives every group the same seeds).
- Every public method (not starting with `_`; not `reset`, `get_reward` or `step`) is a tool,
  bound to the rollout's instance, in the run's `--tool-format`.
- `get_reward(self) -> float | None`, if defined, scores the finished rollout: a reward named
  after the class (metric `reward_<Class>`), with weight 1 unless `--rewards` weights it. A
  list is a reward per turn (`grouprl.train.turn_rewards`).
- `step(self, text) -> str | None`, if defined, plays games whose action is a whole turn: a
  model turn that ends (EOS or a stop string) without a tool call is passed to `step`, and what
  it returns is the next observation (None: the episode is over). Steps count against
  `--max-turns`, as tool calls do.
- `close(self)`, if defined, is called once, when the run is done with the instance.

Instances are kept and reused, as TRL keeps them: a rollout takes one from the pool (a new one
when every kept instance is in use), `reset` starts its episode, and it goes back once the
rollout is scored. So an environment that holds a session (an OpenEnv client's WebSocket) holds
one per rollout running at once, never one per rollout ever run. Before training,
`Environment.preflight` opens as many as a step and an evaluation run at once, so a server that
cannot serve that many says so (one line naming the OpenEnv settings) before the first step.

Without a dataset (and no task) the environment owns the data: each group's `reset` gets no
row (only `seed=`, when it takes one) and returns the prompt itself, as TRL calls it.

The group shares its initial state: its G instances are reset from the same row with the same
seed, while Python's global `random` and NumPy's global generator start from that seed too
(`grouprl.tasks.randomness`: environments written the way TRL's examples are need nothing
more); their initial prompts must come out identical (the prompt is prefilled once for the
group); if they differ, `reset` used randomness grouprl cannot reach, and the run stops with
one line saying so. After the reset each rollout draws from its own stream, swapped in around
every call into its environment, so rollouts differ by what the model does and what the
environment answers, and a run is still a function of its seed.
Reward functions receive the instances as `environments=` (one per completion), as TRL passes
them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grouprl.errors import UserError
from grouprl.messages import is_conversational
from grouprl.tasks.live import is_live, live_object
from grouprl.tasks.randomness import (
    STREAM_ATTRIBUTE,
    RandomStream,
    bind_stream,
    seeded,
    stream_of,
)
from grouprl.tasks.specs import is_file_spec
from grouprl.tasks.tools.calls import Tool

#: Methods of an environment that are not tools.
NOT_TOOLS = frozenset({"reset", "get_reward", "step", "close"})


@dataclass(frozen=True)
class Environment:
    """An environment class and what it offers."""

    cls: type
    spec: str
    methods: tuple[str, ...]  # its tools
    has_reward: bool
    has_step: bool
    takes_seed: bool
    #: instances not in use, kept for the next rollouts (`take`, `release`)
    free: list[Any] = dataclasses.field(default_factory=list, compare=False, repr=False)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, compare=False,
                                             repr=False)  # fmt: skip
    #: how many instances the run holds at once ("at_once", set by `preflight`)
    sizes: dict[str, int] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.cls.__name__

    def tools_of(self, instance: Any) -> dict[str, Tool]:
        return {m: Tool(m, getattr(instance, m)) for m in self.methods}

    def reward(self) -> Callable[..., list[float | None]]:
        """A reward function that reads each rollout's `get_reward()` (named after the class),
        with that rollout's random stream swapped in."""

        def reward(completions, environments, **_):
            out = []
            for env in environments:
                with stream_of(env):
                    out.append(env.get_reward())
            return out

        reward.__name__ = self.name
        return reward

    def start(
        self, rows: Sequence[dict], group_size: int, seeds: Sequence[int], *, chat: bool = False
    ) -> Episodes:
        """One instance per rollout (`group_size` per row), reset from its row (with the row's
        seed when `reset` takes one) while Python's and NumPy's global generators start from
        that seed (`grouprl.tasks.randomness`); then each instance gets its rollout's own
        random stream. The rows' prompts with what `reset` returned; a row without a prompt
        (an environment that owns its data) gets reset's text as the prompt, a user message
        for a `chat` model."""
        instances, prompts, rows_out = [], [], []
        for g, (row, seed) in enumerate(zip(rows, seeds, strict=True)):
            texts = []
            for k in range(group_size):
                env = self.take()
                with seeded(seed):
                    text = self._reset(env, row, seed)
                bind_stream(env, RandomStream(group_seed(seed, k)))
                instances.append(env)
                texts.append(text)
            if any(t != texts[0] for t in texts):
                raise UserError(self._differing(group_size, g, texts))
            if "prompt" in row:  # the row is scored as it is; the model sees reset's text too
                prompts.append(with_reset_text(row["prompt"], texts[0]))
                rows_out.append(row)
            else:  # the environment owns the data: reset's text is the prompt
                prompts.append([{"role": "user", "content": texts[0]}] if chat else texts[0])
                rows_out.append({**row, "prompt": prompts[-1]})
        return Episodes(self, instances, prompts, rows_out)

    def _reset(self, env: Any, row: dict, seed: int) -> str | None:
        """`reset` as the row asks: every column (and the seed) from a dataset row, only the
        seed (when it takes one) for an environment that owns its data, as TRL calls it."""
        owns_data = "prompt" not in row
        kwargs = {} if owns_data else dict(row)
        if self.takes_seed:
            kwargs["seed"] = seed
        try:
            text = env.reset(**kwargs)
        except Exception as err:
            if refused(err):
                raise UserError(self._capacity(err)) from None
            given = "no row (the environment owns the data)" if owns_data else (
                f"every column of the row: {', '.join(row)}")  # fmt: skip
            raise UserError(
                f"environment {self.name}.reset raised {type(err).__name__}: {err}; fix it "
                f"(reset gets {given})"
            ) from None
        if text is not None and not isinstance(text, str):
            raise UserError(
                f"environment {self.name}.reset returned a {type(text).__name__}; return the "
                "text to add to the prompt, or None"
            )
        if owns_data and not text:
            raise UserError(
                f"environment {self.name}.reset returned {text!r} with no dataset: without one "
                "the prompt is what reset returns; return the prompt text, or give --dataset"
            )
        return text

    def _differing(self, group_size: int, g: int, texts: list[str | None]) -> str:
        other = next(t for t in texts if t != texts[0])
        hint = (
            "draw from the seed reset is given"
            if self.takes_seed
            else "take a seed keyword in reset and draw from it"
        )
        return (
            f"environment {self.name}: the {group_size} rollouts of prompt {g} were reset to "
            f"different states ({texts[0]!r} vs {other!r}), although grouprl seeds Python's "
            "global random (and NumPy's) from the group's seed before every reset, so they "
            "come from randomness it cannot reach (a random.Random() of the environment's own, "
            f"the clock); a group must share its initial state, so {hint}"
        )

    def new(self) -> Any:
        """A fresh instance (the class takes no arguments)."""
        try:
            return self.cls()
        except Exception as err:
            if refused(err):
                raise UserError(self._capacity(err)) from None
            raise UserError(
                f"environment {self.name}() raised {type(err).__name__}: {err}; the class is "
                "instantiated with no arguments, once per rollout running at once"
            ) from None

    def take(self) -> Any:
        """A kept instance not in use, or a new one."""
        with self.lock:
            if self.free:
                return self.free.pop()
        return self.new()

    def release(self, instances: Sequence[Any]) -> None:
        """Instances whose rollouts are scored: kept for the next rollouts."""
        with self.lock:
            self.free.extend(instances)

    def close_all(self) -> None:
        """Close every kept instance (`close`, where the class defines it) and forget them."""
        with self.lock:
            kept, self.free[:] = list(self.free), []
        for env in kept:
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    with stream_of(env):
                        close()
                except Exception as err:  # the run is over: say so, lose nothing
                    print(f"warning: environment {self.name}.close raised "
                          f"{type(err).__name__}: {err}")  # fmt: skip

    def preflight(self, rows: Sequence[dict], at_once: int, *, chat: bool = False) -> None:
        """Start `at_once` instances from the first row and keep them (the first rollouts use
        them): a server that refuses that many sessions says so now, before training."""
        self.sizes["at_once"] = at_once
        self.release(self.start(rows[:1], at_once, [0], chat=chat).instances)

    def _capacity(self, err: Exception) -> str:
        n = self.sizes.get("at_once")
        need = f"{n} at once here" if n else "one per rollout running at once"
        return (
            f"environment {self.name}: its server refused a session ({type(err).__name__}: "
            f"{err}); grouprl keeps one session per rollout, {need} (a step's prompts x group "
            "size, or an evaluation batch's); serve the environment with "
            "SUPPORTS_CONCURRENT_SESSIONS = True on its class and create_app(..., "
            f"max_concurrent_envs={n or 'N'}) or more"
        )


def refused(err: Exception) -> bool:
    """Whether `err` is a session server turning a session away for lack of room: OpenEnv's
    SessionCapacityError, or its client's report of one (code CAPACITY_REACHED)."""
    return type(err).__name__ == "SessionCapacityError" or "CAPACITY_REACHED" in str(err)


@dataclass(frozen=True)
class Episodes:
    """A rollout's environments (one per completion row) and its rows' starting prompts."""

    environment: Environment
    instances: list[Any]
    prompts: list[Any]
    rows: list[dict]  # the rows as rewards see them (reset's text as the prompt of a row with none)

    def row_tools(self) -> list[dict[str, Tool]]:
        """Each rollout's tools: its instance's methods, run with its random stream."""
        return [
            {name: dataclasses.replace(tool, stream=getattr(env, STREAM_ATTRIBUTE, None))
             for name, tool in self.environment.tools_of(env).items()}
            for env in self.instances
        ]  # fmt: skip

    def steps(self) -> list[Callable[[str], str | None]] | None:
        if not self.environment.has_step:
            return None
        return [_streamed(env, env.step) for env in self.instances]


def _streamed(env: Any, method: Callable[[str], Any]) -> Callable[[str], Any]:
    def call(text: str) -> Any:
        with stream_of(env):
            return method(text)

    return call


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

    from grouprl.tasks.loading import import_file

    where, _, attr = spec.rpartition(":")
    if is_live(spec):
        return environment_of(live_object(spec, "environment"), spec)
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
    return environment_of(cls, spec)


def environment_of(cls: Any, spec: str) -> Environment:
    """The environment a class makes (checked: a class, with a reset, and tools or a step)."""
    if not inspect.isclass(cls):
        raise UserError(f"environment {spec}: a {type(cls).__name__}, not a class")
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
