"""`grouprl train | eval | sft | compare | doctor | explain | plot`.

Each subcommand's flags come from a dataclass whose field docstrings are the help text (tyro);
`grouprl train --config run.yaml --lr 1e-4` reads the file first and lets flags override it.
Mistakes a user can fix end in one line on stderr and exit status 2, with no traceback. Nothing
heavy is imported before the flags are parsed: `--help` answers without torch or transformers.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from grouprl.errors import UserError


@dataclass
class ExplainArgs:
    """Print the worked examples of GRPO and GSPO, computed live by grouprl.core."""

    json: bool = False
    """Print one JSON object instead of tables."""


@dataclass
class PlotArgs:
    """Write PNG plots of a run directory's metrics into RUN_DIR/plots/."""

    run_dir: Annotated[Path, tyro.conf.Positional]
    """A run directory written by `grouprl train`."""


@dataclass
class DoctorArgs:
    """Read a run directory (finished or in progress) and report what looks wrong: each finding
    with its severity, its evidence and one suggestion. Exit status 1 when a warning is found."""

    run_dir: Annotated[Path, tyro.conf.Positional]
    """A run directory written by `grouprl train`."""
    json: bool = False
    """Print one JSON object instead of the transcript."""


def _quiet_hf() -> None:
    """Our own progress output is enough: no progress bars from the HF libraries."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _train(argv: list[str]) -> int:
    from grouprl.train.config import parse_train_args

    cfg = parse_train_args(argv)  # --help exits here, before torch is imported
    _quiet_hf()
    from grouprl.train.loop import main

    return main(cfg)


def _eval(argv: list[str]) -> int:
    from grouprl.train.config import EvalConfig, parse_args

    cfg = parse_args(EvalConfig, argv, prog="grouprl eval", source="the command line")
    _quiet_hf()
    from grouprl.train.evaluate import main

    return main(cfg)


def _generate(argv: list[str]) -> int:
    from grouprl.train.config import parse_args
    from grouprl.train.generate import GenerateConfig

    cfg = parse_args(GenerateConfig, argv, prog="grouprl generate", source="the command line")
    _quiet_hf()
    from grouprl.train.generate import main

    return main(cfg)


def _sft(argv: list[str]) -> int:
    from grouprl.train.sft import SFTConfig, main

    cfg = tyro.cli(SFTConfig, args=argv, prog="grouprl sft")
    _quiet_hf()
    return main(cfg)


def _explain(argv: list[str]) -> int:
    from grouprl.explain import run

    args = tyro.cli(ExplainArgs, args=argv, prog="grouprl explain")
    return run(as_json=args.json)


def _plot(argv: list[str]) -> int:
    from grouprl.report import plot_run

    args = tyro.cli(PlotArgs, args=argv, prog="grouprl plot")
    for path in plot_run(args.run_dir):
        print(path)
    return 0


def _compare(argv: list[str]) -> int:
    from grouprl.train.compare import main

    return main(argv, before_training=_quiet_hf)


def _check(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: grouprl check [any grouprl train flag] [--check-steps N] [--json] "
            "[--output FILE] [--memory-limit GB] [--second-temperature T]\n\n"
            "Builds the run as train would, samples --check-steps (2) steps of groups, measures "
            "one update without stepping the optimizer, and reports whether it would learn: "
            "prompts as the model sees them, reward spread, groups without gradient, lengths, "
            "speed, memory. Writes nothing unless --output. Exit 1 when the run would not learn."
        )
        return 0
    _quiet_hf()
    from grouprl.train.check import main

    return main(argv)


def _doctor(argv: list[str]) -> int:
    import json

    from grouprl.report.doctor import diagnose, format_findings
    from grouprl.report.runs import load_run

    args = tyro.cli(DoctorArgs, args=argv, prog="grouprl doctor")
    run = load_run(args.run_dir)
    findings = diagnose(run)
    if args.json:
        print(json.dumps({"run_dir": str(run.path), "findings": [f.to_json() for f in findings]}))
    else:
        print(format_findings(run, findings))
    return 1 if any(f.severity == "warning" for f in findings) else 0


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "train": (_train, "train a policy with GRPO, GSPO, Dr. GRPO or DAPO"),
    "eval": (_eval, "held-out pass@1 / pass@k of a model on a task"),
    "generate": (_generate, "a model's completions for a prompt, rendered as training renders it"),
    "sft": (_sft, "supervised warm start on a task's worked solutions"),
    "compare": (_compare, "algorithms side by side on the same data and seeds, with a report"),
    "check": (_check, "before training: will this run learn, and how long will it take"),
    "doctor": (_doctor, "what looks wrong in a run, with evidence and a suggestion"),
    "explain": (_explain, "the seeds' worked examples, computed live"),
    "plot": (_plot, "PNG plots of a run directory"),
}


def version() -> str:
    """The installed package's version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("grouprl")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


def _usage() -> str:
    lines = ["usage: grouprl COMMAND [--help] [flags]   (or: grouprl --version)", "", "commands:"]
    lines += [f"  {name:<8} {doc}" for name, (_, doc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"grouprl {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"grouprl: error: unknown command '{name}'\n\n{_usage()}", file=sys.stderr)
        return 2

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"grouprl {name}: warning: {message}", file=sys.stderr)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = show  # one plain line per warning, no source location
            return COMMANDS[name][0](rest)
    except UserError as err:
        if _prints():
            print(f"grouprl {name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if _prints():
            print(f"grouprl {name}: interrupted", file=sys.stderr)
        return 130


def _prints() -> bool:
    """Under torchrun only rank 0 prints: every rank hits the same error at the same step."""
    return os.environ.get("RANK", "0") == "0" or "WORLD_SIZE" not in os.environ


if __name__ == "__main__":
    sys.exit(main())
