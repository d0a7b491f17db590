"""A tiny program-synthesis task the bundled character-level model learns (`--task code`): from
three input/output pairs of an integer function, write the function's body as one Python
expression in `x`.

    prompt:      f(1)=3,f(2)=5,f(4)=9;f(x)=
    completion:  x*2+1

The hidden function is one of a few shapes with small constants (`SHAPES`: x*a+b, x*a-b, x*x+b,
(x+a)*b, x%a, x//a+b, a-x, abs(x-a)). The completion is judged by running it, never by reading
it: `def f(x): return <completion>` runs in the code sandbox (`grouprl.sandbox`) against seven
inputs, the three shown and four more, in one assert; `correct` is 1 when all seven agree
(any expression that computes the function passes, not only the canonical one) and `shown`
(logged, weight 0) when the three shown ones do. Nothing the model writes runs in the trainer.

Splits are by problem, the function (shape and constants) and the three inputs shown, from a
BLAKE2b hash: a held-out problem shows a function on inputs no training row shows it on, so what
is tested is finding which function three pairs describe (and writing it), not recalling a
prompt. `grouprl sft --task code --noise p` fits a model to
canonical solutions with a constant or the shape made wrong at rate p: how the bundled policy
`builtin:code` was made (see its README.md). `python` (`python_tool`) is a
tool any run can name (`--tools python`): code run in the sandbox, what it prints returned.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grouprl.errors import UserError
from grouprl.tasks.base import Task
from grouprl.tasks.rewards.common import completion_text

#: The function shapes: a template over constants a, b, their ranges, and the function.
SHAPES: dict[str, tuple[str, range, range, Callable[[int, int, int], int]]] = {
    "mul_add": ("x*{a}+{b}", range(2, 6), range(1, 10), lambda x, a, b: x * a + b),
    "mul_sub": ("x*{a}-{b}", range(2, 6), range(1, 10), lambda x, a, b: x * a - b),
    "square_add": ("x*x+{b}", range(1, 2), range(0, 10), lambda x, a, b: x * x + b),
    "add_mul": ("(x+{a})*{b}", range(1, 10), range(2, 6), lambda x, a, b: (x + a) * b),
    "mod": ("x%{a}", range(2, 8), range(0, 1), lambda x, a, b: x % a),
    "div_add": ("x//{a}+{b}", range(2, 6), range(0, 10), lambda x, a, b: x // a + b),
    "sub_from": ("{a}-x", range(5, 20), range(0, 1), lambda x, a, b: a - x),
    "abs_sub": ("abs(x-{a})", range(2, 10), range(0, 1), lambda x, a, b: abs(x - a)),
}
#: Inputs: the three shown are distinct in SHOWN; four more are checked, from CHECKED.
SHOWN, CHECKED = range(0, 6), range(0, 25)
#: Completion budget: the longest canonical body is 10 characters; + EOS and slack.
MAX_NEW_TOKENS = 16
#: What one check of a program may use (a one-line function on seven integers).
LIMITS_CPU_SECONDS = 1.0


@dataclass(frozen=True)
class Function:
    shape: str
    a: int
    b: int

    @property
    def body(self) -> str:
        return SHAPES[self.shape][0].format(a=self.a, b=self.b)

    def __call__(self, x: int) -> int:
        return SHAPES[self.shape][3](x, self.a, self.b)

    @property
    def key(self) -> str:
        return f"{self.shape}:{self.a}:{self.b}"


def _held_out(key: str, fraction: float) -> bool:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < fraction


def problems(split: str, fraction: float) -> list[tuple[Function, tuple[int, ...]]]:
    """Every (function, shown inputs) of a split, in a fixed order: a problem is held out by a
    hash of both, so a held-out problem shows a function on inputs no training row shows it on.
    Only problems whose three pairs single out their function are kept (x%7 and x%5 agree on
    0, 1, 2: such a prompt has no one answer)."""
    every = [Function(shape, a, b) for shape, (_, a_range, b_range, _) in SHAPES.items()
             for a in a_range for b in b_range]  # fmt: skip
    out = []
    for shown in itertools.combinations(SHOWN, 3):
        seen: dict[tuple[int, ...], list[Function]] = {}
        for f in every:
            seen.setdefault(tuple(f(x) for x in shown), []).append(f)
        for (f,) in (fs for fs in seen.values() if len(fs) == 1):
            if _held_out(f"{f.key}:{shown}", fraction) == (split == "heldout"):
                out.append((f, shown))
    return sorted(out, key=lambda p: (p[0].key, p[1]))


def make_row(function: Function, shown: Sequence[int], rng: random.Random) -> dict[str, Any]:
    """A row: the prompt shows three inputs; the test checks those and four more."""
    shown = list(shown)
    rest = sorted(rng.sample([x for x in CHECKED if x not in shown], 4))
    inputs = shown + rest
    prompt = ",".join(f"f({x})={function(x)}" for x in shown) + ";f(x)="
    check = f"assert [f(x) for x in {inputs}] == {[function(x) for x in inputs]}"
    shown_check = f"assert [f(x) for x in {shown}] == {[function(x) for x in shown]}"
    return {"prompt": prompt, "answer": function.body, "solution": function.body,
            "checks": [check, shown_check], "shape": function.shape}  # fmt: skip


class Rows(Sequence):
    """A split's rows, made on access: row i is the split's problem i (in an order shuffled by
    the seed, repeating past the split's count), its four more checked inputs drawn from
    (seed, split, i)."""

    def __init__(self, split: str, size: int, seed: int, fraction: float) -> None:
        self.split, self.size, self.seed = split, size, seed
        found = problems(split, fraction)
        self.problems = random.Random(f"{seed}:{split}").sample(found, len(found))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += self.size
        if not 0 <= index < self.size:
            raise IndexError(index)
        function, shown = self.problems[index % len(self.problems)]
        return make_row(function, shown, random.Random(f"{self.seed}:{self.split}:{index}"))


def noisy_solution(row: dict, rng: random.Random, noise: float) -> str:
    """The canonical body, with a constant off by one or another shape's body at rate `noise`."""
    body = row["solution"]
    if rng.random() >= noise:
        return body
    digits = [i for i, c in enumerate(body) if c.isdigit()]
    if digits and rng.random() < 0.7:
        i = rng.choice(digits)
        return body[:i] + str((int(body[i]) + rng.choice([1, 9])) % 10) + body[i + 1 :]
    other = rng.choice([s for s in SHAPES if s != row["shape"]])
    template, a_range, b_range, _ = SHAPES[other]
    return template.format(a=rng.choice(a_range), b=rng.choice(b_range))


def program(completion: Any) -> str | None:
    """`def f(x): return <completion>`; None for a completion that is not one line."""
    text = (completion_text(completion) or "").strip()
    if not text or "\n" in text or len(text) > 200:
        return None
    return f"def f(x):\n    return {text}\n"


def check_reward(index: int, name: str):
    """A reward running each completion in the sandbox against its row's check `index` (0:
    all seven inputs, 1: the three shown): 1 when the assert holds, else 0."""
    import grouprl.sandbox as sandbox

    limits = sandbox.Limits(cpu_seconds=LIMITS_CPU_SECONDS, memory_mb=256)

    def reward(completions, checks, **_) -> list[float]:
        jobs, where, scores = [], [], [0.0] * len(completions)
        for i, (completion, row_checks) in enumerate(zip(completions, checks, strict=True)):
            code = program(completion)
            if code is not None:
                jobs.append((code, sandbox.Tests.asserts([row_checks[index]])))
                where.append(i)
        for i, verdict in zip(where, sandbox.check_many(jobs, limits)):
            scores[i] = float(all(verdict.passed))
        return scores

    def check_rows(rows, where) -> None:  # before a run: can the sandbox check programs here?
        reason = sandbox.available()
        if reason is not None:
            raise UserError(f"--task code runs every program in the code sandbox, which cannot "
                            f"run here: {reason}")  # fmt: skip

    reward.__name__ = name
    reward.check_rows = check_rows
    return reward


def python_tool(code: str) -> str:
    """Run Python code and return what it prints.

    Args:
        code: the program to run.
    """
    import grouprl.sandbox as sandbox

    ran = sandbox.run(code, limits=sandbox.Limits(cpu_seconds=2.0, memory_mb=256))
    if ran.stdout is None:
        return f"error: {ran.kind}"
    return ran.stdout.strip()


python_tool.__name__ = "python"
#: Tools any run can name with --tools NAME.
BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"python": python_tool}


def code_task(*, seed: int = 0, train_size: int = 1_000_000, heldout_size: int = 500,
              heldout_fraction: float = 0.1) -> Task:  # fmt: skip
    """The code task (see the module docstring)."""
    return Task(
        name="code",
        train=Rows("train", train_size, seed, heldout_fraction),
        heldout=Rows("heldout", heldout_size, seed, heldout_fraction),
        reward_funcs={"correct": check_reward(0, "correct"), "shown": check_reward(1, "shown")},
        reward_weights={"correct": 1.0, "shown": 0.0},
        stop=None,
        max_new_tokens=MAX_NEW_TOKENS,
        noisy_solution=noisy_solution,
        default_model="builtin:code",
        default_steps=600,
    )
