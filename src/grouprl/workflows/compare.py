"""Comparisons (`grouprl compare`): the algorithms on the same model, data, prompts and seeds,
then a report.

Each algorithm and seed is an ordinary run directory, OUTPUT_DIR/<algo>-s<seed>/, trained by
`grouprl train` with the same flags; OUTPUT_DIR/compare.yaml records what was asked, so the same
command run again continues an interrupted comparison: finished runs are kept, an unfinished one
resumes from its latest checkpoint, missing ones start. Then OUTPUT_DIR/report.md and figures/
are (re)written from the run directories (`grouprl.report.compare`).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import yaml

from grouprl.config.parsing import parse_train_args
from grouprl.config.presets import PRESETS, Preset
from grouprl.config.resolution import resolve
from grouprl.errors import UserError
from grouprl.report.runs import finished_at, load_run

#: Flags that compare itself sets for every run.
OWN_FLAGS = ("--algo", "--output-dir", "--resume")


def _default_dir() -> Path:
    return Path("runs") / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"


def _algos(spec: str) -> list[str]:
    algos = [a.strip() for a in spec.split(",") if a.strip()]
    unknown = [a for a in algos if a not in PRESETS]
    if unknown:
        raise UserError(f"--algos: {unknown[0]!r} is not one of {', '.join(PRESETS)}")
    if len(set(algos)) != len(algos) or len(algos) < 2:
        raise UserError("--algos needs two or more different presets, e.g. --algos grpo,gspo")
    return algos


@dataclass(frozen=True)
class Comparison:
    """How a comparison ended: its report, or the signal that stopped it (None: finished)."""

    report: Path | None
    stopped_by: str | None = None


def run_comparison(
    algos: str, seeds: int, rest: list[str], output_dir: Path | None = None
) -> Comparison:
    """Train each of `algos` (comma-separated presets) with `seeds` seeds and the train flags
    `rest`, one run after another in OUTPUT_DIR/<algo>-s<seed>, continuing an interrupted
    comparison in the same directory; then write the report."""
    from grouprl.train import loop

    algos = _algos(algos)
    if seeds < 1:
        raise UserError("--seeds must be at least 1")
    for flag in OWN_FLAGS:
        if any(token == flag or token.startswith(flag + "=") for token in rest):
            raise UserError(f"{flag} is set by compare for each run; drop it (see --help)")
    base = parse_train_args(rest)  # every flag checked once, before anything runs
    overridden = [f.name for f in dataclasses.fields(Preset) if getattr(base, f.name) is not None]
    # what still tells the runs apart: a field left to the presets on which they differ
    apart = [f.name for f in dataclasses.fields(Preset) if f.name not in overridden
             and len({getattr(PRESETS[a], f.name) for a in algos}) > 1]  # fmt: skip
    if not apart:
        raise UserError(
            "the algorithm-defining fields set leave nothing that tells these presets apart (a "
            "run's saved config.yaml records all of them), so every preset would train the same "
            f"run; start from a config without them or drop them ({', '.join(overridden)})"
        )
    if overridden:
        flags = ", ".join("--" + name.replace("_", "-") for name in overridden)
        warnings.warn(
            f"{flags} (from the flags or --config) set an algorithm-defining field, so it "
            "overrides every preset "
            f"({', '.join(algos)}): the runs differ only in what the presets still set",
            stacklevel=1,
        )
    for algo in algos:  # and each preset with them (e.g. GSPO's minibatches must divide B)
        resolve(dataclasses.replace(base, algo=algo),
                task_max_new_tokens=base.max_new_tokens or 1024)  # fmt: skip
    out = output_dir or _default_dir()
    record = {"algos": algos, "seeds": seeds, "train_flags": rest}
    _claim(out, record)
    # what continues this comparison (the default directory's name has the time in it)
    command = shlex.join(["grouprl", "compare", "--algos", ",".join(algos), "--seeds",
                          str(seeds), "--output-dir", str(out), *rest])  # fmt: skip
    plan = [
        (algo, seed) for seed in range(base.seed, base.seed + seeds) for algo in algos
    ]  # every algorithm early on
    for i, (algo, seed) in enumerate(plan, 1):
        run_dir = out / f"{algo}-s{seed}"
        head = f"compare: run {i}/{len(plan)}: {algo}, seed {seed} -> {run_dir}"
        if (run_dir / "config.yaml").is_file():
            if finished_at(run_dir) is not None:
                print(f"{head} (finished earlier)")
                continue
            print(f"{head} (continuing)")
            cfg = parse_train_args(["--resume", str(run_dir)])
        else:
            print(head)
            cfg = parse_train_args(
                [*rest, "--algo", algo, "--seed", str(seed), "--output-dir", str(run_dir)]
            )
        summary = loop.train(cfg)
        if summary.interrupted:
            print(f"compare: stopped; to continue: {command}")
            return Comparison(None, summary.stopped_by or "SIGINT")
    runs = [load_run(out / f"{a}-s{s}") for a, s in plan]
    return Comparison(report_from(runs, out, command=command))


def _claim(out: Path, record: dict) -> None:
    """Record what this comparison is in OUT/compare.yaml, or check that a directory from an
    earlier, interrupted call holds the same comparison."""
    path = out / "compare.yaml"
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; --output-dir must be a directory")
    if path.is_file():
        try:
            saved = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            raise UserError(f"{path} is not valid YAML; choose another --output-dir") from None
        if not isinstance(saved, dict):
            raise UserError(f"{path} does not record a comparison; choose another --output-dir")
        started = any((child / "config.yaml").is_file() for child in out.iterdir())
        if saved != record and not started:  # a mistake stopped it before any run: retry
            path.write_text(yaml.safe_dump(record, sort_keys=False))
        elif saved != record:
            raise UserError(
                f"{out} holds another comparison ({saved.get('algos')}, {saved.get('seeds')} "
                f"seed(s), flags {saved.get('train_flags')}); choose another --output-dir"
            )
        return
    if out.exists() and any(out.iterdir()):
        raise UserError(
            f"{out} already exists and is not a comparison; choose another --output-dir"
        )
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(record, sort_keys=False))


def report_from(runs: list, out: Path | None = None, command: str | None = None) -> Path:
    """Write the report of `runs` (loaded run directories) into `out` and print where it is and
    its verdict."""
    out = out or _default_dir()
    from grouprl.report.compare import write_report

    report = write_report(runs, out, command=command)
    verdict = json.loads((out / "report.json").read_text())["verdict"]
    print(f"report: {report}\n{verdict}")
    return report
