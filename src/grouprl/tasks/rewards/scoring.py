"""Reward functions by name, and scoring a batch of completions with them.

`--rewards NAME WEIGHT ...` names each reward in one of these ways, tried in this order:

- a reward of the task (`correct`, `format` for the arithmetic task);
- a built-in reward: `correct`, `format`, `accuracy`, `think_format`, `code`, `code_all`;
- a file and a function in it, `path/to/rewards.py:my_reward`;
- an importable module and a function in it, `my_package.rewards:my_reward`;
- a local directory holding an `AutoModelForSequenceClassification` (a reward model): it scores
  prompt + completion, with the chat template for conversational data, as TRL does.

A function's metric name is its own `__name__` (a reward model's: its directory name), so
metrics read `reward_my_reward`. One reward decides what counts as correct (`pass_reward`): a
completion passes when that reward's raw score is at least 1. The accuracy metric, pass@1 and
pass@k in `train` and `eval` all use that one definition.

Loading a file or module runs its code, by design: the user names it.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grouprl.errors import UserError
from grouprl.messages import is_conversational
from grouprl.tasks.base import (
    REWARD_TIMEOUT,
    RewardFn,
    Task,
    TrainerState,
    call_rewards,
    completion_objects,
    reward_kwargs,
    summed,
)
from grouprl.tasks.live import is_live, live_name, live_object
from grouprl.tasks.loading import import_file, import_function, load_attribute
from grouprl.tasks.rewards.arithmetic import REWARDS
from grouprl.tasks.rewards.code import CODE_REWARDS
from grouprl.tasks.rewards.math import MATH_REWARDS
from grouprl.tasks.specs import is_file_spec

#: Rewards any task can name.
BUILTIN_REWARDS: dict[str, RewardFn] = {**REWARDS, **MATH_REWARDS, **CODE_REWARDS}


@dataclass(frozen=True)
class Reward:
    """One reward function: its metric name, the spec it was named by, and its weight."""

    name: str
    spec: str
    fn: RewardFn
    weight: float


def load_reward(
    spec: str, task: Task | None = None, *, device: Any = "cpu"
) -> tuple[str, RewardFn]:
    """(metric name, function) for a reward spec; UserError naming the spec when it is none."""
    if is_live(spec):
        return live_name(spec), live_object(spec, "reward")
    if task is not None and spec in task.reward_funcs:
        return spec, task.reward_funcs[spec]
    if spec in BUILTIN_REWARDS:
        return spec, BUILTIN_REWARDS[spec]
    if is_file_spec(spec):
        path_text, _, attr = spec.rpartition(":")
        path = Path(path_text).expanduser()
        if not path.is_file():
            raise UserError(f"reward file {path} does not exist (from --rewards {spec})")
        fn = load_attribute(import_file(path), attr, str(path))
        return getattr(fn, "__name__", attr), fn
    path = Path(spec).expanduser()
    from grouprl.tasks.rewards.judge import is_judge_spec, load_judge, reward_model_settings
    from grouprl.tasks.rewards.remote import RemoteReward, is_remote_spec

    if is_remote_spec(spec):  # a reward model behind a server
        remote = RemoteReward(spec)
        remote.check()
        return remote.__name__, remote
    if spec.endswith((".yaml", ".yml")) and not path.is_file():
        raise UserError(f"reward file {path} does not exist (from --rewards {spec}; a judge's or "
                        "a reward model's YAML)")  # fmt: skip
    settings = reward_model_settings(spec) if is_judge_spec(spec) else None
    if settings is not None:  # a reward model on a device of its own
        from grouprl.tasks.rewards.model import RewardModel

        model = RewardModel(settings["model"], device=settings.get("device", device),
                            batch_size=int(settings.get("batch_size", 16)))  # fmt: skip
        return Path(spec).stem, model
    if is_judge_spec(spec):  # an LLM judge's YAML
        judge = load_judge(spec)
        judge.check()
        return judge.__name__, judge
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(
                f"reward {spec!r} is a directory without config.json, not a reward model"
            )
        from grouprl.tasks.rewards.model import RewardModel

        model = RewardModel(path, device=device)
        return model.__name__, model
    module_name, sep, attr = spec.rpartition(":")
    if sep and module_name and attr:
        fn = import_function(module_name, attr, spec)
        return getattr(fn, "__name__", attr), fn
    known = sorted({*(task.reward_funcs if task else {}), *BUILTIN_REWARDS})
    close = difflib.get_close_matches(spec, known, n=1)
    hint = f"did you mean {close[0]!r}? Or name" if close else "name"
    raise UserError(
        f"unknown reward {spec!r}; {hint} a built-in reward ({', '.join(known)}), a file and "
        "function (path/to/rewards.py:my_reward), a module and function (package.module:fn), "
        "a reward model directory, a judge's or reward model's YAML, or a reward server's URL"
    )


#: Keyword arguments every reward call gets besides the dataset's columns (TRL 1.16's).
CALL_ARGUMENTS = frozenset(
    {
        "completions",
        "prompts",
        "completion_ids",
        "trainer_state",
        "log_metric",
        "log_extra",
        "environments",
        "group_size",
        "num_turns",
    }
)
#: Columns the built-in rewards read from their keyword arguments.
_BUILTIN_COLUMNS = {"correct": ("answer",), "accuracy": ("answer",)}


def required_columns(fn: RewardFn) -> list[str]:
    """Dataset columns a reward function cannot run without: its parameters without a default
    that the call does not supply itself (plus what a built-in reward reads)."""
    name = getattr(fn, "__name__", "")
    if BUILTIN_REWARDS.get(name) is fn:
        return list(_BUILTIN_COLUMNS.get(name, ()))
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and some callables have no signature
        return []
    return [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.name not in CALL_ARGUMENTS
    ]


@dataclass
class Scores:
    """A batch's scores: the weighted total, each function's raw scores, and pass/fail."""

    total: torch.Tensor  # (N,) float32, NaN where no weighted function scored the completion
    by_function: dict[str, torch.Tensor]  # name -> (N,) raw scores, NaN = None
    passed: torch.Tensor  # (N,) bool, the pass reward's raw score >= 1
    logged: dict[str, float] = field(default_factory=dict)  # log_metric(name, value) calls
    extra: dict[str, list[Any]] = field(default_factory=dict)  # log_extra(column, values)
    turns: torch.Tensor | None = None  # (N, K) weighted per-turn rewards, NaN: none; or None


class RewardSet:
    """The run's reward functions with their weights, and the one that decides correctness."""

    def __init__(self, rewards: Sequence[Reward], pass_reward: str) -> None:
        self.rewards = list(rewards)
        names = [r.name for r in self.rewards]
        if pass_reward not in names:
            raise UserError(f"pass reward {pass_reward!r} is not one of the rewards {names}")
        self.pass_reward = pass_reward

    @property
    def weights(self) -> dict[str, float]:
        return {r.name: r.weight for r in self.rewards}

    def keep_in(self, directory: Path) -> None:
        """Rewards that keep something across a run (a judge's cache) keep it in `directory`."""
        for r in self.rewards:
            if hasattr(r.fn, "bind"):
                r.fn.bind(directory)

    def check_columns(self, row: dict, where: str) -> None:
        """UserError when a reward function needs a column `row` lacks (checked before a run
        starts, not at its first step): a required parameter of the function's signature, or
        the `answer` the built-in rewards read."""
        for r in self.rewards:
            missing = [c for c in required_columns(r.fn) if c not in row]
            if missing:
                hint = (
                    "; name the column that holds the reference answer with --answer-column"
                    if "answer" in missing
                    else ""
                )
                raise UserError(
                    f"reward {r.name!r} needs a column {missing[0]!r}, which the rows of {where} "
                    f"lack (they have: {', '.join(row)}){hint}"
                )

    def check_rows(self, rows: Sequence[dict], where: str) -> None:
        """A reward that reads the whole dataset before a run (`fn.check_rows(rows, where)`,
        e.g. the code rewards: is there a row with tests, can the sandbox run here) says
        what is wrong in one UserError line."""
        for r in self.rewards:
            check = getattr(r.fn, "check_rows", None)
            if callable(check):
                check(rows, where)

    def score(
        self,
        texts: Sequence[str],
        rows: Sequence[dict],
        repeats: int,
        *,
        completion_ids: Sequence[Sequence[int]],
        state: TrainerState,
        timeout: float | None = REWARD_TIMEOUT,
        only_pass: bool = False,
        transcripts: Sequence[list[dict]] | None = None,
        environments: Sequence[Any] | None = None,
        num_turns: Sequence[int] | None = None,
    ) -> Scores:
        """Score `texts` (`repeats` consecutive completions per row) with every function (or
        only the pass reward), through TRL's calling convention. With tools, `transcripts` are
        what the functions receive as completions: each completion's role-tagged assistant and
        tool turns, whatever the prompt's format; with an environment, `environments` (one
        instance per completion) reach them as TRL passes them.

        With `num_turns` (a multi-turn rollout: each completion's model turns, which the
        functions receive as `num_turns`), a function may give a completion a list, one reward
        per turn (turn k's at k, None for none, at most one per turn): its score is their sum,
        and `Scores.turns` holds the weighted sum of every function's per-turn rewards."""
        logged: dict[str, list[float]] = {}
        extra: dict[str, list[Any]] = {}

        def log_metric(name: str, value: float) -> None:
            logged.setdefault(str(name), []).append(float(value))

        def log_extra(column: str, values: list) -> None:
            extra.setdefault(str(column), []).extend(values)

        conversational = is_conversational(rows[0]["prompt"])
        completions = (
            [list(t) for t in transcripts]
            if transcripts is not None
            else completion_objects(texts, conversational)
        )
        kwargs = reward_kwargs(
            completions,
            rows,
            repeats,
            completion_ids=[list(ids) for ids in completion_ids],
            trainer_state=state,
            log_metric=log_metric,
            log_extra=log_extra,
            **({} if environments is None else {"environments": list(environments)}),
            **({} if num_turns is None else {"num_turns": list(num_turns)}),
        )
        chosen = [r for r in self.rewards if not only_pass or r.name == self.pass_reward]
        raw = call_rewards({r.name: r.fn for r in chosen}, kwargs, timeout=timeout,
                           turns=num_turns)  # fmt: skip
        n = len(texts)
        turns = _placed(raw, self.weights, n, max(num_turns or [1]))
        by_function = {name: torch.tensor([summed(x) for x in v], dtype=torch.float32)
                       for name, v in raw.items()}  # fmt: skip
        total = torch.zeros(n)
        scored = torch.zeros(n, dtype=torch.bool)
        for r in chosen:
            if r.weight != 0:  # a logged-only reward never decides whether a row is scored
                values = by_function[r.name]
                total += r.weight * values.nan_to_num(0.0)
                scored |= ~values.isnan()
        passed = by_function[self.pass_reward].nan_to_num(0.0) >= 1.0
        return Scores(
            total=torch.where(scored, total, math.nan),
            by_function=by_function,
            passed=passed,
            logged={k: sum(v) / len(v) for k, v in logged.items()},
            extra={k: v for k, v in extra.items() if len(v) == n},
            turns=turns,
        )


