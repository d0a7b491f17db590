"""Metric sinks: one JSON object per line, mirrored to the run's trackers."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grouprl.faults import fault
from grouprl.report.trackers import Trackers


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


#: The run viewer's records in a run directory: groups/step_000010.json.gz, one per logged
#: step, and groups/vocab.json.gz (each token id's text), once.
GROUPS_DIR, VOCAB_FILE = "groups", "vocab.json.gz"
_STEP_FILE = re.compile(r"step_(\d+)\.json\.gz")


def group_file(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / GROUPS_DIR / f"step_{step:06d}.json.gz"


def group_steps(run_dir: Path) -> list[int]:
    """The steps with a groups/ record, in order."""
    folder = Path(run_dir) / GROUPS_DIR
    found = (_STEP_FILE.fullmatch(p.name) for p in folder.iterdir()) if folder.is_dir() else ()
    return sorted(int(m.group(1)) for m in found if m)


def write_json_gz(path: Path, record: dict[str, Any]) -> None:
    """`record` as gzipped JSON, written whole or not at all (a temporary file, then renamed):
    a reader never sees half a file. mtime 0: the same record gives the same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    data = json.dumps(_clean_tree(record), separators=(",", ":"), allow_nan=False)
    tmp.write_bytes(gzip.compress(data.encode("utf-8"), compresslevel=6, mtime=0))
    os.replace(tmp, path)


def _clean_tree(value: Any) -> Any:
    """`_clean` through nested dicts and lists."""
    if isinstance(value, dict):
        return {k: _clean_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean_tree(v) for v in value]
    return _clean(value)


def truncate_groups(run_dir: Path, *, keep_through_step: int) -> None:
    """Delete the groups/ records after `keep_through_step` (a resumed run writes them again)."""
    for step in group_steps(run_dir):
        if step > keep_through_step:
            group_file(run_dir, step).unlink(missing_ok=True)


class MetricSinks:
    """metrics.jsonl, eval.jsonl, samples.jsonl and ratios.jsonl in a run directory, mirrored to
    the trackers `--report-to` names (see `grouprl.report.trackers`), and the viewer's groups/."""

    def __init__(
        self,
        run_dir: Path,
        trackers: Trackers | None = None,
        aliases: Callable[[dict[str, float]], dict[str, float]] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.aliases = aliases  # more names for the trackers (TRL's): the JSONL keeps grouprl's
        self.metrics = JsonlWriter(self.run_dir / "metrics.jsonl")
        self.evals = JsonlWriter(self.run_dir / "eval.jsonl")
        self.samples = JsonlWriter(self.run_dir / "samples.jsonl")
        self.ratios = JsonlWriter(self.run_dir / "ratios.jsonl")
        self.trackers = trackers

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        fault("log")
        self.metrics.write({"step": step, **metrics})
        if self.trackers is not None:
            extra = self.aliases(metrics) if self.aliases is not None else {}
            self.trackers.log("train", step, {**metrics, **extra})

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """The evaluation, and to the trackers the completions sampled since the last one."""
        self.evals.write({"step": step, **metrics})
        if self.trackers is not None:
            self.trackers.log("eval", step, metrics)
            self.trackers.samples_table(step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        for sample in samples:
            self.samples.write({"step": step, **sample})

    def log_ratios(self, step: int, lengths: list[int], log_ratios: list[float]) -> None:
        """Completion lengths and Σ_t log ρ_t after the step's updates (see `grouprl compare`)."""
        self.ratios.write({"step": step, "lengths": lengths, "log_ratio_sum": log_ratios})

    def log_groups(self, step: int, record: dict[str, Any]) -> None:
        """A logged step's whole groups, token by token (`grouprl.train.groups`)."""
        write_json_gz(group_file(self.run_dir, step), {"step": step, **record})

    def log_vocabulary(self, vocab: dict[str, Any]) -> None:
        """Each token id's text, for the viewer: once per run (a resumed run keeps the file)."""
        path = self.run_dir / GROUPS_DIR / VOCAB_FILE
        if not path.exists():
            write_json_gz(path, vocab)

    def log_plots(self, step: int, paths: list[Path]) -> None:
        if self.trackers is not None:
            self.trackers.images(step, paths)

    def close(self, ok: bool = True) -> None:
        for writer in (self.metrics, self.evals, self.samples, self.ratios):
            writer.close()
        if self.trackers is not None:
            self.trackers.close(ok)


#: grouprl's step metrics under the names TRL's GRPOTrainer logs them (its dashboards' keys).
TRL_NAMES = {
    "reward_mean": "reward",
    "reward_std": "reward_std",
    "frac_zero_std": "frac_reward_zero_std",
    "completion_len_mean": "completions/mean_length",
    "completion_len_max": "completions/max_length",
    "truncated_frac": "completions/clipped_ratio",
    "clip_frac_low": "clip_ratio/low_mean",
    "clip_frac_high": "clip_ratio/high_mean",
    "entropy": "entropy",
    "kl": "kl",
    "lr": "learning_rate",
    "logp_mismatch_mean": "sampling/sampling_logp_difference/mean",
    "logp_mismatch_max": "sampling/sampling_logp_difference/max",
    "is_weight_min": "sampling/importance_sampling_ratio/min",
    "is_weight_mean": "sampling/importance_sampling_ratio/mean",
    "is_weight_max": "sampling/importance_sampling_ratio/max",
    "router_aux_loss": "aux_loss",
}


def trl_names(metrics: dict[str, float]) -> dict[str, float]:
    """The step's metrics under TRL's names: the table's, each reward's mean as
    rewards/NAME/mean, and clip_ratio/region_mean (the clipped share, both sides)."""
    named = {TRL_NAMES[k]: v for k, v in metrics.items() if k in TRL_NAMES}
    rewards = {k.removeprefix("reward_") for k in metrics if k.startswith("reward_")}
    for name in sorted(rewards - {"mean", "std"} - {r for r in rewards if r.endswith("_spread")}):
        named[f"rewards/{name}/mean"] = metrics[f"reward_{name}"]
    if "clip_frac_low" in metrics and "clip_frac_high" in metrics:
        named["clip_ratio/region_mean"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    return named


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

    def log_groups(self, step: int, record: dict[str, Any]) -> None:
        pass

    def log_vocabulary(self, vocab: dict[str, Any]) -> None:
        pass

    def log_plots(self, step: int, paths: list[Path]) -> None:
        pass

    def close(self, ok: bool = True) -> None:
        pass
