"""Running one program against its tests in one sandbox, and reading the verdicts back."""

from __future__ import annotations

import json
import math
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import grouprl.sandbox.slots as slots
from grouprl.sandbox.runtime import PACKAGES_MOUNT, Unavailable, packages_dir

HARNESS = (Path(__file__).with_name("harness.py")).read_text(encoding="utf-8")
#: Tests one request runs (one worker process each, forked before the tests are read); a row
#: with more is checked in several requests.
TESTS_PER_SANDBOX = 32
#: Ways a test (or a whole program) fails besides a wrong answer, as `code_errors/KIND` counts.
KINDS = ("syntax", "error", "timeout", "memory", "output", "wall", "not_plain", "format",
         "decode", "no_code", "sandbox")  # fmt: skip


@dataclass(frozen=True)
class Limits:
    """What one test of a program may use. CPU time decides a timeout (so a verdict does not
    depend on the machine's load); the wall clock is a backstop, counted apart (`wall`)."""

    cpu_seconds: float = 2.0
    wall_seconds: float | None = None  # None: 3 x cpu_seconds + 1
    memory_mb: int = 512  # address space
    processes: int = 16  # at once, besides one worker per test
    open_files: int = 64
    file_mb: int = 8  # largest file written
    scratch_mb: int = 16  # the private /tmp, all files together
    output_kb: int = 1024  # stdout per test (stdin/stdout cases)

    @property
    def wall(self) -> float:
        return self.wall_seconds if self.wall_seconds is not None else 3 * self.cpu_seconds + 1

    def wire(self) -> dict:
        return {
            "cpu": self.cpu_seconds,
            "wall": self.wall,
            "memory": self.memory_mb << 20,
            "processes": self.processes,
            "open_files": self.open_files,
            "file_size": self.file_mb << 20,
            "output": self.output_kb << 10,
        }


@dataclass(frozen=True)
class Tests:
    """A program's tests in one of three formats: stdin/stdout cases (`cases` holds (input,
    expected output) pairs), assert statements (MBPP's `test_list`, with `setup` run first),
    or a checker (HumanEval's `test` defining `check(candidate)`, called with `entry_point`)."""

    kind: Literal["stdio", "assert", "check"]
    cases: tuple = ()
    setup: str = ""
    entry_point: str | None = None

    @classmethod
    def stdio(cls, cases: Sequence[tuple[str, str]]) -> Tests:
        return cls("stdio", tuple((str(i), str(o)) for i, o in cases))

    @classmethod
    def asserts(cls, statements: Sequence[str], setup: str = "") -> Tests:
        return cls("assert", tuple(str(s) for s in statements), setup or "")

    @classmethod
    def checker(cls, test: str, entry_point: str) -> Tests:
        return cls("check", (str(test),), "", str(entry_point))

    def key(self) -> str:
        return json.dumps([self.kind, self.cases, self.setup, self.entry_point])


@dataclass(frozen=True)
class Verdict:
    """One verdict per test: passed, the failure's kind (None when it passed, "wrong" for a
    wrong answer), the CPU seconds it took."""

    passed: tuple[bool, ...]
    kinds: tuple[str | None, ...]
    cpu_seconds: tuple[float, ...] = field(default=(), compare=False)

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0

    @classmethod
    def failed(cls, kind: str, n: int) -> Verdict:
        return cls((False,) * n, (kind,) * n, (0.0,) * n)


def _message(fields: Sequence[object]) -> bytes:
    """Text fields as the harness reads them: a 10-digit count, then each field's 10-digit
    byte length and UTF-8 bytes."""
    parts = [b"%010d" % len(fields)]
    for value in fields:
        data = str(value).encode("utf-8", "surrogatepass")
        parts += [b"%010d" % len(data), data]
    return b"".join(parts)


def _lines(data: bytes, nonce: str) -> list[list[str]]:
    """The harness's verdict lines (fields after the nonce), up to the first without it."""
    out = []
    for line in data.split(b"\n"):
        fields = line.decode("ascii", "replace").split("\t")
        if fields[0] != nonce:
            break
        out.append(fields[1:])
    return out


def _sandbox(
    program: str,
    tests: Tests,
    limits: Limits,
    packages: Packages | None = None,
    stop: threading.Event | None = None,
) -> tuple[list[list[str]], str]:
    """`program` against up to TESTS_PER_SANDBOX of `tests`, in a sandbox slot (one whose
    harness has `packages` loaded, when given; killed at once if `stop` is set already). The
    harness's verdict lines, and the kind of failure of the tests it sent none for."""
    n = len(tests.cases)
    stdio = tests.kind == "stdio"
    wire = limits.wire()
    nonce = secrets.token_hex(16)
    cases = [c[0] for c in tests.cases] if stdio else list(tests.cases)
    data = _message([program, tests.setup, n, int(stdio), *wire.values()]) + _message(
        [nonce, tests.kind, tests.entry_point or "", *cases]
    )
    cap = n * (wire["output"] * 2 + 4096) + 65536
    harness, mounted = (HARNESS, None) if packages is None else (packages.harness, packages.dir)
    slot = slots.take(harness, limits.scratch_mb << 20, mounted, stop)
    out, state = b"", "dead"
    try:
        out, state = slot.ask(data, time.monotonic() + n * (limits.wall + 1) + 10, cap)
    finally:
        lines = _lines(out, nonce)
        complete = state == "ok" and (len(lines) == n or lines[:1] == [["syntax"]])
        slots.give(slot, healthy=complete)
    if state == "dead" and not lines and slot.stderr.startswith(b"bwrap:"):
        raise Unavailable(slot.stderr.decode(errors="replace").strip().splitlines()[-1])
    return lines, {"wall": "wall", "output": "output"}.get(state, "sandbox")


