"""The benchmark scripts import, and every grouprl name they import (most of them inside
functions, where only running the benchmark would find a moved module) exists. The benchmarks
themselves never run in the suite: they take minutes and need TRL."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def _grouprl_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for each `from grouprl... import name` and (module, None) for each
    `import grouprl...`, at any depth of the script."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "grouprl":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "grouprl"]
    return found


def test_there_are_benchmarks_and_they_use_grouprl():
    assert len(SCRIPTS) >= 5
    assert sum(bool(_grouprl_imports(p)) for p in SCRIPTS) >= 4


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_imports_and_names_only_what_exists(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [str(path)])  # a script that reads argv at import: none
    importlib.import_module(path.stem)
    for module, name in _grouprl_imports(path):
        imported = importlib.import_module(module)
        if name is not None and not hasattr(imported, name):
            importlib.import_module(f"{module}.{name}")  # `from package import module`
