"""A verifiers tool environment that rewards its steps: each tool call's step earns 0.5 (set on
the trajectory's step, as verifiers' GymEnv and OpenEnvEnv set theirs), and the rubric adds the
answer's correctness to the steps' sum."""

import verifiers as vf
from datasets import Dataset


def lookup(key: int) -> int:
    """The value stored under a key.

    Args:
        key: the key to look up.
    """
    return key * 7 + 3


class Steps(vf.ToolEnv):
    async def env_response(self, messages, state, **kwargs):
        state["trajectory"][-1]["reward"] = 0.5
        return await super().env_response(messages, state, **kwargs)


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

    def steps(state) -> float:
        return sum(s.get("reward") or 0.0 for s in state["trajectory"])

    return Steps(dataset=Dataset.from_list(rows), tools=[lookup], max_turns=3,
                 rubric=vf.Rubric(funcs=[said, steps]))  # fmt: skip
