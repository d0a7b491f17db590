"""The program that runs inside the sandbox, as its process 1: it runs a model's program against
its tests and reports one verdict per test. Never imported by grouprl: `grouprl.sandbox` reads
this file as text and hands it to the sandboxed interpreter (`python -I -S -c`). Standard
library only.

Why the verdicts cannot be forged. The model's program never runs in this process: each test
gets a worker forked *before* the tests are read (so no worker's memory holds a test or an
expected output), which sets its own limits and runs the program. This process is not dumpable
(no worker can read its memory or its file descriptors) and, as process 1 of the sandbox's PID
namespace, cannot be killed from inside it. Stdin/stdout cases: the worker's output goes back to
the trainer, which compares it with the expected output it never sent. Assert and checker tests
run here, in this process, with the program's functions as proxies: a call crosses to the
worker and returns plain data only (numbers, strings, bytes, lists, tuples, dicts, sets, None,
by exact type), so a returned object cannot lie in `__eq__`, and nothing the program does
(exiting early, patching `assert`'s helpers, printing) reaches the checking code. Each verdict
goes out with a nonce the workers never saw.

Wire format, both ways: frames of 10 ASCII digits (the length) then that many bytes of JSON.
In: {"program", "setup", "tests": count, "limits"}; then {"nonce", "kind", "tests"}. Out: one
frame per test, {"nonce", "index", "passed", "kind", "cpu", "stdout"} (stdout base64, stdin/
stdout cases only), or a single {"nonce", "syntax": message}.
"""

import base64
import builtins
import contextlib
import ctypes
import json
import math
import os
import resource
import selectors
import signal
import sys
import time

HEADER = 10
MAX_DEPTH = 64
PLAIN = (type(None), bool, int, float, str)


# ---------------------------------------------------------------------------------------------
# Frames and plain data


def read_exactly(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(fd):
    return json.loads(read_exactly(fd, int(read_exactly(fd, HEADER))))


def write_frame(fd, obj):
    data = json.dumps(obj).encode()
    data = b"%010d" % len(data) + data
    while data:
        data = data[os.write(fd, data) :]


class NotPlain(Exception):
    """A value that is not plain data (or nests too deep) cannot cross between processes."""


def encode(x, depth=0):
    """Plain data as JSON with tagged containers; exact types only (no subclasses)."""
    if depth > MAX_DEPTH:
        raise NotPlain("nested too deep")
    t = type(x)
    if t in PLAIN:
        return x
    if t in (list, tuple, set, frozenset):
        items = sorted(x, key=repr) if t in (set, frozenset) else x
        return [t.__name__, [encode(i, depth + 1) for i in items]]
    if t is dict:
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]]
    if t is bytes:
        return ["bytes", x.hex()]
    if t is complex:
        return ["complex", [x.real, x.imag]]
    raise NotPlain(t.__name__)


def decode(x):
    if not isinstance(x, list):
        return x
    tag, value = x
    if tag == "dict":
        return {decode(k): decode(v) for k, v in value}
    if tag == "bytes":
        return bytes.fromhex(value)
    if tag == "complex":
        return complex(*value)
    return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](
        decode(i) for i in value
    )


# ---------------------------------------------------------------------------------------------
# The workers: model code runs only there


def start_worker(code, setup, limits, stdio):
    """Fork one worker; it waits for its go before running anything. Returns (pid, control
    fd to write, reply/output fd to read, stdin fd to write or None)."""
    ctl_r, ctl_w = os.pipe()
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe() if stdio else (None, None)
    pid = os.fork()
    if pid:
        for fd in (ctl_r, out_w, in_r):
            if fd is not None:
                os.close(fd)
        return pid, ctl_w, out_r, in_w
    try:
        null = os.open("/dev/null", os.O_RDWR)
        os.dup2(in_r if stdio else null, 0)
        os.dup2(out_w if stdio else null, 1)
        os.dup2(null, 2)
        keep = {0, 1, 2, ctl_r, out_w}
        for fd in os.listdir("/proc/self/fd"):  # everything else: the trainer's channel included
            if int(fd) not in keep:
                with contextlib.suppress(OSError):
                    os.close(int(fd))
        os.setsid()
        cpu = max(1, math.ceil(limits["cpu"]))
        for name, value in (
            ("RLIMIT_CPU", (cpu, cpu + 1)),
            ("RLIMIT_AS", (limits["memory"],) * 2),
            ("RLIMIT_FSIZE", (limits["file_size"],) * 2),
            ("RLIMIT_NOFILE", (limits["open_files"],) * 2),
            ("RLIMIT_CORE", (0, 0)),
        ):
            resource.setrlimit(getattr(resource, name), value)
        if not os.read(ctl_r, 1):  # the go (EOF: this worker's test never runs)
            os._exit(0)
        if stdio:
            os.close(ctl_r)
            os.close(out_w)
            os._exit(run_main(code, setup))
        run_server(code, setup, ctl_r, out_w)
    finally:
        os._exit(1)


