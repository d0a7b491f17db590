"""The one exception type for mistakes a user can fix (bad config, missing file, bad data row),
and the names its messages give the options a user can change."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar

#: How the caller names options, when not by grouprl's flags: a caller with its own vocabulary
#: (the TRL shim: `max_completion_length` for max_new_tokens) sets it around what it runs.
_NAMES: ContextVar[Mapping[str, str] | None] = ContextVar("grouprl_option_names", default=None)


class UserError(Exception):
    """A problem the user caused and can fix; its message names the problem and the fix.

    The CLI prints it as one line on stderr and exits with status 2, without a traceback. The
    message is one line whatever it quotes: a newline in a user's value shows as ``\\n``.
    """

    def __str__(self) -> str:
        return super().__str__().replace("\r", "\\r").replace("\n", "\\n")


def one_line(err: BaseException) -> str:
    """A library's exception as one line for a UserError message: its type and the first line
    of its text. An exception that only wraps another (a message that says nothing but that
    something failed, as datasets' DatasetGenerationError does) is described by its cause."""
    cause = err.__cause__
    if cause is not None and type(err).__name__.endswith("GenerationError"):
        err = cause
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0].strip() if lines else ''}".rstrip(": ")


def option_name(name: str) -> str | None:
    """How the caller names option `name` (a field of grouprl's options): its flag
    (`--max-new-tokens`), or, under a caller with names of its own (`option_names`), that
    name, None when that caller has no way to set it."""
    names = _NAMES.get()
    if names is None:
        return "--" + name.replace("_", "-")
    return names.get(name)


@contextlib.contextmanager
def option_names(names: Mapping[str, str]) -> Iterator[None]:
    """Messages raised inside name options as `names` does (grouprl field -> the caller's
    name); an option missing from it is one the caller cannot set, left out of remedies."""
    token = _NAMES.set(names)
    try:
        yield
    finally:
        _NAMES.reset(token)


def remedy(*moves: tuple[str, str], otherwise: str | tuple[str, ...]) -> str:
    """The ways out a message offers, in the caller's names: "raise --max-prompt-length, lower
    --max-new-tokens or shorten the prompts" from (("raise", "max_prompt_length"), ("lower",
    "max_new_tokens")) and `otherwise` (what any caller can do, always last); a move on an
    option the caller cannot set is left out."""
    ways = [f"{verb} {named}" for verb, name in moves if (named := option_name(name)) is not None]
    ways += [otherwise] if isinstance(otherwise, str) else list(otherwise)
    return ways[0] if len(ways) == 1 else ", ".join(ways[:-1]) + " or " + ways[-1]
