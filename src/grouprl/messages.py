"""Chat messages as TRL's conversational format has them: one definition for every layer."""

from __future__ import annotations

from typing import Any


def is_conversational(prompt: Any) -> bool:
    """Whether a prompt is a list of chat messages (``{"role", "content"}`` dicts), TRL's
    conversational format, rather than a string or a list of token ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict)
