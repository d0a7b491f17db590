"""The task interface the trainer, `grouprl sft` and `grouprl eval` use for every task."""

from __future__ import annotations

import asyncio
import inspect
import math
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    """Training rows: {"prompt": str or chat messages, "answer": ..., ...every other column,
    passed to the reward functions}."""
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
    transcript: Callable[[dict, random.Random, float], list[tuple[str, str]]] | None = None
    """For `grouprl sft` on a tool-use task: a worked completion of a row as (role, text)
    turns, "assistant" or "tool", with errors injected at rate p; tool turns carry no loss."""
    tools: dict[str, Callable[..., Any]] | None = None
    """Tools the task ships, by name (`--tools NAME`); used by default when given."""
    default_model: str = "builtin:arith"
    """The policy `--model` means when it is not given."""
    default_steps: int = 200
    """The training steps `--steps` means when it is not given."""
    episodes: bool = False
    """Training draws fresh episodes of an environment, not rows: the environment owns the data
    (its rows have no prompt: `reset` writes it) or every row is one prompt. Each group is
    then seeded by its position in the run's episodes (`grouprl.tasks.tools.use.Episode`)."""
    heldout_episodes: bool = False
    """The held-out evaluation runs `eval_size` fresh episodes of `heldout[0]`, seeded apart
    from training's, instead of held-out rows."""
    driver: Any = None
    """An environment of another ecosystem that runs its own rollouts and scores them (a
    verifiers environment: `grouprl.tasks.ecosystems.verifiers`); None: grouprl's own loop."""

    def split(self, name: str) -> Sequence[dict]:
        """The rows of split `name`: "train", "heldout", or "all" (train, then heldout)."""
        if name not in SPLITS:
            raise UserError(f"unknown split {name!r}; valid: {', '.join(SPLITS)}")
        if name == "all":
            return Concatenated([self.train, self.heldout])
        return self.train if name == "train" else self.heldout


SPLITS = ("train", "heldout", "all")


class Concatenated(Sequence):
    """Several row sequences read as one, without copying them."""

    def __init__(self, parts: Sequence[Sequence[dict]]) -> None:
        self.parts = list(parts)

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        for part in self.parts:
            if 0 <= index < len(part):
                return part[index]
            index -= len(part)
        raise IndexError(index)


#: Seconds a reward function may take for one batch before the run stops with an error.
REWARD_TIMEOUT = 60.0


@dataclass(frozen=True)
class TrainerState:
    """What TRL passes to reward functions as ``trainer_state``: the optimizer steps done so far
    and the run's total, for rewards that change with training progress."""

    global_step: int = 0
    max_steps: int = 0


# ---------------------------------------------------------------------------------------------
# Time limits that nest
#
# One SIGALRM timer serves every limit: the run's per-call reward deadline and, inside it, a
# reward's own per-completion limit (see `grouprl.tasks.rewards.math`). The limits form a stack
# (outermost first); the timer is always armed for the earliest end, and after that end it goes
# on firing every `_REFIRE` seconds until a limit is entered or left. When it fires in a limit's
# body, the outermost limit that has run out ends, and with it every limit nested inside it: the
# handler pops them off the stack and re-arms the timer before raising.
#
# While a limit is being entered or left (`_BUSY`, or a frame of that code) the handler does
# nothing at all: the stack, the timer and SIGALRM's disposition are changed only by the code
# that holds them, and the refiring timer brings the alarm back once it is done. (A handler that
# acted there could give SIGALRM back to its default action between the bookkeeping's reading of
# the stack and its arming of the timer; the next alarm would then kill the process.) Libraries
# that call `signal.alarm` themselves would cancel this timer: math-verify's own timeouts are off
# for that reason.

#: Seconds between alarms once the earliest end has passed (until the handler acts on one).
_REFIRE = 1e-3


class TimeLimitExceeded(BaseException):
    """Raised by `time_limit` when its time ran out. A BaseException so that a reward
    function's own ``except Exception`` cannot swallow it."""


