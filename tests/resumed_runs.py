"""A run stopped mid-way and resumed, beside the same run straight: what the resume tests of
the engines share (tests/vllm_engine)."""

from __future__ import annotations

import pytest


def straight_and_resumed(options: dict, root):
    """A straight run of `options`, and one stopped by SIGINT during step 2 (it finishes the
    step, saves and stops), then resumed to the end: (straight, broken, resumed) results."""
    import dataclasses
    import os
    import signal

    from grouprl.config import TrainConfig
    from grouprl.train import loop

    straight = loop.train(TrainConfig(**options, output_dir=root / "straight"))
    original = loop.collect_batch

    def interrupt(cfg, sampler, step, position):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return original(cfg, sampler, step, position)

    patch = pytest.MonkeyPatch()
    patch.setattr(loop, "collect_batch", interrupt)
    try:
        broken = loop.train(TrainConfig(**options, output_dir=root / "broken"))
    finally:
        patch.undo()
    resumed = loop.train(dataclasses.replace(TrainConfig(**options), resume=broken.run_dir))
    return straight, broken, resumed
