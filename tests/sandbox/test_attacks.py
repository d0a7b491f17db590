"""Hostile programs, run through the code reward exactly as completions are: each is contained
(no effect outside the sandbox, the trainer unaffected, no process left behind) and scores 0.

Every attack's test is built so that the attack succeeding would *pass* it (the expected output
is what only a successful attack prints), and a well-behaved completion scored in the same
batch still scores 1. The whole file takes about 15 s on 2 cores (CPU limits of 1 s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
from tests.sandbox.conftest import (
    all_sandbox_processes,
    fenced,
    sandbox_processes,
    status_field,
)

from grouprl import sandbox
from grouprl.sandbox import slots
from grouprl.sandbox.runtime import runtime
from grouprl.tasks.rewards.code import code_reward

LIMITS = sandbox.Limits(cpu_seconds=1.0, wall_seconds=4.0, processes=8, memory_mb=256,
                        scratch_mb=4, file_mb=2, output_kb=64)  # fmt: skip
REWARD = code_reward(limits=LIMITS)
HONEST = "print(sum(map(int, input().split())))"


def score(program: str, expected: str, reward=REWARD) -> tuple[float, float, dict[str, float]]:
    """The hostile program's reward, an honest program's in the same batch, and the metrics,
    for a stdin/stdout case whose expected output only the attack's success prints."""
    logged: dict[str, float] = {}
    info = {"language": "python", "test_cases": [{"input": "2 3\n", "output": expected}]}
    honest = {"language": "python", "test_cases": [{"input": "2 3\n", "output": "5"}]}
    scores = reward(
        [fenced(program), fenced(HONEST)],
        verification_info=[info, honest],
        log_metric=lambda k, v: logged.__setitem__(k, v),
    )
    assert not sandbox_processes(), sandbox_processes()
    return scores[0], scores[1], logged


def contained(program: str, expected: str = "ESCAPED", reward=REWARD) -> dict[str, float]:
    hostile, honest, logged = score(program, expected, reward)
    assert (hostile, honest) == (0.0, 1.0)
    return logged


# --- identity: checked first, the fork bomb relies on them -------------------------------------


def uid_and_limits_hold() -> None:
    """Seen from the host, every sandboxed process has a non-zero real uid and no capabilities
    once it runs anything but bwrap itself (bwrap's child, while it sets the sandbox up, holds
    every capability of the new user namespace: that is how an unprivileged bwrap mounts; it
    drops them before it executes the harness); a fork past the process limit fails inside."""
    bwrap = str(runtime().bwrap).encode()
    seen: list[tuple[int, str, bytes]] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            for pid, uid, _ in all_sandbox_processes():
                with contextlib.suppress(OSError, StopIteration):
                    # the command line first: a process that runs the harness never runs bwrap again
                    program = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                    seen.append((uid, status_field(pid, "CapEff"), program))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        ran = sandbox.run("import time\ntime.sleep(0.5)\nprint('ok')", limits=LIMITS)
    finally:
        done.set()
        watcher.join()
    assert ran.stdout == "ok\n"
    assert any(program != bwrap for *_, program in seen), f"no sandboxed program was seen: {seen}"
    assert all(uid != 0 for uid, *_ in seen), seen
    assert all(cap == "0" * 16 for _, cap, program in seen if program != bwrap), seen
    forks = sandbox.run(
        "import os, time\nn = 0\nfor _ in range(64):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(5)\n"
        "        os._exit(0)\n    n += 1\nprint(n)",
        limits=LIMITS,
    )
    assert forks.stdout is not None and int(forks.stdout) < LIMITS.processes + 1, forks


def test_the_program_runs_unprivileged_and_its_forks_are_bounded():
    uid_and_limits_hold()
    inside = sandbox.run(
        "import os\nstatus = open('/proc/self/status').read().split('\\n')\n"
        "print(os.getuid(), [l.split()[1] for l in status if l.startswith('CapEff')][0])",
        limits=LIMITS,
    )
    uid, caps = inside.stdout.split()
    assert int(uid) != 0 and caps == "0000000000000000", inside


