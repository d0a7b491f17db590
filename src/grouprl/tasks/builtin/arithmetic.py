"""The built-in `arithmetic` task: multi-digit addition (and subtraction) with a worked trace.

A prompt is a bare problem, and the completion works it column by column, least significant
digit first, then gives the answer after a single `|`:

    prompt      37+45=
    completion  7+5=12,3+4+1=8|82

Each step writes the column's digits (a missing digit is written as 0), the carry from the
previous column as a trailing `+c`, and the column's full sum; its last digit is the answer
digit, the rest is the next carry. Subtraction (two operands, the larger first, so the answer is
never negative) borrows explicitly: the top digit is written as `1x` when it must borrow, and
the borrow is paid in the next column as `-1`:

    prompt      42-15=
    completion  12-5=7,4-1-1=2|27

The answer is the canonical integer (no leading zeros). A sum of two numbers with d columns has
a completion of 7 to 9 characters per column, so completion length varies with the problem
(7 to 29 characters with the default knobs).
This format suits a character-level model: every step only needs digits the model can copy
from the prompt or from its own previous step, and a one-digit sum.

Splits. `train` and `heldout` never share a problem: each problem has a canonical key (operands
of a sum sorted, so `37+45` and `45+37` are the same problem), the key is hashed with BLAKE2b,
and the hash alone decides the split (`heldout_fraction` of the hash space is held out). The
split is a property of the problem, not of the seed or of the split sizes, so no seed, size or
sampling order can leak a held-out problem into training, for supervised warm start or for RL.
Held-out problems come from the same distribution of lengths and operand counts as training
problems: the held-out split tests that the model learned the column algorithm (it has never
seen any held-out problem, nor its commuted twin), not that it can extrapolate to longer
numbers, which a model this small cannot do and which RL would not teach in minutes. The
problem space is far larger than anything a run sees (about 8·10⁵ pairs of three-digit
operands), so memorising the training split is not an option for the model either.

Rows are generated lazily and deterministically: row i of a split depends only on (seed, split,
i), drawn with `random.Random` seeded by a string (stable across processes and Python hash
seeds), so `task.train[12345]` costs microseconds and is the same everywhere. Both splits draw
i.i.d. from the same distribution, each restricted to its side of the hash.

Noisy traces (`noisy_solution`) are for the supervised warm start only: with probability
`noise` a column's answer digit is replaced by a different random digit and the trace continues
consistently from the error (carry, later columns and final answer follow the wrong digit). A
model fitted to such traces puts about `noise` of its probability mass on a wrong digit at each
column while its most likely digit stays right: at temperature 1 it is often wrong, greedily it
is mostly right, and pass@k is far above pass@1, which is the room RL needs.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from grouprl.errors import UserError
from grouprl.tasks.base import Task
from grouprl.tasks.rewards.arithmetic import REWARDS

#: Operator characters the generator knows.
OPERATORS = "+-"
#: Largest number of digits per operand: keeps every answer within the 32 digits the reward
#: reads (the bundled model is trained on 1-3 digits only).
MAX_DIGITS = 9
#: Largest number of operands of a sum.
MAX_OPERANDS = 6


@dataclass(frozen=True)
class Problem:
    """One problem: `operands[0] op operands[1] op ...`; subtraction has exactly two operands."""

    operands: tuple[int, ...]
    op: str

    @property
    def prompt(self) -> str:
        return self.op.join(str(x) for x in self.operands) + "="

    @property
    def value(self) -> int:
        if self.op == "+":
            return sum(self.operands)
        return self.operands[0] - self.operands[1]

    @property
    def key(self) -> str:
        """Canonical form used for the split: a sum's operands are sorted (a+b is b+a)."""
        operands = sorted(self.operands) if self.op == "+" else self.operands
        return self.op.join(str(x) for x in operands)


def parse_prompt(prompt: str) -> Problem:
    """Inverse of `Problem.prompt`; raises ValueError on anything else."""
    if not prompt.endswith("="):
        raise ValueError(f"not an arithmetic prompt: {prompt!r}")
    body = prompt[:-1]
    op = "-" if "-" in body else "+"
    parts = body.split(op)
    if len(parts) < 2 or not all(p.isascii() and p.isdigit() for p in parts):
        raise ValueError(f"not an arithmetic prompt: {prompt!r}")
    if op == "-" and len(parts) != 2:
        raise ValueError(f"subtraction takes two operands: {prompt!r}")
    return Problem(tuple(int(p) for p in parts), op)


