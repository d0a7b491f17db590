"""`grouprl compare`'s report: algorithms side by side, from their run directories.

Runs are grouped by algorithm (by run directory name when two runs share an algorithm and a
seed); each group's numbers are the mean and the spread over its seeds. The report names a
winner only when the gap in final held-out pass@1 is larger than the seeds' spread, so a
difference that another seed could undo is reported as such.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from grouprl.errors import UserError
from grouprl.report.plots import pyplot
from grouprl.report.runs import RunLog

#: Completions are binned by length into at most this many bins of equal counts, each of at
#: least MIN_BIN completions, for the ratio figure and table.
LENGTH_BINS = 6
MIN_BIN = 20
#: Config fields that do not make runs different experiments (where and how they ran, what
#: they log); runs of one algorithm that differ in any other field are labelled apart.
INCIDENTAL = {
    "seed", "output_dir", "device", "threads", "progress", "eval_every", "save_every",
    "keep_last", "log_samples", "log_ratios", "log_ratios_every", "doctor", "reward_timeout",
    "strategy", "steps", "report_to", "run_name", "trl_metrics", "tool_timeout",
}  # fmt: skip
#: The ratio spread is read as this percentile of |log ratio| in a bin.
RATIO_PERCENTILE = 0.9
#: Steps at the start of a run whose clip fraction the report quotes (off-policy updates clip
#: most while the policy moves fastest).
EARLY_STEPS = 20


@dataclass
class RunNumbers:
    """What the report reads off one run."""

    name: str
    seed: int
    steps: int
    finished: bool
    final_pass_at_1: float | None  # held-out pass@1 at the last evaluation
    final_step: int | None  # the step of that evaluation
    last_eval_step: int  # the run's own last evaluation (it may go beyond final_step)
    train_seconds: float  # cumulative step_seconds: sampling + updates, evaluation excluded
    tokens_per_s: float  # sampled completion tokens / train_seconds


@dataclass
class AlgoNumbers:
    """One algorithm over its seeds."""

    label: str
    algo: str
    runs: list[RunNumbers]
    pass_at_1_mean: float | None
    pass_at_1_min: float | None
    pass_at_1_max: float | None
    train_seconds_mean: float
    tokens_per_s_mean: float
    clip_early: float | None  # mean clipped share (low + high) over the first EARLY_STEPS steps
    clip_late: float | None  # ... over the last EARLY_STEPS steps
    on_policy: bool  # one update per rollout: the ratio is 1, nothing clips
    clip_steps: int  # steps at each end that clip_early and clip_late average over
    ratio_bins: list[dict[str, float]] = field(default_factory=list)
    pass_at_1_curve: list[tuple[int, float]] = field(default_factory=list)  # mean over seeds

    @property
    def spread(self) -> float | None:
        """max - min of the final held-out pass@1 over seeds (None unless at least two seeds were
        evaluated)."""
        if sum(n.final_pass_at_1 is not None for n in self.runs) < 2:
            return None
        return self.pass_at_1_max - self.pass_at_1_min


@dataclass
class Comparison:
    algos: list[AlgoNumbers]
    verdict: str
    winner: str | None
    at_step: int | None  # the step the final held-out pass@1 of every run is taken at


# ----- numbers ----------------------------------------------------------------------------------


def run_numbers(run: RunLog, at_step: int | None) -> RunNumbers:
    """The run's numbers, its held-out pass@1 taken at its last evaluation at or before
    `at_step` (the last step every compared run has been evaluated at)."""
    seconds = sum(r.get("step_seconds") or 0.0 for r in run.metrics)
    tokens = sum((r.get("tokens_per_s") or 0.0) * (r.get("step_seconds") or 0.0)
                 for r in run.metrics)  # fmt: skip
    points = [
        (s, v)
        for s, v in zip(*run.series("pass_at_1", source="evals"), strict=True)
        if s > 0 and (at_step is None or s <= at_step)
    ]
    last = run.metrics[-1]["step"] if run.metrics else 0
    return RunNumbers(
        name=run.name,
        seed=run.seed,
        steps=last,
        finished=run.finished_at is not None,
        final_pass_at_1=points[-1][1] if points else None,
        final_step=points[-1][0] if points else None,
        last_eval_step=max(run.series("pass_at_1", source="evals")[0], default=0),
        train_seconds=seconds,
        tokens_per_s=tokens / seconds if seconds else 0.0,
    )


def _labels(runs: list[RunLog]) -> list[str]:
    """Each run's group: its algorithm, plus `field=value` for every field (not INCIDENTAL) in
    which runs of that algorithm differ, so that only seeds of one experiment are pooled; runs
    still alike in everything but their directory are told apart by it."""
    labels = []
    for run in runs:
        peers = [r for r in runs if r.algo == run.algo]
        keys = sorted({k for r in peers for k in r.config} - INCIDENTAL)
        differ = [k for k in keys if len({repr(r.config.get(k)) for r in peers}) > 1]
        labels.append(run.algo + "".join(f" {k}={run.config.get(k)}" for k in differ))
    pairs = list(zip(labels, (r.seed for r in runs), strict=True))
    return [
        f"{label} ({run.path.parent.name}/{run.name})" if pairs.count((label, run.seed)) > 1
        else label
        for label, run in zip(labels, runs, strict=True)
    ]  # fmt: skip


def _clip_steps(runs: list[RunLog]) -> int:
    """EARLY_STEPS, or half the shortest run, so that the first and last windows never overlap."""
    return min([EARLY_STEPS, *(len(run.series("clip_frac_low")[0]) // 2 for run in runs)])


def _clip(runs: list[RunLog], end: str) -> float | None:
    """Mean clipped share (low + high) over the first or the last `_clip_steps` steps."""
    w, values = _clip_steps(runs), []
    for run in runs:
        _, low = run.series("clip_frac_low")
        _, high = run.series("clip_frac_high")
        total = [a + b for a, b in zip(low, high, strict=False)]
        if w:
            values += total[:w] if end == "first" else total[-w:]
    return statistics.fmean(values) if values else None


def _percentile_name() -> str:
    return f"{round(RATIO_PERCENTILE * 100)}th"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ratio_bins(runs: list[RunLog], edges: list[float]) -> list[dict[str, float]]:
    """Per completion-length bin: how far one step moved the token-ratio product (|Σ_t log ρ_t|)
    and GSPO's length-normalised sequence ratio (|Σ_t log ρ_t| / |y|), as the RATIO_PERCENTILE
    of each over every logged completion of `runs`."""
    points = [
        (length, value)
        for run in runs
        for record in run.ratios
        for length, value in zip(record["lengths"], record["log_ratio_sum"], strict=True)
        if value is not None and length > 0
    ]
    out = []
    for lo, hi in itertools.pairwise(edges):
        inside = [(n, v) for n, v in points if lo <= n < hi]
        if not inside:
            continue
        out.append(
            {
                "length_from": lo,
                "length_to": hi - 1,  # inclusive
                "completions": len(inside),
                "token_product": _percentile([abs(v) for _, v in inside], RATIO_PERCENTILE),
                "sequence": _percentile([abs(v) / n for n, v in inside], RATIO_PERCENTILE),
            }
        )
    return out


def _length_edges(runs: list[RunLog]) -> list[float]:
    """Bin edges over the logged completions' lengths: up to LENGTH_BINS bins of equal counts,
    each of at least MIN_BIN completions (one bin when there are fewer)."""
    lengths = sorted(n for run in runs for rec in run.ratios for n in rec["lengths"] if n > 0)
    if not lengths:
        return []
    bins = max(1, min(LENGTH_BINS, len(lengths) // MIN_BIN))
    starts = sorted({lengths[i * len(lengths) // bins] for i in range(bins)})
    return [*starts, lengths[-1] + 1]  # bins [lo, hi): lengths are whole tokens


def compare_runs(runs: list[RunLog]) -> Comparison:
    """The numbers and the verdict of a comparison of `runs`."""
    if not runs:
        raise UserError("no runs to compare")
    labels = _labels(runs)
    edges = _length_edges(runs)
    evaluated = [r.series("pass_at_1", source="evals")[0] for r in runs]
    # the last step every run evaluated after step 0 has reached (a run killed before its
    # first evaluation after step 0 has no final number and does not hold the others back)
    at_step = min((steps[-1] for steps in evaluated if steps and steps[-1] > 0), default=None)
    algos = []
    for label in dict.fromkeys(labels):
        mine = [r for r, lab in zip(runs, labels, strict=True) if lab == label]
        numbers = [run_numbers(r, at_step) for r in mine]
        finals = [n.final_pass_at_1 for n in numbers if n.final_pass_at_1 is not None]
        curve = _mean_curve(mine, "pass_at_1", "evals")  # (steps, mean, min, max, time)
        algos.append(
            AlgoNumbers(
                label=label,
                algo=mine[0].algo,
                runs=numbers,
                pass_at_1_mean=statistics.fmean(finals) if finals else None,
                pass_at_1_min=min(finals) if finals else None,
                pass_at_1_max=max(finals) if finals else None,
                train_seconds_mean=statistics.fmean(n.train_seconds for n in numbers),
                tokens_per_s_mean=statistics.fmean(n.tokens_per_s for n in numbers),
                clip_early=_clip(mine, "first"),
                clip_late=_clip(mine, "last"),
                clip_steps=_clip_steps(mine),
                on_policy=all(
                    int(r.config.get("minibatches") or 1) == 1
                    and int(r.config.get("epochs") or 1) == 1
                    for r in mine
                ),
                ratio_bins=ratio_bins(mine, edges) if edges else [],
                pass_at_1_curve=list(zip(*curve[:2], strict=True)),
            )
        )
    winner, verdict = _verdict(algos, at_step)
    return Comparison(algos, verdict, winner, at_step)


def _verdict(algos: list[AlgoNumbers], at_step: int | None) -> tuple[str | None, str]:
    scored = sorted(
        (a for a in algos if a.pass_at_1_mean is not None),
        key=lambda a: -a.pass_at_1_mean,
    )
    if len(scored) < 2 or not at_step:
        return None, (
            "Fewer than two algorithms have a held-out evaluation after step 0: nothing to "
            "compare yet."
        )
    best, second = scored[0], scored[1]
    gap = best.pass_at_1_mean - second.pass_at_1_mean
    spreads = [a.spread for a in (best, second)]
    faster = min(scored, key=lambda a: a.train_seconds_mean)
    slower = max(scored, key=lambda a: a.train_seconds_mean)
    ratio = slower.train_seconds_mean / max(faster.train_seconds_mean, 1e-9)
    speed = (
        f" {faster.label} trained {ratio:.2f}x faster ({_seconds(faster.train_seconds_mean)} of "
        f"sampling and updates per run against {slower.label}'s "
        f"{_seconds(slower.train_seconds_mean)})."
        if ratio > 1.1
        else " They cost about the same time per run."
    )
    unfinished = sum(not n.finished for a in algos for n in a.runs)
    if any(n.last_eval_step > at_step for a in algos for n in a.runs):
        speed += (
            f" Every run is compared at step {at_step}, the last step all of them have been "
            f"evaluated at ({unfinished} run(s) have not finished)."
        )
    if any(s is None for s in spreads):
        return None, (
            f"{best.label} is highest (held-out pass@1 at step {at_step}: "
            f"{best.pass_at_1_mean:.3f} against {second.label}'s {second.pass_at_1_mean:.3f}), "
            f"but with fewer than two evaluated seeds there is no spread to compare the gap of "
            f"{gap:.3f} with: run more seeds (--seeds 3) before choosing." + speed
        )
    spread = max(spreads)
    if gap > spread:
        return best.label, (
            f"{best.label} wins: held-out pass@1 at step {at_step} {best.pass_at_1_mean:.3f} "
            f"against {second.label}'s {second.pass_at_1_mean:.3f}, a gap of {gap:.3f}, larger "
            f"than the spread across seeds ({spread:.3f})." + speed
        )
    return None, (
        f"These runs do not separate {best.label} and {second.label}: the gap in held-out "
        f"pass@1 at step {at_step} ({gap:.3f}) is within the spread across seeds "
        f"({spread:.3f}). Choose on cost and on the learning curves below, or run more seeds."
        + speed
    )


# ----- figures ----------------------------------------------------------------------------------


def _mean_curve(
    runs: list[RunLog], key: str, source: str
) -> tuple[list[int], list[float], list[float], list[float], list[float]]:
    """Steps logged by every run, with the mean, min and max of `key` over runs and the mean
    cumulative training time (seconds, evaluation excluded) at each step."""
    series = [dict(zip(*run.series(key, source=source), strict=True)) for run in runs]
    clocks = []
    for run in runs:
        total, clock = 0.0, {0: 0.0}
        for record in run.metrics:
            total += record.get("step_seconds") or 0.0
            clock[record["step"]] = total
        clocks.append(clock)
    steps = sorted(set.intersection(*(set(s) for s in series)) if series else set())
    steps = [s for s in steps if all(s in c for c in clocks)]
    mean = [statistics.fmean(s[x] for s in series) for x in steps]
    low = [min(s[x] for s in series) for x in steps]
    high = [max(s[x] for s in series) for x in steps]
    time = [statistics.fmean(c[x] for c in clocks) for x in steps]
    return steps, mean, low, high, time


def _smooth(values: list[float], steps: int) -> list[float]:
    """A trailing mean over `steps` points (per-step training metrics are noisy)."""
    out, window = [], []
    for v in values:
        window = [*window[-(steps - 1) :], v] if steps > 1 else [v]
        out.append(statistics.fmean(window))
    return out


def write_figures(groups: dict[str, list[RunLog]], comparison: Comparison, out: Path) -> list[Path]:
    plt = pyplot()
    out.mkdir(parents=True, exist_ok=True)
    colours = {label: f"C{i}" for i, label in enumerate(groups)}
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / f"{name}.png")
        plt.close(fig)
        written.append(out / f"{name}.png")

    longest = max((len(r.metrics) for runs in groups.values() for r in runs), default=1)
    smooth = max(1, longest // 40)

    def curves(ax, key, source, use_time, smoothed=False):
        for label, runs in groups.items():
            steps, mean, low, high, time = _mean_curve(runs, key, source)
            if not steps:
                continue
            if smoothed:
                mean, low, high = (_smooth(v, smooth) for v in (mean, low, high))
            xs = time if use_time else steps
            marker = "o" if source == "evals" else None
            ax.plot(xs, mean, color=colours[label], label=label, marker=marker, linewidth=1.4)
            if len(runs) > 1:
                ax.fill_between(xs, low, high, color=colours[label], alpha=0.2, linewidth=0)
        ax.set_xlabel("training time (s, evaluation excluded)" if use_time else "step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), dpi=100)
    for row, (key, source, name) in enumerate(
        [("reward_mean", "metrics", "training reward"), ("pass_at_1", "evals", "held-out pass@1")]
    ):
        for col, use_time in enumerate((False, True)):
            curves(axes[row][col], key, source, use_time, smoothed=source == "metrics")
            axes[row][col].set_ylabel(name)
    fig.suptitle("Reward and held-out pass@1: mean over seeds, band = min to max")
    save(fig, "learning")

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), dpi=100)
    for ax, key, name in zip(axes, ("clip_frac_low", "clip_frac_high"), ("low", "high"),
                             strict=True):  # fmt: skip
        curves(ax, key, "metrics", False, smoothed=True)
        ax.set_ylabel(f"clipped share ({name})")
    fig.suptitle("Clipped share of tokens per step (mean over seeds)")
    save(fig, "clip")

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6), dpi=100)
    for ax, (key, name) in zip(
        axes,
        [
            ("completion_len_mean", "completion length (tokens)"),
            ("entropy", "entropy (nats per token)"),
            ("frac_zero_std", "share of zero-variance groups"),
        ],
        strict=True,
    ):
        curves(ax, key, "metrics", False, smoothed=True)
        ax.set_ylabel(name)
    save(fig, "dynamics")

    if any(a.ratio_bins for a in comparison.algos):
        save(_ratio_figure(plt, comparison, colours), "ratios")
    return written


def _ratio_figure(plt: Any, comparison: Comparison, colours: dict[str, str]) -> Any:
    """Per algorithm, how far one step moves a completion's ratio, by completion length."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=100)
    for algo in comparison.algos:
        if not algo.ratio_bins:
            continue
        xs = [(b["length_from"] + b["length_to"]) / 2 for b in algo.ratio_bins]
        colour = colours[algo.label]
        ax.plot(xs, [max(b["token_product"], 1e-12) for b in algo.ratio_bins], "-o",
                color=colour, label=f"{algo.label}: token-ratio product")  # fmt: skip
        ax.plot(xs, [max(b["sequence"], 1e-12) for b in algo.ratio_bins], "--s",
                color=colour, label=f"{algo.label}: sequence ratio (length-normalised)")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("completion length (tokens)")
    ax.set_ylabel(f"|log ratio|, {_percentile_name()} percentile")
    ax.set_title("How far one step moves each completion's ratio, by length")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return fig


