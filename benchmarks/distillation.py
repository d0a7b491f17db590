"""On-policy distillation on the built-in task: the untrained built-in policy taught by a trained
one (`--teacher`: the default run's final/, held-out pass@1 0.94), against RL alone.

Arms, each `grouprl train` with GSPO's defaults and evaluations every `--eval-every` steps:
"rl" (the task's reward alone), "distill" (the teacher's per-token reverse KL alone,
`--teacher-task-weight 0`), "distill + rl" (both). Reported: mean (min-max over seeds) held-out
pass@1 at the chosen steps and the training seconds to get there (step_seconds summed, the
evaluations left out), and a figure by step and by second (docs/images/distillation.png with --figure).

Usage (from the repository root; the teacher first, ~3 minutes, then ~10 minutes on 2 cores):

    .venv/bin/grouprl train --output-dir runs/bench/opd/teacher
    .venv/bin/python benchmarks/distillation.py --figure docs/images/distillation.png
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


@dataclass(frozen=True)
class Args:
    teacher: Path = Path("runs/bench/opd/teacher/final")
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 60
    eval_every: int = 10
    at: tuple[int, ...] = (10, 20, 60)
    """Steps whose held-out pass@1 the table shows."""
    jobs: int = 2
    """Runs at a time (each with one torch thread)."""
    figure: Path | None = None
    out_dir: Path | None = None
    """Where runs and results.json go. None: runs/bench/distillation-<date>-<time>."""


def arms(teacher: Path) -> dict[str, list[str]]:
    return {"rl": [], "distill": ["--teacher", str(teacher), "--teacher-task-weight", "0"],
            "distill + rl": ["--teacher", str(teacher)]}  # fmt: skip


def train(args: Args, arm: str, seed: int, out: Path) -> Path:
    flags = ["--steps", str(args.steps), "--seed", str(seed), "--eval-every",
             str(args.eval_every), *arms(args.teacher)[arm]]  # fmt: skip
    name = f"{arm.replace(' ', '').replace('+', '-')}-seed{seed}"
    return train_run(out / name, flags, f"{arm} seed {seed}")


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, training seconds so far, held-out pass@1) at each evaluation."""
    seconds, clock = {0: 0.0}, 0.0
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        clock += row["step_seconds"]
        seconds[row["step"]] = clock
    return [
        (r["step"], seconds[r["step"]], r["pass_at_1"]) for r in read_jsonl(run_dir / "eval.jsonl")
    ]


def main(args: Args) -> None:
    if not (args.teacher / "config.json").exists():
        raise SystemExit(f"no teacher at {args.teacher}: train it first (see the usage)")
    out = args.out_dir or Path("runs/bench") / f"distillation-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(arm, seed) for seed in args.seeds for arm in arms(args.teacher)]
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(pool.map(lambda job: train(args, *job, out), jobs))
    curves: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for (arm, _), run_dir in zip(jobs, dirs, strict=True):
        for step, seconds, value in curve(run_dir):
            curves.setdefault(arm, {}).setdefault(step, []).append((seconds, value))
    results = {"versions": versions(), "args": {k: str(v) for k, v in vars(args).items()},
               "curves": curves}  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1))
    rows = []
    for arm, by_step in curves.items():
        cells = []
        for step in (0, *args.at):
            values = [v for _, v in by_step.get(step, [])]
            seconds = statistics.mean(s for s, _ in by_step[step]) if values else 0
            cells.append(f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f}), "
                         f"{seconds:.0f} s" if values else "-")  # fmt: skip
        rows.append([arm, *cells])
    print(md_table(["arm", *(f"step {s}" for s in (0, *args.at))], rows))
    if args.figure is not None:
        plot(curves, args, args.figure)
    print(f"results: {out / 'results.json'}")


def plot(curves: dict, args: Args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for arm, by_step in curves.items():
        steps = sorted(by_step)
        means = [statistics.mean(v for _, v in by_step[s]) for s in steps]
        seconds = [statistics.mean(t for t, _ in by_step[s]) for s in steps]
        axes[0].plot(steps, means, marker=".", label=arm)
        axes[1].plot(seconds, means, marker=".", label=arm)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training seconds (evaluations left out)")
    axes[0].set_ylabel(f"held-out pass@1 (mean of {len(args.seeds)} seeds)")
    fig.suptitle("built-in task: on-policy distillation from a trained policy vs RL alone")
    axes[0].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"figure: {path}")


if __name__ == "__main__":
    main(tyro.cli(Args))
