"""`grouprl train | eval | sft | explain | plot`.

Each subcommand's flags come from a dataclass whose field docstrings are the help text (tyro);
`grouprl train --config run.yaml --lr 1e-4` reads the file first and lets flags override it.
Mistakes a user can fix end in one line on stderr and exit status 2, with no traceback.
"""

from __future__ import annotations

import argparse
import sys
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


def _train(argv: list[str]) -> int:
    from grouprl.train.config import TrainConfig, from_mapping, load_yaml
    from grouprl.train.loop import main

    # --config and --resume pick the defaults the other flags then override.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path)
    pre.add_argument("--resume", type=Path)
    known, _ = pre.parse_known_args(argv)
    base = TrainConfig()
    if known.resume is not None:
        saved = known.resume / "config.yaml"
        if not saved.is_file():
            raise UserError(
                f"{known.resume} is not a run directory (no config.yaml); check --resume"
            )
        base = from_mapping(load_yaml(saved), source=str(saved))
        base.output_dir = known.resume
    elif known.config is not None:
        base = from_mapping(load_yaml(known.config), source=str(known.config))
    cfg = tyro.cli(TrainConfig, args=argv, default=base, prog="grouprl train")
    return main(cfg)


def _eval(argv: list[str]) -> int:
    from grouprl.train.evaluate import EvalConfig, main

    return main(tyro.cli(EvalConfig, args=argv, prog="grouprl eval"))


def _sft(argv: list[str]) -> int:
    from grouprl.train.sft import SFTConfig, main

    return main(tyro.cli(SFTConfig, args=argv, prog="grouprl sft"))


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


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "train": (_train, "train a policy with GRPO, GSPO, Dr. GRPO or DAPO"),
    "eval": (_eval, "held-out pass@1 / pass@k of a model on a task"),
    "sft": (_sft, "supervised warm start on a task's worked solutions"),
    "explain": (_explain, "the seeds' worked examples, computed live"),
    "plot": (_plot, "PNG plots of a run directory"),
}


def _usage() -> str:
    lines = ["usage: grouprl COMMAND [--help] [flags]", "", "commands:"]
    lines += [f"  {name:<8} {doc}" for name, (_, doc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress output is enough
    if name not in COMMANDS:
        print(f"grouprl: error: unknown command '{name}'\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[name][0](rest)
    except UserError as err:
        print(f"grouprl {name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"grouprl {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