MEMORY_STATUS = 86


def run_main(code, setup):
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(setup, namespace)
        exec(code, namespace)
        sys.stdout.flush()
    except SystemExit as stop:
        sys.stdout.flush()
        return stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except MemoryError:
        return MEMORY_STATUS
    except BaseException:
        return 1
    return 0


def run_server(code, setup, rfd, wfd):
    """Run the program's top level, then answer calls of its functions with plain data."""
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(setup, namespace)
        exec(code, namespace)
        reply = ["ready", [k for k, v in namespace.items() if callable(v) and k[:2] != "__"]]
    except MemoryError:
        reply = ["memory"]
    except BaseException as err:
        reply = ["raise", type(err).__name__]
    write_frame(wfd, reply)
    while True:
        name, args, kwargs = read_frame(rfd)
        try:
            args, kwargs = decode(args), decode(kwargs)
            result = namespace[name](*args, **kwargs)
            reply = ["ok", encode(result), encode(args)]
        except NotPlain as err:
            reply = ["notplain", str(err)]
        except MemoryError:
            reply = ["memory"]
        except BaseException as err:
            reply = ["raise", type(err).__name__]
        write_frame(wfd, reply)


# ---------------------------------------------------------------------------------------------
# This process: runs each test against its worker and judges it


class Failed(BaseException):
    """A test failed for a reason other than a wrong answer: `kind` names it. A BaseException:
    test code's own `except Exception` cannot swallow it."""

    def __init__(self, kind):
        super().__init__(kind)
        self.kind = kind


class Worker:
    def __init__(self, handles, limits):
        self.pid, self.ctl, self.out, self.stdin = handles
        self.limits = limits
        self.deadline = None
        self.pidfd = os.pidfd_open(self.pid)

    def go(self):
        self.deadline = time.monotonic() + self.limits["wall"]
        os.write(self.ctl, b"g")

    def wait_readable(self, fd):
        """Wait until `fd` can be read; Failed("wall") at the deadline."""
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            if not sel.select(max(0.0, self.deadline - time.monotonic())):
                raise Failed("wall")

    def call(self, name, args, kwargs):
        try:
            write_frame(self.ctl, [name, encode(list(args)), encode(kwargs)])
        except NotPlain as err:
            raise Failed("not_plain") from err
        except OSError:
            raise Failed("error") from None
        reply = self.reply()
        if reply[0] != "ok":
            raise Failed({"raise": "error", "notplain": "not_plain"}.get(reply[0], reply[0]))
        for old, new in zip(args, decode(reply[2])):  # arguments the function changed in place
            if type(old) is list:
                old[:] = new
            elif type(old) in (dict, set):
                old.clear()
                old.update(new)
        return decode(reply[1])

    def reply(self):
        self.wait_readable(self.out)
        try:
            return read_frame(self.out)
        except (EOFError, ValueError):
            raise Failed("error") from None

    def stdio(self, data, cap):
        """Feed `data` and collect the output (at most `cap` bytes) until the worker exits
        (what its leftover children print after that does not count)."""
        chunks, size = [], 0
        data = memoryview(data)
        with selectors.DefaultSelector() as sel:
            sel.register(self.out, selectors.EVENT_READ)
            sel.register(self.pidfd, selectors.EVENT_READ)
            if data:
                sel.register(self.stdin, selectors.EVENT_WRITE)
            else:
                os.close(self.stdin)
            exited = False
            while not exited:
                events = sel.select(max(0.0, self.deadline - time.monotonic()))
                if not events:
                    raise Failed("wall")
                for key, _ in events:
                    if key.fd == self.pidfd:
                        exited = True
                        os.set_blocking(self.out, False)
                    elif key.fd == self.out:
                        size += self.drain(chunks, cap - size, sel)
                    else:
                        try:
                            data = data[os.write(self.stdin, data[: 1 << 16]) :]
                        except BrokenPipeError:
                            data = data[:0]
                        if not data:
                            sel.unregister(self.stdin)
                            os.close(self.stdin)
            self.drain(chunks, cap - size, sel)
        return b"".join(chunks)

    def drain(self, chunks, room, sel):
        """Read what the output pipe holds (one read while the worker runs, all of it after);
        Failed("output") past `room` bytes. The bytes read."""
        got = 0
        while True:
            try:
                chunk = os.read(self.out, 1 << 16)
            except BlockingIOError:
                return got
            if not chunk:
                if self.out in sel.get_map():
                    sel.unregister(self.out)
                return got
            got += len(chunk)
            if got > room:
                raise Failed("output")
            chunks.append(chunk)
            if os.get_blocking(self.out):
                return got

    def finish(self, wait=False):
        """Kill the worker and what it started in its session (after it ends by itself, up to
        the deadline, with `wait`); its CPU seconds and exit status."""
        if wait and self.deadline is not None:
            with contextlib.suppress(Failed):
                self.wait_readable(self.pidfd)
        for target in (-self.pid, self.pid):
            with contextlib.suppress(OSError):
                os.kill(target, signal.SIGKILL)
        _, status, usage = os.wait4(self.pid, 0)
        return usage.ru_utime + usage.ru_stime, status


