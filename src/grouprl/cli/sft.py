"""`grouprl sft`: the supervised warm start's flags, then `grouprl.sft.train_sft`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import tyro

from grouprl.cli import quiet_hf

if TYPE_CHECKING:
    from grouprl.sft import SFTConfig


def run(argv: list[str]) -> int:
    from grouprl.sft import SFTConfig

    cfg = tyro.cli(SFTConfig, args=argv, prog="grouprl sft")
    quiet_hf()
    return main(cfg)


def main(cfg: SFTConfig) -> int:
    from grouprl.sft import train_sft

    train_sft(cfg)
    return 0
