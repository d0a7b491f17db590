"""call_reward: TRL's calling convention, and clear errors for a user's broken function."""

import contextlib
import math
import time

import pytest

from grouprl.errors import UserError
from grouprl.tasks.base import call_reward

ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def test_columns_are_repeated_per_completion_and_none_is_nan():
    def fn(completions, prompts, answer, **kwargs):
        assert prompts == ["1+1=", "1+1=", "2+2=", "2+2="]
        assert answer == ["2", "2", "4", "4"]
        return [1, None, 0.5, True]

    values = call_reward("fn", fn, ["a", "b", "c", "d"], ROWS, 2)
    assert values[0] == 1.0 and math.isnan(values[1]) and values[2:] == [0.5, 1.0]


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda completions, **kw: 1 / 0, "reward function 'f' raised ZeroDivisionError"),
        (lambda completions, **kw: [1.0], "returned 1 values for 4 completions"),
        (lambda completions, **kw: "oops", "returned str values"),
        (lambda completions, **kw: ["x"] * 4, "neither a number nor None"),
        (lambda completions, **kw: [1.0, float("nan"), 0.0, None], "returned nan; return a finite"),
        (lambda completions, **kw: [float("-inf")] * 4, "returned -inf; return a finite number"),
    ],
)
def test_broken_functions_are_user_errors(fn, message):
    with pytest.raises(UserError, match=message):
        call_reward("f", fn, ["a", "b", "c", "d"], ROWS, 2)


def test_a_hanging_function_is_stopped_even_if_it_catches_exceptions():
    def hangs(completions, **kwargs):
        # Bounded, so that a broken deadline fails this test ("did not raise") instead of
        # hanging the suite; a careless `except Exception` must not swallow the deadline.
        end = time.monotonic() + 30
        while time.monotonic() < end:
            with contextlib.suppress(Exception):
                time.sleep(0.01)
        return [0.0] * len(completions)

    with pytest.raises(UserError, match=r"did not return within 0\.2 s"):
        call_reward("slow", hangs, ["a", "b", "c", "d"], ROWS, 2, timeout=0.2)