def judge_stdio(worker, test, limits):
    worker.go()
    kind, out = None, b""
    try:
        out = worker.stdio(test.encode(), limits["output"])
    except Failed as failed:
        kind = failed.kind
    cpu, status = worker.finish(wait=kind is None)
    if cpu > limits["cpu"] or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU):
        kind = "timeout"
    elif kind is None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == MEMORY_STATUS:
        kind = "memory"
    elif kind is None and status != 0:
        kind = "error"
    return {"passed": None, "kind": kind, "cpu": cpu, "stdout": base64.b64encode(out).decode()}


def judge_call(worker, kind, test, setup, entry_point, limits):
    """An assert (kind "assert") or a checker (kind "check") run here against the worker."""
    worker.go()
    failure = None
    try:
        reply = worker.reply()
        if reply[0] != "ready":
            raise Failed({"raise": "error"}.get(reply[0], reply[0]))
        namespace = {"__name__": "tests", "__builtins__": builtins}
        exec(setup, namespace)
        for name in reply[1]:
            namespace[name] = proxy(worker, name)
        exec(test, namespace)
        if kind == "check":
            if entry_point not in reply[1]:
                raise Failed("error")
            namespace["check"](namespace[entry_point])
    except Failed as failed:
        failure = failed.kind
    except AssertionError:
        failure = "wrong"
    except Exception:
        failure = "error"
    cpu, status = worker.finish()
    if cpu > limits["cpu"] or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU):
        failure = "timeout"
    return {"passed": failure is None, "kind": failure, "cpu": cpu}


def proxy(worker, name):
    def call(*args, **kwargs):
        return worker.call(name, args, kwargs)

    call.__name__ = name
    return call


def serve():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no worker reads this process's memory or fds
    job = read_frame(0)
    limits = job["limits"]
    count = job["tests"]
    resource.setrlimit(resource.RLIMIT_NPROC, (count + limits["processes"],) * 2)
    stdio = job["stdio"]
    try:
        code = compile(job["program"], "<program>", "exec")
        setup = compile(job["setup"], "<setup>", "exec")
        error = None
    except (SyntaxError, ValueError, MemoryError, RecursionError) as err:
        error = f"{type(err).__name__}: {err}"[:500]
    workers = [] if error else [start_worker(code, setup, limits, stdio) for _ in range(count)]
    del job
    tests = read_frame(0)  # only now: no worker's memory holds them
    nonce = tests["nonce"]
    if error:
        write_frame(1, {"nonce": nonce, "syntax": error})
        return
    for index, (handles, test) in enumerate(zip(workers, tests["tests"])):
        worker = Worker(handles, limits)
        if stdio:
            verdict = judge_stdio(worker, test, limits)
        else:
            try:
                compiled = compile(test, "<test>", "exec")
            except (SyntaxError, ValueError, MemoryError, RecursionError):
                worker.finish()
                write_frame(1, {"nonce": nonce, "index": index, "passed": False, "kind": "format"})
                continue
            verdict = judge_call(worker, tests["kind"], compiled, setup, tests["entry"], limits)
        write_frame(1, {"nonce": nonce, "index": index, **verdict})


serve()
