"""Checking many programs at once: one sandbox per program on each core, results cached by
(program, tests, limits), and nothing left running if the caller is stopped."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grouprl.sandbox.slots as slots
from grouprl.sandbox.run import Limits, Tests, Verdict, check, run
from grouprl.sandbox.runtime import Unavailable

#: Verdicts kept (a step's completions repeat across a group and across epochs).
CACHE_SIZE = 16_384

_CACHE: OrderedDict[str, Verdict] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_PROBED: list[str | None] = []


def _key(program: str, tests: Tests, limits: Limits) -> str:
    text = "\0".join((program, tests.key(), repr(limits)))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def workers() -> int:
    """Sandboxes run at once: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def check_many(
    jobs: Sequence[tuple[str, Tests]], limits: Limits | None = None, *, parallel: int | None = None
) -> list[Verdict]:
    """`check` for each (program, tests), `parallel` sandboxes at a time (default: one per
    core), repeated jobs run once. If the caller is interrupted (a reward deadline), every
    sandbox still running or starting is killed before the interruption goes on, and no
    program starts after it."""
    limits = limits or Limits()
    keys = [_key(p, t, limits) for p, t in jobs]
    todo: dict[str, tuple[str, Tests]] = {}
    results: dict[str, Verdict] = {}
    with _CACHE_LOCK:  # the hits now: storing this call's verdicts may evict them
        for key, job in zip(keys, jobs):
            if key in _CACHE:
                results[key] = _CACHE[key]
            else:
                todo.setdefault(key, job)
    if todo:
        stop = threading.Event()
        with ThreadPoolExecutor(max_workers=min(parallel or workers(), len(todo))) as pool:
            futures = {}
            try:  # the submitting too: an interruption may land while it goes on
                for key, (program, tests) in todo.items():
                    futures[key] = pool.submit(check, program, tests, limits, stop=stop)
                fresh = {k: f.result() for k, f in futures.items()}
            except BaseException:
                stop.set()  # before kill_busy: a slot made busy after it looked sees this
                for f in futures.values():
                    f.cancel()
                slots.kill_busy()
                raise
        results.update(fresh)
        with _CACHE_LOCK:
            for key, verdict in fresh.items():
                _CACHE[key] = verdict
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
    return [results[k] for k in keys]


def probe() -> str | None:
    """None when a sandboxed program runs and prints here (checked once per process), else
    why not."""
    if not _PROBED:
        try:
            ran = run("print(6 * 7)")
            reason = None if ran.stdout == "42\n" else f"a test program failed ({ran.kind})"
        except (Unavailable, OSError) as err:
            reason = str(err)
        _PROBED.append(reason)
    return _PROBED[0]
