"""Reward functions of the arithmetic task: `correct` and `format`.

Both follow TRL's reward contract, ``fn(completions, **kwargs) -> list[float | None]``: one score
per completion; the dataset columns arrive as keyword lists with one value per completion
(``answer=[...]``); ``prompts`` and any other column are accepted and ignored. A completion is
a string, or a TRL conversational completion (a list of messages, the last assistant message's
``content`` is scored; a tool turn never is). They parse with plain string operations and anchored regular expressions on bounded
input; they never ``eval`` or ``exec`` model output and never raise on a completion.

Answer policy (each line is a test in tests/tasks/test_rewards.py):

- Completions longer than `MAX_COMPLETION_CHARS` (4,096; a clean completion of the built-in task
  is under 100) score 0 without being parsed, so a 1 MB completion costs nothing.
- Surrounding whitespace (space, tab, CR, LF) of the completion and of the answer is ignored:
  ``"…|82\\n"`` and ``"…| 82"`` are read as 82.
- The answer is the text after the answer marker ``|``. Exactly one marker is required: no
  marker scores 0, and so do two or more, even when they repeat the right answer
  (``"…|82|83"``, ``"…|82|82"``), so hedging is never rewarded.
- The answer must be an integer literal in ASCII: an optional ``-`` then 1–32 ASCII digits and
  nothing else. ``"+82"``, ``"85.0"``, ``"8 2"``, ``"82."``, ``"82abc"``, Arabic-Indic
  ``"٨٢"``, full-width ``"８２"`` and superscript digits all score 0.
- Integers compare by value: ``"082"`` equals 82 and ``"-0"`` equals 0 (harmless spellings of
  the right number; no policy can gain anything from them).
- `correct` does not look at the trace: ``"|82"`` alone scores 1.0 for 37+45. `format` is the
  reward that checks the trace.
- A reference answer that is not an integer literal (a broken data row) makes every
  completion of that row score 0.

`format` scores 1.0 when the whole completion (surrounding whitespace aside) is a worked trace in
the task's grammar: one or more column steps ``d(+d)+=n`` or ``d(-d)+=n`` (digits with at most
three characters each) separated by ``,``, then ``|`` and an integer answer as above. It checks
the syntax only, not the arithmetic.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from grouprl.tasks.rewards.common import completion_text, reward_column

#: Completions longer than this score 0 unparsed (bounds the cost of any completion).
MAX_COMPLETION_CHARS = 4096
#: The answer marker: the answer is the text after the only `|` of a completion.
ANSWER_MARKER = "|"

_WHITESPACE = " \t\r\n"
_INTEGER = re.compile(r"-?[0-9]{1,32}")
_STEP = r"[0-9]{1,3}(?:[+-][0-9]{1,3})+=[0-9]{1,3}"
_TRACE = re.compile(rf"{_STEP}(?:,{_STEP})*\|[ \t\r\n]*-?[0-9]{{1,32}}")


def parse_integer(text: Any) -> int | None:
    """An integer literal per the answer policy (ASCII, optional '-', ≤ 32 digits) or None."""
    if isinstance(text, bool) or not isinstance(text, str | int):
        return None
    text = str(text).strip(_WHITESPACE)
    return int(text) if _INTEGER.fullmatch(text) else None


def parse_answer(completion: Any) -> int | None:
    """The final answer of a completion per the answer policy, or None when there is none."""
    text = completion_text(completion)
    if text is None or len(text) > MAX_COMPLETION_CHARS:
        return None
    if text.count(ANSWER_MARKER) != 1:
        return None
    return parse_integer(text.partition(ANSWER_MARKER)[2])


def correct(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's final answer equals the row's `answer`, else 0.0."""
    answers = reward_column(kwargs, "answer", len(completions), "correct")
    scores: list[float | None] = []
    for completion, reference in zip(completions, answers):
        got, want = parse_answer(completion), parse_integer(reference)
        scores.append(1.0 if got is not None and want is not None and got == want else 0.0)
    return scores


def format_(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion is a worked trace followed by one integer answer, else 0.0."""
    scores: list[float | None] = []
    for completion in completions:
        text = completion_text(completion)
        ok = text is not None and len(text) <= MAX_COMPLETION_CHARS
        ok = ok and _TRACE.fullmatch(text.strip(_WHITESPACE)) is not None  # type: ignore[union-attr]
        scores.append(1.0 if ok else 0.0)
    return scores


#: Reward functions by name.
REWARDS = {"correct": correct, "format": format_}
