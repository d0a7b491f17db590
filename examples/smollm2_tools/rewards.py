"""Rewards for the SmolLM2 tools example: the right product in the model's final words."""

import re


def _final_text(completion):
    """A tool run's completion is a transcript; the reply is its last assistant message (what
    the model wrote after the tool's result, never the result itself)."""
    if isinstance(completion, list):
        replies = [m["content"] for m in completion if m["role"] == "assistant"]
        return replies[-1] if replies else ""
    return completion


def right_number(completions, answer, **kwargs):
    """1 when the final reply holds the right product as a whole number (digits may be grouped
    with commas), else 0."""
    scores = []
    for c, a in zip(completions, answer, strict=True):
        numbers = re.findall(r"-?\d[\d,]*", _final_text(c))
        scores.append(1.0 if str(a) in [n.replace(",", "").rstrip(",") for n in numbers] else 0.0)
    return scores
