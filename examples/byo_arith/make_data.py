"""Write sums.jsonl: 2,000 addition problems in columns of our own naming (x, y, total).

    python examples/byo_arith/make_data.py

Operands have 1 to 3 digits, like the problems the bundled model was warm-started on; the
columns are not the `prompt`/`answer` grouprl reads by default, so the config maps them
(`prompt_template: "{x}+{y}="`, `answer_column: total`).
"""

import json
import random
from pathlib import Path


def operand(rng: random.Random) -> int:
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def main() -> None:
    rng = random.Random(2026)
    path = Path(__file__).with_name("sums.jsonl")
    with path.open("w") as f:
        for _ in range(2000):
            x, y = operand(rng), operand(rng)
            f.write(json.dumps({"x": str(x), "y": str(y), "total": x + y}) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