def _column_step(digits: list[int], op: str, carry: int) -> tuple[str, int, int]:
    """One column: returns (left-hand side text, column value, borrow taken).

    Addition: value = Σ digits + carry (may exceed 9; its tens are the next carry).
    Subtraction: value = top − bottom − borrow ∈ [0, 9], where top = x or 10 + x (borrowing).
    """
    if op == "+":
        lhs = "+".join(str(d) for d in digits) + (f"+{carry}" if carry else "")
        return lhs, sum(digits) + carry, 0
    x, y = digits
    borrow = int(x - y - carry < 0)
    top = x + 10 * borrow
    lhs = f"{top}-{y}" + ("-1" if carry else "")
    return lhs, top - y - carry, borrow


def solve(problem: Problem, *, noise: float = 0.0, rng: random.Random | None = None) -> str:
    """The worked completion (trace, `|`, answer) for `problem`.

    With `noise` > 0, each column's answer digit is, with probability `noise`, replaced by a
    different digit drawn from `rng`, and the rest of the trace follows from the wrong digit.
    """
    if noise > 0.0 and rng is None:
        raise ValueError("noise needs an rng")
    reversed_digits = [str(x)[::-1] for x in problem.operands]
    width = max(len(d) for d in reversed_digits)
    steps: list[str] = []
    values: list[int] = []
    carry = 0  # carry (addition) or borrow (subtraction) into the current column
    for col in range(width):
        digits = [int(d[col]) if col < len(d) else 0 for d in reversed_digits]
        lhs, value, borrow = _column_step(digits, problem.op, carry)
        if noise > 0.0 and rng is not None and rng.random() < noise:
            wrong = rng.choice([d for d in range(10) if d != value % 10])
            value += wrong - value % 10
        steps.append(f"{lhs}={value}")
        values.append(value)
        carry = value // 10 if problem.op == "+" else borrow
    # The last column's value is written whole (its tens are the final carry); the others give
    # their last digit. int() drops the leading zeros a subtraction leaves (100-99 → 001 → 1).
    answer = int(str(values[-1]) + "".join(str(v % 10) for v in reversed(values[:-1])))
    return ",".join(steps) + f"|{answer}"


def row(problem: Problem) -> dict:
    """A task row: prompt, reference answer, and the clean worked solution."""
    return {"prompt": problem.prompt, "answer": str(problem.value), "solution": solve(problem)}


def noisy_solution(row: dict, rng: random.Random, noise: float) -> str:
    """A solution for `row` with column errors injected at rate `noise` (see module docstring)."""
    return solve(parse_prompt(row["prompt"]), noise=noise, rng=rng)