def _placed(
    raw: dict[str, list[float | list[float]]], weights: dict[str, float], n: int, k: int
) -> torch.Tensor | None:
    """(n, k) Σ weight × per-turn reward over the weighted functions that gave turns (NaN on a
    turn none rewarded), or None when none did."""
    lists = [(weights[name], i, value) for name, values in raw.items() if weights[name] != 0
             for i, value in enumerate(values) if isinstance(value, list)]  # fmt: skip
    if not lists:
        return None
    out = torch.full((n, k), math.nan, dtype=torch.float64)
    for w, i, value in lists:
        for t, v in enumerate(value):
            if not math.isnan(v):
                out[i, t] = out[i, t].nan_to_num(0.0) + w * v
    return out


def build_reward_set(
    weights: dict[str, float],
    task: Task | None,
    *,
    pass_reward: str | None = None,
    device: Any = "cpu",
    loader: Callable[..., tuple[str, RewardFn]] = load_reward,
) -> RewardSet:
    """Load every reward of `weights` (spec -> weight) and pick the pass reward.

    pass_reward: a metric name or spec among them, or another spec (then loaded with weight 0:
    logged, deciding correctness, not part of the total). None: `accuracy` when listed, else
    `correct`, else the first reward.
    """
    rewards: list[Reward] = []
    for spec, weight in weights.items():
        name, fn = loader(spec, task, device=device)
        if any(r.name == name for r in rewards):
            raise UserError(
                f"two rewards are named {name!r} ({spec} and "
                f"{next(r.spec for r in rewards if r.name == name)}); rename one function"
            )
        rewards.append(Reward(name, spec, fn, float(weight)))
    if pass_reward is None:
        names = [r.name for r in rewards]
        chosen = next((n for n in ("accuracy", "correct") if n in names), names[0])
    else:
        match = [r.name for r in rewards if pass_reward in (r.name, r.spec)]
        if match:
            chosen = match[0]
        else:
            name, fn = loader(pass_reward, task, device=device)
            if any(r.name == name for r in rewards):
                raise UserError(f"pass reward {pass_reward!r} clashes with reward {name!r}")
            rewards.append(Reward(name, pass_reward, fn, 0.0))
            chosen = name
    return RewardSet(rewards, chosen)
