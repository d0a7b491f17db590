"""The program that runs inside the sandbox, as its process 1: it runs a model's program against
its tests and reports one verdict per test, one request after another (`serve`), each in a
fresh fork of itself, killing everything the last program started before the next. Never imported by grouprl: `grouprl.sandbox` reads
this file as text and hands it to the sandboxed interpreter (`python -I -S -c`). Standard
library only, and only modules that import in well under a millisecond (no json, re, enum,
signal or selectors): start-up is most of a short program's check.

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

Wire format. In (from the trainer): two messages of text fields, each a 10-digit count, then
per field a 10-digit byte length and the UTF-8 bytes:
  program, setup, test count, "1" for stdin/stdout cases, then the limits (cpu, wall, memory,
  processes, open_files, file_size, output); and, after the workers are forked,
  nonce, kind ("stdio", "assert", "check"), entry point, then one field per test.
Out (to the trainer): one line per test, tab-separated: nonce, index, passed (1/0/-), failure
kind (or -), CPU seconds, the stdout as hex (stdin/stdout cases; else -); or a single line
"nonce syntax". Between this process and a worker: marshal frames of plain data, checked by
exact type on arrival here.
"""

import builtins
import ctypes
import marshal
import math
import os
import resource
import select
import sys
import time

HEADER = 10
MAX_DEPTH = 64
PLAIN = frozenset((type(None), bool, int, float, complex, str, bytes))
CONTAINERS = frozenset((list, tuple, set, frozenset, dict))
SIGKILL, SIGXCPU = 9, 24  # Linux's numbers (the signal module would import enum: 7 ms)
LIMIT_NAMES = ("cpu", "wall", "memory", "processes", "open_files", "file_size", "output")
#: A worker's reply other than "ok"/"ready", as the failure kind it makes ("memory" is itself).
REPLY_KINDS = {"raise": "error", "notplain": "not_plain"}


# ---------------------------------------------------------------------------------------------
# Messages and plain data


