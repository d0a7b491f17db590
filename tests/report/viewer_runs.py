"""Runs for the viewer's tests: short real runs whose every step is logged, and ways to make a
record hostile. Imported by the viewer's test modules (one module-scoped run each)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

from grouprl.config import TrainConfig
from grouprl.report.sinks import GROUPS_DIR, VOCAB_FILE, group_file, group_steps, write_json_gz
from grouprl.train import loop

SMALL = dict(prompts_per_step=4, group_size=4, eval_size=4, eval_samples=2, eval_every=0,
             save_every=10, progress=False, threads=1, log_groups=4, log_groups_every=1)  # fmt: skip
#: what a page must show as text, never run
HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


def short_run(out: Path, algo: str, steps: int = 3, **overrides) -> Path:
    """`algo` for `steps` steps with every group logged at every step; a learning rate that moves
    GSPO's sequence ratios past its clip within a step."""
    loop.train(TrainConfig(**{**SMALL, "algo": algo, "steps": steps, "lr": 1e-3,
                              "output_dir": out, **overrides}))  # fmt: skip
    return out


def record(run_dir: Path, step: int) -> dict:
    return json.loads(gzip.decompress(group_file(run_dir, step).read_bytes()))


def vocab(run_dir: Path) -> dict:
    return json.loads(gzip.decompress((run_dir / GROUPS_DIR / VOCAB_FILE).read_bytes()))


def hostile_copy(run_dir: Path, out: Path) -> Path:
    """A copy of `run_dir` whose model wrote HOSTILE: the first completion of every logged step's
    first group has it as its text, its prompt has it, and the piece of its first token's id is
    it."""
    shutil.copytree(run_dir, out)
    pieces = vocab(out)
    for step in group_steps(out):
        rec = record(out, step)
        group = rec["groups"][0]
        group["prompt"] = HOSTILE
        group["completions"][0]["text"] = HOSTILE
        pieces["pieces"][group["completions"][0]["ids"][0]] = HOSTILE
        write_json_gz(group_file(out, step), rec)
    (out / GROUPS_DIR / VOCAB_FILE).unlink()
    write_json_gz(out / GROUPS_DIR / VOCAB_FILE, pieces)
    return out
