"""Metric sinks: one JSON object per line, and TensorBoard scalars."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from grouprl.faults import fault


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity; write them as null rather than invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


class JsonlWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most one line."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        record = {k: _clean(v) for k, v in record.items()}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def truncate_jsonl(path: Path, *, keep_through_step: int) -> int:
    """Drop records after `keep_through_step`, so a resumed run does not log a step twice, and
    any line that is not a whole JSON object (the half-written last line of a killed process).
    Returns how many unreadable lines were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, broken = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            broken += 1
            continue
        if isinstance(record, dict) and record.get("step", 0) <= keep_through_step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
    return broken


class MetricSinks:
    """metrics.jsonl, eval.jsonl, samples.jsonl, ratios.jsonl and TensorBoard event files in a
    run directory."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, purge_step: int | None = None):
        """purge_step: on a resumed run, TensorBoard drops what it logged at this step and after
        (the steps the run replays)."""
        self.run_dir = Path(run_dir)
        self.metrics = JsonlWriter(self.run_dir / "metrics.jsonl")
        self.evals = JsonlWriter(self.run_dir / "eval.jsonl")
        self.samples = JsonlWriter(self.run_dir / "samples.jsonl")
        self.ratios = JsonlWriter(self.run_dir / "ratios.jsonl")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                log_dir=str(self.run_dir / "tensorboard"), purge_step=purge_step
            )

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        fault("log")
        self.metrics.write({"step": step, **metrics})
        self._scalars("train", step, metrics)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.evals.write({"step": step, **metrics})
        self._scalars("eval", step, metrics)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        for sample in samples:
            self.samples.write({"step": step, **sample})

    def log_ratios(self, step: int, lengths: list[int], log_ratios: list[float]) -> None:
        """Completion lengths and Σ_t log ρ_t after the step's updates (see `grouprl compare`)."""
        self.ratios.write({"step": step, "lengths": lengths, "log_ratio_sum": log_ratios})

    def _scalars(self, prefix: str, step: int, metrics: dict[str, float]) -> None:
        if self._tb is None:
            return
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(f"{prefix}/{key}", value, step)
        self._tb.flush()

    def close(self) -> None:
        for writer in (self.metrics, self.evals, self.samples, self.ratios):
            writer.close()
        if self._tb is not None:
            self._tb.close()


class NullSinks:
    """What ranks other than rank 0 log to: nothing (only rank 0 writes the run directory)."""

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        pass

    def log_ratios(self, step: int, lengths: list[int], log_ratios: list[float]) -> None:
        pass

    def close(self) -> None:
        pass
