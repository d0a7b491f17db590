"""`grouprl doctor`: read a run directory and print what looks wrong (`grouprl.report.doctor`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro


@dataclass
class DoctorArgs:
    """Read a run directory (finished or in progress) and report what looks wrong: each finding
    with its severity, its evidence and one suggestion. Exit status 1 when a warning is found."""

    run_dir: Annotated[Path, tyro.conf.Positional]
    """A run directory written by `grouprl train`."""
    json: bool = False
    """Print one JSON object instead of the transcript."""


def run(argv: list[str]) -> int:
    from grouprl.report.doctor import diagnose, format_findings
    from grouprl.report.runs import load_run

    args = tyro.cli(DoctorArgs, args=argv, prog="grouprl doctor")
    log = load_run(args.run_dir)
    findings = diagnose(log)
    if args.json:
        print(json.dumps({"run_dir": str(log.path), "findings": [f.to_json() for f in findings]}))
    else:
        print(format_findings(log, findings))
    return 1 if any(f.severity == "warning" for f in findings) else 0
