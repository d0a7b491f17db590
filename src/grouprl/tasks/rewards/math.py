"""Reward functions for real math data: `accuracy` (math-verify) and `think_format`.

Both follow TRL's contract, ``fn(completions, **columns) -> list[float | None]``, accept string
or conversational completions, never evaluate model output as code, and never raise on a
completion. math-verify (the library open-r1 and TRL use) is imported on first use.

`accuracy` scores 1.0 when the completion's final answer is mathematically equal to the row's
`answer`, else 0.0; None (unscored) when the reference itself cannot be parsed. The policy, one
test per line in tests/tasks/test_math_rewards.py:

- The final answer is, in this order of preference: the content of the last
  ``<answer>…</answer>``; else the content of the last ``\\boxed{…}``; else the rest of the
  line after the last ``####`` (GSM8K). A completion with none of them scores 0: free text is
  not searched for a number.
- Reference answers may be GSM8K solutions: only what follows the last ``####`` counts. Digit
  groups with thousands commas (``1,200``) are read as one number, in answers and references.
- Equality is math-verify's: ``\\frac{1}{2}`` equals ``0.5``, ``x^2+1`` equals ``1+x^2``, a set
  ``{72, 73}`` does not equal 72 (listing candidates is not rewarded).
- Cost is bounded, so a completion cannot stall training: completions over
  `MAX_COMPLETION_CHARS` and answers over `MAX_ANSWER_CHARS` score 0 unparsed; answers whose
  value could explode (an exponent of four or more digits, a nested power or a factorial of an
  expression, which sympy would compute in C where no timeout can stop it) score 0 unparsed;
  and each completion gets `SECONDS_PER_COMPLETION` of parsing and comparison before it scores
  0. math-verify's own timeouts are switched off: they use `signal.alarm`, which would cancel
  the run's reward deadline (`--reward-timeout`); grouprl's nested time limits replace them.
- Model output is never evaluated: answers are read with math-verify's LaTeX grammar (its
  plain-expression reader would `eval` them), and text that can only be Python (dunder names,
  attribute access, quotes, `lambda`/`import`) scores 0 unparsed.

`think_format` scores 1.0 when the completion (surrounding whitespace aside) is one
``<think>…</think>`` block with non-blank reasoning, followed by a non-blank answer; if the
answer uses ``<answer>`` tags it must be exactly one ``<answer>…</answer>`` block. Else 0.0.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence
from typing import Any

from grouprl.tasks.base import TimeLimitExceeded, time_limit
from grouprl.tasks.rewards.common import completion_text, reward_column

#: Completions longer than this score 0 without being parsed.
MAX_COMPLETION_CHARS = 32_768
#: A final answer longer than this scores 0 without being parsed.
MAX_ANSWER_CHARS = 512
#: Wall time for parsing and comparing one completion's answer.
SECONDS_PER_COMPLETION = 3.0

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_POWER = r"(?:\^|\*\*)"
_EXPLOSIVE = [
    re.compile(_POWER + r"\s*[{(]?\s*[-+]?\s*\d{4,}"),  # 2^{10000}
    re.compile(_POWER + r"\s*\{[^{}]*" + _POWER),  # 9^{9^9}
    re.compile(_POWER + r"\s*\(?[\w.]+\)?\s*" + _POWER),  # 9^9^9, 9**9**9
    re.compile(r"(?:\d{4,}|[)}])\s*!|!\s*!"),  # 10000!, (10^10)!, 5!!
    re.compile(r"\\(?:binom|dbinom|tbinom|choose)\s*\{?\s*\d{4,}"),
]
#: Text that can only mean Python, never mathematics (dunder names, attribute access, quotes,
#: keywords): such an answer scores 0 without reaching the parser.
_NOT_MATH = re.compile(r"__|\.\s*[A-Za-z_]|['\"`]|\b(?:lambda|import|exec|eval)\b")
_THINK = re.compile(r"<think>(?P<think>.*?)</think>(?P<answer>.*)", re.DOTALL)


def _braced(text: str, start: int) -> str | None:
    """The content of the brace group opening at text[start - 1] == "{", or None if unclosed."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def final_answer(text: str) -> str | None:
    """The final answer region of a completion (see the module docstring), or None."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    boxes = list(_BOXED.finditer(text))
    if boxes:
        return _braced(text, boxes[-1].end())
    if "####" in text:
        return text.rpartition("####")[2].strip().split("\n", 1)[0].strip()
    return None


def reference_answer(reference: Any) -> str | None:
    """The answer part of a reference: what follows the last ``####`` (GSM8K), else all of it."""
    if reference is None or isinstance(reference, bool):
        return None
    text = str(reference)
    if "####" in text:
        text = text.rpartition("####")[2]
    return text.strip() or None


