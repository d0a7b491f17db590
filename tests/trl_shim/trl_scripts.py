"""What the tests that run TRL's scripts share (here and in tests/vllm_engine): TRL's `trl grpo`
script from the installed TRL with grouprl.trl's import added, and local datasets laid out as
the hub's."""

from __future__ import annotations

import json
from pathlib import Path


def dataset_dir(directory: Path, rows: dict[str, int], *, numina: bool = False) -> Path:
    """A local dataset in a hub dataset's layout (train/test JSONL): sums with a LaTeX solution
    (accuracy_reward's); NuminaMath-TIR's columns (problem, solution, messages) with `numina`,
    else conversational prompts."""
    directory.mkdir(parents=True)
    for split, n in rows.items():
        with open(directory / f"{split}.jsonl", "w") as f:
            for i in range(n):
                a, b = i % 17, i % 5
                question = f"What is {a} + {b}?"
                row = ({"problem": question, "messages": [{"role": "user", "content": question}]}
                       if numina else {"prompt": [{"role": "user", "content": question}]})  # fmt: skip
                f.write(json.dumps({**row, "solution": f"$\\boxed{{{a + b}}}$"}) + "\n")
    return directory


def trl_grpo_script(directory: Path) -> Path:
    """The installed TRL's trl/scripts/grpo.py with grouprl.trl's GRPOConfig and GRPOTrainer
    imported after TRL's (the only change)."""
    import importlib.util

    source = Path(importlib.util.find_spec("trl.scripts.grpo").origin).read_text()
    for theirs, ours in [
        ("    from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config\n",
         "    from grouprl.trl import GRPOTrainer\n"),
        ("    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser\n",
         "    from grouprl.trl import GRPOConfig\n"),
    ]:  # fmt: skip
        assert source.count(theirs) == 1, theirs  # TRL's script still imports as it did
        source = source.replace(theirs, theirs + ours)
    path = directory / "grpo.py"
    path.write_text(source)
    return path