def test_a_fork_bomb_is_contained():
    uid_and_limits_hold()  # only then can the bomb not take the machine down
    logged = contained("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                       "        pass")  # fmt: skip
    # ended by its own limits (CPU time, or the wall clock when its forks crowd it out), not by
    # the trainer giving up on the sandbox ("sandbox")
    assert logged.get("code_errors/timeout", 0) + logged.get("code_errors/wall", 0) == 1.0, logged


# --- the network, the host's files and environment ---------------------------------------------


def test_no_connection_reaches_a_listener_on_the_host():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        contained(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), 1)\n"
                  "print('ESCAPED')")  # fmt: skip
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_secrets_in_the_temporary_and_home_directories_are_not_readable(tmp_path):
    token = f"tok-{secrets.token_hex(8)}"
    places = [Path(tempfile.gettempdir()) / f"grouprl-secret-{token}", Path.home() / f".{token}",
              tmp_path / "secret"]  # fmt: skip
    try:
        for place in places:
            place.write_text(token)
        reads = "\n".join(f"try:\n    print(open({str(p)!r}).read())\nexcept OSError:\n    pass"
                          for p in places)  # fmt: skip
        contained(reads, expected=token)
    finally:
        for place in places:
            place.unlink(missing_ok=True)


def test_nothing_is_written_outside_the_scratch_directory(tmp_path):
    targets = [tmp_path / "pwned", Path("/usr/pwned"), Path("/pwned"), Path.home() / "pwned"]
    program = "\n".join(f"try:\n    open({str(t)!r}, 'w').write('x')\n    print('ESCAPED')\n"
                        "except OSError:\n    pass" for t in targets)  # fmt: skip
    contained(program)
    assert not any(t.exists() for t in targets)


def test_the_trainers_environment_is_not_visible(monkeypatch):
    token = f"tok-{secrets.token_hex(8)}"
    monkeypatch.setenv("GROUPRL_TEST_SECRET", token)
    contained("import os\nprint(os.environ.get('GROUPRL_TEST_SECRET'), dict(os.environ))",
              expected=token)  # fmt: skip


def test_searching_the_filesystem_and_proc_finds_no_expected_output():
    """The expected output is on the host only: a program reading every file it can see (its
    own memory included) has nothing to find."""
    token = f"tok-{secrets.token_hex(8)}"
    contained(
        "import os\nfound = set()\nfor root, dirs, files in os.walk('/'):\n"
        "    if root.startswith(('/usr', '/sys', '/dev')) or '/lib/python' in root:\n"
        "        dirs[:] = []\n        continue\n    for name in files:\n        try:\n"
        "            data = open(os.path.join(root, name), 'rb').read(1 << 20)\n"
        "        except OSError:\n            continue\n        at = data.find(b'tok-')\n"
        "        if at >= 0:\n            found.add(data[at:at + 20].decode(errors='replace'))\n"
        "print('\\n'.join(sorted(found)))",
        expected=token,
    )


# --- processes ---------------------------------------------------------------------------------


def test_a_daemon_does_not_outlive_its_sandbox():
    contained("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        time.sleep(60)\n    os._exit(0)\ntime.sleep(0.2)\nprint('bye')")  # fmt: skip


def test_killing_its_parent_or_its_process_group_changes_nothing():
    logged = contained(
        "import os, signal\nfor target in (os.getppid(), 1, 0, -1):\n    try:\n"
        "        os.kill(target, signal.SIGKILL)\n    except OSError:\n        pass\n"
        "try:\n    os.killpg(0, signal.SIGKILL)\nexcept OSError:\n    pass"
    )
    # its parent (the fork of the harness checking this program) dies with its verdicts: counted
    # as `sandbox`; process 1 of the namespace, which no signal from inside kills, cleans up
    assert logged["code_errors/sandbox"] == 1.0


# --- resources -----------------------------------------------------------------------------------


def test_memory_past_the_limit_fails_as_memory():
    logged = contained("x = bytearray(1 << 30)\nprint('ESCAPED')")
    assert logged["code_errors/memory"] == 1.0