# ----- the report -------------------------------------------------------------------------------


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 100 else f"{value:.0f} s"


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def write_report(runs: list[RunLog], out: Path, *, command: str | None = None) -> Path:
    """Write OUT/report.md, OUT/report.json and OUT/figures/; return report.md's path."""
    comparison = compare_runs(runs)
    labels = _labels(runs)
    groups: dict[str, list[RunLog]] = {}
    for run, label in zip(runs, labels, strict=True):
        groups.setdefault(label, []).append(run)
    out = Path(out)
    figures = write_figures(groups, comparison, out / "figures")
    lines = ["# grouprl compare", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines += ["## Verdict", "", comparison.verdict, ""]
    lines += [*_results_table(comparison), ""]
    lines += [*_reading(comparison), ""]
    for path in figures:
        lines += [f"![{path.stem}](figures/{path.name})", ""]
    lines += _ratio_table(comparison)
    lines += ["## Runs", ""]
    for algo in comparison.algos:
        names = ", ".join(
            f"`{n.name}`" + ("" if n.finished else " (unfinished)") for n in algo.runs
        )
        lines.append(f"- {algo.label}: {names}")
    lines.append("")
    report = out / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    (out / "report.json").write_text(
        json.dumps(
            {
                "verdict": comparison.verdict,
                "winner": comparison.winner,
                "algos": [{**asdict(a), "spread": a.spread} for a in comparison.algos],
            },
            indent=1,
        )
        + "\n",
        encoding="utf-8",
    )
    return report


def _results_table(comparison: Comparison) -> list[str]:
    lines = [
        "| algorithm | seeds | final held-out pass@1 (mean ± half-range) | per seed | training "
        "time (s) | sampled tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for a in comparison.algos:
        half = (a.spread or 0.0) / 2
        per_seed = ", ".join(f"s{n.seed}: {_fmt(n.final_pass_at_1)}" for n in a.runs)
        spread = f" ± {half:.3f}" if a.spread is not None else ""
        lines.append(
            f"| {a.label} | {len(a.runs)} | {_fmt(a.pass_at_1_mean)}{spread} | {per_seed} | "
            f"{a.train_seconds_mean:.0f} | {a.tokens_per_s_mean:.0f} |"
        )
    return lines


def _reading(comparison: Comparison) -> list[str]:
    """What the other numbers say, in sentences."""
    lines = ["## What the runs show", ""]
    for a in comparison.algos:
        if a.clip_early is not None:
            lines.append(
                f"- {a.label}: clipped share {a.clip_early:.3f} over the first {a.clip_steps} "
                f"steps, {a.clip_late:.3f} over the last {a.clip_steps}"
                + (
                    " (one on-policy update per rollout: the ratio is 1, nothing clips)."
                    if a.on_policy
                    else "."
                )
            )
    common = sorted(set.intersection(*(set(dict(a.pass_at_1_curve)) for a in comparison.algos)))
    if len(common) >= 3:  # how fast each got there, not only where it ended
        middle = common[len(common) // 2]
        values = ", ".join(f"{a.label} {dict(a.pass_at_1_curve)[middle]:.3f}"
                           for a in comparison.algos)  # fmt: skip
        lines.append(f"- Held-out pass@1 halfway, at step {middle} (mean over seeds): {values}.")
    full = {a.label: [b for b in a.ratio_bins if b["completions"] >= MIN_BIN]
            for a in comparison.algos}  # fmt: skip
    binned = [a for a in comparison.algos if len(full[a.label]) >= 2]
    for a in binned:
        short, long_ = full[a.label][0], full[a.label][-1]
        lines.append(
            f"- {a.label}, how far one step moved its own completions ({_percentile_name()} "
            f"percentile of |log ratio|; {short['completions']} and {long_['completions']} "
            f"completions): from {short['length_from']:.0f}-{short['length_to']:.0f} to "
            f"{long_['length_from']:.0f}-{long_['length_to']:.0f} tokens, the token-ratio "
            f"product e^{short['token_product']:.2g} -> e^{long_['token_product']:.2g}, the "
            f"length-normalised sequence ratio e^{short['sequence']:.2g} -> "
            f"e^{long_['sequence']:.2g}."
        )
    if binned:
        longest = max(b["length_to"] for a in binned for b in full[a.label])
        lines.append(
            f"- These completions are at most {longest:.0f} tokens long. A product of token "
            "ratios compounds with length, a length-normalised ratio does not: in the seeds' "
            "example a drift of 0.1 per token is e^200 over 2,000 tokens for the product and "
            "e^0.1 for the sequence ratio, the case for GSPO's ratio on long reasoning traces."
        )
    return lines


def _ratio_table(comparison: Comparison) -> list[str]:
    binned = [a for a in comparison.algos if a.ratio_bins]
    if not binned:
        return []
    lines = [
        "## Ratio spread by completion length",
        "",
        f"|log ratio| after one step, {_percentile_name()} percentile over the logged "
        "completions (`ratios.jsonl`).",
        "",
        "| algorithm | length (tokens) | completions | token-ratio product | sequence ratio |",
        "|---|---|---|---|---|",
    ]
    for a in binned:
        for b in a.ratio_bins:
            lines.append(
                f"| {a.label} | {b['length_from']:.0f}-{b['length_to']:.0f} | "
                f"{b['completions']} | e^{b['token_product']:.2g} | e^{b['sequence']:.2g} |"
            )
    return [*lines, ""]
