"""GSPO's claim at laptop scale: does routing replay matter on a mixture-of-experts policy?

Five arms on the bundled tiny MoE base policy (`builtin:arith-moe`: 8 experts, 2 a token, 4
layers) and the built-in task, each over 3 seeds: GRPO, GRPO with R2, GRPO with R3, GSPO, GSPO
with R3. Every arm takes 4 minibatches a step (so three of each step's four updates train
completions that earlier updates of the step moved: the off-policy updates where a changed
route moves a token's ratio) and the same learning rate, 4x the default, so that routing moves.
Each run is a child process with one torch thread, two at a time (at most 5 minutes a run).

Reported: held-out pass@1 (mean and min-max over seeds) at the start, midway and at the end;
the share of expert sets one step changes (`routing_update_changed`), the clipped share of
tokens and the largest token ratio per step (medians over steps, means over seeds); whether a
run collapsed (its last held-out pass@1 below its first). Then `grouprl compare --from` writes
its report over the same runs, and --figure the study's figure.

Usage (from the repository root; ~35 minutes on 2 cores with the defaults):

    .venv/bin/python benchmarks/moe_routing.py --figure docs/images/moe_routing.png
    .venv/bin/python benchmarks/moe_routing.py --seeds 0 --steps 20   # a quick look
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import tyro

from harness import md_table, read_jsonl, train_run, versions

ARMS = {
    "grpo": ["--algo", "grpo"],
    "grpo r2": ["--algo", "grpo", "--routing-replay", "r2"],
    "grpo r3": ["--algo", "grpo", "--routing-replay", "r3"],
    "gspo": ["--algo", "gspo"],
    "gspo r3": ["--algo", "gspo", "--routing-replay", "r3"],
}


@dataclass(frozen=True)
class Args:
    arms: tuple[str, ...] = tuple(ARMS)
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 100
    lr: float = 2e-4
    minibatches: int = 4
    eval_every: int = 20
    eval_size: int = 100
    jobs: int = 2
    """Runs at a time (each with one torch thread)."""
    figure: Path | None = None
    out_dir: Path | None = None
    """Where runs and results.json go. None: runs/bench/moe-routing-<date>-<time>."""


def run(args: Args, arm: str, seed: int, out: Path) -> Path:
    flags = ["--model", "builtin:arith-moe", "--steps", str(args.steps), "--seed", str(seed),
             "--lr", str(args.lr), "--minibatches", str(args.minibatches), "--eval-every",
             str(args.eval_every), "--eval-size", str(args.eval_size), "--log-groups", "0",
             *ARMS[arm]]  # fmt: skip
    run_dir, start = out / f"{arm.replace(' ', '-')}-s{seed}", time.perf_counter()
    trained = not (run_dir / "final").exists()  # a finished run is kept as it is
    done = train_run(run_dir, flags, f"{arm} seed {seed}")
    if trained:
        (done / "wall_seconds.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
    return done


def _median(run_dir: Path, key: str) -> float:
    values = [r[key] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def summarise(arm: str, dirs: list[Path]) -> dict:
    evals = [{r["step"]: r["pass_at_1"] for r in read_jsonl(d / "eval.jsonl")} for d in dirs]
    metrics = [list(read_jsonl(d / "metrics.jsonl")) for d in dirs]
    return {
        "arm": arm,
        "pass_at_1": {step: [e[step] for e in evals] for step in sorted(evals[0])},
        "routing_update_changed": [_median(d, "routing_update_changed") for d in dirs],
        "clip_frac": [
            statistics.median(r["clip_frac_low"] + r["clip_frac_high"] for r in m) for m in metrics
        ],
        "ratio_max": [_median(d, "ratio_max") for d in dirs],
        "collapsed": sum(e[max(e)] < e[min(e)] for e in evals),
        "curves": {
            key: [[r.get(key) for r in m] for m in metrics]
            for key in ("routing_update_changed", "clip_frac_high", "ratio_max")
        },
        "seconds": [
            float((d / "wall_seconds.txt").read_text())
            for d in dirs
            if (d / "wall_seconds.txt").exists()
        ],
    }


def _cell(values: list[float], digits: int = 3) -> str:
    return (
        f"{statistics.mean(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"
    )


def main(args: Args) -> None:
    out = args.out_dir or Path("runs/bench") / f"moe-routing-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(pool.map(lambda job: run(args, *job, out), jobs))
    by_arm = {arm: [d for (a, _), d in zip(jobs, dirs, strict=True) if a == arm]
              for arm in args.arms}  # fmt: skip
    summary = [summarise(arm, ds) for arm, ds in by_arm.items()]
    results = {"versions": versions(), "args": {k: str(v) for k, v in vars(args).items()},
               "arms": summary}  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1))
    steps = sorted(summary[0]["pass_at_1"])
    shown = [steps[0], steps[len(steps) // 2], steps[-1]]
    rows = [[s["arm"], *(_cell(s["pass_at_1"][step]) for step in shown),
             _cell(s["routing_update_changed"], 4), _cell(s["clip_frac"], 4),
             _cell(s["ratio_max"], 2), f"{s['collapsed']}/{len(args.seeds)}",
             f"{max(s['seconds'], default=float('nan')):.0f}"] for s in summary]  # fmt: skip
    print(md_table(["arm", *(f"pass@1 step {s}" for s in shown), "routes changed / step",
                    "clipped share", "max token ratio", "collapsed", "slowest run (s)"], rows))  # fmt: skip
    subprocess.run([sys.executable, "-m", "grouprl", "compare", "--from", *map(str, dirs),
                    "--output-dir", str(out / "compare")], check=True)  # fmt: skip
    if args.figure is not None:
        figure(summary, args, args.figure)
        print(f"figure: {args.figure}")
    print(f"results: {out / 'results.json'}")


def figure(summary: list[dict], args: Args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for i, s in enumerate(summary):
        colour, style = f"C{i}", "--" if s["arm"].startswith("gspo") else "-"
        width = 3.0 - 0.5 * i  # an arm equal to another (r2 and r3 can be) shows beneath it
        steps = sorted(s["pass_at_1"])
        axes[0].plot(steps, [statistics.mean(s["pass_at_1"][t]) for t in steps], style,
                     color=colour, marker=".", label=s["arm"], linewidth=width)  # fmt: skip
        for ax, key in ((axes[1], "routing_update_changed"), (axes[2], "ratio_max")):
            runs = s["curves"][key]  # None: a step that trained nothing (every group skipped)
            steps_run = min(len(r) for r in runs)
            mean = [_mean([r[t] for r in runs]) for t in range(steps_run)]
            ax.plot(range(1, steps_run + 1), _smoothed(mean, 5), style, color=colour,
                    label=s["arm"], linewidth=width)  # fmt: skip
    axes[0].set_ylabel(f"held-out pass@1 (mean of {len(args.seeds)} seeds)")
    axes[1].set_ylabel("expert sets changed by a step")
    axes[2].set_ylabel("largest ratio in a step (GRPO: token, GSPO: sequence)", fontsize=8)
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"builtin:arith-moe, lr {args.lr}, {args.minibatches} minibatches a step "
                 "(curves 2-3: 5-step running means)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def _smoothed(values: list[float | None], k: int) -> list[float]:
    out = [_mean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]
    return [float("nan") if v is None else v for v in out]


if __name__ == "__main__":
    main(tyro.cli(Args))
