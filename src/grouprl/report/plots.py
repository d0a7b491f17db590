"""PNG plots of one run directory: a figure per quantity, and a one-page overview.

Every quantity gets an axis where it can be read: the KL terms (1e-6 on an on-policy run) on a
log scale of their own rather than beside entropy; the gradient norm on a log scale with the
clipping norm drawn; train reward apart from accuracy (they coincide on 0/1 rewards), with a
reward function's curve only where it differs from the total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from grouprl.errors import UserError
from grouprl.report.runs import RunLog, load_run


@dataclass(frozen=True)
class Panel:
    """One plot: train metrics as lines, held-out metrics as markers, on one y axis."""

    name: str  # file name in plots/ (without .png)
    title: str
    train: tuple[tuple[str, str], ...] = ()  # (metrics.jsonl key, label)
    heldout: tuple[tuple[str, str], ...] = ()  # (eval.jsonl key, label)
    ylabel: str = ""
    log: bool = False  # log y axis (values <= 0 are left out)
    unit_range: bool = False  # a share or a rate: y from 0 to 1


PANELS = (
    Panel("reward", "Training reward (mean over sampled completions)", ylabel="reward"),
    Panel(
        "accuracy",
        "Accuracy by the pass reward",
        train=(("accuracy", "train (sampled)"),),
        heldout=(("pass_at_1", "held-out pass@1"), ("greedy_pass_at_1", "held-out greedy")),
        unit_range=True,
    ),
    Panel("loss", "Policy loss", train=(("loss", "loss"),)),
    Panel(
        "grad_norm",
        "Gradient norm (before clipping)",
        train=(("grad_norm", "grad norm"),),
        log=True,
    ),
    Panel("lr", "Learning rate", train=(("lr", "lr"),)),
    Panel(
        "clip",
        "Clipped share of tokens",
        train=(
            ("clip_frac_low", "low (ratio < 1 - clip_low)"),
            ("clip_frac_high", "high (ratio > 1 + clip_high)"),
        ),
    ),
    Panel(
        "kl",
        "KL per token",
        train=(("approx_kl", "approx KL(old || new)"), ("kl", "KL to reference")),
        log=True,
    ),
    Panel(
        "ratio",
        "Importance ratio of trained tokens/sequences",
        train=(("ratio_max", "max"), ("ratio_mean", "mean"), ("ratio_min", "min")),
    ),
    Panel(
        "entropy",
        "Entropy of the sampling policy (nats per token)",
        train=(("entropy", "entropy"),),
    ),
    Panel(
        "length",
        "Completion length (tokens)",
        train=(("completion_len_mean", "mean"), ("completion_len_max", "max")),
    ),
    Panel(
        "groups",
        "Shares of groups and completions",
        train=(
            ("frac_zero_std", "groups with zero reward variance"),
            ("frac_none_pass", "groups all wrong"),
            ("frac_all_pass", "groups all right"),
            ("trained_frac", "groups trained"),
            ("truncated_frac", "completions cut at max_new_tokens"),
        ),
        unit_range=True,
    ),
    Panel(
        "tools",
        "Tool use (runs with tools)",
        train=(
            ("tool_call_rate", "completions calling a tool"),
            ("tool_failure_frac", "calls that failed"),
            ("observation_token_frac", "tokens that are observations"),
            ("ended_by_turns_frac", "ended by --max-turns"),
        ),
        heldout=(("tool_call_rate", "held-out: completions calling a tool"),),
        unit_range=True,
    ),
    Panel("throughput", "Sampled tokens per second", train=(("tokens_per_s", "tokens/s"),)),
)


def _reward_keys(run: RunLog) -> tuple[tuple[str, str], ...]:
    """reward_mean, and each reward function's mean where it is not the same curve."""
    keys = sorted({k for r in run.metrics for k in r if k.startswith("reward_")} - {
        "reward_mean", "reward_std"})  # fmt: skip
    _, total = run.series("reward_mean")
    out = [("reward_mean", "total (weighted)")]
    for key in keys:
        if key.endswith("_kept"):
            continue
        _, values = run.series(key)
        if values and values != total:
            out.append((key, key.removeprefix("reward_")))
    return tuple(out)


