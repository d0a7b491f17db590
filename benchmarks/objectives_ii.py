"""The second set of objectives on the built-in task, against GRPO and GSPO: REINFORCE++ (and its
baseline variant), OPO, GPG, Pass@k training, ReMax, Clip-Cov and KL-Cov as presets, and GRPO
with the top 20% entropy tokens and with the adaptive entropy bonus (TRL's default target 0.2,
above the built-in policy's starting entropy of about 0.16 nats a token, and 0.05, below it).

The last comparison's protocol (the README's objectives table): each arm `grouprl train --algo
A` with the preset's defaults, the default 200 steps and evaluations every 25 steps, seeds 0-2;
every run a child process with one torch thread, `--jobs` at a time. Reported: mean (min-max
over seeds) held-out pass@1 at the chosen steps, the policy's entropy at the last step, the
share of tokens (of sequences for GSPO) the clip acted on over the run, and training seconds per
step; `grouprl compare --from` over every run writes its report beside them; the figure: held-out
pass@1 and the policy's entropy by step, the estimators apart from the entropy controls.

Usage (from the repository root; about 70 minutes on 2 cores):

    .venv/bin/python benchmarks/objectives_ii.py --figure docs/images/objectives_ii.png
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

#: arm -> its train flags
ARMS = {
    "grpo": ["--algo", "grpo"],
    "gspo": ["--algo", "gspo"],
    "reinforce_pp": ["--algo", "reinforce_pp"],
    "reinforce_pp_baseline": ["--algo", "reinforce_pp_baseline"],
    "opo": ["--algo", "opo"],
    "gpg": ["--algo", "gpg"],
    "grpo_passk": ["--algo", "grpo_passk"],
    "remax": ["--algo", "remax"],
    "clip_cov": ["--algo", "clip_cov"],
    "kl_cov": ["--algo", "kl_cov"],
    "grpo, top 20% entropy": ["--algo", "grpo", "--top-entropy-quantile", "0.2"],
    "grpo, adaptive entropy 0.2": ["--algo", "grpo", "--entropy-target", "0.2"],
    "grpo, adaptive entropy 0.05": ["--algo", "grpo", "--entropy-target", "0.05"],
}


@dataclass(frozen=True)
class Args:
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int = 200
    eval_every: int = 25
    at: tuple[int, ...] = (25, 50, 200)
    """Steps whose held-out pass@1 the table shows."""
    arms: tuple[str, ...] = tuple(ARMS)
    jobs: int = 2
    """Runs at a time (each with one torch thread)."""
    figure: Path | None = None
    """Where to copy the comparison report's learning figure."""
    out_dir: Path = Path("runs/bench/objectives_ii")
    """Where runs, the report and results.json go; a finished run there is kept."""


def train(args: Args, arm: str, seed: int) -> Path:
    flags = ["--steps", str(args.steps), "--seed", str(seed), "--eval-every",
             str(args.eval_every), *ARMS[arm]]  # fmt: skip
    name = arm.replace(", ", "-").replace(" ", "_").replace("%", "")
    return train_run(args.out_dir / f"{name}-s{seed}", flags, f"{arm} seed {seed}")


