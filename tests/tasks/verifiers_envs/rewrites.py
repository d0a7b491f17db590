"""A multi-turn verifiers environment that rewrites its history each turn: grouprl refuses it
(the ids it sampled would not be the conversation the environment holds)."""

import verifiers as vf
from datasets import Dataset


class Rewrites(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Again."}]

    async def get_prompt_messages(self, state):
        if not state["trajectory"]:
            return state["prompt"]
        return [{"role": "user", "content": "A new conversation."}]


def load_environment():
    rows = [
        {"prompt": [{"role": "user", "content": f"Say {k}."}], "answer": str(k)} for k in range(12)
    ]
    return Rewrites(
        dataset=Dataset.from_list(rows),
        max_turns=3,
        rubric=vf.Rubric(funcs=[lambda completion: 0.0]),
    )