def _explosive(answer: str) -> bool:
    return any(pattern.search(answer) for pattern in _EXPLOSIVE)


@functools.cache
def _math_verify():
    """math-verify's parse/verify and extraction config, imported once, its timeout warnings
    silenced (grouprl bounds the time itself).

    LaTeX extraction only: math-verify's plain-expression extraction hands the matched text to
    sympy's `parse_expr`, which runs it through `eval`; LaTeX goes through a grammar instead.

    The first symbolic comparison imports more of sympy (seen to take over the 3 s per-answer
    limit on a loaded 2-core machine, scoring a right answer 0): one is made here, once, outside
    any limit.
    """
    from math_verify import LatexExtractionConfig, parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    configs = [LatexExtractionConfig(boxed_match_priority=0)]
    options = {"extraction_config": configs, "parsing_timeout": None}
    verify(parse("$x^2+1$", **options), parse("$1+x^2$", **options), timeout_seconds=None)
    return parse, verify, configs


def _parse(text: str) -> list | None:
    """math-verify's reading of an answer, or None when it finds nothing (or would explode)."""
    text = _THOUSANDS.sub("", text.strip().rstrip("."))
    if not text or len(text) > MAX_ANSWER_CHARS or _explosive(text) or _NOT_MATH.search(text):
        return None
    parse, _, configs = _math_verify()
    wrapped = text if ("$" in text or "\\boxed" in text) else f"${text}$"
    parsed = parse(
        wrapped, extraction_config=configs, extraction_mode="first_match", parsing_timeout=None
    )
    return parsed or None


def accuracy(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 when the final answer equals the row's `answer` mathematically (math-verify), 0.0
    when it does not or there is none, None when the reference cannot be parsed."""
    references = reward_column(kwargs, "answer", len(completions), "accuracy")
    _, verify, _ = _math_verify()
    gold_cache: dict[str, list | None] = {}
    scores: list[float | None] = []
    for completion, reference in zip(completions, references):
        ref = reference_answer(reference)
        if ref is not None and ref not in gold_cache:
            try:
                with time_limit(SECONDS_PER_COMPLETION):
                    gold_cache[ref] = _parse(ref)
            except TimeLimitExceeded:
                gold_cache[ref] = None
            except Exception:  # a reference math-verify cannot read: the row goes unscored
                gold_cache[ref] = None
        gold = gold_cache.get(ref) if ref is not None else None
        if gold is None:
            scores.append(None)
            continue
        text = completion_text(completion)
        answer = final_answer(text) if text and len(text) <= MAX_COMPLETION_CHARS else None
        score = 0.0
        if answer is not None:
            try:
                with time_limit(SECONDS_PER_COMPLETION):
                    parsed = _parse(answer)
                    if parsed is not None and verify(gold, parsed, timeout_seconds=None):
                        score = 1.0
            except TimeLimitExceeded:
                score = 0.0
            except Exception:  # math-verify on hostile input; an answer it cannot read is wrong
                score = 0.0
        scores.append(score)
    return scores


def think_format(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 for one non-blank ``<think>…</think>`` block followed by a non-blank answer (in one
    ``<answer>…</answer>`` block if tagged), else 0.0."""
    scores: list[float | None] = []
    for completion in completions:
        text = completion_text(completion)
        ok = text is not None and len(text) <= MAX_COMPLETION_CHARS
        if ok:
            text = text.strip()
            match = _THINK.fullmatch(text) if text.startswith("<think>") else None
            ok = (
                match is not None
                and text.count("<think>") == 1
                and text.count("</think>") == 1
                and bool(match["think"].strip())
                and bool(match["answer"].strip())
            )
            if ok and ("<answer>" in match["answer"] or "</answer>" in match["answer"]):
                tagged = match["answer"].strip()
                ok = (
                    tagged.startswith("<answer>")
                    and tagged.endswith("</answer>")
                    and tagged.count("<answer>") == 1
                    and tagged.count("</answer>") == 1
                    and bool(tagged[len("<answer>") : -len("</answer>")].strip())
                )
        scores.append(1.0 if ok else 0.0)
    return scores


#: The built-in rewards for real data, by name.
MATH_REWARDS = {"accuracy": accuracy, "think_format": think_format}
