"""Sandboxes kept running between programs: a slot is one bwrap process whose harness checks one
request after another (a fresh fork of it for each, every process of the last one killed and the
scratch directory emptied in between), so a program costs a fork rather than bwrap's set-up and
an interpreter's start. A slot holds its uid for its life; it is dropped (killed, its uid
returned) after any request that does not end cleanly, and dies with the trainer
(`--die-with-parent`, and end of input).

A slot is killed through its process 1 (bwrap's child, the harness), never through bwrap: the
kernel kills every other process of the sandbox's PID namespace and reaps them before process 1
itself ends, bwrap reaps process 1 and exits, and the trainer reaps bwrap. So once `close`
returns nothing of the sandbox is left on the host, not even a zombie, and its uid goes back to
the pool with no process counted against it. (Killing bwrap first orphans process 1: it ends as
a zombie of the host's init, which reaps it when it gets to it, seen here after up to 1.5 s.)"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import select
import signal
import subprocess
import threading
import time
from pathlib import Path

from grouprl.sandbox.runtime import UIDS, Unavailable, command, runtime

_END = b"end\n"
_LOCK = threading.Lock()
_SPAWNS: queue.Queue = queue.Queue()
_SPAWNER: list[threading.Thread] = []


def _spawner() -> None:
    while True:
        start, box, done = _SPAWNS.get()
        try:
            box.append(start())
        except BaseException as err:
            box.append(err)
        done.set()


def _start(args: list[str], user: dict) -> tuple[subprocess.Popen, int | None]:
    """bwrap started, with a pidfd of its child (process 1 of the sandbox) once bwrap has said
    which it is; run in the spawner thread (see `_spawned`)."""
    info, info_w = os.pipe()  # bwrap writes its child's pid there
    with os.fdopen(info, "rb") as info_stream:
        try:
            proc = subprocess.Popen(
                [args[0], "--info-fd", str(info_w), *args[1:]],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                close_fds=True, pass_fds=(info_w,), start_new_session=True, **user,
            )  # fmt: skip
        finally:
            os.close(info_w)
        try:
            return proc, _child_pidfd(info_stream.read(), proc.pid)
        except BaseException:
            _end(proc, None)
            raise


def _spawned(args: list[str], user: dict) -> tuple[subprocess.Popen, int | None]:
    """`_start` run in one thread that lives as long as this process: bwrap's
    --die-with-parent kills the sandbox when the *thread* that started it ends (Linux's
    parent-death signal follows the thread), and reward calls start their threads anew. A
    caller interrupted while it waits (a reward's time limit) still waits for the start to
    finish, and kills what it made, before the interruption goes on."""
    with _LOCK:
        if not _SPAWNER:
            _SPAWNER.append(threading.Thread(target=_spawner, name="sandbox-spawner", daemon=True))
            _SPAWNER[0].start()
    box: list = []
    done = threading.Event()
    _SPAWNS.put((lambda: _start(args, user), box, done))
    try:
        done.wait()
    except BaseException:
        done.wait()
        if not isinstance(box[0], BaseException):
            _end(*box[0])
        raise
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _kill(proc: subprocess.Popen, pidfd: int | None) -> None:
    """Kill a sandbox through its process 1 (bwrap then exits by itself), or bwrap itself when
    its child is not known (bwrap never got as far as starting one)."""
    if pidfd is not None:
        with contextlib.suppress(ProcessLookupError):  # ended already
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return
    with contextlib.suppress(OSError):
        proc.kill()


def _end(proc: subprocess.Popen, pidfd: int | None) -> None:
    """Kill a sandbox and wait until nothing of it is left: bwrap ends only after it has
    reaped process 1, which ends only after every other process of its namespace."""
    _kill(proc, pidfd)
    proc.wait()
    if pidfd is not None:
        os.close(pidfd)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        stream.close()


class Slot:
    """One running sandbox, used by one thread at a time."""

    def __init__(self, harness: str, scratch_bytes: int, packages: Path | None = None) -> None:
        rt = runtime()
        self.scratch_bytes, self.harness, self.packages = scratch_bytes, harness, packages
        self.uid = UIDS.take() if rt.as_root else None
        user = (
            {"user": self.uid, "group": self.uid, "extra_groups": []}
            if self.uid is not None
            else {}
        )
        args = command(rt, harness, scratch_bytes, packages)
        try:
            self.proc, self._pidfd = _spawned(args, user)
        except OSError as err:
            self._give_uid()
            raise Unavailable(f"cannot start {args[0]}: {err}") from None
        except BaseException:
            self._give_uid()
            raise
        self._lock = threading.Lock()  # kill (any thread) against close (the owner)
        self._closing = False
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            os.set_blocking(stream.fileno(), False)
        self.stderr = bytearray()

    def ask(self, data: bytes, deadline: float, cap: int) -> tuple[bytes, str]:
        """Send one request, read its answer up to "end". (answer, state): state "ok", "wall"
        (past `deadline`), "output" (past `cap` bytes) or "dead" (the sandbox ended)."""
        out, view = bytearray(), memoryview(data)
        stdin, stdout, stderr = (s.fileno() for s in (self.proc.stdin, self.proc.stdout,
                                                      self.proc.stderr))  # fmt: skip
        poll = select.poll()
        poll.register(stdout, select.POLLIN)
        poll.register(stderr, select.POLLIN)
        poll.register(stdin, select.POLLOUT)
        while True:
            events = poll.poll(max(0.0, deadline - time.monotonic()) * 1000)
            if not events:
                return bytes(out), "wall"
            for fd, _ in events:
                if fd == stdin:
                    try:
                        view = view[os.write(stdin, view[: 1 << 16]) :]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        self._read_stderr()
                        return bytes(out), "dead"
                    if not view:
                        poll.unregister(stdin)
                    continue
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    self._read_stderr()
                    return bytes(out), "dead"
                if fd == stderr:
                    self.stderr = (self.stderr + chunk)[-(1 << 16) :]
                    continue
                out += chunk
                if out.endswith(_END) and (len(out) == len(_END) or out[-5:-4] == b"\n"):
                    return bytes(out[: -len(_END)]), "ok"
                if len(out) > cap:
                    return bytes(out), "output"

    def _read_stderr(self) -> None:
        """What an ended sandbox said on stderr (bwrap's reason when it could not start)."""
        try:
            self.proc.wait(timeout=1)
            while chunk := os.read(self.proc.stderr.fileno(), 1 << 16):
                self.stderr = (self.stderr + chunk)[-(1 << 16) :]
        except (OSError, subprocess.TimeoutExpired):
            pass

    def kill(self) -> None:
        """Kill the sandbox (any thread; its owner then sees it dead and closes it)."""
        with self._lock:
            if not self._closing:  # else `close` kills it, and its pidfd may be closed
                _kill(self.proc, self._pidfd)

    def close(self) -> None:
        """Kill the sandbox and wait until nothing of it is left on the host, not even a
        zombie; its uid goes back to the pool."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        _end(self.proc, self._pidfd)
        self._give_uid()

    def _give_uid(self) -> None:
        if self.uid is not None:
            UIDS.give(self.uid)
            self.uid = None


def _child_pidfd(info: bytes, bwrap: int) -> int | None:
    """A pidfd of bwrap's child, from what bwrap wrote on its info fd (`info`, JSON) once it
    had started the child; None when bwrap wrote nothing (it could not start it) or the child
    is gone already. Opened while bwrap, our child, is not yet reaped: the pid is still its
    child's unless that child ended and the pid was taken again, which the parent check rules
    out."""
    try:
        pid = int(json.loads(info)["child-pid"])
        pidfd = os.pidfd_open(pid)
    except (ValueError, KeyError, TypeError, OSError):
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        parent = None
    if parent != bwrap:
        os.close(pidfd)
        return None
    return pidfd


_IDLE: list[Slot] = []
_BUSY: set[Slot] = set()


def take(
    harness: str,
    scratch_bytes: int,
    packages: Path | None = None,
    stop: threading.Event | None = None,
) -> Slot:
    """An idle slot running this harness with this scratch size and packages, or a new one;
    killed before it is returned when `stop` is set by then. (A caller that sets `stop` and
    then calls `kill_busy` kills every slot its threads hold or are starting: a slot made busy
    after `kill_busy` looked sees `stop` set here.)"""
    ended = []
    found = None
    with _LOCK:
        for slot in list(_IDLE):
            if slot.proc.poll() is not None:  # ended while idle: closed, its uid returned
                _IDLE.remove(slot)
                ended.append(slot)
            elif found is None and (slot.harness, slot.scratch_bytes, slot.packages) == (
                    harness, scratch_bytes, packages):  # fmt: skip
                _IDLE.remove(slot)
                _BUSY.add(slot)
                found = slot
    for slot in ended:
        slot.close()
    if found is None:
        found = Slot(harness, scratch_bytes, packages)
        with _LOCK:
            _BUSY.add(found)
    if stop is not None and stop.is_set():
        found.kill()
    return found


def give(slot: Slot, healthy: bool) -> None:
    """Back to the idle slots when its request ended cleanly; else closed."""
    with _LOCK:
        _BUSY.discard(slot)
        if healthy:
            _IDLE.append(slot)
    if not healthy:
        slot.close()


def kill_busy() -> None:
    """Kill every slot in use (a reward call that was stopped); its thread then drops it."""
    with _LOCK:
        busy = list(_BUSY)
    for slot in busy:
        slot.kill()


@atexit.register
def close_all() -> None:
    """Close every slot (their sandboxes end with this process in any case)."""
    with _LOCK:
        slots = [*_IDLE, *_BUSY]
        _IDLE.clear()
        _BUSY.clear()
    for slot in slots:
        slot.close()
