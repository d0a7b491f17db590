"""The built-in `lookup` task: look a value up with a tool, then add to it.

A prompt names a key and an addend; the key's value is known only to the `lookup` tool (a keyed
hash of the key, 10 to 99), so no model can know it, least of all for a held-out key. A
completion calls the tool in the tags format, reads the observation, and adds with the
arithmetic task's column-by-column trace:

    prompt       #482+37=
    completion   <lookup>482</lookup>         the policy's call
    observation  57                           the tool's answer, fed to the model
    completion   ;7+7=14,5+3+1=9|94           the trace of 57+37, then the answer

Without the tool a policy can only guess the value: it is right 1 time in 90 (the `correct`
reward scores the answer after `|` in the last assistant turn, never the tool's text).

Splits: keys are 100 to 999, and a key is held out by a hash of it (about 10% of them), so a
held-out row's key never appears in training, nor does its value; addends are 10 to 99.

Why RL has room: the base policy `builtin:lookup` is `builtin:arith` fitted (`grouprl sft
--task lookup`) to transcripts that call the tool only `tool_rate` (30%) of the time and guess
the value otherwise, with the arithmetic task's digit noise in the trace. It calls the tool
sometimes, and then is often right; RL raises the call rate (a group where some completions
call and some guess has a clear winner) and sharpens the trace.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from grouprl.errors import UserError
from grouprl.tasks.base import Task
from grouprl.tasks.builtin.arithmetic import Problem, solve
from grouprl.tasks.rewards.arithmetic import REWARDS

KEYS = range(100, 1000)
ADDENDS = range(10, 100)
#: The hash key of the values: a constant, so every run and every machine sees the same ones.
_SECRET = b"grouprl-lookup-v1"


def lookup(key: int) -> int:
    """The value stored under a key.

    Args:
        key: a key from 100 to 999.

    Returns:
        The value under the key, from 10 to 99.
    """
    if key not in KEYS:
        raise KeyError(f"no key {key}: keys run from 100 to 999")
    digest = hashlib.blake2b(str(key).encode("ascii"), digest_size=8, key=_SECRET).digest()
    return 10 + int.from_bytes(digest, "big") % 90


def is_heldout_key(key: int, fraction: float = 0.1) -> bool:
    digest = hashlib.blake2b(f"heldout:{key}".encode("ascii"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < fraction


def row(key: int, addend: int) -> dict:
    value = lookup(key)
    return {
        "prompt": f"#{key}+{addend}=",
        "answer": str(value + addend),
        "key": key,
        "addend": addend,
    }


def transcript(
    row: dict, rng: random.Random, noise: float, tool_rate: float
) -> list[tuple[str, str]]:
    """A worked completion of `row` as (role, text) turns for `grouprl sft`: with probability
    `tool_rate` it calls the tool and adds to the observation, otherwise it guesses a value
    and adds to that; each column's digit is wrong with probability `noise` (see
    `grouprl.tasks.builtin.arithmetic.solve`)."""
    addend = int(row["addend"])
    if rng.random() < tool_rate:
        value = lookup(int(row["key"]))
        trace = solve(Problem((value, addend), "+"), noise=noise, rng=rng)
        return [("assistant", f"<lookup>{row['key']}</lookup>"), ("tool", str(value)),
                ("assistant", f";{trace}")]  # fmt: skip
    guess = rng.choice(ADDENDS)
    trace = solve(Problem((guess, addend), "+"), noise=noise, rng=rng)
    return [("assistant", f"{guess};{trace}")]


class _Rows(Sequence):
    """Every (key, addend) of one split, in a fixed shuffled order (made once, 81,000 rows)."""

    def __init__(self, heldout: bool, seed: int) -> None:
        keys = [k for k in KEYS if is_heldout_key(k) == heldout]
        self.pairs = [(k, a) for k in keys for a in ADDENDS]
        random.Random(f"lookup:{seed}:{heldout}").shuffle(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return row(*self.pairs[index])


def lookup_task(*, seed: int = 0, tool_rate: float = 0.3) -> Task:
    """The lookup task (see the module docstring); `tool_rate` is how often the supervised
    transcripts (`grouprl sft --task lookup`) call the tool."""
    if not 0.0 <= tool_rate <= 1.0:
        raise UserError(f"lookup: tool_rate must lie in [0, 1], got {tool_rate}")
    return Task(
        name="lookup",
        train=_Rows(heldout=False, seed=seed),
        heldout=_Rows(heldout=True, seed=seed),
        reward_funcs=dict(REWARDS),
        reward_weights={"correct": 1.0},
        stop=None,
        # call 20, observation 2, trace of two 2-digit numbers <= 18, EOS 1; + slack
        max_new_tokens=48,
        transcript=lambda r, rng, noise: transcript(r, rng, noise, tool_rate),
        tools={"lookup": lookup},
        default_model="builtin:lookup",
        default_steps=120,  # held-out pass@1 from 0.15 to about 0.9 in 3 minutes on 2 cores
    )
