"""A single-turn verifiers environment, written as the Hub's are: sums in <answer> tags."""

import verifiers as vf
from datasets import Dataset


def load_environment(count: int = 40):
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
        for a in range(1, 9)
        for b in range(1, 6)
    ][:count]
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct(completion, answer, parser) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    rubric = vf.Rubric(
        funcs=[correct, parser.get_format_reward_func()], weights=[1.0, 0.2], parser=parser
    )
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows),
        parser=parser,
        rubric=rubric,
        system_prompt="Answer inside <answer></answer>.",
    )
