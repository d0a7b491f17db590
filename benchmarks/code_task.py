"""The code task (`--task code`) learning on 2 CPU cores: the bundled `builtin:code` policy
trained by `grouprl train --task code --algo grpo --lr 1e-4 --steps 600` for 3 seeds, every
program run in the sandbox; held-out pass@1 by step and by second, the figure the README shows.

Usage (from the repository root; about 15 minutes on 2 cores, one run at a time so that each
run's wall time is what one run takes on 2 cores):

    .venv/bin/python benchmarks/code_task.py --figure docs/images/code_task.png
"""

from __future__ import annotations

import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import tyro

from harness import md_table, read_jsonl, train_run, versions

FLAGS = ["--task", "code", "--algo", "grpo", "--lr", "1e-4", "--steps", "600", "--eval-every", "50"]


@dataclass(frozen=True)
class Args:
    seeds: tuple[int, ...] = (0, 1, 2)
    jobs: int = 1
    """Runs at a time (each with one torch thread; more than 1 inflates each run's time)."""
    figure: Path | None = None
    out_dir: Path = Path("runs/bench/code_task")
    """Where runs and results.json go; a finished run there is kept."""


def main(args: Args) -> None:
    args.out_dir.mkdir(parents=True, exist_ok=True)

    walls: dict[int, float] = {}

    def train(seed: int) -> Path:
        started = time.perf_counter()
        run = train_run(args.out_dir / f"s{seed}", [*FLAGS, "--seed", str(seed)], f"seed {seed}")
        walls[seed] = time.perf_counter() - started  # a run kept from before: ~0
        return run

    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(pool.map(train, args.seeds))
    runs = []
    for seed, run in zip(args.seeds, dirs, strict=True):
        evals = {r["step"]: r for r in read_jsonl(run / "eval.jsonl")}
        metrics = read_jsonl(run / "metrics.jsonl")
        seconds, clock = {0: 0.0}, 0.0
        for r in metrics:
            clock += r["step_seconds"]
            seconds[r["step"]] = clock
        runs.append({"evals": evals, "seconds": seconds, "wall": walls[seed]})
    steps = sorted(runs[0]["evals"])
    rows = []
    for step in (0, 100, 300, steps[-1]):
        values = [r["evals"][step]["pass_at_1"] for r in runs]
        greedy = [r["evals"][step]["greedy_pass_at_1"] for r in runs]
        rows.append([str(step), f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})",
                     f"{statistics.mean(greedy):.3f}",
                     f"{statistics.mean(r['seconds'][step] for r in runs):.0f}"])  # fmt: skip
    print(md_table(["step", "held-out pass@1 (mean, min-max)", "greedy", "training s"], rows))
    gains = [r["evals"][steps[-1]]["pass_at_1"] - r["evals"][0]["pass_at_1"] for r in runs]
    print(
        f"gain: {', '.join(f'{g:+.3f}' for g in gains)} (mean {statistics.mean(gains):+.3f}); "
        f"wall s per run (evals included): {', '.join(f'{w:.0f}' for w in walls.values())}"
    )
    (args.out_dir / "results.json").write_text(json.dumps(
        {"versions": versions(), "runs": [{k: v for k, v in r.items()} for r in runs]},
        indent=1, default=str))  # fmt: skip
    if args.figure is not None:
        plot(args, runs, steps)


def plot(args: Args, runs: list[dict], steps: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for seed, run in zip(args.seeds, runs, strict=True):
        for ax, x in zip(axes, ([s for s in steps], [run["seconds"][s] for s in steps])):
            ax.plot(x, [run["evals"][s]["pass_at_1"] for s in steps], marker=".",
                    label=f"seed {seed}")  # fmt: skip
    for ax, label in zip(axes, ("step", "training seconds (2 CPU cores, one run at a time)")):
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out pass@1 (T = 1)")
    axes[0].legend(fontsize=8)
    fig.suptitle("--task code: builtin:code learns to write f(x) from three examples")
    fig.tight_layout()
    fig.savefig(args.figure, dpi=110)
    print(f"figure: {args.figure}")


if __name__ == "__main__":
    started = time.perf_counter()
    main(tyro.cli(Args))
    print(f"{time.perf_counter() - started:.0f} s")
