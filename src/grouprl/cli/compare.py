"""`grouprl compare`: compare's own flags, the rest train's for every run; or `--from` existing
runs (`grouprl.workflows.compare` trains and reports)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from grouprl.cli import quiet_hf
from grouprl.cli.train import EXIT_STATUS
from grouprl.errors import UserError


@dataclass
class CompareArgs:
    """Train several algorithms on the same model, data, prompts and seeds and write a report
    (report.md, figures/). Every other flag is a `grouprl train` flag, given to every run."""

    algos: str = "grpo,gspo"
    """Comma-separated presets to compare: grpo, gspo, dr_grpo, dapo, gdpo, cispo, sapo, gmpo,
    luspo, vespo, reinforce_pp, reinforce_pp_baseline, opo, gpg, grpo_passk, remax, clip_cov, kl_cov."""
    seeds: int = 1
    """Seeds per algorithm: --seed, --seed + 1, ... (the spread over seeds decides the verdict)."""
    output_dir: Path | None = None
    """Where the runs and the report go. None: runs/compare-<date>-<time>. The same command with
    the same directory continues an interrupted comparison."""
    from_: Annotated[list[Path] | None, tyro.conf.arg(name="from")] = None
    """Build the report from these existing run directories instead of training."""


def parse_compare_args(argv: list[str]) -> tuple[CompareArgs, list[str]]:
    """Compare's own flags, and the rest (train flags for every run)."""
    args, rest = tyro.cli(CompareArgs, args=argv, prog="grouprl compare", return_unknown_args=True)
    return args, list(rest)


def run(argv: list[str]) -> int:
    args, rest = parse_compare_args(argv)  # --help exits here, before torch is imported
    quiet_hf()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise UserError(
            "compare runs its runs one after another in one process; under torchrun, train each "
            "run with `torchrun ... -m grouprl train --algo A --seed S --output-dir D/A-sS` and "
            "build the report with `grouprl compare --from D/*`"
        )
    from grouprl.report.runs import load_run
    from grouprl.workflows.compare import report_from, run_comparison

    if args.from_ is not None:
        defaults = CompareArgs()
        given = [flag for flag, same in (("--algos", args.algos == defaults.algos),
                                         ("--seeds", args.seeds == defaults.seeds)) if not same]  # fmt: skip
        if rest or given:
            raise UserError(
                f"--from builds the report from existing runs as they are; {(rest or given)[0]} "
                "does not apply (drop it)"
            )
        runs = [load_run(p) for p in args.from_]
        if len(runs) < 2:
            raise UserError("--from needs two or more run directories to compare")
        report_from(runs, args.output_dir, command=None)
        return 0
    done = run_comparison(args.algos, args.seeds, rest, args.output_dir)
    return 0 if done.stopped_by is None else EXIT_STATUS.get(done.stopped_by, 130)
