"""Writes the two example datasets (a dozen problems each, written for grouprl): mbpp.jsonl in
MBPP's columns (test_list, test_setup_code) and stdio.jsonl in open-r1's (verification_info).

    python examples/code/make_data.py
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
FUNCTIONS = [
    ("add(a, b) returning a + b", ["assert add(1, 2) == 3", "assert add(-4, 4) == 0"]),
    ("square(x) returning x squared", ["assert square(3) == 9", "assert square(-2) == 4"]),
    ("is_even(n) returning True when n is even", ["assert is_even(4)", "assert not is_even(7)"]),
    (
        "reverse(s) returning the string s reversed",
        ["assert reverse('abc') == 'cba'", "assert reverse('') == ''"],
    ),
    (
        "count_vowels(s) returning how many of s's letters are vowels (aeiou)",
        ["assert count_vowels('banana') == 3", "assert count_vowels('xyz') == 0"],
    ),
    (
        "largest(xs) returning the largest number of a non-empty list",
        ["assert largest([3, 9, 2]) == 9", "assert largest([-5]) == -5"],
    ),
    ("factorial(n) returning n!", ["assert factorial(0) == 1", "assert factorial(5) == 120"]),
    (
        "fizz(n) returning 'Fizz' when 3 divides n, else str(n)",
        ["assert fizz(9) == 'Fizz'", "assert fizz(4) == '4'"],
    ),
    (
        "unique(xs) returning the distinct items of xs, in first-seen order",
        ["assert unique([1, 2, 1, 3]) == [1, 2, 3]", "assert unique([]) == []"],
    ),
    (
        "word_lengths(s) returning a dict of each word of s to its length",
        ["assert word_lengths('a bb') == {'a': 1, 'bb': 2}"],
    ),
    (
        "gcd(a, b) returning the greatest common divisor",
        ["assert gcd(12, 18) == 6", "assert gcd(7, 5) == 1"],
    ),
    (
        "clamp(x) returning x limited to LOW..HIGH (defined for you)",
        ["assert clamp(-3) == LOW", "assert clamp(50) == HIGH", "assert clamp(5) == 5"],
    ),
]
PROGRAMS = [
    ("two integers a and b on one line; print their sum", [("1 2\n", "3\n"), ("10 -4\n", "6\n")]),
    ("an integer n; print n squared", [("4\n", "16\n"), ("-3\n", "9\n")]),
    ("a line of text; print it reversed", [("abc\n", "cba\n"), ("race car\n", "rac ecar\n")]),
    ("an integer n; print the numbers 1 to n, one per line", [("3\n", "1\n2\n3\n")]),
    ("a line of integers; print the largest", [("3 9 2\n", "9\n"), ("-1 -7\n", "-1\n")]),
    ("a word; print YES if it is a palindrome, else NO", [("level\n", "YES\n"), ("abc\n", "NO\n")]),
    ("an integer n; print n factorial", [("5\n", "120\n"), ("0\n", "1\n")]),
    ("a line of text; print how many words it has", [("a b c\n", "3\n"), ("hello\n", "1\n")]),
    ("two integers a and b; print a // b and a % b on two lines", [("7 2\n", "3\n1\n")]),
    ("an integer n; print FizzBuzz for 1..n, one per line", [("5\n", "1\n2\nFizz\n4\nBuzz\n")]),
    (
        "a line of integers; print them sorted ascending, space-separated",
        [("3 1 2\n", "1 2 3\n"), ("5\n", "5\n")],
    ),
    ("an integer n; print the sum of its digits", [("1234\n", "10\n"), ("7\n", "7\n")]),
]
ASK = "Answer with the program in a ```python block."

with open(HERE / "mbpp.jsonl", "w") as f:
    for spec, tests in FUNCTIONS:
        setup = "LOW, HIGH = 0, 10" if "LOW" in spec else ""
        f.write(
            json.dumps(
                {
                    "prompt": f"Write a Python function {spec}. {ASK}",
                    "test_list": tests,
                    "test_setup_code": setup,
                }
            )
            + "\n"
        )
with open(HERE / "stdio.jsonl", "w") as f:
    for spec, cases in PROGRAMS:
        info = {"language": "python", "test_cases": [{"input": i, "output": o} for i, o in cases]}
        f.write(
            json.dumps(
                {
                    "prompt": f"Write a Python program that reads {spec}. {ASK}",
                    "verification_info": info,
                }
            )
            + "\n"
        )
