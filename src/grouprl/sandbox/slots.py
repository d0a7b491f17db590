"""Sandboxes kept running between programs: a slot is one bwrap process whose harness checks one
request after another (a fresh fork of it for each, every process of the last one killed and the
scratch directory emptied in between), so a program costs a fork rather than bwrap's set-up and
an interpreter's start. A slot holds its uid for its life; it is dropped (killed, its uid
returned) after any request that does not end cleanly, and dies with the trainer
(`--die-with-parent`, and end of input)."""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import select
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
        args, kwargs, box, done = _SPAWNS.get()
        try:
            box.append(subprocess.Popen(args, **kwargs))
        except BaseException as err:
            box.append(err)
        done.set()


def _popen(args: list[str], **kwargs) -> subprocess.Popen:
    """Popen from one thread that lives as long as this process: bwrap's --die-with-parent
    kills the sandbox when the *thread* that started it ends (Linux's parent-death signal
    follows the thread), and reward calls start their threads anew."""
    with _LOCK:
        if not _SPAWNER:
            _SPAWNER.append(threading.Thread(target=_spawner, name="sandbox-spawner", daemon=True))
            _SPAWNER[0].start()
    box: list = []
    done = threading.Event()
    _SPAWNS.put((args, kwargs, box, done))
    done.wait()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


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
            self.proc = _popen(
                args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                close_fds=True, start_new_session=True, **user,
            )  # fmt: skip
        except OSError as err:
            self._give_uid()
            raise Unavailable(f"cannot start {args[0]}: {err}") from None
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

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()
        self._give_uid()

    def _give_uid(self) -> None:
        if self.uid is not None:
            UIDS.give(self.uid)
            self.uid = None


_IDLE: list[Slot] = []
_BUSY: set[Slot] = set()


def take(harness: str, scratch_bytes: int, packages: Path | None = None) -> Slot:
    """An idle slot running this harness with this scratch size and packages, or a new one."""
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
    if found is not None:
        return found
    slot = Slot(harness, scratch_bytes, packages)
    with _LOCK:
        _BUSY.add(slot)
    return slot


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
        with contextlib.suppress(OSError):
            slot.proc.kill()


@atexit.register
def close_all() -> None:
    """Close every slot (their sandboxes end with this process in any case)."""
    with _LOCK:
        slots = [*_IDLE, *_BUSY]
        _IDLE.clear()
        _BUSY.clear()
    for slot in slots:
        slot.close()
