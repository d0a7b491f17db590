"""Reading a run directory back: its config and JSONL logs, finished or still being written."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grouprl.errors import UserError

#: Written into final/ last, with the step of the final policy: final/ is complete.
FINAL_MARKER = "grouprl_final.json"


def finished_at(run_dir: Path) -> int | None:
    """The step of the run's complete final/ directory, or None."""
    try:
        return int(json.loads((Path(run_dir) / "final" / FINAL_MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, in order; lines that are not a whole JSON object (the
    half-written last line of a run in progress or a killed one) are skipped. Missing: []."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


@dataclass
class RunLog:
    """What a run directory holds: config.yaml and the JSONL logs of `grouprl train`."""

    path: Path
    config: dict[str, Any]
    metrics: list[dict[str, Any]]  # metrics.jsonl: one record per step
    evals: list[dict[str, Any]]  # eval.jsonl: held-out pass@1 at step 0, every eval_every, end
    ratios: list[dict[str, Any]] = field(default_factory=list)  # ratios.jsonl
    samples_path: Path | None = None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def algo(self) -> str:
        return str(self.config.get("algo", "?"))

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))

    def series(self, key: str, source: str = "metrics") -> tuple[list[int], list[float]]:
        """(steps, values) of `key` where it was logged with a finite value."""
        records = self.metrics if source == "metrics" else self.evals
        points = [(r["step"], float(r[key])) for r in records if r.get(key) is not None]
        return [p[0] for p in points], [p[1] for p in points]

    def samples(self) -> list[dict[str, Any]]:
        return read_jsonl(self.samples_path) if self.samples_path else []

    @property
    def finished_at(self) -> int | None:
        """The step of the run's final policy, the last thing `grouprl train` writes (None:
        still running, stopped, or killed)."""
        return finished_at(self.path)


def load_run(path: Path) -> RunLog:
    """Read RUN_DIR; one UserError line when it is not a run directory."""
    path = Path(path)
    config_path = path / "config.yaml"
    if not path.is_dir():
        raise UserError(f"{path} does not exist or is not a directory; give a run directory")
    if not config_path.is_file():
        raise UserError(
            f"{path} is not a grouprl run directory (no config.yaml); give the directory "
            "`grouprl train` printed as 'run directory:'"
        )
    try:
        config = yaml.safe_load(config_path.read_text()) or {}
    except yaml.YAMLError:
        raise UserError(f"{config_path} is not valid YAML; is {path} a run directory?") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_path} does not hold a run's config")
    return RunLog(
        path=path,
        config=config,
        metrics=read_jsonl(path / "metrics.jsonl"),
        evals=read_jsonl(path / "eval.jsonl"),
        ratios=read_jsonl(path / "ratios.jsonl"),
        samples_path=path / "samples.jsonl",
    )
