"""The GPU check's CPU dry run (`benchmarks/gpu_check.py --dry-run`): every case (bf16 full
fine-tuning padded and packed, LoRA, torchrun on 1 rank, FSDP2 on 1 rank) trains its steps on
the CPU and fills its row of the table, so that on a GPU only CUDA itself is new; and a machine
that lacks a module the check needs is told which, and what to carry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_check  # noqa: E402


def test_the_dry_run_fills_every_row(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["case"] for r in rows] == [c[0] for c in gpu_check.CASES]
    for row in rows:
        assert row["ok"] and row["steps"] == 2 and row["loss_finite"], row
        assert row["tokens_per_s"] > 0 and row["peak_gib"] > 0 and row["peak_kind"] == "host RSS"
    table = (tmp_path / "table.md").read_text()
    assert table.count("\n") == len(rows) + 2 and "fsdp2-1" in table


def test_a_missing_module_is_named_with_what_to_carry(monkeypatch):
    monkeypatch.setattr(gpu_check, "NEEDS", [("tyro_not_here", "carry its wheels")])
    monkeypatch.setattr(gpu_check, "APIS", {"fsdp2": ("torch.distributed.fsdp", "no_such_api")})
    lines = gpu_check.missing()
    assert lines[0].startswith("missing module tyro_not_here") and "carry its wheels" in lines[0]
    assert "torch lacks torch.distributed.fsdp.no_such_api" in lines[1]


def test_the_carried_wheels_are_pure_python_and_pinned_to_what_is_installed_here():
    from importlib.metadata import distribution

    for pin in gpu_check.wheels():
        name, version = pin.split("==")
        wheel = distribution(name).read_text("WHEEL")
        assert "Tag: py3-none-any" in wheel, (name, wheel)  # it installs on any Python 3
        assert version == distribution(name).version
