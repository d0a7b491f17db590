"""`grouprl plot`: write a run directory's plots (`grouprl.report.plots`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro


@dataclass
class PlotArgs:
    """Write PNG plots of a run directory's metrics into RUN_DIR/plots/."""

    run_dir: Annotated[Path, tyro.conf.Positional]
    """A run directory written by `grouprl train`."""


def run(argv: list[str]) -> int:
    from grouprl.report import plot_run

    args = tyro.cli(PlotArgs, args=argv, prog="grouprl plot")
    for path in plot_run(args.run_dir):
        print(path)
    return 0
