"""`grouprl eval`: held-out pass@1 (sampled and greedy) and pass@k of a model, as a table or
one JSON line (`grouprl.train.evaluate` measures)."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from grouprl.cli import quiet_hf
from grouprl.config.options import EvalConfig
from grouprl.config.parsing import parse_args


def run(argv: list[str]) -> int:
    cfg = parse_args(EvalConfig, argv, prog="grouprl eval", source="the command line")
    quiet_hf()
    return main(cfg)


def _table(out: dict[str, Any]) -> Table:
    k = out["k"]
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row(f"pass@1 (T={out['temperature']:g}, {k} samples)", f"{out['pass_at_1']:.1%}")
    table.add_row(f"pass@{k}", f"{out['pass_at_k']:.1%}")
    if out["greedy_pass_at_1"] is not None:
        table.add_row("pass@1 (greedy)", f"{out['greedy_pass_at_1']:.1%}")
    table.add_row("judged by (pass reward)", out["pass_reward"])
    table.add_row("mean completion tokens", f"{out['mean_length']:.1f}")
    if out.get("tool_call_rate") is not None:
        table.add_row("completions calling a tool", f"{out['tool_call_rate']:.1%}")
    table.add_row("seconds", f"{out['seconds']:.1f}")
    return table


def main(cfg: EvalConfig) -> int:
    """Evaluate as `cfg` says and print the table (or one JSON line)."""
    from grouprl.train.evaluate import evaluate_model

    out = evaluate_model(cfg, progress=True)
    if cfg.json:
        sys.stdout.write(json.dumps(out) + "\n")
    else:
        console = Console()
        console.print(f"{out['model']} on {out['task']} ({out['split']}, {out['n']} problems)")
        console.print(_table(out))
    return 0