class _TimeUp(BaseException):
    """What the alarm raises inside a limit's body: which limit ran out. Not a
    TimeLimitExceeded, so code that catches its own, inner limit's expiry cannot swallow an
    outer one's; each limit turns its own `_TimeUp` into TimeLimitExceeded as it is left."""

    def __init__(self, token: object) -> None:
        super().__init__()
        self.token = token


_LIMITS: list[tuple[float, object]] = []  # (monotonic end, token), outermost first
_BUSY = 0  # > 0 while a limit is entered or left, or the handler itself keeps the books
_PREVIOUS_HANDLER: Any = signal.SIG_DFL


def _settle() -> None:
    """Arm the timer for the earliest end, or, with no limit left, stop it and give SIGALRM
    back to its previous handler. Called only while `_BUSY`."""
    if _LIMITS:
        delay = min(end for end, _ in _LIMITS) - time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, max(delay, 1e-4), _REFIRE)
    else:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, _PREVIOUS_HANDLER)


def _on_alarm(signum, frame) -> None:
    global _BUSY
    if _BUSY or (frame is not None and frame.f_code in _BOOKKEEPING):
        return  # the bookkeeping in progress re-arms the timer; it fires again after it
    _BUSY += 1
    try:
        now = time.monotonic()
        token = None
        for index, (end, limit) in enumerate(_LIMITS):  # the outermost limit that ran out wins
            if end <= now + 1e-4:
                token = limit
                del _LIMITS[index:]  # it ends, and every limit inside it
                break
        _settle()  # the next end, or (woke early) this one again
    finally:
        _BUSY -= 1
    if token is not None:
        raise _TimeUp(token)


class time_limit:  # lower case: it reads like a function, `with time_limit(3): ...`
    """Raise TimeLimitExceeded if the body runs longer than `seconds` (wall time).

    Limits nest: an inner limit does not cancel an outer one, and an outer limit that runs out
    inside an inner one ends both (and cannot be caught as the inner one's TimeLimitExceeded).
    Only the main thread on Unix can be interrupted; elsewhere (and with `seconds` None or 0)
    the body runs unlimited. Code running in C (one huge integer power, say) is interrupted
    only when it returns to Python. A body that ends while its limit is being left counts as
    finished, even if its time ran out during the leaving.
    """

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.token = object()
        main = threading.current_thread() is threading.main_thread()
        self.active = bool(seconds) and hasattr(signal, "setitimer") and main

    def __enter__(self) -> time_limit:
        global _BUSY, _PREVIOUS_HANDLER
        if self.active:
            _BUSY += 1
            try:
                if not _LIMITS:
                    previous = signal.signal(signal.SIGALRM, _on_alarm)
                    _PREVIOUS_HANDLER = signal.SIG_DFL if previous is None else previous  # C
                _LIMITS.append((time.monotonic() + self.seconds, self.token))
                _settle()
            finally:
                _BUSY -= 1
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        global _BUSY
        if not self.active:
            return False
        _BUSY += 1
        try:
            for index, (_, token) in enumerate(_LIMITS):
                if token is self.token:  # still on the stack: the alarm did not end it
                    del _LIMITS[index:]  # it ends, and whatever it holds
                    break
            _settle()
        finally:
            _BUSY -= 1
        if isinstance(exc, _TimeUp) and exc.token is self.token:
            raise TimeLimitExceeded(self.seconds) from None
        return False


_BOOKKEEPING = frozenset(
    f.__code__ for f in (time_limit.__enter__, time_limit.__exit__, _settle, _on_alarm)
)


# ---------------------------------------------------------------------------------------------
# Calling reward functions


def completion_objects(texts: Sequence[str], conversational: bool) -> list[Any]:
    """Completions as TRL hands them to reward functions: strings, or for conversational
    prompts a one-message list ``[{"role": "assistant", "content": text}]``."""
    if conversational:
        return [[{"role": "assistant", "content": text}] for text in texts]
    return list(texts)


