"""Writes the SmolLM2 tools example's data, seeded:

- problems.jsonl: 2000 products of a 2-digit and a 2- or 3-digit number asked in words, with
  the answer (grouprl holds out a share of them by a hash of the prompt);
- warmstart.jsonl: 64 conversations (other numbers, none among the problems) in TRL's
  conversational SFT shape that call the `multiply` tool and state its result, for
  `grouprl sft --data`.
"""

import json
import random
from pathlib import Path

SYSTEM = "You are a helpful assistant. Answer with the number."
QUESTIONS = [
    "What is {a} times {b}?",
    "What is {a} multiplied by {b}?",
    "A box holds {a} rows of {b} beads. How many beads are in the box?",
    "A farmer plants {a} rows of {b} trees. How many trees does he plant?",
    "Each of {a} buses carries {b} people. How many people do the buses carry?",
    "How much is {a} times {b}?",
    "A book has {a} pages with {b} words on each page. How many words are in the book?",
    "Compute the product of {a} and {b}.",
]
ANSWERS = ["{a} times {b} is {c}.", "The answer is {c}.", "{c}"]


def pairs(rng, count, taken):
    out = []
    while len(out) < count:
        a, b = rng.randint(12, 99), rng.choice([rng.randint(12, 99), rng.randint(100, 999)])
        if (a, b) not in taken:
            taken.add((a, b))
            out.append((a, b))
    return out


def main():
    here = Path(__file__).parent
    rng, taken = random.Random(0), set()
    problems = []
    for a, b in pairs(rng, 2000, taken):
        question = rng.choice(QUESTIONS).format(a=a, b=b)
        problems.append({"prompt": question, "answer": str(a * b)})
    conversations = []
    for a, b in pairs(rng, 64, taken):
        question = rng.choice(QUESTIONS).format(a=a, b=b)
        call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
        conversations.append(
            {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "multiply", "content": str(a * b)},
                    {
                        "role": "assistant",
                        "content": " " + rng.choice(ANSWERS).format(a=a, b=b, c=a * b),
                    },
                ]
            }
        )
    for name, rows in (("problems.jsonl", problems), ("warmstart.jsonl", conversations)):
        (here / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} rows to {here / name}")


if __name__ == "__main__":
    main()
