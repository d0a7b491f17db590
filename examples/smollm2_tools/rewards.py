"""The reward of the SmolLM2 tools example: the right product in the model's final words, in a
completion that ended."""

import re

#: The config's max_new_tokens: a completion this long was cut off by the budget, not finished.
BUDGET = 48


def _final_text(completion):
    """A tool run's completion is a transcript; the reply is its last assistant message (what
    the model wrote after the tool's result, never the result itself)."""
    if isinstance(completion, list):
        replies = [m["content"] for m in completion if m["role"] == "assistant"]
        return replies[-1] if replies else ""
    return completion


def _says(text, answer):
    numbers = re.findall(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+", text)
    return str(answer) in [n.replace(",", "") for n in numbers]


def right_number(completions, answer, completion_ids, **kwargs):
    """1 when the final reply holds the right product as a whole number (digits may be grouped
    in threes with commas) and the completion ended before the budget cut it (its token ids,
    the call and the tool's result included, are fewer than BUDGET), else 0: an answer followed
    by whatever comes next until the budget runs out is not an answer."""
    return [float(_says(_final_text(c), a) and len(ids) < BUDGET)
            for c, a, ids in zip(completions, answer, completion_ids, strict=True)]  # fmt: skip