def run_tests(
    program: str, tests: Tests, limits: Limits, stop: threading.Event | None = None
) -> Verdict:
    lines, missing = _sandbox(program, tests, limits, stop=stop)
    n = len(tests.cases)
    if lines and lines[0] == ["syntax"]:
        return Verdict.failed("syntax", n)
    passed, kinds, cpu = [False] * n, [missing] * n, [0.0] * n
    for fields in lines:
        try:
            index, mark, kind, seconds, out = fields
            i = int(index)
            if not 0 <= i < n:
                break
            cpu[i] = float(seconds)
        except ValueError:
            break
        kind = None if kind == "-" else kind
        if tests.kind == "stdio" and kind is None:
            kind = _compare(bytes.fromhex(out), tests.cases[i][1])
        elif kind is None and mark != "1":
            kind = "wrong"
        passed[i], kinds[i] = kind is None, kind
    return Verdict(tuple(passed), tuple(kinds), tuple(cpu))


def _compare(output: bytes, expected: str) -> str | None:
    """None when `output` is `expected` line by line (each line stripped, trailing blank lines
    ignored: open-r1's comparison, without its pass for missing lines); else the kind."""
    try:
        text = output.decode("utf-8")
    except UnicodeDecodeError:
        return "decode"
    got = [line.strip() for line in text.strip().splitlines()]
    want = [line.strip() for line in str(expected).strip().splitlines()]
    return None if got == want else "wrong"


def check(
    program: str,
    tests: Tests,
    limits: Limits | None = None,
    *,
    stop: threading.Event | None = None,
) -> Verdict:
    """Run `program` against `tests` in the sandbox: one verdict per test. Raises
    `Unavailable` when the sandbox cannot run here (never runs the program unsandboxed).
    `stop`: once set (a caller that was interrupted), no further sandbox runs this program
    (its tests not yet run fail as "sandbox"); one already running is the caller's to kill
    (`slots.kill_busy`)."""
    limits = limits or Limits()
    if not tests.cases:
        return Verdict((), ())
    parts = []
    for start in range(0, len(tests.cases), TESTS_PER_SANDBOX):
        chunk = Tests(tests.kind, tests.cases[start : start + TESTS_PER_SANDBOX], tests.setup,
                      tests.entry_point)  # fmt: skip
        if stop is not None and stop.is_set():
            parts.append(Verdict.failed("sandbox", len(chunk.cases)))
        else:
            parts.append(run_tests(program, chunk, limits, stop))
    return Verdict(
        sum((p.passed for p in parts), ()),
        sum((p.kinds for p in parts), ()),
        sum((p.cpu_seconds for p in parts), ()),
    )


@dataclass(frozen=True)
class Packages:
    """Third-party code a sandboxed program may import: the installed distributions `names`
    (and what they require), mounted read-only (`runtime.packages_dir`), and `preload`, the
    modules the harness imports once before it forks any worker, so that a program importing
    them pays nothing. For trusted programs that treat model text as data but hand it to a
    library that may evaluate it (a scorer calling sympy's parse_expr): the evaluation then
    happens where the model's own programs run."""

    names: tuple[str, ...]
    preload: tuple[str, ...] = ()

    @property
    def dir(self) -> Path:
        return packages_dir(self.names)

    @property
    def harness(self) -> str:
        lines = [f"import sys\nsys.path.insert(0, {PACKAGES_MOUNT!r})"]
        lines += [f"import {module}" for module in self.preload]
        return "\n".join(lines) + "\n" + HARNESS


@dataclass(frozen=True)
class Ran:
    """A program run once on an input: its stdout (None unless it exited 0 within its limits),
    the failure kind (None when it exited 0), the CPU seconds."""

    stdout: str | None
    kind: str | None
    cpu_seconds: float


def run(program: str, stdin: str = "", limits: Limits | None = None) -> Ran:
    """Run `program` once in the sandbox with `stdin`; its output comes back."""
    return run_each(program, [stdin], limits)[0]


def run_each(
    program: str,
    stdins: Sequence[str],
    limits: Limits | None = None,
    packages: Packages | None = None,
) -> list[Ran]:
    """Run `program` once per input, each in a worker of its own (TESTS_PER_SANDBOX to a
    sandbox request), with `packages` importable; each run's output comes back."""
    limits, out = limits or Limits(), []
    for start in range(0, len(stdins), TESTS_PER_SANDBOX):
        chunk = [(stdin, "") for stdin in stdins[start : start + TESTS_PER_SANDBOX]]
        lines, missing = _sandbox(program, Tests("stdio", tuple(chunk)), limits, packages)
        if lines[:1] == [["syntax"]]:
            out += [Ran(None, "syntax", 0.0)] * len(chunk)
            continue
        got = [Ran(None, missing, math.nan)] * len(chunk)
        for fields in lines:
            try:
                index, _, kind, seconds, hexed = fields
                i = int(index)
                if not 0 <= i < len(chunk):
                    break
                got[i] = _ran(kind, float(seconds), hexed)
            except ValueError:
                break
        out += got
    return out


def _ran(kind: str, seconds: float, hexed: str) -> Ran:
    if kind != "-":
        return Ran(None, kind, seconds)
    try:
        return Ran(bytes.fromhex(hexed).decode("utf-8"), None, seconds)
    except UnicodeDecodeError:
        return Ran(None, "decode", seconds)
