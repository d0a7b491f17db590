"""The arithmetic generator: worked traces, determinism per seed, disjoint splits, knobs."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.errors import UserError
from grouprl.tasks import TASKS, get_task
from grouprl.tasks.builtin.arithmetic import Problem, is_heldout, parse_prompt, solve
from grouprl.tasks.rewards.arithmetic import correct, format_


@pytest.mark.parametrize(
    ("prompt", "solution"),
    [
        ("37+45=", "7+5=12,3+4+1=8|82"),
        ("37+5=", "7+5=12,3+0+1=4|42"),
        ("8+5=", "8+5=13|13"),
        ("0+0=", "0+0=0|0"),
        ("999+999+999=", "9+9+9=27,9+9+9+2=29,9+9+9+2=29|2997"),
        ("42-15=", "12-5=7,4-1-1=2|27"),
        ("201-99=", "11-9=2,10-9-1=0,2-0-1=1|102"),
        ("100-99=", "10-9=1,10-9-1=0,1-0-1=0|1"),
        ("5-5=", "5-5=0|0"),
    ],
)
def test_worked_traces(prompt: str, solution: str) -> None:
    assert solve(parse_prompt(prompt)) == solution


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 10**6), min_size=2, max_size=5),
    st.sampled_from("+-"),
)
def test_trace_answer_is_the_value_and_scores_full_marks(operands: list[int], op: str) -> None:
    if op == "-":
        operands = sorted(operands[:2], reverse=True)
    problem = Problem(tuple(operands), op)
    solution = solve(problem)
    assert solution.endswith(f"|{problem.value}")
    assert correct([solution], answer=[str(problem.value)]) == [1.0]
    assert format_([solution]) == [1.0]


def test_noisy_trace_stays_consistent_and_is_wrong_at_the_noise_rate() -> None:
    rng = random.Random(0)
    problem = Problem((456, 789), "+")
    wrong = 0
    for _ in range(2000):
        text = solve(problem, noise=0.3, rng=rng)
        assert format_([text]) == [1.0]
        # Consistency: the answer is what the written column values say it is.
        values = [int(step.split("=")[1]) for step in text.split("|")[0].split(",")]
        implied = int(str(values[-1]) + "".join(str(v % 10) for v in reversed(values[:-1])))
        assert text.endswith(f"|{implied}")
        wrong += implied != problem.value
    # three columns, each wrong with probability 0.3: 1 - 0.7**3 = 0.657
    assert 0.62 < wrong / 2000 < 0.70


def test_rows_are_deterministic_per_seed() -> None:
    a, b, c = get_task("arithmetic", seed=1), get_task("arithmetic", seed=1), get_task("arithmetic")
    assert [a.train[i] for i in range(300)] == [b.train[i] for i in range(300)]
    assert list(a.heldout) == list(b.heldout)
    assert [a.train[i] for i in range(300)] != [c.train[i] for i in range(300)]
    assert list(a.heldout) != list(c.heldout)
    # Row i does not depend on the access order.
    assert a.train[1234] == a.train[1234] == b.train[:1235][-1]


def test_rows_have_the_documented_columns() -> None:
    task = get_task("arithmetic")
    for row in [*task.heldout[:50], *task.train[:50]]:
        assert set(row) == {"prompt", "answer", "solution"}
        assert row["solution"].endswith("|" + row["answer"])
        assert parse_prompt(row["prompt"]).value == int(row["answer"])
        assert len(row["solution"]) + 1 <= task.max_new_tokens


@pytest.mark.numerics
@pytest.mark.parametrize("knobs", [{}, {"ops": "+-", "max_operands": 3, "max_digits": 4}])
def test_heldout_never_overlaps_train(knobs: dict) -> None:
    task = get_task("arithmetic", heldout_size=2000, **knobs)
    heldout_keys = {parse_prompt(r["prompt"]).key for r in task.heldout}
    train_keys = {parse_prompt(task.train[i]["prompt"]).key for i in range(20_000)}
    assert len(heldout_keys) > 1000
    assert not heldout_keys & train_keys
    # Membership is a property of the problem: commuted sums fall on the same side.
    for row in task.heldout[:200]:
        problem = parse_prompt(row["prompt"])
        if problem.op == "+":
            twin = Problem(problem.operands[::-1], "+")
            assert is_heldout(twin, 0.1)
    # The two splits draw from the same distribution of lengths (generalisation, not extrapolation).
    train_len = sum(len(task.train[i]["solution"]) for i in range(2000)) / 2000
    heldout_len = sum(len(r["solution"]) for r in task.heldout) / len(task.heldout)
    # (a statistic of generated data, not float rounding: the mean lengths, in characters,
    # within one character of each other)
    assert abs(train_len - heldout_len) < 1.0


def test_splits_are_disjoint_across_seeds() -> None:
    heldout = {r["prompt"] for r in get_task("arithmetic", seed=3).heldout}
    other = get_task("arithmetic", seed=4)
    train = {other.train[i]["prompt"] for i in range(5000)}
    assert not heldout & train


def test_knobs_shape_the_problems() -> None:
    task = get_task("arithmetic", min_digits=4, max_digits=4, min_operands=3, max_operands=3)
    for row in task.train[:100]:
        operands = parse_prompt(row["prompt"]).operands
        assert len(operands) == 3 and all(1000 <= x <= 9999 for x in operands)
    task = get_task("arithmetic", ops="-")
    for row in task.train[:100]:
        problem = parse_prompt(row["prompt"])
        assert problem.op == "-" and problem.operands[0] >= problem.operands[1]
        assert int(row["answer"]) >= 0
    # Completion length varies with the problem.
    lengths = {len(r["solution"]) for r in get_task("arithmetic").heldout}
    assert len(lengths) >= 6


def test_task_interface() -> None:
    task = get_task("arithmetic")
    assert "arithmetic" in TASKS and task.name == "arithmetic"
    assert set(task.reward_funcs) == {"correct", "format"}
    assert task.reward_weights == {"correct": 1.0, "format": 0.0}
    assert task.stop is None
    assert task.split("train") is task.train and task.split("heldout") is task.heldout
    assert len(task.heldout) == 500 and len(task.train) == 1_000_000


@pytest.mark.parametrize(
    ("name", "knobs", "match"),
    [
        ("nope", {}, "unknown task 'nope'"),
        ("arithmetic", {"digits": 3}, "no knob 'digits'"),
        ("arithmetic", {"min_digits": 4, "max_digits": 3}, "min_digits"),
        ("arithmetic", {"max_digits": 10}, "max_digits"),
        ("arithmetic", {"max_operands": 1, "min_operands": 1}, "operands"),
        ("arithmetic", {"ops": "*"}, "ops"),
        ("arithmetic", {"heldout_fraction": 1.0}, "heldout_fraction"),
        ("arithmetic", {"heldout_size": 0}, "heldout_size"),
    ],
)
def test_bad_task_arguments_raise_user_error(name: str, knobs: dict, match: str) -> None:
    with pytest.raises(UserError, match=match):
        get_task(name, **knobs)


def test_unknown_split_raises_user_error() -> None:
    with pytest.raises(UserError, match="unknown split"):
        get_task("arithmetic").split("test")


def test_small_problem_space_still_gives_disjoint_splits() -> None:
    task = get_task("arithmetic", max_digits=1, heldout_size=200)
    heldout = {r["prompt"] for r in task.heldout}
    train = {r["prompt"] for r in task.train[:2000]}
    assert len(task.heldout) == 200 and 0 < len(heldout) < 30
    assert not heldout & train and len(heldout | train) == 100