def test_spinning_past_the_cpu_limit_is_a_timeout():
    """CPU time decides: with the wall-clock backstop far off (a loaded machine may give the
    spinner a small share of a core), only the CPU limit can end it."""
    reward = code_reward(limits=dataclasses.replace(LIMITS, wall_seconds=60.0))
    logged = contained("while True:\n    pass", reward=reward)
    assert logged["code_errors/timeout"] == 1.0, logged


def test_filling_the_scratch_directory_stops_at_its_size():
    program = ("import os\nn = 0\ntry:\n    for i in range(1000):\n"
               "        with open(f'/tmp/f{i}', 'wb') as f:\n            f.write(b'x' * (1 << 20))\n"
               "        n += 1\nexcept OSError:\n    pass\nprint(n)")  # fmt: skip
    ran = sandbox.run(program, limits=LIMITS)
    assert ran.stdout is not None and int(ran.stdout) <= LIMITS.scratch_mb, ran
    contained(program, expected="1000")


def test_printing_gigabytes_stops_at_the_output_limit():
    # "output", not "timeout" or "wall": the output limit stopped it, not its time running out
    logged = contained("import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))")
    assert logged["code_errors/output"] == 1.0


def test_its_own_limits_cannot_be_raised():
    contained(
        "import resource\nfor name in ('RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_NPROC', 'RLIMIT_FSIZE'):\n"
        "    r = getattr(resource, name)\n    try:\n"
        "        resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
        "        print('ESCAPED')\n    except (ValueError, OSError):\n        pass"
    )


def test_system_calls_through_ctypes_gain_nothing():
    """setuid(0), a new user namespace, mounting, tracing process 1: all refused."""
    ran = sandbox.run(
        "import ctypes, ctypes.util\nlibc = ctypes.CDLL(None, use_errno=True)\nresults = [\n"
        "    libc.setuid(0),\n    libc.unshare(0x10000000),\n"
        "    libc.mount(b'none', b'/usr', b'tmpfs', 0, None),\n"
        "    libc.ptrace(16, 1, None, None),\n]\nprint(results)",
        limits=LIMITS,
    )
    assert ran.stdout == "[-1, -1, -1, -1]\n", ran
    contained("import ctypes\nlibc = ctypes.CDLL(None)\n"
              "if libc.setuid(0) == 0 or libc.unshare(0x10000000) == 0:\n    print('ESCAPED')")  # fmt: skip


# --- forged verdicts ----------------------------------------------------------------------------

ASSERTS = ["assert add(2, 3) == 5", "assert add(1, 1) == 2"]
FORGERIES = {
    "exit(0) before the asserts": "import sys\nsys.exit(0)",
    "os._exit(0) before the asserts": "import os\nos._exit(0)",
    "printing a pass": "print('PASS')\nprint('0000000042{\"passed\": true}')\ndef add(a, b):\n"
    "    print('ok')\n    return None",
    "an object equal to everything": "class Any:\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = object.__hash__\ndef add(a, b):\n    return Any()",
    "an int subclass equal to everything": "class I(int):\n    def __eq__(self, other):\n"
    "        return True\ndef add(a, b):\n    return I(7)",
    "patching assert's helpers": "import builtins\nbuiltins.AssertionError = type('E', (), {})\n"
    "builtins.isinstance = lambda *a: True\nimport sys\n"
    "sys.excepthook = lambda *a: None\ndef add(a, b):\n    return 0",
    "exiting inside the call": "def add(a, b):\n    import os\n    os._exit(0)",
    "killing the checker from the call": "def add(a, b):\n    import os, signal\n"
    "    os.kill(os.getppid(), signal.SIGKILL)\n"
    "    os.kill(1, signal.SIGKILL)\n    return 0",
}


@pytest.mark.parametrize("program", FORGERIES.values(), ids=FORGERIES)
def test_an_assert_verdict_cannot_be_forged(program):
    honest = "def add(a, b):\n    return a + b"
    scores = REWARD([fenced(program), fenced(honest)], test_list=[ASSERTS, ASSERTS])
    assert scores == [0.0, 1.0]
    assert not sandbox_processes()


