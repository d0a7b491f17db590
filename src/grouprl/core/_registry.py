"""Name → function registries: one lookup with one clear error for every variant in core."""

from collections.abc import Callable, Mapping
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def choose(registry: Mapping[str, F], name: str, what: str) -> F:
    """Return ``registry[name]``; an unknown name raises ValueError listing the valid ones."""
    try:
        return registry[name]
    except KeyError:
        valid = ", ".join(repr(k) for k in registry)
        raise ValueError(f"unknown {what} {name!r}; valid choices: {valid}") from None
