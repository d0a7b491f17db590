"""How a reward is named on the command line (no heavy imports: the config reads these)."""

from __future__ import annotations

from pathlib import Path


def is_file_spec(spec: str) -> bool:
    """`path/to/file.py:function`."""
    path, sep, attr = spec.rpartition(":")
    return bool(sep and attr and path.endswith(".py"))


def absolute_spec(spec: str) -> str:
    """A file spec with its path made absolute (so a resumed run imports the same file from any
    directory); other specs unchanged."""
    if not is_file_spec(spec):
        return spec
    path, _, attr = spec.rpartition(":")
    return f"{Path(path).expanduser().resolve()}:{attr}"
