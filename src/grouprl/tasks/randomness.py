"""Group-consistent global randomness for environments written the way TRL's examples write
them: drawing from Python's global `random` (or NumPy's global generator) in `reset` and in
their tools.

- `seeded(seed)`: around each `reset`, the global generators start from the group's shared
  seed, so the G instances of a group reset to the same state whatever they draw; the caller's
  state is restored afterwards.
- `RandomStream`: each rollout's own stream, derived from (run seed, step, row, rollout index).
  Around each later call into that rollout's environment (a tool, `step`, `get_reward`) the
  stream is swapped in and, afterwards, what the call left of it is kept and the caller's state
  restored: the G rollouts draw differently after the reset, each as random as it was written,
  and a run is a function of its seed (streams are derived, never saved, so a resume continues
  exactly).

NumPy's global generator is handled only when NumPy is already imported (an environment that
uses it has imported it); nothing here imports it. Randomness these cannot reach (an
environment's own `random.Random()` instance, the clock, the OS) is the environment's own to
seed: `reset` may take a `seed` keyword for that.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any


def _numpy() -> Any:
    return sys.modules.get("numpy")


def _state() -> tuple[Any, Any]:
    np = _numpy()
    return random.getstate(), None if np is None else np.random.get_state()


def _set_state(python: Any, numpy: Any) -> None:
    random.setstate(python)
    np = _numpy()
    if np is not None and numpy is not None:
        np.random.set_state(numpy)


def _fresh(seed: int) -> tuple[Any, Any]:
    """The generators' states seeded from `seed` (NumPy's from its low 32 bits)."""
    np = _numpy()
    numpy = None if np is None else np.random.RandomState(seed & 0xFFFFFFFF).get_state()
    return random.Random(seed).getstate(), numpy


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Python's (and NumPy's) global generators seeded from `seed` inside; the caller's states
    restored after."""
    saved = _state()
    _set_state(*_fresh(seed))
    try:
        yield
    finally:
        _set_state(*saved)


class RandomStream:
    """One rollout's global-random stream: swapped in around each call into its environment,
    and carried on from call to call."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._python, self._numpy = _fresh(seed)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        saved = _state()
        if self._numpy is None and _numpy() is not None:  # NumPy arrived after the reset
            self._numpy = _fresh(self.seed)[1]
        _set_state(self._python, self._numpy)
        try:
            yield
        finally:
            self._python, self._numpy = _state()
            _set_state(*saved)


#: The attribute under which an environment instance carries its rollout's stream.
STREAM_ATTRIBUTE = "_grouprl_random_stream"


def bind_stream(instance: Any, stream: RandomStream) -> None:
    """Give `instance` its rollout's stream (for `get_reward`, which only gets the instance);
    an instance that takes no attributes (`__slots__`) runs it with the caller's state."""
    with contextlib.suppress(AttributeError, TypeError):
        object.__setattr__(instance, STREAM_ATTRIBUTE, stream)


def stream_of(instance: Any) -> contextlib.AbstractContextManager:
    """The context that swaps in `instance`'s stream (a no-op without one)."""
    stream = getattr(instance, STREAM_ATTRIBUTE, None)
    return stream.swapped() if stream is not None else contextlib.nullcontext()