def reward_kwargs(
    completions: Sequence[Any], rows: Sequence[dict], repeats: int, **extra: Any
) -> dict[str, Any]:
    """The keyword arguments of a reward call (TRL's convention): ``completions``, ``prompts``,
    every other column of the rows repeated once per completion, and `extra` (TRL passes
    ``completion_ids``, ``trainer_state``, ``log_metric`` and ``log_extra``); and grouprl's
    ``group_size``: the completions come as groups of that many consecutive ones of one prompt
    (a group reward, such as a group judge, scores each group at once)."""
    columns = {key: [row[key] for row in rows for _ in range(repeats)] for key in rows[0]}
    prompts = columns.pop("prompt")
    for name in ("completion", "completion_ids"):
        columns.pop(name, None)
    return {**columns, "completions": list(completions), "prompts": prompts,
            "group_size": repeats, **extra}  # fmt: skip


def _check_values(
    name: str, values: Any, n: int, turns: Sequence[int] | None = None
) -> list[float | list[float]]:
    """A reward function's values as floats (NaN for None); with `turns` (each completion's
    model turns), a completion's value may be a list of per-turn rewards, at most one per turn
    (a list of floats, NaN for None)."""
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise UserError(
            f"reward function '{name}' returned {got} values for {n} "
            "completions; it must return a list with one float or None per completion"
        )
    out: list[float | list[float]] = []
    for i, value in enumerate(values):
        if not isinstance(value, (list, tuple)):
            out.append(_finite(name, value))
            continue
        if turns is None:
            raise UserError(
                f"reward function '{name}' gave completion {i} a list: per-turn rewards are for "
                "multi-turn rollouts (tools, an environment, an agent); return one float or "
                "None per completion"
            )
        if len(value) > turns[i]:
            raise UserError(
                f"reward function '{name}' gave completion {i} {len(value)} per-turn rewards; "
                f"it has {turns[i]} turns (the num_turns argument): give at most one per turn "
                "(turn k's at k)"
            )
        out.append([_finite(name, v) for v in value])
    return out


def _finite(name: str, value: Any) -> float:
    """A reward as a float, NaN for None; UserError for anything else that is not finite."""
    if value is None:
        return math.nan
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise UserError(
            f"reward function '{name}' returned a value that is neither a number nor None"
        ) from None
    if not math.isfinite(score):  # NaN would silently read as "unscored", inf would poison
        raise UserError(
            f"reward function '{name}' returned {score}; return a finite number, or None for a "
            "completion the function does not apply to"
        )
    return score


def _raised(name: str, err: BaseException) -> UserError:
    if isinstance(err, UserError):  # a built-in reward's own message (e.g. a missing column)
        return err
    return UserError(
        f"reward function '{name}' raised {type(err).__name__}: {err}; fix the function "
        "(it must return one float or None per completion)"
    )


def call_rewards(
    funcs: dict[str, RewardFn],
    kwargs: dict[str, Any],
    *,
    timeout: float | None = REWARD_TIMEOUT,
    turns: Sequence[int] | None = None,
) -> dict[str, list[float | list[float]]]:
    """Call every reward function with `kwargs` (see `reward_kwargs`); scores by name, NaN
    where a function returned None. With `turns` (each completion's model turns), a function
    may give a completion a list of per-turn rewards (`_check_values`).

    Plain functions run one after the other, each within `timeout` seconds; `async def`
    functions run concurrently in one event loop, together within `timeout`. A function that
    raises, hangs past its time, or returns the wrong number of values is the user's to fix:
    UserError, naming the function.
    """
    n = len(kwargs["completions"])
    out: dict[str, list[float]] = {}
    waiting = {name: fn for name, fn in funcs.items() if inspect.iscoroutinefunction(fn)}
    for name, fn in funcs.items():
        if name in waiting:
            continue
        try:
            with time_limit(timeout):
                values = fn(**kwargs)
        except TimeLimitExceeded:
            raise _timed_out([name], timeout, n) from None
        except Exception as err:  # a user's reward function: report it, don't crash opaquely
            raise _raised(name, err) from None
        out[name] = _check_values(name, values, n, turns)
    if waiting:
        results = _run_concurrently(waiting, kwargs, timeout)
        late = [name for name, value in results.items() if isinstance(value, TimeLimitExceeded)]
        if late:
            raise _timed_out(late, timeout, n)
        for name, values in results.items():
            if isinstance(values, BaseException):
                raise _raised(name, values)
            out[name] = _check_values(name, values, n, turns)
    return {name: out[name] for name in funcs}


