"""Fault injection for the reliability tests: signal this process at a named point.

`GROUPRL_FAULT=POINT:N[:SIGNAL]` sends SIGNAL (KILL or TERM; default KILL) to the process the
N-th time it reaches POINT (counting from 1). The points:

    sample      after a round of sampling (before the completions are scored)
    update      after an optimizer step (mid-update when a step has several minibatches)
    checkpoint  inside a checkpoint write (model files written, state and manifest not yet)
    eval        before a held-out evaluation

Unset, `fault()` costs one dictionary lookup. The fault tests (tests/test_faults.py, `make
test-faults`) use it to stop runs at random points and check that every run resumes, that no
checkpoint is ever corrupt, and that the resumed run ends bit for bit like an uninterrupted one.
"""

from __future__ import annotations

import os
import signal

POINTS = ("sample", "update", "checkpoint", "eval")
_hits: dict[str, int] = {}
_plan: tuple[str, int, int] | bool | None = False  # False: not read yet; None: no fault


def _read_plan() -> tuple[str, int, int] | None:
    spec = os.environ.get("GROUPRL_FAULT")
    if not spec:
        return None
    point, n, *rest = spec.split(":")
    if point not in POINTS:
        raise ValueError(f"GROUPRL_FAULT point {point!r} is not one of {', '.join(POINTS)}")
    signum = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM}[rest[0] if rest else "KILL"]
    return point, int(n), signum


def fault(point: str) -> None:
    """Count a visit to `point`; signal this process if GROUPRL_FAULT asks for this visit."""
    global _plan
    if _plan is False:
        _plan = _read_plan()
    if _plan is None:
        return
    _hits[point] = _hits.get(point, 0) + 1
    target, n, signum = _plan
    if point == target and _hits[point] == n:
        os.kill(os.getpid(), signum)
