"""Live objects: what a run started from Python (`grouprl.Trainer`) takes instead of a spec: a
loaded model and tokenizer, an in-memory dataset, reward and tool functions, an environment
class. The run's config names each one `live:NAME`, and every loader that resolves a spec (a
model, a dataset, a reward, a tool, an environment) looks `live:` specs up here, among the
objects of the run being built (`using`). Nothing is written to a file and imported again: the
objects are called as given.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from grouprl.errors import UserError

PREFIX = "live:"
_CURRENT: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "grouprl_live_objects", default=None
)


def is_live(spec: Any) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def live_name(spec: str) -> str:
    """The name after `live:` (a reward's metric name, a tool's name)."""
    return spec[len(PREFIX) :]


@contextlib.contextmanager
def using(objects: dict[str, Any]) -> Iterator[None]:
    """Inside, `live:` specs resolve to `objects` (spec -> object)."""
    token = _CURRENT.set(objects)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def live_object(spec: str, what: str) -> Any:
    """The object a `live:` spec names in the run being built, or one line saying that only
    Python can give it."""
    objects = _CURRENT.get() or {}
    if spec not in objects:
        raise UserError(
            f"{what} {spec!r} is an object a run made from Python was given; the command line "
            "cannot give it: resume or repeat that run from Python with grouprl.Trainer and "
            "the same objects"
        )
    return objects[spec]


def live_tokenizer(model_spec: str) -> str:
    """The spec under which a live model's tokenizer is given."""
    return f"{model_spec}#tokenizer"
