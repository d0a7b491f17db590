"""The built-in lookup task two ways: grouprl's native tool loop (`grouprl train --task lookup`)
and the same task written as an agent program over the `openai` client
(`examples/lookup_agent/agent.py`, `--agent`), whose requests grouprl's endpoint answers.

Two measurements, each run a child process with 2 torch threads, one at a time:

- learning: both runs at the task's defaults (120 steps, held-out pass@1 every 25 steps on 200
  held-out rows), their curves, and their wall times;
- rollout throughput: `--pairs` alternating pairs of short runs (`--steps`, one held-out row),
  the median over steps 2.. of completion tokens per second of rollout (sampling, the tool
  calls or the agent's requests, and nothing else).

Usage (from the repository root; ~9 minutes on 2 cores):

    .venv/bin/python benchmarks/agent_loop.py --figure docs/images/lookup_agent.png
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from harness import md_table, read_jsonl, run_child, versions

AGENT = ["--agent", "examples/lookup_agent/agent.py:agent"]
ARMS = {"native tool loop": [], "agent program": AGENT}


@dataclass(frozen=True)
class Args:
    pairs: int = 3
    """Alternating pairs of short runs for the throughput."""
    steps: int = 8
    """Steps of each short run."""
    learning: bool = True
    """Also run both at the task's defaults (the learning curves)."""
    figure: Path | None = None
    out_dir: Path | None = None
    """Where runs and results.json go. None: runs/bench/agent-loop-<date>-<time>."""


def train(run_dir: Path, flags: list[str]) -> float:
    """`grouprl train --task lookup *flags` in a child with 2 threads; its wall seconds."""
    cmd = [sys.executable, "-m", "grouprl", "train", "--task", "lookup", "--threads", "2",
           "--no-progress", "--output-dir", str(run_dir), *flags]  # fmt: skip
    child = run_child(cmd, run_dir.with_name(run_dir.name + ".log"), 2)
    if child.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed: see {child.log}")
    return child.wall_s


def rollout_rate(run_dir: Path) -> float:
    """Median over steps 2.. of completion tokens per second of rollout."""
    config = (run_dir / "config.yaml").read_text()
    G = int(next(line.split(":")[1] for line in config.splitlines()
                 if line.startswith("group_size:")))  # fmt: skip
    rows = read_jsonl(run_dir / "metrics.jsonl")[1:]
    return statistics.median(r["completion_len_mean"] * r["groups"] * G / r["rollout_seconds"]
                             for r in rows)  # fmt: skip


def main(args: Args) -> None:
    out = args.out_dir or Path("runs/bench") / f"agent-loop-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"versions": versions(), "rates": {a: [] for a in ARMS}, "learning": {}}
    short = ["--steps", str(args.steps), "--eval-size", "1", "--eval-samples", "1"]
    for pair in range(args.pairs):
        for arm, flags in ARMS.items():
            run_dir = out / f"rate-{arm.split()[0]}-{pair}"
            train(run_dir, [*short, *flags])
            results["rates"][arm].append(rollout_rate(run_dir))
            print(f"{arm} pair {pair}: {results['rates'][arm][-1]:.0f} tokens/s", flush=True)
    if args.learning:
        for arm, flags in ARMS.items():
            run_dir = out / f"learn-{arm.split()[0]}"
            wall = train(run_dir, flags)
            results["learning"][arm] = {"wall_s": wall,
                                        "eval": read_jsonl(run_dir / "eval.jsonl")}  # fmt: skip
            print(f"{arm}: {wall:.0f} s", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    native, agent = (statistics.median(results["rates"][a]) for a in ARMS)
    print(md_table(["loop", "rollout tokens/s (median of pairs)", "ratio"],
                   [["native tool loop", f"{native:.0f}", "1"],
                    ["agent program", f"{agent:.0f}", f"{agent / native:.2f}"]]))  # fmt: skip
    if results["learning"]:
        rows = []
        for arm, run in results["learning"].items():
            curve = {e["step"]: e["pass_at_1"] for e in run["eval"]}
            last = max(curve)
            rows.append([arm, f"{curve[0]:.3f}", f"{curve[last]:.3f}", str(last),
                         f"{run['wall_s'] / 60:.1f} min"])  # fmt: skip
        print(md_table(["loop", "held-out pass@1 at start", "at end", "steps", "wall"], rows))
    if args.figure is not None and results["learning"]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        for arm, run in results["learning"].items():
            ax.plot([e["step"] for e in run["eval"]], [e["pass_at_1"] for e in run["eval"]],
                    marker=".", label=f"{arm} ({run['wall_s'] / 60:.1f} min)")  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel("held-out pass@1 (200 keys)")
        ax.set_title("lookup: native tool loop vs an agent program (--agent)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.figure, dpi=120)
        print(f"figure: {args.figure}")
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main(tyro.cli(Args))
