"""The Python API's notebook (examples/python_api) runs top to bottom, as a user runs it:
`jupyter nbconvert --execute`, in a kernel of this environment, in a fresh directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

NOTEBOOK = Path(__file__).parent.parent / "examples" / "python_api" / "train_from_python.ipynb"


def test_the_notebook_trains_evaluates_generates_and_plots(tmp_path):
    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # backstops for a hang, not speed checks: the whole notebook takes about 45 s on 2 idle
    # cores (its training cell most of it); 10 times that per cell and in all
    done = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
         NOTEBOOK.name, "--output", "executed.ipynb", "--ExecutePreprocessor.timeout=450"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=450,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "notebook"
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == sorted({e["step"] for e in evals})  # none twice
    assert evals[-1]["step"] == steps[-1] == len(steps)
    if len(steps) < 40:  # the callback ended the run at an evaluation above its threshold
        assert evals[-1]["pass_at_1"] > 0.75
    assert (run / "notebook.png").stat().st_size > 10_000
    cells = json.loads((tmp_path / "executed.ipynb").read_text())["cells"]
    errors = [o for c in cells for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert errors == []
