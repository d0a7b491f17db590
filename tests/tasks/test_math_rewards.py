"""`accuracy` (math-verify) and `think_format`: one documented rule per case, adversarial
completions included; neither ever raises on a completion."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grouprl.tasks.base import time_limit
from grouprl.tasks.rewards.math import (
    MAX_ANSWER_CHARS,
    MAX_COMPLETION_CHARS,
    accuracy,
    final_answer,
    reference_answer,
    think_format,
)

GSM8K = "Natalia sold 48/2 = 24 clips in May.\nIn all she sold 48+24 = 72 clips.\n#### 72"


@pytest.fixture(scope="module", autouse=True)
def math_verify_loaded():
    """math-verify (sympy, its LaTeX grammar) imported and warmed once, outside any time limit:
    the guard below then bounds one answer's check alone."""
    accuracy(["\\boxed{1}"], answer=["1"])


def score(completion, answer="72"):
    with time_limit(20):  # a guard: a completion that hangs fails here instead of hanging
        return accuracy([completion], answer=[answer])[0]


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so the total is \\boxed{72}.", "72", 1.0),
        ("\\boxed{72}", GSM8K, 1.0),  # a GSM8K solution: what follows #### counts
        ("<answer>72</answer>", GSM8K, 1.0),
        ("work...\n#### 72", GSM8K, 1.0),  # GSM8K's own answer format
        ("#### 1,200", "#### 1,200", 1.0),  # thousands commas on both sides
        ("\\boxed{1200}", "1,200", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # mathematical equality
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{1+x^2}", "x^2+1", 1.0),
        ("\\boxed{\\frac{144}{2}}", "72", 1.0),
        ("\\boxed{73}", "72", 0.0),
        ("The answer is 72.", "72", 0.0),  # free text is not searched for a number
        ("", "72", 0.0),
        ("\\boxed{72, 73}", "72", 0.0),  # listing candidates is not rewarded
        ("\\boxed{72", "72", 0.0),  # unclosed box
        ("\\boxed{1} then \\boxed{72}", "72", 1.0),  # the last box is the final answer
        ("\\boxed{72} then \\boxed{1}", "72", 0.0),
        ("<answer>72</answer> \\boxed{5}", "72", 1.0),  # answer tags first
        ("\\boxed{9^{9^{9^{9}}}}", "72", 0.0),  # would compute a tower in C: never parsed
        ("\\boxed{9^9^9}", "72", 0.0),
        ("\\boxed{9**9**9}", "72", 0.0),
        ("\\boxed{2^{100000}}", "72", 0.0),
        ("\\boxed{(10^{10})!}", "72", 0.0),
        ("\\boxed{100000!}", "72", 0.0),
        ("\\boxed{\\binom{100000}{50000}}", "72", 0.0),
        ("\\boxed{" + "7" * (MAX_ANSWER_CHARS + 1) + "}", "72", 0.0),
        ("x" * (MAX_COMPLETION_CHARS + 1) + "\\boxed{72}", "72", 0.0),  # too long: unparsed
        ("\\boxed{\\}", "72", 0.0),
        ("\\boxed{\\frac{1}{0}}", "72", 0.0),
        ([{"role": "assistant", "content": "\\boxed{72}"}], "72", 1.0),  # conversational
        (None, "72", 0.0),
        (72, "72", 0.0),
        ("\\boxed{72}", None, None),  # no reference: unscored
        ("\\boxed{72}", "", None),
        ("\\boxed{72}", "#### ", None),
    ],
)
def test_accuracy(completion, answer, expected):
    assert score(completion, answer) == expected


def test_accuracy_needs_the_answer_column():
    from grouprl.errors import UserError

    with pytest.raises(UserError, match=r"needs a column 'answer'.*--answer-column"):
        accuracy(["\\boxed{1}"], solution=["1"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a <answer> 1 </answer> b <answer>2</answer>", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\fbox{3}", "3"),
        ("x\n#### 5 apples\nmore", "5 apples"),
        ("nothing here", None),
    ],
)
def test_final_answer_region(text, expected):
    assert final_answer(text) == expected


def test_reference_answer_of_a_gsm8k_solution():
    assert reference_answer(GSM8K) == "72"
    assert reference_answer(3) == "3" and reference_answer(None) is None


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>add 2 and 2</think> 4", 1.0),
        ("<think>\nadd\n</think>\n<answer>\n4\n</answer>", 1.0),  # open-r1's format
        ("  <think>x</think>4  ", 1.0),
        ("<think></think> 4", 0.0),  # no reasoning
        ("<think>  </think> 4", 0.0),
        ("<think>x</think>", 0.0),  # no answer
        ("<think>x</think>   ", 0.0),
        ("4 <think>x</think>", 0.0),  # reasoning must come first
        ("<think>x</think> 4 <think>y</think>", 0.0),  # one block only
        ("<think>x<think>y</think> 4", 0.0),
        ("<think>x</think> <answer>4</answer> extra", 0.0),  # tagged answer: nothing after
        ("<think>x</think> <answer>4</answer><answer>5</answer>", 0.0),
        ("<think>x</think> <answer> </answer>", 0.0),
        ("<think>x</think> 4</answer>", 0.0),
        ("<think>x 4", 0.0),
        ("<think>" + "x" * MAX_COMPLETION_CHARS + "</think> 4", 0.0),
        ([{"role": "assistant", "content": "<think>x</think> 4"}], 1.0),
        (None, 0.0),
    ],
)
def test_think_format(completion, expected):
    assert think_format([completion]) == [expected]


math_text = st.one_of(
    st.text(max_size=60),
    st.text(alphabet="0123456789+-*/^{}()\\boxed frac#<>answer/think ,.$!", max_size=60),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(math_text, st.one_of(st.none(), st.integers(), math_text))
def test_the_math_rewards_never_raise(completion, answer):
    """Any completion against any reference: a score in {0, 1} or None, never an exception."""
    with time_limit(60):
        (score,) = accuracy([completion], answer=[answer])
        assert score in (0.0, 1.0, None)
        assert think_format([completion]) in ([0.0], [1.0])
        region = final_answer(completion)
        assert region is None or isinstance(region, str)
