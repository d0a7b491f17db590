"""Writes sums.jsonl: "What is A + B? Reply with only the number." with its answer, for
small A and B (2000 rows, seeded)."""

import json
import random
from pathlib import Path

rng = random.Random(0)
rows = []
for _ in range(2000):
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    rows.append({"prompt": f"What is {a} + {b}? Reply with only the number.", "answer": str(a + b)})
path = Path(__file__).with_name("sums.jsonl")
path.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"wrote {len(rows)} rows to {path}")
