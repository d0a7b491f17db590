"""`grouprl explain`: the seeds' worked examples as tables, or one JSON object
(`grouprl.explain` computes them)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import tyro


@dataclass
class ExplainArgs:
    """Print the worked examples of GRPO and GSPO, computed live by grouprl.core."""

    json: bool = False
    """Print one JSON object instead of tables."""


def run(argv: list[str]) -> int:
    args = tyro.cli(ExplainArgs, args=argv, prog="grouprl explain")
    return show(as_json=args.json)


def show(as_json: bool = False) -> int:
    """Print the four worked examples as tables, or as one JSON object; returns the exit code."""
    from rich.console import Console

    from grouprl.explain import render, worked_examples

    data = worked_examples()
    if as_json:
        print(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        render(data, Console(highlight=False))
    return 0
