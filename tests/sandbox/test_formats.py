"""The code rewards on the three test formats, with hand-written correct, wrong and partly
correct programs; what they do with bad input; and the one-line refusals before a run."""

from __future__ import annotations

import dataclasses
import json
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest
from tests.sandbox.conftest import fenced, sandbox_processes

from grouprl import sandbox
from grouprl.errors import UserError
from grouprl.tasks.rewards.code import code, code_all, code_reward, extract_program

ADD_CASES = {"language": "python", "test_cases": [
    {"input": "1 2\n", "output": "3\n"}, {"input": "10 -4", "output": "6"},
    {"input": "0 0", "output": "0"}, {"input": "7 7", "output": "14"},
]}  # fmt: skip
MBPP = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4",
        "assert add(10, 5) == 15"]  # fmt: skip
HUMANEVAL = (
    "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(5, 5) == 10\n"
)
RIGHT_STDIO = "a, b = map(int, input().split())\nprint(a + b)"
WRONG_STDIO = "a, b = map(int, input().split())\nprint(a * b)"
PARTLY_STDIO = "a, b = map(int, input().split())\nprint(a + b if a != b else 0)"
RIGHT_FN = "def add(a, b):\n    return a + b"
WRONG_FN = "def add(a, b):\n    return a - b"
PARTLY_FN = "def add(a, b):\n    return a + b if a < 5 else 0"


def logged_call(fn, completions, **columns):
    logged: dict[str, float] = {}
    scores = fn(completions, log_metric=lambda k, v: logged.__setitem__(k, v), **columns)
    return scores, logged


def test_stdin_stdout_cases_score_the_fraction_passed():
    programs = [RIGHT_STDIO, WRONG_STDIO, PARTLY_STDIO]
    # a*b is right only for "0 0"; the partly right one fails "7 7" only (it prints 0)
    scores = code([fenced(p) for p in programs], verification_info=[ADD_CASES] * 3)
    assert scores == [1.0, 0.25, 0.75]
    text = json.dumps(ADD_CASES)  # the column as a JSON string, as some datasets store it
    assert code_all([fenced(p) for p in programs], verification_info=[text] * 3) == [1, 0, 0]


def test_assert_lists_score_the_fraction_passed():
    programs = [RIGHT_FN, WRONG_FN, PARTLY_FN]
    # a-b passes none of them; the partly right one fails add(10, 5) only
    scores = code([fenced(p) for p in programs], test_list=[MBPP] * 3)
    assert scores == [1.0, 0.0, 0.75]
    assert code_all([fenced(p) for p in programs], test_list=[MBPP] * 3) == [1.0, 0.0, 0.0]


def test_setup_code_runs_before_the_asserts():
    setup = "import math\nLIMIT = 3"
    tests = ["assert add(LIMIT, 1) == 4", "assert math.isclose(add(0.1, 0.2), 0.3)"]
    scores = code([fenced(RIGHT_FN)], test_list=[tests], test_setup_code=[setup])
    assert scores == [1.0]


def test_a_checker_is_one_test():
    programs = [RIGHT_FN, WRONG_FN, PARTLY_FN]
    scores = code([fenced(p) for p in programs], test=[HUMANEVAL] * 3, entry_point=["add"] * 3)
    assert scores == [1.0, 0.0, 0.0]  # the partly right one fails check's second assert


def test_arguments_changed_in_place_reach_the_test():
    program = "def sort_in_place(xs):\n    xs.sort()"
    tests = ["xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]"]
    assert code([fenced(program)], test_list=[tests]) == [1.0]


def test_rows_without_tests_score_none_and_mixed_batches_score_each_row():
    rows = {"verification_info": [ADD_CASES, None, None],
            "test_list": [None, MBPP, None]}  # fmt: skip
    scores = code([fenced(RIGHT_STDIO), fenced(RIGHT_FN), fenced(RIGHT_FN)], **rows)
    assert scores == [1.0, 1.0, None]