def summary(run_dir: Path) -> dict:
    """Held-out pass@1 by step, and the run's entropy at its last step, clip share and
    seconds per step."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    clipped = sum((r.get("clip_frac_low", 0) + r.get("clip_frac_high", 0)) for r in rows)
    return {
        "pass_at_1": {r["step"]: r["pass_at_1"] for r in read_jsonl(run_dir / "eval.jsonl")},
        "entropy": rows[-1].get("entropy"),
        "clip_share": clipped / len(rows),
        "step_seconds": statistics.mean(r["step_seconds"] for r in rows),
    }


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(args: Args) -> None:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]  # every arm early on
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = list(pool.map(lambda job: train(args, *job), jobs))
    by_arm: dict[str, list[dict]] = {}
    for (arm, _), run_dir in zip(jobs, dirs, strict=True):
        by_arm.setdefault(arm, []).append(summary(run_dir))
    rows = []
    for arm, runs in by_arm.items():
        cells = [spread([r["pass_at_1"][s] for r in runs]) for s in args.at]
        rows.append([arm, *cells, f"{statistics.mean(r['entropy'] for r in runs):.3f}",
                     f"{statistics.mean(r['clip_share'] for r in runs):.3f}",
                     f"{statistics.mean(r['step_seconds'] for r in runs):.2f}"])  # fmt: skip
    start = spread([r["pass_at_1"][0] for runs in by_arm.values() for r in runs])
    print(md_table(["arm", *(f"pass@1 at step {s}" for s in args.at), "entropy at the end",
                    "clip share", "s / step"], rows))  # fmt: skip
    print(f"held-out pass@1 at step 0: {start}")
    results = {"versions": versions(), "args": {k: str(v) for k, v in vars(args).items()},
               "arms": by_arm}  # fmt: skip
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    report = args.out_dir / "report"
    cmd = [sys.executable, "-m", "grouprl", "compare", "--from", *map(str, dirs),
           "--output-dir", str(report)]  # fmt: skip
    subprocess.run(cmd, check=True)
    if args.figure is not None:
        plot(args, jobs, dirs)
    print(f"results: {args.out_dir / 'results.json'}")


#: the figure's two columns: arms that change the advantage, arms that control the entropy
PANELS = {
    "advantage estimators": ["grpo", "gspo", "reinforce_pp", "reinforce_pp_baseline", "opo",
                             "gpg", "grpo_passk", "remax"],
    "entropy control": ["grpo", "gspo", "clip_cov", "kl_cov", "grpo, top 20% entropy",
                        "grpo, adaptive entropy 0.2", "grpo, adaptive entropy 0.05"],
}  # fmt: skip


def plot(args: Args, jobs: list[tuple[str, int]], dirs: list[Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, dict[str, dict[int, list[float]]]] = {}
    for (arm, _), run_dir in zip(jobs, dirs, strict=True):
        evals = curves.setdefault(arm, {"pass": {}, "entropy": {}})
        for r in read_jsonl(run_dir / "eval.jsonl"):
            evals["pass"].setdefault(r["step"], []).append(r["pass_at_1"])
        for r in read_jsonl(run_dir / "metrics.jsonl"):
            evals["entropy"].setdefault(r["step"], []).append(r["entropy"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True)
    colours = {arm: plt.get_cmap("tab20")(i) for i, arm in enumerate(ARMS)}
    for col, (title, arms) in enumerate(PANELS.items()):
        for row, key in enumerate(("pass", "entropy")):
            ax = axes[row][col]
            for arm in arms:
                if arm not in curves:
                    continue
                steps = sorted(curves[arm][key])
                means = [statistics.mean(curves[arm][key][s]) for s in steps]
                if key == "entropy":  # per-step metrics are noisy: a trailing mean of 10
                    means = [
                        statistics.mean(means[max(0, i - 9) : i + 1]) for i in range(len(means))
                    ]
                ax.plot(steps, means, color=colours[arm], label=arm,
                        marker="." if key == "pass" else None, linewidth=1.3)  # fmt: skip
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(title)
                ax.legend(fontsize=7)
        axes[0][col].set_ylabel(f"held-out pass@1 (mean of {len(args.seeds)} seeds)")
        axes[1][col].set_ylabel("policy entropy per token (nats)")
        axes[1][col].set_xlabel("step")
    fig.suptitle("built-in task: the second set of objectives against GRPO and GSPO")
    fig.tight_layout()
    fig.savefig(args.figure, dpi=110)
    print(f"figure: {args.figure}")


if __name__ == "__main__":
    started = time.perf_counter()
    main(tyro.cli(Args))
    print(f"{time.perf_counter() - started:.0f} s")