def is_heldout(problem: Problem, heldout_fraction: float) -> bool:
    """Deterministic split membership from a BLAKE2b hash of the canonical problem."""
    digest = hashlib.blake2b(problem.key.encode("ascii"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < heldout_fraction


@dataclass(frozen=True)
class ArithmeticConfig:
    """Difficulty knobs of the arithmetic generator (validated in `__post_init__`)."""

    min_digits: int = 1
    max_digits: int = 3
    min_operands: int = 2
    max_operands: int = 2
    ops: str = "+"
    heldout_fraction: float = 0.1

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= MAX_DIGITS:
            raise UserError(
                f"arithmetic: need 1 <= min_digits <= max_digits <= {MAX_DIGITS}, got "
                f"min_digits={self.min_digits}, max_digits={self.max_digits}"
            )
        if not 2 <= self.min_operands <= self.max_operands <= MAX_OPERANDS:
            raise UserError(
                f"arithmetic: need 2 <= min_operands <= max_operands <= {MAX_OPERANDS}, got "
                f"min_operands={self.min_operands}, max_operands={self.max_operands}"
            )
        if not self.ops or any(c not in OPERATORS for c in self.ops):
            raise UserError(f"arithmetic: ops must be made of {OPERATORS!r}, got {self.ops!r}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise UserError(
                f"arithmetic: heldout_fraction must lie in (0, 1), got {self.heldout_fraction}"
            )

    def draw(self, rng: random.Random) -> Problem:
        """One problem: an operator, an operand count, then each operand's digit count and value.

        Subtraction problems always have two operands, the larger first.
        """
        op = rng.choice(self.ops)
        count = 2 if op == "-" else rng.randint(self.min_operands, self.max_operands)
        operands = []
        for _ in range(count):
            n = rng.randint(self.min_digits, self.max_digits)
            operands.append(rng.randint(0 if n == 1 else 10 ** (n - 1), 10**n - 1))
        if op == "-":
            operands.sort(reverse=True)
        return Problem(tuple(operands), op)

    def max_completion_chars(self) -> int:
        """Length of the longest clean completion these knobs can produce."""
        top = 10**self.max_digits - 1
        worst = [Problem((top,) * self.max_operands, "+")]
        if "-" in self.ops:
            # every column borrows: 10…0 − 9…9 (one digit fewer) is the longest subtraction
            worst.append(Problem((10 ** (self.max_digits - 1), top // 10 or 1), "-"))
        return max(len(solve(p)) for p in worst)


class GeneratedSplit(Sequence):
    """A split generated lazily: row i depends only on (seed, split name, i).

    Rows are drawn i.i.d. from the task distribution restricted to the split's side of the hash,
    so both splits have the same mix of lengths and operand counts. Small problems may repeat
    (there are only 100 one-digit sums); in the held-out split a repeat is a repeat of an unseen
    problem.
    """

    def __init__(self, config: ArithmeticConfig, split: str, size: int, seed: int) -> None:
        if split not in ("train", "heldout"):
            raise ValueError(f"unknown split {split!r}")
        self.config, self.split, self.size, self.seed = config, split, size, seed

    def __len__(self) -> int:
        return self.size

    def problem(self, index: int) -> Problem:
        rng = random.Random(f"arithmetic:{self.seed}:{self.split}:{index}")
        want_heldout = self.split == "heldout"
        # Rejection on the hash: about 1/heldout_fraction draws per held-out row. Bounded, so a
        # degenerate config (no problem on one side) fails loudly instead of looping.
        for _ in range(100_000):
            problem = self.config.draw(rng)
            if is_heldout(problem, self.config.heldout_fraction) == want_heldout:
                return problem
        raise UserError(
            f"arithmetic: these knobs leave no {self.split} problem; widen the digit range"
        )

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.size))]
        if index < 0:
            index += self.size
        if not 0 <= index < self.size:
            raise IndexError(index)
        return row(self.problem(index))

    def __repr__(self) -> str:
        return f"GeneratedSplit({self.split!r}, size={self.size}, seed={self.seed}, {self.config})"


def arithmetic_task(
    *,
    seed: int = 0,
    train_size: int = 1_000_000,
    heldout_size: int = 500,
    min_digits: int = 1,
    max_digits: int = 3,
    min_operands: int = 2,
    max_operands: int = 2,
    ops: str = "+",
    heldout_fraction: float = 0.1,
) -> Task:
    """The arithmetic task. Defaults: sums of two numbers of 1–3 digits each.

    `train_size` and `heldout_size` are the lengths of the lazily generated splits; rows are
    made on access, so a large training split costs nothing.
    """
    if train_size < 1 or heldout_size < 1:
        raise UserError(
            f"arithmetic: train_size and heldout_size must be positive, got {train_size}, "
            f"{heldout_size}"
        )
    config = ArithmeticConfig(
        min_digits=min_digits,
        max_digits=max_digits,
        min_operands=min_operands,
        max_operands=max_operands,
        ops=ops,
        heldout_fraction=heldout_fraction,
    )
    return Task(
        name="arithmetic",
        train=GeneratedSplit(config, "train", train_size, seed),
        heldout=GeneratedSplit(config, "heldout", heldout_size, seed),
        reward_funcs=dict(REWARDS),
        reward_weights={"correct": 1.0, "format": 0.0},
        stop=None,
        # + EOS, + slack so a wrong but longer trace is not cut before its answer
        max_new_tokens=config.max_completion_chars() + 1 + 8,
        noisy_solution=noisy_solution,
    )
