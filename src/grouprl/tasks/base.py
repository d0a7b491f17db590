"""The task interface the trainer, `grouprl sft` and `grouprl eval` use for every task."""

from __future__ import annotations

import math
import random
import signal
import threading
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from grouprl.errors import UserError

#: A reward function: ``fn(completions=list[str], prompts=list[str], **columns)`` where each
#: column (e.g. ``answer=[...]``) holds one value per completion. It returns one score per
#: completion, or None where it does not apply. Same contract as TRL's reward functions, so a
#: function written for TRL's GRPOTrainer drops in.
RewardFn = Callable[..., list[float | None]]


@dataclass(frozen=True)
class Task:
    """Prompts with reference answers, and the functions that score completions."""

    name: str
    train: Sequence[dict]
    """Training rows: {"prompt": str, "answer": str, ...extra columns passed to the rewards}."""
    heldout: Sequence[dict]
    """Evaluation rows, disjoint from `train`."""
    reward_funcs: dict[str, RewardFn]
    """Reward functions by name, e.g. {"correct": ..., "format": ...}."""
    reward_weights: dict[str, float]
    """Default weight of each reward in the total (a weight of 0 logs the reward only)."""
    stop: list[str] | None
    """Stop strings for sampling; None when the EOS token ends completions."""
    max_new_tokens: int
    """A generation budget that fits every clean completion of the task, with some slack."""
    noisy_solution: Callable[[dict, random.Random, float], str] | None = field(default=None)
    """For `grouprl sft --noise p`: a worked solution of a row with errors injected at rate p.
    None: the task has no noisy traces (supervised training then uses row["solution"])."""

    def split(self, name: str) -> Sequence[dict]:
        """The rows of split `name` ("train" or "heldout")."""
        if name not in SPLITS:
            raise UserError(f"unknown split {name!r}; valid: {', '.join(SPLITS)}")
        return self.train if name == "train" else self.heldout


SPLITS = ("train", "heldout")


#: Seconds a reward function may take for one batch before the run stops with an error.
REWARD_TIMEOUT = 60.0


class _RewardTimeout(BaseException):
    """Raised inside a reward function that overran its time; a BaseException so that the
    function's own ``except Exception`` cannot swallow it."""


@contextmanager
def _deadline(seconds: float | None):
    """Raise _RewardTimeout after `seconds` of wall time (main thread on Unix; elsewhere no-op)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not seconds or not usable:
        yield
        return

    def overran(signum, frame):
        raise _RewardTimeout

    previous = signal.signal(signal.SIGALRM, overran)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def call_reward(
    name: str,
    fn: RewardFn,
    completions: list[str],
    rows: Sequence[dict],
    repeats: int,
    *,
    timeout: float | None = REWARD_TIMEOUT,
) -> list[float]:
    """Score `completions` (`repeats` consecutive ones per row) with one reward function.

    The function gets ``completions``, ``prompts`` and every other column of the rows, one value
    per completion (TRL's calling convention). Returns one float per completion, NaN where the
    function returned None. A function that raises, hangs past `timeout` seconds, or returns the
    wrong number of values is the user's to fix: UserError, naming the function.
    """
    columns = {key: [row[key] for row in rows for _ in range(repeats)] for key in rows[0]}
    prompts = columns.pop("prompt")
    try:
        with _deadline(timeout):
            values = fn(completions=completions, prompts=prompts, **columns)
    except _RewardTimeout:
        raise UserError(
            f"reward function '{name}' did not return within {timeout:g} s for "
            f"{len(completions)} completions; make it faster or raise --reward-timeout"
        ) from None
    except Exception as err:  # a user's reward function: report it, don't crash opaquely
        raise UserError(
            f"reward function '{name}' raised {type(err).__name__}: {err}; fix the function "
            "(it must return one float or None per completion)"
        ) from None
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise UserError(
            f"reward function '{name}' returned {got} values for {len(completions)} "
            "completions; it must return a list with one float or None per completion"
        )
    try:
        return [math.nan if v is None else float(v) for v in values]
    except (TypeError, ValueError):
        raise UserError(
            f"reward function '{name}' returned a value that is neither a number nor None"
        ) from None
