"""A vision-language model learns on a laptop: `grouprl train --task dots` over 3 seeds.

The built-in `dots` task (how many dots a 64 x 64 image shows, 1 to 4) and its bundled base
policy `builtin:dots` (a 0.80M-parameter Idefics3 fitted to noisy counts by `grouprl sft`), run
as a user runs it: `grouprl train --task dots --seed S` with the task's defaults (300 steps,
the vision encoder frozen), one run at a time on both cores, held-out pass@1 (200 images x 4
samples at temperature 1) every 50 steps. The issue's bar: +25 points of held-out pass@1 in at
most 10 minutes.

Reported per seed: held-out pass@1 at the start and the end, the gain, greedy pass@1, and the
run's wall time; --figure draws held-out pass@1 against minutes for every seed.

Usage (from the repository root; about 4 minutes on 2 cores):

    .venv/bin/python benchmarks/dots_vlm.py --figure docs/images/dots_vlm.png
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from harness import child_env, md_table, read_jsonl, versions


@dataclass(frozen=True)
class Args:
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int | None = None
    """None: the task's default (300)."""
    eval_every: int = 50
    threads: int = 2
    figure: Path | None = None
    out_dir: Path | None = None
    """Where runs and results.json go. None: runs/bench/dots-vlm-<date>-<time>."""


def run(args: Args, seed: int, out: Path) -> dict:
    run_dir = out / f"seed{seed}"
    cmd = [sys.executable, "-m", "grouprl", "train", "--task", "dots", "--seed", str(seed),
           "--eval-every", str(args.eval_every), "--threads", str(args.threads),
           "--no-progress", "--output-dir", str(run_dir),
           *(["--steps", str(args.steps)] if args.steps else [])]  # fmt: skip
    start = time.perf_counter()
    with (out / f"seed{seed}.log").open("w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                              env=child_env(args.threads))  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} failed: see {out / f'seed{seed}.log'}")
    evals = read_jsonl(run_dir / "eval.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    elapsed, clock = {0: 0.0}, 0.0  # seconds of training (steps) before each evaluation
    for m in metrics:
        clock += m.get("step_seconds", 0.0)
        elapsed[m["step"]] = clock
    return {
        "seed": seed,
        "seconds": seconds,
        "curve": [(e["step"], elapsed.get(e["step"], clock), e["pass_at_1"]) for e in evals],
        "start": evals[0]["pass_at_1"],
        "end": evals[-1]["pass_at_1"],
        "greedy_start": evals[0]["greedy_pass_at_1"],
        "greedy_end": evals[-1]["greedy_pass_at_1"],
    }


def figure(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in results:
        minutes = [t / 60 for _, t, _ in r["curve"]]
        ax.plot(minutes, [p for _, _, p in r["curve"]], marker="o", label=f"seed {r['seed']}")
    start = sum(r["start"] for r in results) / len(results)
    ax.axhline(start + 0.25, color="grey", linestyle="--", linewidth=1, label="start + 25 points")
    ax.set_xlabel("minutes of training (2 CPU cores)")
    ax.set_ylabel("held-out pass@1 (T = 1)")
    ax.set_title("grouprl train --task dots (builtin:dots, a 0.8M-parameter VLM)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(args: Args) -> None:
    out = args.out_dir or Path("runs/bench") / time.strftime("dots-vlm-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    results = [run(args, seed, out) for seed in args.seeds]
    rows = [(r["seed"], f"{r['start']:.3f}", f"{r['end']:.3f}",
             f"{100 * (r['end'] - r['start']):+.1f}",
             f"{r['greedy_start']:.3f} -> {r['greedy_end']:.3f}",
             f"{r['curve'][-1][1] / 60:.1f}", f"{r['seconds'] / 60:.1f}") for r in results]  # fmt: skip
    print(md_table(["seed", "pass@1 start", "pass@1 end", "points", "greedy pass@1",
                    "training minutes", "wall minutes"], rows))  # fmt: skip
    (out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "versions": versions(),
         "results": results}, indent=2))  # fmt: skip
    if args.figure is not None:
        figure(results, args.figure)
        print(f"figure: {args.figure}")


if __name__ == "__main__":
    main(tyro.cli(Args))
