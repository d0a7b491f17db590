"""`grouprl train | eval | generate | sft | compare | check | doctor | explain | plot | view | serve |
trl`.

One module per command (`grouprl.cli.train`, ...), each with `run(argv) -> exit status`: it
parses its flags (a dataclass whose field docstrings are the help text, through tyro), builds
what the library needs and calls it. Mistakes a user can fix end in one line on stderr and exit
status 2, with no traceback. Nothing heavy is imported before the flags are parsed: `--help`
answers without torch or transformers (a command's module is imported only when it runs).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

from grouprl.errors import UserError
from grouprl.quiet import quiet_hf  # noqa: F401 (the commands' import)

#: Each command: its module in grouprl.cli, and the line `grouprl --help` shows for it.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train a policy with GRPO, GSPO, Dr. GRPO or DAPO"),
    "eval": ("eval", "held-out pass@1 / pass@k of a model on a task"),
    "generate": ("generate", "a model's completions for a prompt, rendered as training renders it"),
    "sft": ("sft", "supervised warm start on a task's worked solutions"),
    "compare": ("compare", "algorithms side by side on the same data and seeds, with a report"),
    "check": ("check", "before training: will this run learn, and how long will it take"),
    "doctor": ("doctor", "what looks wrong in a run, with evidence and a suggestion"),
    "explain": ("explain", "the seeds' worked examples, computed live"),
    "plot": ("plot", "PNG plots of a run directory"),
    "view": ("view", "runs in the browser: groups, advantages, each token's ratio and clip"),
    "serve": ("serve", "a saved model behind an OpenAI-compatible endpoint on 127.0.0.1"),
    "trl": (
        "trl",
        "TRL's `trl grpo` and `trl rloo` command lines (same flags, TRL's reward names) on grouprl",
    ),
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
            command = importlib.import_module(f"grouprl.cli.{COMMANDS[name][0]}")
            return command.run(rest)
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
