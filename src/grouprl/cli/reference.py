"""Every command's flags as Markdown, read from the parser its `--help` prints from: tyro's over
the command's options (and `grouprl check`'s own), TRL's for `grouprl trl grpo`. The docs'
command reference is made from this (`docs/hooks.py`), never written by hand, and a test holds
it to each command's `--help`.
"""

from __future__ import annotations

import importlib
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from grouprl.cli import COMMANDS


@dataclass(frozen=True)
class FlagRow:
    """One flag as the reference lists it."""

    flag: str  # its option strings ("--progress, --no-progress"), or a positional's name
    takes: str  # its choices or metavar ("" for a switch)
    default: str
    help: str


#: The options each command parses with tyro: (module, class) by command; compare and check
#: take every train flag besides their own.
_OPTIONS = {
    "train": ("grouprl.config.options", "TrainConfig"),
    "eval": ("grouprl.config.options", "EvalConfig"),
    "generate": ("grouprl.config.options", "GenerateConfig"),
    "sft": ("grouprl.workflows.sft", "SFTConfig"),
    "compare": ("grouprl.cli.compare", "CompareArgs"),
    "check": ("grouprl.workflows.check", "CheckOptions"),
    "doctor": ("grouprl.cli.doctor", "DoctorArgs"),
    "explain": ("grouprl.cli.explain", "ExplainArgs"),
    "plot": ("grouprl.cli.plot", "PlotArgs"),
    "view": ("grouprl.cli.view", "ViewArgs"),
    "serve": ("grouprl.cli.serve", "ServeArgs"),
}
#: Commands whose other flags are all of train's.
_TRAIN_TOO = ("compare", "check")


def _parser(cls: type) -> Any:
    """tyro's argparse parser for `cls` (the one its --help describes)."""
    import tyro

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # get_parser: still tyro's own
        return tyro.extras.get_parser(cls)


def _rows(actions: Iterable[Any], renamed: dict[str, str] | None = None) -> list[FlagRow]:
    rows = []
    for action in actions:
        if "-h" in action.option_strings:
            continue
        text = " ".join((action.help or "").split())
        found = re.search(r"\s*\(default: (.*?)\)\s*$", text)
        default = (
            found.group(1) if found else ("" if action.default is None else str(action.default))
        )
        text = text[: found.start()] if found else text
        if "(required)" in text:
            text, default = text.replace("(required)", "").strip(), "required"
        names = [renamed.get(o.lstrip("-").replace("-", "_"), o) if renamed else o
                 for o in action.option_strings] or [action.dest.upper()]  # fmt: skip
        if renamed:
            names = [n for n in dict.fromkeys(names)]
        takes = "" if action.nargs == 0 else str(action.metavar or "").replace("|", " or ")
        rows.append(FlagRow(", ".join(f"{n}" for n in names), takes, default.replace("|", " or "),
                            text.replace("|", "\\|")))  # fmt: skip
    return rows


def flag_rows(cls: type, *, renamed: dict[str, str] | None = None) -> list[FlagRow]:
    """The flags of a tyro-parsed options class, in --help's order (`renamed`: field name ->
    the flag a command gives it, as `grouprl check` names its own)."""
    return _rows(_parser(cls)._actions, renamed)


def command_rows(command: str) -> list[FlagRow]:
    """The rows of one command's own flags (without train's, for compare and check)."""
    module, name = _OPTIONS[command]
    cls = getattr(importlib.import_module(module), name)
    if command == "check":
        from grouprl.workflows.check import OWN_FLAGS

        return flag_rows(cls, renamed={v: k for k, v in OWN_FLAGS.items()})
    return flag_rows(cls)


def _table(rows: list[FlagRow]) -> list[str]:
    lines = ["| flag | takes | default | what it does |", "|---|---|---|---|"]
    for r in rows:
        takes = f"`{r.takes}`" if r.takes else ""
        default = f"`{r.default}`" if r.default not in ("", "required") else r.default
        lines.append(f"| `{r.flag}` | {takes} | {default} | {r.help} |")
    return lines


def trl_rows() -> tuple[list[FlagRow], dict[str, str]]:
    """`grouprl trl grpo`'s flags from TRL's parser (TRL's script arguments, grouprl's
    GRPOConfig, TRL's ModelConfig and dataset mixture), and what grouprl does with each of
    GRPOConfig's fields (mapped, refused, warned)."""
    from grouprl.trl.fields import FIELDS
    from grouprl.trl.scripts import make_parser

    return _rows(make_parser()._actions), {name: f.kind for name, f in FIELDS.items()}


def markdown(command: str) -> str:
    """The reference section of one command: what it does and a table of its flags."""
    lines = [f"## `grouprl {command}`", "", COMMANDS[command][1][0].upper() + COMMANDS[command][1][1:]
             + ".", ""]  # fmt: skip
    if command == "trl":
        rows, kinds = trl_rows()
        lines += ["`grouprl trl grpo` parses TRL's own command line (TRL must be installed): "
                  "TRL's script arguments, TRL's model and dataset options, and GRPOConfig's "
                  "fields, each mapped onto grouprl's options, refused in one line, or (TRL's "
                  "plumbing) warned about and ignored.", ""]  # fmt: skip
        lines += ["| flag | takes | default | grouprl | what it does |", "|---|---|---|---|---|"]
        for r in rows:
            name = r.flag.split(",")[0].lstrip("-").replace("-", "_")
            takes = f"`{r.takes}`" if r.takes else ""
            lines.append(f"| `{r.flag}` | {takes} | `{r.default}` | {kinds.get(name, 'TRL')} "
                         f"| {r.help} |")  # fmt: skip
        lines += ["", *_rloo_lines({r.flag for r in rows})]
        return "\n".join(lines) + "\n"
    if command in _TRAIN_TOO:
        lines += ["Every `grouprl train` flag, and its own:", ""]
    lines += _table(command_rows(command))
    return "\n".join(lines) + "\n"


def _rloo_lines(grpo_flags: set[str]) -> list[str]:
    """`grouprl trl rloo`: TRL's `trl rloo` command line, which differs from `trl grpo`'s by
    the flags RLOOConfig lacks and its own (`grouprl.trl.rloo`)."""
    from grouprl.trl.rloo import _GRPO_ONLY, RLOO_FIELDS
    from grouprl.trl.scripts import make_parser

    rows = _rows(make_parser("rloo")._actions)
    lines = ["`grouprl trl rloo` parses TRL's `trl rloo` command line: the flags above less "
             "GRPOConfig's own (" + ", ".join(f"`--{n}`" for n in _GRPO_ONLY) + "), with "
             "RLOOConfig's defaults (`--num_generations 2`, `--beta 0.05`) and TRL's RLOO "
             "semantics (leave-one-out advantages, the KL in the reward, the sequence ratio), "
             "and these of its own:", "",
             "| flag | takes | default | grouprl | what it does |", "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if r.flag in grpo_flags:
            continue
        name = r.flag.split(",")[0].lstrip("-").replace("-", "_")
        takes = f"`{r.takes}`" if r.takes else ""
        kind = RLOO_FIELDS[name].kind if name in RLOO_FIELDS else "TRL"
        lines.append(f"| `{r.flag}` | {takes} | `{r.default}` | {kind} | {r.help} |")
    return lines


def reference() -> str:
    """The reference of every command, in `grouprl --help`'s order."""
    return "\n".join(markdown(command) for command in COMMANDS)
