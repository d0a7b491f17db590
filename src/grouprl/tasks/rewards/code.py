"""Reward functions that run the model's program against the row's tests: `code` (the fraction
of tests passed) and `code_all` (1 only when every test passes); `code_reward(...)` makes one
with other options. They follow TRL's contract, ``fn(completions, **columns)``.

The program is the last fenced ```` ```python ```` (or ```` ```py ````) block of the completion,
or with ``extract="whole"`` the whole completion. It runs only in the sandbox
(`grouprl.sandbox`): never in this process, never without the sandbox. A row's tests are read
from the first of these columns that it fills:

- ``verification_info`` (open-r1): ``{"language": "python", "test_cases": [{"input": ...,
  "output": ...}, ...]}`` (a dict or its JSON text): each case feeds ``input`` on stdin; the
  output must equal ``output`` line by line, each line stripped.
- ``test_list`` (MBPP): assert statements, after ``test_setup_code`` when the row has one.
- ``test`` with ``entry_point`` (HumanEval): ``test`` defines ``check(candidate)``; it is
  called with the program's ``entry_point`` function (one test).

A row with none of them scores None (the reward does not apply to it). A completion without a
program, a program that does not parse, tests in an unknown format, a crash, a timeout: 0,
counted in the metrics as ``code_errors/KIND`` (completions of the call with that kind, out of
``code_checked``, the completions whose rows have tests).
Programs of one call run in parallel, one sandbox per core; verdicts are cached by (program,
tests, limits).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Literal

import grouprl.sandbox as sandbox
from grouprl.errors import UserError
from grouprl.tasks.rewards.common import completion_text

#: Completions longer than this score 0 without running (`code_errors/too_long`).
MAX_COMPLETION_CHARS = 65_536
#: The columns tests are read from.
TEST_COLUMNS = ("verification_info", "test_list", "test")
ERROR_KINDS = (*sandbox.KINDS, "too_long")

_BLOCK = re.compile(r"```(?:python|py)[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_program(text: str, extract: Literal["last_block", "whole"] = "last_block"):
    """The program of a completion, or None when it has none."""
    if extract == "whole":
        return text if text.strip() else None
    blocks = _BLOCK.findall(text)
    return blocks[-1] if blocks else None


class FormatError(ValueError):
    """A row's tests are in no format the reward knows."""


def row_tests(row: dict[str, Any]) -> sandbox.Tests | None:
    """The tests of a row (by its columns), None when it has none; FormatError when its tests
    are in a format this module does not read."""
    info = row.get("verification_info")
    if info not in (None, ""):
        if isinstance(info, str):
            try:
                info = json.loads(info)
            except ValueError:
                raise FormatError("verification_info is not JSON") from None
        if not isinstance(info, dict) or not isinstance(info.get("test_cases"), list):
            raise FormatError("verification_info has no test_cases list")
        if str(info.get("language", "python")).lower() != "python":
            raise FormatError(f"language {info.get('language')!r} (only python runs)")
        cases = info["test_cases"]
        if not all(isinstance(c, dict) and {"input", "output"} <= set(c) for c in cases):
            raise FormatError("a test case lacks input or output")
        return sandbox.Tests.stdio([(c["input"], c["output"]) for c in cases]) if cases else None
    asserts = row.get("test_list")
    if asserts not in (None, "", []):
        if not isinstance(asserts, list | tuple) or not all(isinstance(a, str) for a in asserts):
            raise FormatError("test_list is not a list of strings")
        return sandbox.Tests.asserts(asserts, row.get("test_setup_code") or "")
    test = row.get("test")
    if test not in (None, ""):
        entry = row.get("entry_point")
        if not isinstance(test, str) or not isinstance(entry, str) or not entry:
            raise FormatError("test needs a string entry_point beside it")
        return sandbox.Tests.checker(test, entry)
    return None


def _rows(n: int, columns: dict[str, Any]) -> list[dict[str, Any]]:
    names = [c for c in (*TEST_COLUMNS, "test_setup_code", "entry_point") if c in columns]
    return [{c: columns[c][i] for c in names} for i in range(n)]


def code_reward(
    *,
    all_or_nothing: bool = False,
    extract: Literal["last_block", "whole"] = "last_block",
    limits: sandbox.Limits | None = None,
    name: str = "code",
) -> Callable[..., list[float | None]]:
    """A reward function running each completion's program against its row's tests in the
    sandbox: the fraction of tests passed, or 1/0 with `all_or_nothing`."""
    limits = limits or sandbox.Limits()

    def reward(completions: Sequence[Any], log_metric=None, **columns: Any) -> list[float | None]:
        n = len(completions)
        scores: list[float | None] = [None] * n
        errors: Counter[str] = Counter()
        jobs, where = [], []
        for i, row in enumerate(_rows(n, columns)):
            try:
                tests = row_tests(row)
            except FormatError:
                scores[i], errors["format"] = 0.0, errors["format"] + 1
                continue
            if tests is None:
                continue
            text = completion_text(completions[i]) or ""
            program = extract_program(text, extract) if len(text) <= MAX_COMPLETION_CHARS else ""
            if not program:
                kind = "no_code" if program is None else "too_long"
                scores[i], errors[kind] = 0.0, errors[kind] + 1
                continue
            jobs.append((program, tests))
            where.append(i)
        for i, verdict in zip(where, sandbox.check_many(jobs, limits)):
            passed = all(verdict.passed) if all_or_nothing else verdict.fraction
            scores[i] = float(passed)
            errors.update(set(k for k in verdict.kinds if k not in (None, "wrong")))
        if log_metric is not None:
            log_metric("code_checked", float(sum(s is not None for s in scores)))
            for kind in ERROR_KINDS:
                log_metric(f"code_errors/{kind}", float(errors[kind]))
        return scores

    def check_rows(rows: Sequence[dict[str, Any]], where: str) -> None:
        """UserError (one line) when the sandbox cannot run here or no row has tests."""
        reason = sandbox.available()
        if reason is not None:
            raise UserError(
                f"reward {name!r} runs programs in a sandbox, which cannot run here: {reason}"
            )
        for row in rows:
            try:
                if row_tests(row) is not None:
                    return
            except FormatError:
                return  # counted per row as it is scored
        columns = ", ".join(rows[0]) if len(rows) else "none"
        raise UserError(
            f"reward {name!r}: no row of {where} has tests (a verification_info, test_list, or "
            f"test and entry_point column; its rows have: {columns})"
        )

    reward.__name__ = reward.__qualname__ = name
    reward.check_rows = check_rows  # type: ignore[attr-defined]
    return reward


code = code_reward()
code_all = code_reward(all_or_nothing=True, name="code_all")
CODE_REWARDS = {"code": code, "code_all": code_all}
