"""Helpers for the sandbox's tests: completions wrapping a program, and the host's view of
what sandboxes left running."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grouprl import sandbox
from grouprl.sandbox import slots
from grouprl.sandbox.runtime import UIDS

#: Text only the harness's command line holds: its processes (and forks) show it on the host.
MARKER = b"The program that runs inside the sandbox, as its process 1"

if sandbox.available() is not None:  # a Linux machine without user namespaces, or no bwrap
    pytest.skip(f"the sandbox cannot run here: {sandbox.available()}", allow_module_level=True)


def fenced(program: str) -> str:
    """A completion whose last ```python block is `program`."""
    return f"Here is my solution.\n```python\n{program}\n```\n"


def sandbox_processes() -> list[tuple[int, int, bytes]]:
    """(pid, real uid, command line) of every host process a sandbox started that is still
    running, except the sandboxes kept running between programs (each slot's bwrap and its
    harness, process 1 inside). Read once, with no grace period: a killed sandbox is gone by the
    time the call that killed it returns (`slots.Slot.close`). A zombie (state Z: ended, waiting
    for its parent to read its exit status) or a process being torn down (X) runs nothing and
    holds no memory: it is not counted."""
    return [(pid, uid, cmdline) for pid, uid, state, cmdline in _processes(kept_too=False)
            if state not in ("Z", "X")]  # fmt: skip


def all_sandbox_processes(kept_too: bool = True) -> list[tuple[int, int, bytes]]:
    """Every host process of this process's sandboxes now, zombies included: run as a uid this
    process holds (wherever on the machine it is), or descended from this process and carrying
    the harness's command line (a trainer that is not root runs them as itself). Without
    `kept_too`, not the sandboxes kept running (each slot's bwrap and process 1)."""
    return [(pid, uid, cmdline) for pid, uid, _, cmdline in _processes(kept_too)]


def _processes(kept_too: bool) -> list[tuple[int, int, str, bytes]]:
    """(pid, real uid, state letter, command line) of `all_sandbox_processes`."""
    ours = UIDS.held()
    kept = set() if kept_too else {slot.proc.pid for slot in slots._IDLE}
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid, parent = int(fields["Uid"].split()[0]), int(fields["PPid"])
        table[int(entry.name)] = (uid, parent, fields["State"].split()[0], cmdline)

    def descends(pid: int) -> bool:
        seen = set()
        while pid in table and pid not in seen:
            seen.add(pid)
            pid = table[pid][1]
            if pid == os.getpid():
                return True
        return False

    found = []
    for pid, (uid, parent, state, cmdline) in table.items():
        if pid in kept or parent in kept or pid == os.getpid():
            continue
        if uid in ours or (MARKER in cmdline and descends(pid)):
            found.append((pid, uid, state, cmdline[:80]))
    return found


def status_field(pid: int, name: str) -> str:
    text = Path(f"/proc/{pid}/status").read_text()
    return next(line for line in text.splitlines() if line.startswith(name + ":")).split()[1]
