"""Does a stale sampler still learn? Held-out pass@1 on the built-in task for asynchronous runs
(`--max-staleness K`) with and without an importance-sampling correction, and for bf16 sampling.

Every arm is the default run (`grouprl train`: GSPO, 200 steps, evaluations every 25) with
its options added, over several seeds, each run a child process with one torch thread (an
asynchronous run sampling in that thread between updates: the same schedule, and so the same
run, as an overlapped one), `--jobs` at a time. Reported: mean (min-max over seeds) held-out pass@1 at
the chosen steps, and a figure of the mean curves (docs/images/async_learning.png with --figure).

Usage (from the repository root; ~40 minutes on 2 cores with the defaults):

    .venv/bin/python benchmarks/async_learning.py --figure docs/images/async_learning.png
    .venv/bin/python benchmarks/async_learning.py --seeds 0 --arms k0 k1 --steps 50
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

ARMS = {
    "k0": [],
    "k0 bf16": ["--precision", "bf16"],
    "k0 bf16 token_band bypass": [
        "--precision",
        "bf16",
        "--correction",
        "token_band",
        "--proximal",
        "behaviour",
    ],
    "k1": ["--max-staleness", "1"],
    "k1 tis": ["--max-staleness", "1", "--correction", "token_tis"],
    "k2": ["--max-staleness", "2"],
    "k2 tis": ["--max-staleness", "2", "--correction", "token_tis"],
    "k4": ["--max-staleness", "4"],
    "k4 tis": ["--max-staleness", "4", "--correction", "token_tis"],
}


@dataclass(frozen=True)
class Args:
    arms: tuple[str, ...] = tuple(ARMS)
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 200
    at: tuple[int, ...] = (25, 50, 200)
    """Steps whose held-out pass@1 the table shows."""
    jobs: int = 2
    """Runs at a time (each with one torch thread)."""
    figure: Path | None = None
    out_dir: Path | None = None
    """Where runs and results.json go. None: runs/bench/async-learning-<date>-<time>."""


def run(args: Args, arm: str, seed: int, out: Path) -> Path:
    # an asynchronous run sampling in the trainer's thread between updates: the same run
    flags = ["--steps", str(args.steps), "--seed", str(seed), "--sampler-threads", "0",
             *ARMS[arm]]  # fmt: skip
    return train_run(out / f"{arm.replace(' ', '-')}-seed{seed}", flags, f"{arm} seed {seed}")


def main(args: Args) -> None:
    out = args.out_dir or Path("runs/bench") / f"async-learning-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(pool.map(lambda job: run(args, *job, out), jobs))
    curves: dict[str, dict[int, list[float]]] = {}
    for (arm, _), run_dir in zip(jobs, dirs, strict=True):
        for row in read_jsonl(run_dir / "eval.jsonl"):
            curves.setdefault(arm, {}).setdefault(row["step"], []).append(row["pass_at_1"])
    results = {"versions": versions(), "args": {k: str(v) for k, v in vars(args).items()},
               "curves": curves}  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1))
    rows = []
    for arm in args.arms:
        cells = []
        for step in (0, *args.at):
            values = curves[arm].get(step, [])
            cells.append(f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"
                         if values else "-")  # fmt: skip
        rows.append([arm, *cells])
    print(md_table(["arm", *(f"step {s}" for s in (0, *args.at))], rows))
    if args.figure is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for arm in args.arms:
            steps = sorted(curves[arm])
            ax.plot(steps, [statistics.mean(curves[arm][s]) for s in steps], marker=".",
                    label=arm, linestyle="--" if "tis" in arm or "token_band" in arm else "-")  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel(f"held-out pass@1 (mean of {len(args.seeds)} seed(s))")
        ax.set_title("built-in task: staleness K, with and without token TIS")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.figure, dpi=120)
        print(f"figure: {args.figure}")
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main(tyro.cli(Args))
