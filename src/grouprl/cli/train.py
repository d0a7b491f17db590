"""`grouprl train`: parse the flags (a `--config` file, `--resume`), then train."""

from __future__ import annotations

from grouprl.cli import quiet_hf
from grouprl.config.parsing import parse_train_args

#: Exit statuses of a run a signal stopped (128 + the signal number, as shells report them).
EXIT_STATUS = {"SIGINT": 130, "SIGTERM": 143}


def run(argv: list[str]) -> int:
    cfg = parse_train_args(argv)  # --help exits here, before torch is imported
    quiet_hf()
    from grouprl.train.loop import train_and_leave

    summary = train_and_leave(cfg)
    return EXIT_STATUS.get(summary.stopped_by, 130) if summary.interrupted else 0
