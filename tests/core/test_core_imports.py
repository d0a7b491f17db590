"""grouprl.core imports torch and the standard library only: the math has no plumbing (the docs' Architecture page)."""

import ast
import subprocess
import sys
from pathlib import Path

import grouprl.core

CORE = Path(grouprl.core.__file__).parent


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # `from .x import y` stays inside core; `from ..x` would reach the rest of grouprl.
            names.append("." * node.level + (node.module or ""))
    return names


def test_core_sources_import_only_torch_stdlib_and_core():
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 3
    for path in files:
        for name in imported_modules(path):
            top = name.split(".")[0]
            relative_in_core = name.startswith(".") and not name.startswith("..")
            assert relative_in_core or top == "torch" or top in sys.stdlib_module_names, (
                f"{path.name}: {name}"
            )


def test_importing_core_loads_no_other_grouprl_module_or_heavy_dependency():
    code = (
        "import sys, grouprl.core\n"
        "heavy = {'transformers', 'tokenizers', 'safetensors', 'rich', 'tyro', 'datasets', 'peft', 'trl'}\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in heavy\n"
        "       or (m.startswith('grouprl.') and not m.startswith('grouprl.core'))]\n"
        "print(sorted(bad))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
