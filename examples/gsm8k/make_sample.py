"""Write sample.jsonl: 200 short word problems in GSM8K's format, made up here.

    python examples/gsm8k/make_sample.py

Each row has a `question` and an `answer` that is a worked solution ending in `#### <number>`,
exactly like GSM8K's rows, so the same command and config run on the real file:

    python -c "from datasets import load_dataset; \\
      load_dataset('openai/gsm8k', 'main', split='train').to_json('gsm8k_train.jsonl'); \\
      load_dataset('openai/gsm8k', 'main', split='test').to_json('gsm8k_test.jsonl')"
"""

import json
import random
from pathlib import Path

NAMES = ["Ada", "Ben", "Chen", "Dana", "Emil", "Fatima", "Goran", "Hana"]
THINGS = ["apples", "stamps", "marbles", "books", "shells", "cards"]


def problem(rng: random.Random) -> dict:
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b, price = rng.randint(3, 60), rng.randint(2, 40), rng.randint(2, 9)
    if rng.random() < 0.5:
        total = a + b
        question = (
            f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
        )
        answer = f"{name} has {a} + {b} = <<{a}+{b}={total}>>{total} {thing}.\n#### {total}"
    else:
        total = (a + b) * price
        question = (
            f"{name} buys {a} {thing} on Monday and {b} on Tuesday. Each costs ${price}. "
            f"How many dollars does {name} spend?"
        )
        answer = (
            f"{name} buys {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {thing}.\n"
            f"They cost {a + b} * {price} = <<{a + b}*{price}={total}>>{total} dollars.\n#### {total}"
        )
    return {"question": question, "answer": answer}


def main() -> None:
    rng = random.Random(7)
    path = Path(__file__).with_name("sample.jsonl")
    with path.open("w") as f:
        for _ in range(200):
            f.write(json.dumps(problem(rng)) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