def read_exactly(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_fields(fd):
    """A message of the trainer's: its text fields."""
    count = int(read_exactly(fd, HEADER))
    return [read_exactly(fd, int(read_exactly(fd, HEADER))).decode() for _ in range(count)]


def write_all(fd, data):
    while data:
        data = data[os.write(fd, data) :]


def check_plain(x, depth=0):
    """`x` itself when it is plain data by exact type (no subclass, no code object), nested at
    most MAX_DEPTH deep; else NotPlain."""
    t = type(x)
    if t in PLAIN:
        return x
    if t not in CONTAINERS or depth > MAX_DEPTH:
        raise NotPlain(t.__name__ if depth <= MAX_DEPTH else "nested too deep")
    for item in x.items() if t is dict else x:
        if t is dict:
            check_plain(item[0], depth + 1)
            check_plain(item[1], depth + 1)
        else:
            check_plain(item, depth + 1)
    return x


def send(fd, obj):
    data = marshal.dumps(obj)
    write_all(fd, b"%010d" % len(data) + data)


def receive(fd):
    return marshal.loads(read_exactly(fd, int(read_exactly(fd, HEADER))))


class NotPlain(Exception):
    """A value that is not plain data (or nests too deep) cannot cross between processes."""


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
        low, high = sorted((ctl_r, out_w))  # close everything else: the trainer's channel too
        os.closerange(3, low)
        os.closerange(low + 1, high)
        os.closerange(high + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
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
        reply = ("ready", [k for k, v in namespace.items() if callable(v) and k[:2] != "__"])
    except MemoryError:
        reply = ("memory",)
    except BaseException:
        reply = ("raise",)
    send(wfd, reply)
    while True:
        name, args, kwargs = receive(rfd)
        try:
            result = namespace[name](*args, **kwargs)
            reply = ("ok", check_plain(result), check_plain(args))
        except NotPlain as err:
            reply = ("notplain", str(err))
        except MemoryError:
            reply = ("memory",)
        except BaseException:
            reply = ("raise",)
        send(wfd, reply)


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

    def wait(self, poll):
        """The ready (fd, events) of `poll`; Failed("wall") at the deadline."""
        events = poll.poll(max(0.0, self.deadline - time.monotonic()) * 1000)
        if not events:
            raise Failed("wall")
        return events

    def call(self, name, args, kwargs):
        try:
            send(self.ctl, (name, check_plain(args), check_plain(kwargs)))
        except (NotPlain, ValueError) as err:
            raise Failed("not_plain") from err
        except OSError:
            raise Failed("error") from None
        reply = self.reply()
        if reply[0] != "ok":
            raise Failed(REPLY_KINDS.get(reply[0], reply[0]))
        for old, new in zip(args, reply[2]):  # arguments the function changed in place
            if type(old) is list:
                old[:] = new
            elif type(old) in (dict, set):
                old.clear()
                old.update(new)
        return reply[1]

    def reply(self):
        """The worker's next message, checked to be plain data."""
        poll = select.poll()
        poll.register(self.out, select.POLLIN)
        self.wait(poll)
        try:
            reply = check_plain(receive(self.out))
        except (EOFError, ValueError, TypeError, NotPlain):
            raise Failed("error") from None
        if type(reply) is not tuple or not reply or type(reply[0]) is not str:
            raise Failed("error")
        if reply[0] == "ok" and (len(reply) != 3 or type(reply[2]) is not tuple):
            raise Failed("error")
        return reply

    def stdio(self, data, cap):
        """Feed `data` and collect the output (at most `cap` bytes) until the worker exits
        (what its leftover children print after that does not count)."""
        chunks = []
        data = memoryview(data)
        poll = select.poll()
        poll.register(self.out, select.POLLIN)
        poll.register(self.pidfd, select.POLLIN)
        if data:
            poll.register(self.stdin, select.POLLOUT)
        else:
            os.close(self.stdin)
        exited = False
        while not exited:
            for fd, _ in self.wait(poll):
                if fd == self.pidfd:
                    exited = True
                elif fd == self.out:
                    self.drain(chunks, cap, poll, once=True)
                elif fd == self.stdin:
                    try:
                        data = data[os.write(self.stdin, data[: 1 << 16]) :]
                    except BrokenPipeError:
                        data = data[:0]
                    if not data:
                        poll.unregister(self.stdin)
                        os.close(self.stdin)
        os.set_blocking(self.out, False)
        self.drain(chunks, cap, poll, once=False)
        return b"".join(chunks)

    def drain(self, chunks, cap, poll, once):
        """Read what the output pipe holds (one read `once`, else all of it); Failed("output")
        past `cap` bytes in all."""
        while True:
            try:
                chunk = os.read(self.out, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                try:  # noqa: SIM105
                    poll.unregister(self.out)
                except KeyError:  # already at its end
                    pass
                return
            chunks.append(chunk)
            if sum(map(len, chunks)) > cap:
                raise Failed("output")
            if once:
                return

    def finish(self, wait=False):
        """Kill the worker and what it started in its session (after it ends by itself, up to
        the deadline, with `wait`); its CPU seconds and exit status."""
        if wait and self.deadline is not None:
            poll = select.poll()
            poll.register(self.pidfd, select.POLLIN)
            try:  # noqa: SIM105
                self.wait(poll)
            except Failed:
                pass
        self.kill()
        return self.reap()

    def kill(self):
        for target in (-self.pid, self.pid):
            try:  # noqa: SIM105
                os.kill(target, SIGKILL)
            except OSError:
                pass

    def reap(self):
        """The (killed or ended) worker's CPU seconds and exit status."""
        _, status, usage = os.wait4(self.pid, 0)
        os.close(self.pidfd)
        return usage.ru_utime + usage.ru_stime, status


def timed_out(cpu, status, limits):
    return cpu > limits["cpu"] or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == SIGXCPU)


def judge_stdio(worker, test, limits):
    worker.go()
    kind, out = None, b""
    try:
        out = worker.stdio(test.encode(), limits["output"])
    except Failed as failed:
        kind = failed.kind
    cpu, status = worker.finish(wait=kind is None)
    if timed_out(cpu, status, limits):
        kind = "timeout"
    elif kind is None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == MEMORY_STATUS:
        kind = "memory"
    elif kind is None and status != 0:
        kind = "error"
    return None, kind, cpu, out.hex() if kind is None else "-"


def judge_call(worker, kind, test, setup, entry_point, limits):
    """An assert (kind "assert") or a checker (kind "check") run here against the worker."""
    worker.go()
    failure = None
    try:
        reply = worker.reply()
        if reply[0] != "ready":
            raise Failed(REPLY_KINDS.get(reply[0], reply[0]))
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
    worker.kill()  # reaped later, while the next tests run: a worker takes a while to end
    return failure


def proxy(worker, name):
    def call(*args, **kwargs):
        return worker.call(name, args, kwargs)

    call.__name__ = name
    return call


def report(nonce, index, passed, kind, cpu, out):
    mark = "-" if passed is None else str(int(passed))
    write_all(1, f"{nonce}\t{index}\t{mark}\t{kind or '-'}\t{cpu!r}\t{out}\n".encode())


def check_one():
    """One request: the program, its workers forked, then its tests; a verdict line each."""
    program, setup, count, stdio, *numbers = read_fields(0)
    limits = dict(zip(LIMIT_NAMES, map(float, numbers)))
    for name in LIMIT_NAMES[2:]:
        limits[name] = int(limits[name])
    count, stdio = int(count), stdio == "1"
    resource.setrlimit(resource.RLIMIT_NPROC, (count + limits["processes"] + 1,) * 2)
    try:
        code = compile(program, "<program>", "exec")
        setup = compile(setup, "<setup>", "exec")
        error = None
    except (SyntaxError, ValueError, MemoryError, RecursionError) as err:
        error = err
    workers = [] if error else [start_worker(code, setup, limits, stdio) for _ in range(count)]
    del program
    nonce, kind, entry, *tests = read_fields(0)  # only now: no worker's memory holds them
    if error:
        write_all(1, f"{nonce}\tsyntax\n".encode())
        return
    judged = []
    for index, (handles, test) in enumerate(zip(workers, tests)):
        worker = Worker(handles, limits)
        if stdio:
            report(nonce, index, *judge_stdio(worker, test, limits))
            continue
        try:
            compiled = compile(test, "<test>", "exec")
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            worker.kill()
            judged.append((index, worker, "format"))
            continue
        judged.append((index, worker, judge_call(worker, kind, compiled, setup, entry, limits)))
    for index, worker, failure in judged:
        cpu, status = worker.reap()
        if failure != "format" and timed_out(cpu, status, limits):
            failure = "timeout"
        report(nonce, index, failure is None, failure, cpu, "-")


def clean(path):
    """Remove everything under `path` (what a request left in the scratch directory)."""
    try:
        os.chmod(path, 0o1777 if path == "/tmp" else 0o700)
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                clean(entry.path)
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


def serve():
    """Requests one after another, each in a fresh fork of this process (which never reads a
    request itself, so no fork holds an earlier one's tests). After each, every other process
    of the namespace is killed and reaped and the scratch directory emptied, then "end" tells
    the trainer: nothing of one program outlives its request."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no worker reads this process's memory or fds
    waiting = select.poll()
    waiting.register(0, select.POLLIN)
    while True:
        if not any(event & select.POLLIN for _, event in waiting.poll()):
            return  # the trainer closed the channel
        pid = os.fork()
        if pid == 0:
            try:
                check_one()
            except BaseException as err:  # a bug of this harness: the trainer logs stderr
                write_all(2, f"harness: {type(err).__name__}: {err}\n".encode())
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        try:  # noqa: SIM105
            os.kill(-1, SIGKILL)  # every process but this one (process 1 is never signalled)
        except OSError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
        clean("/tmp")
        clean("/dev/shm")
        write_all(1, b"end\n")  # and only now: the trainer sees a clean sandbox


serve()