@pytest.mark.parametrize(
    ("completion", "columns", "kind"),
    [
        ("no fenced block: def add(a, b): return a + b", {"test_list": [MBPP]}, "no_code"),
        (fenced("def add(a, b)\n    return a + b"), {"test_list": [MBPP]}, "syntax"),
        (fenced(RIGHT_FN), {"verification_info": [{"language": "cpp", "test_cases": []}]},
         "format"),
        (fenced(RIGHT_FN), {"verification_info": ["{not json"]}, "format"),
        (fenced(RIGHT_FN), {"test": [HUMANEVAL], "entry_point": [None]}, "format"),
        (fenced("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe3')"),
         {"verification_info": [ADD_CASES]}, "decode"),
        (fenced("def add(a, b):\n    raise ValueError"), {"test_list": [MBPP]}, "error"),
        (fenced("def add(a, b):\n    return object()"), {"test_list": [MBPP]}, "not_plain"),
        (fenced("x" * 70_000), {"test_list": [MBPP]}, "too_long"),
    ],
    ids=["no_code", "syntax", "language", "not_json", "no_entry_point", "not_utf8", "raises",
         "not_plain", "too_long"],
)  # fmt: skip
def test_bad_input_scores_zero_with_its_kind_counted(completion, columns, kind):
    scores, logged = logged_call(code, [completion], **columns)
    assert scores == [0.0]
    assert logged[f"code_errors/{kind}"] == 1.0
    errors = {k: v for k, v in logged.items() if k.startswith("code_errors/")}
    assert sum(errors.values()) == 1.0  # counted once, under its own kind
    assert logged["code_checked"] == 1.0


def test_the_whole_completion_can_be_the_program():
    whole = code_reward(extract="whole", name="code_whole")
    assert whole([RIGHT_FN], test_list=[MBPP]) == [1.0]
    assert extract_program(RIGHT_FN) is None
    two = f"{fenced(WRONG_FN)}\nOn second thought:\n```py\n{RIGHT_FN}\n```"
    assert extract_program(two) == RIGHT_FN + "\n"  # the last block counts


def test_conversational_completions_are_read_like_strings():
    completion = [{"role": "assistant", "content": fenced(RIGHT_FN)}]
    assert code([completion], test_list=[MBPP]) == [1.0]


def test_cpu_time_decides_a_timeout_and_repeats_are_cached():
    # the wall-clock backstop far off: however small a share of a core the loop gets on a
    # loaded machine, the CPU limit ends it
    limits = sandbox.Limits(cpu_seconds=1.0, wall_seconds=60.0)
    slow = "def add(a, b):\n    while True:\n        pass"
    verdict = sandbox.check(slow, sandbox.Tests.asserts(MBPP[:1]), limits)
    # The kernel ends it (SIGXCPU) once its tick-sampled CPU time reaches the 1 s limit, and
    # kills it at 2 s whatever it does; the seconds reported are its precise CPU time, which on
    # a loaded machine can fall short of the sampled count (0.84 s seen, with four busy
    # processes on 2 cores): half the limit still tells a spent budget from a limit set wrong.
    assert verdict.kinds == ("timeout",), verdict
    assert limits.cpu_seconds / 2 <= verdict.cpu_seconds[0] <= limits.cpu_seconds + 1.1, verdict
    jobs = [(RIGHT_FN, sandbox.Tests.asserts(MBPP))] * 3
    first = sandbox.check_many(jobs)
    assert sandbox.check_many(jobs) == first and first[0].fraction == 1.0


def test_a_full_cache_evicting_this_calls_hits_loses_no_verdict(monkeypatch):
    """A call whose own new verdicts push its cached ones out of a full cache still answers
    every job (it once raised KeyError: a hit read back after the eviction)."""
    from grouprl.sandbox import pool

    monkeypatch.setattr(pool, "CACHE_SIZE", 2)
    monkeypatch.setattr(pool, "_CACHE", type(pool._CACHE)())
    tests = sandbox.Tests.asserts(MBPP[:1])
    cached = (RIGHT_FN, tests)
    assert sandbox.check_many([cached])[0].fraction == 1.0
    new = [(RIGHT_FN + f"\n# {i}", tests) for i in range(2)]
    verdicts = sandbox.check_many([cached, *new])
    assert [v.fraction for v in verdicts] == [1.0, 1.0, 1.0] and cached[0] not in str(
        list(pool._CACHE))  # fmt: skip


def test_more_tests_than_one_sandbox_holds_are_all_run():
    many = [f"assert add({i}, 1) == {i + 1}" for i in range(40)] + ["assert add(0, 0) == 1"]
    verdict = sandbox.check(RIGHT_FN, sandbox.Tests.asserts(many))
    assert verdict.passed == (True,) * 40 + (False,)


