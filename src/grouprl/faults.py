"""Fault injection for the reliability tests: signal this process, or fail a write, at a named
point.

`GROUPRL_FAULT=POINT:N[:WHAT]` acts the N-th time the process reaches POINT (counting from 1):
WHAT is KILL or TERM (send that signal; default KILL), or ENOSPC or EACCES (raise the OSError
a full disk or a permission error would: only at the points that write). The points:

    sample      after a round of sampling (before the completions are scored)
    update      after an optimizer step (mid-update when a step has several minibatches)
    checkpoint  inside a checkpoint write (model files written, state and manifest not yet)
    eval        before a held-out evaluation
    log         as a step's metrics are written (rank 0)

Unset, `fault()` costs one dictionary lookup. The fault tests (tests/test_faults.py, `make
test-faults`) use it to stop runs at random points and check that every run resumes, that no
checkpoint is ever corrupt, and that the resumed run ends bit for bit like an uninterrupted one.
"""

from __future__ import annotations

import errno
import os
import signal

POINTS = ("sample", "update", "checkpoint", "eval", "log")
#: What a fault does: a signal number, or an OSError's errno (negative, to tell them apart).
ACTIONS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "ENOSPC": -errno.ENOSPC,
           "EACCES": -errno.EACCES}  # fmt: skip
_hits: dict[str, int] = {}
_plan: tuple[str, int, int] | bool | None = False  # False: not read yet; None: no fault


def _read_plan() -> tuple[str, int, int] | None:
    spec = os.environ.get("GROUPRL_FAULT")
    if not spec:
        return None
    point, n, *rest = spec.split(":")
    if point not in POINTS:
        raise ValueError(f"GROUPRL_FAULT point {point!r} is not one of {', '.join(POINTS)}")
    return point, int(n), ACTIONS[rest[0] if rest else "KILL"]


def fault(point: str) -> None:
    """Count a visit to `point`; signal this process if GROUPRL_FAULT asks for this visit."""
    global _plan
    if _plan is False:
        _plan = _read_plan()
    if _plan is None:
        return
    _hits[point] = _hits.get(point, 0) + 1
    target, n, action = _plan
    if point == target and _hits[point] == n:
        if action < 0:
            raise OSError(-action, os.strerror(-action), f"(injected at {point})")
        os.kill(os.getpid(), action)
