"""`grouprl sft`: the supervised warm start's flags, then `grouprl.workflows.sft.train_sft`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import tyro

from grouprl.cli import quiet_hf

if TYPE_CHECKING:
    from grouprl.workflows.sft import SFTConfig


def run(argv: list[str]) -> int:
    from grouprl.workflows.sft import SFTConfig

    cfg = tyro.cli(SFTConfig, args=argv, prog="grouprl sft")
    quiet_hf()
    return main(cfg)


def main(cfg: SFTConfig) -> int:
    from grouprl.workflows.sft import train_sft

    train_sft(cfg)
    return 0
