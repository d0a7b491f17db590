"""The answer policy of the arithmetic rewards, one documented rule per case."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.errors import UserError
from grouprl.tasks.rewards.arithmetic import MAX_COMPLETION_CHARS, correct, format_, parse_answer

TRACE = "7+5=12,3+4+1=8"


def score(completion, answer="82") -> float | None:
    return correct([completion], answer=[answer])[0]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (f"{TRACE}|82", 1.0),
        (f"{TRACE}|83", 0.0),
        ("|82", 1.0),  # correct ignores the trace
        (f"  {TRACE}|82\n", 1.0),  # surrounding whitespace
        (f"{TRACE}| 82 ", 1.0),
        (f"{TRACE}|\t82\r\n", 1.0),
        (f"{TRACE}|082", 1.0),  # leading zeros: compared by value
        (f"{TRACE}|0082", 1.0),
        (f"{TRACE}|+82", 0.0),  # explicit plus sign is not an integer literal here
        (f"{TRACE}|82.0", 0.0),
        (f"{TRACE}|85.0", 0.0),
        (f"{TRACE}|82.", 0.0),
        (f"{TRACE}|8 2", 0.0),
        (f"{TRACE}|82abc", 0.0),
        (f"{TRACE}|82,", 0.0),
        (f"{TRACE}|82|83", 0.0),  # several markers: hedging never pays
        (f"{TRACE}|82|82", 0.0),
        (f"{TRACE}||82", 0.0),
        (f"{TRACE}|", 0.0),
        (TRACE, 0.0),  # no marker
        ("", 0.0),
        ("   ", 0.0),
        ("|", 0.0),
        (f"{TRACE}|٨٢", 0.0),  # Arabic-Indic digits
        (f"{TRACE}|８２", 0.0),  # full-width digits
        (f"{TRACE}|⁸²", 0.0),  # superscripts
        (f"{TRACE}|82\u200b", 0.0),  # zero-width space is not whitespace here
        (f"{TRACE}\u00e9\U0001f600|82", 1.0),  # unicode in the trace does not matter to correct
        (f"{TRACE}|-82", 0.0),
        ("|" + "9" * 40, 0.0),  # more than 32 digits is not an answer
        (f"{TRACE}<answer>82</answer>", 0.0),  # another format's tags are not markers
        (None, 0.0),
        (82, 0.0),
        ([{"role": "assistant", "content": f"{TRACE}|82"}], 1.0),  # TRL conversational
        ([{"role": "assistant", "content": None}], 0.0),
        ([], 0.0),
    ],
)
def test_correct_answer_policy(completion, expected: float) -> None:
    assert score(completion) == expected


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("|-0", "0", 1.0),  # -0 equals 0
        ("|0", "-0", 1.0),
        ("|-00", "0", 1.0),
        ("|-27", "-27", 1.0),
        ("|27", "-27", 0.0),
        ("|-", "0", 0.0),
        ("|82", 82, 1.0),  # an int reference works too
        ("|82", "082", 1.0),
        ("|82", "82.0", 0.0),  # a reference that is not an integer: every completion scores 0
        ("|82", "", 0.0),
        ("|82", None, 0.0),
        ("|1", True, 0.0),
    ],
)
def test_correct_signs_and_references(completion: str, answer, expected: float) -> None:
    assert score(completion, answer) == expected


def test_huge_completions_score_zero_fast() -> None:
    megabyte = "7" * 1_000_000 + "|82"
    nested = "|" * 500_000 + "82"
    unicode_mb = "٨" * 1_000_000
    many_steps = ",".join(["7+5=12"] * 200_000) + "|82"
    start = time.process_time()  # this process's CPU time: another process's load adds none
    for text in (megabyte, nested, unicode_mb, many_steps):
        assert correct([text], answer=["82"]) == [0.0]
        assert format_([text]) == [0.0]
    assert time.process_time() - start < 0.5
    edge = "|82".rjust(MAX_COMPLETION_CHARS)  # at the limit, whitespace padded: still read
    assert score(edge) == 1.0 and score(" " + edge) == 0.0


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (f"{TRACE}|82", 1.0),
        (f"{TRACE}|83", 1.0),  # syntax only
        (f" {TRACE}|82\n", 1.0),
        ("12-5=7,4-1-1=2|27", 1.0),
        ("9+9+9=27,9+9+9+2=29|2997", 1.0),
        (f"{TRACE}|-5", 1.0),
        ("|82", 0.0),  # no trace
        ("82", 0.0),
        ("", 0.0),
        (f"{TRACE}|82|82", 0.0),
        (f"{TRACE},|82", 0.0),
        (f"{TRACE}|82 extra", 0.0),
        ("7+5=12,,3+4=7|82", 0.0),
        ("7=12|82", 0.0),
        ("7+5=|82", 0.0),
        ("7+5=1234|82", 0.0),
        ("٧+٥=١٢|82", 0.0),
        (f"{TRACE}|82.0", 0.0),
        (None, 0.0),
        ([{"role": "assistant", "content": f"{TRACE}|82"}], 1.0),
    ],
)
def test_format(completion, expected: float) -> None:
    assert format_([completion]) == [expected]


def test_reward_contract_columns_and_extra_kwargs() -> None:
    completions = ["|1", "|2", "|3"]
    scores = correct(
        completions, prompts=["a", "b", "c"], answer=["1", "0", "3"], solution=["x"] * 3, foo=1
    )
    assert scores == [1.0, 0.0, 1.0]
    assert format_(completions, prompts=["a"] * 3, answer=["1"] * 3) == [0.0] * 3
    assert correct([], answer=[]) == []
    with pytest.raises(UserError, match="answer"):
        correct(completions)
    with pytest.raises(UserError, match="answer"):
        correct(completions, answer=["1"])


@settings(max_examples=150, deadline=None)
@given(st.one_of(st.text(max_size=200), st.binary(max_size=50).map(lambda b: b.decode("latin-1"))))
def test_rewards_never_raise_and_stay_in_range(text: str) -> None:
    for reward in (correct, format_):
        assert reward([text], answer=["5"])[0] in (0.0, 1.0)
    got = parse_answer(text)
    assert got is None or isinstance(got, int)