def test_a_dataset_without_tests_is_refused_in_one_line():
    with pytest.raises(
        UserError, match=r"no row of data\.jsonl has tests .*its rows have: prompt\)"
    ):
        code.check_rows([{"prompt": "x"}, {"prompt": "y", "test_list": None}], "data.jsonl")
    code.check_rows([{"prompt": "x"}, {"prompt": "y", "test_list": MBPP}], "data.jsonl")


def test_a_machine_without_namespaces_is_refused_in_one_line(monkeypatch):
    """What bwrap says where user namespaces are forbidden ends in one line; nothing runs
    unsandboxed."""
    from grouprl.sandbox import pool, runtime, slots

    home = Path(tempfile.mkdtemp())  # readable by the sandbox's uid, unlike pytest's tmp_path
    try:
        home.chmod(0o755)
        fake = home / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\n"
                        "exit 1\n")  # fmt: skip
        fake.chmod(0o755)
        monkeypatch.setattr(runtime, "_RUNTIME", dataclasses.replace(runtime.runtime(), bwrap=fake))
        monkeypatch.setattr(pool, "_PROBED", [])
        slots.close_all()  # the sandboxes kept running are real ones
        refused(fake)
    finally:
        shutil.rmtree(home)


def refused(fake: Path) -> None:
    with pytest.raises(UserError) as err:
        code.check_rows([{"test_list": MBPP}], "data.jsonl")
    message = str(err.value)
    assert "\n" not in message and "No permissions to create a new namespace" in message
    with pytest.raises(sandbox.Unavailable):
        sandbox.check(RIGHT_FN, sandbox.Tests.asserts(MBPP))


def test_training_on_data_without_tests_stops_before_writing_anything(tmp_path, capsys):
    from grouprl.cli import main

    data = tmp_path / "sums.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(8)))
    run = tmp_path / "run"
    flags = ["--dataset", str(data), "--rewards", "code", "1.0", "--steps", "1", "--threads", "1",
             "--no-progress", "--output-dir", str(run)]  # fmt: skip
    assert main(["train", *flags]) != 0
    err = capsys.readouterr().err.strip().splitlines()  # (a warning on the small dataset first)
    assert err[-1].startswith("grouprl train: error: reward 'code': no row of"), err
    assert not run.exists()


def test_kept_sandboxes_outlive_the_threads_that_started_them():
    """Each reward call checks its programs from new threads; the sandboxes they started are
    kept for the next call, so they must not end with those threads (bwrap's parent-death
    signal follows the thread that started it)."""
    from grouprl.sandbox import slots

    slots.close_all()
    tests = sandbox.Tests.asserts(MBPP)
    fresh = secrets.token_hex(8)  # programs no earlier check cached: each runs in a sandbox
    first = sandbox.check_many([(RIGHT_FN + f"\n# {fresh} {i}", tests) for i in range(4)])
    assert all(v.fraction == 1.0 for v in first) and slots._IDLE
    kept = {slot.proc.pid for slot in slots._IDLE}
    for i in range(30):  # about 0.2 s of checks, one after another, in the kept sandboxes
        assert sandbox.check(RIGHT_FN + f"\n# {fresh} again {i}", tests).fraction == 1.0
    assert {slot.proc.pid for slot in slots._IDLE} <= kept


def test_a_stopped_reward_call_leaves_nothing_running():
    """A reward call cut short (the run's --reward-timeout) kills the sandboxes it was using
    before the interruption goes on: nothing of them is left once it has."""
    import time

    from grouprl.tasks.base import TimeLimitExceeded, time_limit

    sleep = 30.0
    slow = [(f"import time\ntime.sleep({sleep})\n# {i}", sandbox.Tests.stdio([("", "")]))
            for i in range(2)]  # fmt: skip
    start = time.monotonic()
    with pytest.raises(TimeLimitExceeded), time_limit(0.5):
        sandbox.check_many(slow, sandbox.Limits(wall_seconds=sleep))
    # a call that was not cut short would take the programs' whole sleep; one that was takes
    # the limit and the killing, however loaded the machine: half the sleep tells them apart
    assert time.monotonic() - start < sleep / 2
    assert not sandbox_processes()
