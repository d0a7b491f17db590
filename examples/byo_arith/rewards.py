"""Reward functions written for TRL's GRPOTrainer: they run in grouprl unchanged.

Each gets the completions and every dataset column by name (one value per completion), and
returns one float per completion (None where it does not apply).
"""

import re

ANSWER = re.compile(r"\|\s*(-?\d+)\s*$")


def correct_total(completions, total, **kwargs):
    """1.0 when the number after the final `|` equals the row's `total` column."""
    scores = []
    for completion, expected in zip(completions, total):
        match = ANSWER.search(completion)
        scores.append(1.0 if match and int(match.group(1)) == int(expected) else 0.0)
    return scores


def shows_work(completions, **kwargs):
    """0.1 for a worked trace (one `=` per column) before the answer, else 0."""
    return [0.1 if "=" in c.partition("|")[0] else 0.0 for c in completions]