def _run_concurrently(
    funcs: dict[str, RewardFn], kwargs: dict[str, Any], timeout: float | None
) -> dict[str, Any]:
    """Run `async def` reward functions in one event loop; each one's result, exception, or a
    TimeLimitExceeded when it had not finished after `timeout` seconds.

    The event loop's own timeout ends functions that wait (on I/O, a server); the alarm of
    `time_limit`, a little later, ends one that computes without ever yielding to the loop.
    """

    async def run_all() -> dict[str, Any]:
        tasks = {name: asyncio.ensure_future(fn(**kwargs)) for name, fn in funcs.items()}
        _, pending = await asyncio.wait(tasks.values(), timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        out = {}
        for name, task in tasks.items():
            value = TimeLimitExceeded(timeout) if task in pending else task.exception()
            if isinstance(value, _TimeUp):  # the alarm landed inside this function's code
                value = TimeLimitExceeded(timeout)
            out[name] = task.result() if value is None else value
        return out

    try:
        with time_limit(None if timeout is None else timeout + 1.0):
            return asyncio.run(run_all())
    except TimeLimitExceeded:  # the event loop itself was blocked past the deadline
        return dict.fromkeys(funcs, TimeLimitExceeded(timeout))


def _timed_out(names: list[str], timeout: float | None, n: int) -> UserError:
    which = ", ".join(f"'{name}'" for name in names)
    plural = "s" if len(names) > 1 else ""
    return UserError(
        f"reward function{plural} {which} did not return within {timeout:g} s for "
        f"{n} completions; make {'them' if plural else 'it'} faster or raise --reward-timeout"
    )


def call_reward(
    name: str,
    fn: RewardFn,
    completions: list[Any],
    rows: Sequence[dict],
    repeats: int,
    *,
    timeout: float | None = REWARD_TIMEOUT,
    **extra: Any,
) -> list[float]:
    """Score `completions` (`repeats` consecutive ones per row) with one reward function; see
    `call_rewards`. `extra` adds keyword arguments (``completion_ids``, ``trainer_state``, ...;
    with ``num_turns``, per-turn rewards are taken, each completion's summed)."""
    kwargs = reward_kwargs(completions, rows, repeats, **extra)
    values = call_rewards({name: fn}, kwargs, timeout=timeout, turns=extra.get("num_turns"))
    return [summed(v) for v in values[name]]


def turns_summing_to(
    reward: float | None, turns: Sequence[float | None] | None
) -> float | list[float | None] | None:
    """An episode's reward as rewards per turn, where an environment rewarded its turns: those
    (None: a turn it did not reward), with what `reward` has beyond their sum on the last listed
    one, so they sum to it. `reward` itself where there is none, or no turn was rewarded."""
    if reward is None or not turns or all(t is None for t in turns):
        return reward
    out = [None if t is None else float(t) for t in turns]
    rest = reward - math.fsum(t for t in out if t is not None)
    if rest != 0 or out[-1] is None:
        out[-1] = (out[-1] or 0.0) + rest
    return out


def summed(value: float | list[float]) -> float:
    """A completion's score: its per-turn rewards' sum (NaN when it gave none), or the score."""
    if not isinstance(value, list):
        return value
    given = [v for v in value if not math.isnan(v)]
    return math.fsum(given) if given else math.nan