def test_a_checker_cannot_be_replaced_by_the_program():
    check = "def check(candidate):\n    assert candidate(2, 3) == 5\n"
    program = ("def check(candidate):\n    pass\ndef add(a, b):\n    return 0\n"
               "import builtins\nbuiltins.check = check")  # fmt: skip
    scores = REWARD([fenced(program), fenced("def add(a, b):\n    return a + b")],
                    test=[check, check], entry_point=["add", "add"])  # fmt: skip
    assert scores == [0.0, 1.0]


def test_the_trainer_is_unaffected():
    """After every attack above, this process is whole: same directory, environment, limits
    and user; nothing else of ours is running."""
    import resource

    before = (os.getcwd(), dict(os.environ), resource.getrlimit(resource.RLIMIT_NPROC), os.getuid())
    contained("import os\nos.chdir('/')\nos.environ['X'] = '1'\nprint('bye')")
    assert (os.getcwd(), dict(os.environ), resource.getrlimit(resource.RLIMIT_NPROC),
            os.getuid()) == before  # fmt: skip


# --- one program after another in a kept sandbox ------------------------------------------------

SCAN_MEMORY = """def scan():
    import gc, re
    pattern = re.compile(rb"tok-[0-9a-f]{16}")
    try:  # every readable mapping (a worker is not dumpable: this is refused)
        with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
            for line in maps.read().splitlines():
                span, perms = line.split()[:2]
                start, end = (int(x, 16) for x in span.split("-"))
                if "r" not in perms or end - start > 1 << 26:
                    continue
                try:
                    mem.seek(start)
                    found = pattern.search(mem.read(end - start))
                except (OSError, ValueError, OverflowError):
                    continue
                if found:
                    return found.group().decode()
    except OSError:
        pass
    for obj in gc.get_objects():  # every object the interpreter tracks, and their strings
        for value in (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()):
            if isinstance(value, (str, bytes)):
                found = pattern.search(value.encode() if isinstance(value, str) else value)
                if found:
                    return found.group().decode()
    return "none"
"""


def test_no_program_finds_tests_in_its_memory():
    """The tests of this program and of the one before it in the same sandbox are in no memory
    the program can read: its worker was forked before the tests were read, from a process that
    never reads a request at all."""
    slots.close_all()  # then one new sandbox, kept for both programs
    earlier, own = (f"tok-{secrets.token_hex(8)}" for _ in range(2))
    first = sandbox.check("def f():\n    return 1", sandbox.Tests.asserts([f"assert f() != {earlier!r}"]),
                          LIMITS)  # fmt: skip
    assert first.passed == (True,) and len(slots._IDLE) == 1
    program = SCAN_MEMORY + "def f():\n    return scan()"
    verdict = sandbox.check(program, sandbox.Tests.asserts([f"assert f() in ({earlier!r}, {own!r})"]),
                            LIMITS)  # fmt: skip
    assert verdict.kinds == ("wrong",) and len(slots._IDLE) == 1
    assert sandbox.run(SCAN_MEMORY + "print(scan())", limits=LIMITS).stdout == "none\n"
    planted = sandbox.run(SCAN_MEMORY + f"X = {own!r}\nprint(scan())", limits=LIMITS)
    assert planted.stdout == own + "\n"  # the scan finds what is there


def test_nothing_of_one_program_is_there_for_the_next():
    """A daemon and a file left by one program are gone when the next runs in the same
    sandbox."""
    slots.close_all()
    left = sandbox.run("import os, time\nopen('/tmp/left', 'w').write('x')\nif os.fork() == 0:\n"
                       "    os.setsid()\n    time.sleep(60)\nprint('ok')", limits=LIMITS)  # fmt: skip
    assert left.stdout == "ok\n" and len(slots._IDLE) == 1
    after = sandbox.run("import os\nprint(len(os.listdir('/tmp')))\n"
                        "print(sum(name.isdigit() for name in os.listdir('/proc')))", limits=LIMITS)  # fmt: skip
    files, processes = after.stdout.split()
    assert files == "0"
    assert processes == "3"  # process 1, the fork checking this program, and its worker
