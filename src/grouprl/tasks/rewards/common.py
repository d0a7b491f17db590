"""What every reward function reads the same way: a completion's scored text (a string, or the
last assistant message of a TRL conversational completion) and a dataset column's values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grouprl.errors import UserError


def completion_text(completion: Any) -> str | None:
    """The scored text of a completion: a string, or the content of a message list's last
    assistant message (TRL conversational format; with tools, a transcript whose tool turns
    are never scored); None for anything else."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        for message in reversed(completion):
            if isinstance(message, dict) and message.get("role", "assistant") == "assistant":
                content = message.get("content")
                return content if isinstance(content, str) else None
    return None


def reward_column(kwargs: dict, name: str, n: int, reward: str) -> Sequence:
    """The column `name` of the reward call's `kwargs`, one value per completion (`n`); one
    UserError line naming the reward and the column when it is missing or the wrong length."""
    values = kwargs.get(name)
    if values is None or len(values) != n:
        got = "none" if values is None else f"{len(values)} values"
        raise UserError(
            f"reward {reward!r} needs a column {name!r} with one value per completion "
            f"({n}), got {got}; give the dataset an {name!r} column (--answer-column names "
            "the column that holds the reference answer)"
        )
    return values
