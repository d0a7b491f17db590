"""What "nothing left running" means for the sandbox's tests, and that a killed sandbox leaves
nothing at all on the host, not even a zombie, by the time the call that killed it returns."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from tests.sandbox.conftest import MARKER, all_sandbox_processes, sandbox_processes

from grouprl import sandbox
from grouprl.sandbox import slots
from grouprl.sandbox.run import HARNESS, _sandbox
from grouprl.sandbox.runtime import UIDS

ROOT = os.geteuid() == 0


def spawn(script: str, **kwargs) -> tuple[subprocess.Popen, int | None]:
    """A shell running `script` that looks like a sandbox's process to the helpers: run as a
    sandbox uid this process holds when root (as root's sandboxes run), else carrying the
    harness's command line."""
    uid = UIDS.take() if ROOT else None
    user = {"user": uid, "group": uid, "extra_groups": []} if ROOT else {}
    args = ["/bin/sh", "-c", script, MARKER.decode()]
    return subprocess.Popen(args, **user, **kwargs), uid


@pytest.mark.skipif(not ROOT, reason="as non-root a sandbox's processes are found by their "
                    "command line, which a zombie no longer has")  # fmt: skip
def test_a_zombie_is_found_but_not_counted_as_running():
    proc, uid = spawn(":")
    try:
        # waits until it has ended, without reaping it: it stays a zombie of this process
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        assert Path(f"/proc/{proc.pid}/status").read_text().count("State:\tZ") == 1
        assert proc.pid in {pid for pid, *_ in all_sandbox_processes()}
        assert proc.pid not in {pid for pid, *_ in sandbox_processes()}
    finally:
        proc.wait()
        UIDS.give(uid)
    assert proc.pid not in {pid for pid, *_ in all_sandbox_processes()}


def test_a_live_leaked_process_is_counted():
    proc, uid = spawn("read line", stdin=subprocess.PIPE)
    try:  # it blocks on its stdin until this test closes it: alive throughout
        assert proc.pid in {pid for pid, *_ in sandbox_processes()}
    finally:
        proc.stdin.close()
        proc.wait()
        if uid is not None:
            UIDS.give(uid)
    assert proc.pid not in {pid for pid, *_ in sandbox_processes()}


def descendants(pid: int) -> dict[int, int]:
    """Every host process below `pid`, with its depth (1 for a child)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if entry.name.isdigit():
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    depth = {pid: 0}
    changed = True
    while changed:
        changed = False
        for child, parent in parents.items():
            if parent in depth and child not in depth:
                depth[child], changed = depth[parent] + 1, True
    del depth[pid]
    return depth


def test_a_killed_sandbox_leaves_no_process_and_no_zombie():
    """Killed while its program runs (with a child of its own), a sandbox is gone from the host
    process table as soon as its slot is closed: bwrap, process 1, the request's fork, the
    worker and the program's child, none of them even a zombie."""
    program = "import os, time\nif os.fork() == 0:\n    time.sleep(120)\ntime.sleep(120)"
    limits = sandbox.Limits(wall_seconds=120)
    done: list = []
    thread = threading.Thread(target=lambda: done.append(
        _sandbox(program, sandbox.Tests.stdio([("", "")]), limits)))  # fmt: skip
    slots.close_all()
    thread.start()
    tree: dict[int, int] = {}
    # bwrap > process 1 > the request's fork > the worker > the program's child: depth 4 below
    # bwrap exists only once the program runs (waiting on the process table, not on a clock)
    while thread.is_alive() and max(tree.values(), default=0) < 4:
        busy = list(slots._BUSY)
        tree = {busy[0].proc.pid: 0, **descendants(busy[0].proc.pid)} if busy else {}
    assert max(tree.values(), default=0) == 4, (tree, done)
    slots.kill_busy()
    thread.join()
    assert done and done[0][1] == "sandbox"  # ended early: no verdict
    left = [pid for pid in tree if Path(f"/proc/{pid}").exists()]
    assert not left, [(pid, Path(f"/proc/{pid}/status").read_text()[:200]) for pid in left]


def test_a_call_stopped_while_its_sandbox_starts_runs_nothing_after(monkeypatch):
    """The interruption lands while a check's sandbox is still starting (held there until the
    call has killed what was busy): the slot it then gets is killed before the program runs,
    so the call ends at once rather than after the program's whole run."""
    from grouprl.tasks.base import TimeLimitExceeded, time_limit

    started, release = threading.Event(), threading.Event()
    real_slot, real_kill_busy = slots.Slot, slots.kill_busy

    def slow_start(*args, **kwargs):
        started.set()
        release.wait()  # set only once the interrupted call has killed what was busy
        return real_slot(*args, **kwargs)

    def kill_busy():
        real_kill_busy()
        release.set()

    monkeypatch.setattr(slots, "Slot", slow_start)
    monkeypatch.setattr(slots, "kill_busy", kill_busy)
    slots.close_all()
    sleep = 60.0
    job = (f"import time\ntime.sleep({sleep})", sandbox.Tests.stdio([("", "")]))
    clock = time.monotonic()
    with pytest.raises(TimeLimitExceeded), time_limit(0.5):
        sandbox.check_many([job], sandbox.Limits(wall_seconds=sleep))
    assert started.is_set()
    # the program's sleep is what a call that let it run would take; half of it tells them apart
    assert time.monotonic() - clock < sleep / 2
    assert not all_sandbox_processes(kept_too=False)


def test_a_caller_interrupted_while_its_sandbox_starts_leaves_nothing(monkeypatch):
    """The interruption (a reward's time limit, in the main thread) lands while the spawner
    thread is starting the sandbox: the start is finished, then killed, before it goes on."""

    class Interrupted(BaseException):
        pass

    interrupted, started = threading.Event(), []
    real_start = slots._start

    def on_signal(signum, frame):
        interrupted.set()
        raise Interrupted

    def start(*args):  # in the spawner thread, while the caller waits for it
        started.append(real_start(*args))
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        interrupted.wait()  # the caller is interrupted before this start is handed back
        return started[0]

    monkeypatch.setattr(slots, "_start", start)
    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        with pytest.raises(Interrupted):
            slots.take(HARNESS, 16 << 20)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    proc, pidfd = started[0]
    assert pidfd is not None and proc.returncode is not None  # killed through process 1, reaped
    assert not all_sandbox_processes(kept_too=False)  # not even a zombie
    in_use = {slot.uid for slot in [*slots._IDLE, *slots._BUSY] if slot.uid is not None}
    assert UIDS.held() == set(UIDS._free) | in_use  # its uid given back