def _draw(ax, run: RunLog, panel: Panel) -> bool:
    """Draw `panel` on `ax`; False when the run logged none of its quantities."""
    train = _reward_keys(run) if panel.name == "reward" else panel.train
    drawn = False
    for i, (key, label) in enumerate(train):
        xs, ys = run.series(key)
        if panel.log:
            xs, ys = [x for x, y in zip(xs, ys) if y > 0], [y for y in ys if y > 0]
        if xs:
            ax.plot(xs, ys, "-" if i == 0 else ("--", ":", "-.")[i % 3], label=label,
                    linewidth=1.2)  # fmt: skip
            drawn = True
    for key, label in panel.heldout:
        xs, ys = run.series(key, source="evals")
        if xs:
            ax.plot(xs, ys, label=label, marker="o", linewidth=1.5)
            drawn = True
    if not drawn:
        return False
    if panel.name == "grad_norm" and run.config.get("max_grad_norm"):
        ax.axhline(float(run.config["max_grad_norm"]), color="grey", linestyle=":",
                   label="clipped above")  # fmt: skip
    if panel.log:
        ax.set_yscale("log")
    if panel.unit_range:
        ax.set_ylim(-0.03, 1.03)
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    if panel.ylabel:
        ax.set_ylabel(panel.ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    return True


def plot_run(run_dir: Path) -> list[Path]:
    """Write plots/overview.png (every quantity of the run on one page) and a PNG per quantity
    into RUN_DIR/plots/; return their paths, the overview first.

    The page is drawn once and each quantity's PNG is its panel cut out of it (with its title,
    labels and legend): drawing a figure per quantity cost three times as long, and every
    training run writes these."""
    from PIL import Image

    plt = pyplot()
    run = load_run(run_dir)
    if not run.metrics and not run.evals:
        raise UserError(f"{run_dir} holds no metrics.jsonl or eval.jsonl yet; nothing to plot")
    out_dir = run.path / "plots"
    out_dir.mkdir(exist_ok=True)
    panels = [p for p in PANELS if _has_data(run, p)]
    cols = 3
    rows = max(1, math.ceil(len(panels) / cols))
    height = 3.2 * rows  # inches
    fig, axes = plt.subplots(rows, cols, figsize=(16, height), dpi=100, squeeze=False)
    drawn = [(ax, panel) for ax, panel in zip(axes.flat, panels, strict=False)
             if _draw(ax, run, panel)]  # fmt: skip
    for ax in list(axes.flat)[len(drawn) :]:
        ax.axis("off")
    steps = run.metrics[-1]["step"] if run.metrics else 0
    fig.suptitle(f"{run.name}: {run.algo}, {steps} steps", fontsize=12)
    # fixed margins (in inches: the title above, step labels below): tight_layout measures
    # every label and took most of the plotting time
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.45 / height, top=1 - 0.8 / height,
                        hspace=0.45, wspace=0.2)  # fmt: skip
    fig.canvas.draw()
    page = np.asarray(fig.canvas.buffer_rgba())  # (H, W, 4), row 0 at the top
    written = [out_dir / "overview.png"]
    Image.fromarray(page).save(written[0])
    inch = fig.dpi
    for ax, panel in drawn:
        # the axes and the margins around it that hold its labels (measuring each label's
        # extent instead cost a third of the plotting time)
        box = ax.get_window_extent()  # pixels, origin at the bottom left
        x0, x1 = max(0, int(box.x0 - 0.75 * inch)), min(page.shape[1], int(box.x1 + 0.1 * inch))
        y0, y1 = max(0, int(box.y0 - 0.45 * inch)), min(page.shape[0], int(box.y1 + 0.35 * inch))
        path = out_dir / f"{panel.name}.png"
        Image.fromarray(page[page.shape[0] - y1 : page.shape[0] - y0, x0:x1]).save(path)
        written.append(path)
    plt.close(fig)
    return written


def _has_data(run: RunLog, panel: Panel) -> bool:
    keys = [k for k, _ in panel.train] or ["reward_mean"]
    return any(run.series(k)[0] for k in keys) or any(
        run.series(k, source="evals")[0] for k, _ in panel.heldout
    )


def pyplot() -> Any:
    """matplotlib.pyplot with the file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
