"""PNG plots of a run directory's metrics.jsonl and eval.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from grouprl.errors import UserError

# One figure per file: (file name, title, [(metric, label)], source file).
PANELS = [
    (
        "reward.png",
        "Reward and accuracy",
        [("reward_mean", "train reward"), ("accuracy", "train accuracy")],
        [("pass_at_1", "held-out pass@1"), ("greedy_pass_at_1", "held-out greedy")],
    ),
    (
        "clip.png",
        "Clipped share of tokens",
        [("clip_frac_low", "low"), ("clip_frac_high", "high")],
        [],
    ),
    (
        "kl_entropy.png",
        "KL and entropy",
        [("approx_kl", "approx KL (old||new)"), ("kl", "KL to ref"), ("entropy", "entropy")],
        [],
    ),
    (
        "length.png",
        "Completion length",
        [("completion_len_mean", "mean"), ("completion_len_max", "max")],
        [],
    ),
    ("groups.png", "Groups with zero reward variance", [("frac_zero_std", "frac_zero_std")], []),
]


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(run_dir: Path) -> list[Path]:
    """Write the PNG plots into RUN_DIR/plots/ and return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = _read(run_dir / "metrics.jsonl")
    evals = _read(run_dir / "eval.jsonl")
    if not metrics and not evals:
        raise UserError(
            f"{run_dir} holds no metrics.jsonl or eval.jsonl; is it a grouprl run directory?"
        )
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for name, title, train_keys, eval_keys in PANELS:
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
        drawn = False
        for key, label in train_keys:
            xs, ys = _series(metrics, key)
            if xs:
                # A second train curve is dashed: reward and accuracy coincide on 0/1 rewards.
                style = "-" if not drawn else "--"
                ax.plot(xs, ys, style, label=label, linewidth=1.2)
                drawn = True
        for key, label in eval_keys:
            xs, ys = _series(evals, key)
            if xs:
                ax.plot(xs, ys, label=label, marker="o", linewidth=1.5)
                drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        written.append(out_dir / name)
    return written
