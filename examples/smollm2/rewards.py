"""Rewards for the SmolLM2 example: the reply must be the number and nothing else."""

import re


def _text(completion):
    """A chat completion is a list of messages; the reply is the last assistant message."""
    if isinstance(completion, list):
        return completion[-1]["content"]
    return completion


def only_number(completions, answer, **kwargs):
    """1 when the whole reply is the right number (a final period allowed), else 0."""
    return [
        1.0 if _text(c).strip().rstrip(".").strip() == str(a) else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]


def right_number(completions, answer, **kwargs):
    """1 when the reply contains the right number as a whole number anywhere, else 0."""
    return [
        1.0 if str(a) in re.findall(r"-?\d+", _text(c)) else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]


def terse(completions, answer, **kwargs):
    """Partial credit toward the bare number: 1 for the number alone, 1/w for a reply of w
    words that holds the right number ("18." 1, "= 18" 0.5, "10 + 8 = 18" 0.2), 0 without it."""
    scores = []
    for c, a in zip(completions, answer, strict=True):
        text = _text(c).strip().rstrip(".").strip()
        if text == str(a):
            scores.append(1.0)
        elif str(a) in re.findall(r"-?\d+", text):
            scores.append(1.0 / max(len(text.split()), 1))
        else:
            scores.append(0.0)
    return scores
