"""A multi-turn verifiers environment with a tool (ToolEnv)."""

import verifiers as vf
from datasets import Dataset


def lookup(key: int) -> int:
    """The value stored under a key.

    Args:
        key: the key to look up.
    """
    return key * 7 + 3


def load_environment():
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Look up key {k} and say its value."}],
            "answer": str(k * 7 + 3),
        }
        for k in range(1, 30)
    ]

    def said(completion, answer) -> float:
        text = completion[-1].content if completion else ""
        return 1.0 if answer in (text or "") else 0.0

    return vf.ToolEnv(
        dataset=Dataset.from_list(rows), tools=[lookup], max_turns=3, rubric=vf.Rubric(funcs=[said])
    )
