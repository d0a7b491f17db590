"""What the viewer reads from run directories: each run's summary (its settings, curves and
logged steps), a logged step's groups (groups/step_NNNNNN.json.gz) and the vocabulary.

The step records stay gzipped on disk and are sent as they are (`Content-Encoding: gzip`): the
server never holds more than the step a page asks for, so a long run opens as fast as a short
one.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from grouprl.errors import UserError
from grouprl.report.runs import RunLog, load_run
from grouprl.report.sinks import GROUPS_DIR, VOCAB_FILE, group_file, group_steps

#: metrics.jsonl's keys the viewer draws, and eval.jsonl's
CURVES = ("reward_mean", "accuracy", "frac_zero_std", "clip_frac_low", "clip_frac_high",
          "entropy", "approx_kl", "completion_len_mean", "routing_update_changed",
          "routing_sampler_changed")  # fmt: skip
#: a mixture-of-experts run's per-layer metric the page draws as a steps x layers map
LAYERED = "routing_update_changed"
EVAL_CURVES = ("pass_at_1",)
#: config.yaml's fields the page shows and reads the ratios with
SETTINGS = ("algo", "ratio_level", "objective", "clip_low", "clip_high", "cispo_cap", "epochs",
            "minibatches", "group_size", "prompts_per_step", "lr", "seed", "model", "steps")  # fmt: skip


def run_dirs(paths: list[Path]) -> list[Path]:
    """The run directories given: each path a run (it has config.yaml), or a folder of runs
    (`grouprl compare`'s output directory: every subfolder that is a run, in name order). One
    UserError line for a path that is neither."""
    found: list[Path] = []
    for path in map(Path, paths):
        if (path / "config.yaml").is_file():
            found.append(path)
            continue
        inside = sorted(p for p in path.iterdir() if (p / "config.yaml").is_file()) if (
            path.is_dir()) else []  # fmt: skip
        if not inside:
            load_run(path)  # its own message: missing, not a directory, or not a run
        found.extend(inside)
    return found


def summary(path: Path) -> dict[str, Any]:
    """A run as the page's index shows it: its name and settings, its curves as columns, its
    held-out evaluations, and the steps with a groups/ record (and a note when there is none)."""
    log: RunLog = load_run(path)
    steps = group_steps(path)
    note = None
    if not steps:
        note = (
            "no groups/ records: the run was made before grouprl wrote them, with --log-groups "
            "0, or has not reached its first logged step (--log-groups-every); only its curves "
            "are shown"
        )
    return {
        "name": log.name,
        "path": str(path.resolve()),
        "settings": {k: log.config.get(k) for k in SETTINGS},
        "curves": _columns(log.metrics, CURVES),
        "evals": _columns(log.evals, EVAL_CURVES),
        "layers": by_layer(log.metrics, LAYERED),
        "steps": steps,
        "finished": log.finished_at is not None,
        "note": note,
    }


def _columns(records: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, list]:
    """{"step": [...], key: [...]} with null where a record lacks a key."""
    columns: dict[str, list] = {"step": [r.get("step") for r in records]}
    for key in keys:
        if any(key in r for r in records):
            columns[key] = [r.get(key) for r in records]
    return columns


def by_layer(records: list[dict[str, Any]], key: str) -> dict[str, list] | None:
    """`key`'s per-layer values (`key`_layer0, _layer1, ...) as {"step": [...], "values":
    [[layer 0, layer 1, ...] per step]} over the steps that logged them; None where none did."""
    logged = [r for r in records if f"{key}_layer0" in r]
    if not logged:
        return None
    layers = 0
    while f"{key}_layer{layers}" in logged[0]:
        layers += 1
    return {"step": [r.get("step") for r in logged],
            "values": [[r.get(f"{key}_layer{i}") for i in range(layers)] for r in logged]}  # fmt: skip


def step_bytes(path: Path, step: int) -> bytes:
    """A logged step's record, gzipped JSON as written. UserError when there is none."""
    file = group_file(path, step)
    if not file.is_file():
        raise UserError(f"{path} has no groups/ record for step {step}")
    return file.read_bytes()


def vocab_bytes(path: Path) -> bytes:
    """The run's vocabulary (gzipped JSON: {"pieces": [...], "special": [...]})."""
    file = Path(path) / GROUPS_DIR / VOCAB_FILE
    if not file.is_file():
        raise UserError(f"{path} has no {GROUPS_DIR}/{VOCAB_FILE}")
    return file.read_bytes()


def unzipped(data: bytes) -> Any:
    return json.loads(gzip.decompress(data))
