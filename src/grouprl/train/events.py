"""What a run tells the callbacks a run from Python was given (no heavy imports)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunEvent:
    """What a callback is told after each step ("step"), each held-out evaluation
    ("evaluation") and each checkpoint written ("save", no metrics): the step, its metrics
    (read-only) and the run directory. `stop()` asks the
    run to end after this step, as if `--steps` had been this step: it saves, evaluates and
    writes final/ as a finished run does."""

    kind: str
    step: int
    metrics: Mapping[str, float]
    run_dir: Path
    stop: Callable[[], None]
