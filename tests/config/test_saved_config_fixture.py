"""A config.yaml saved before the options were grouped into sections (tests/fixtures/config_v2,
see its README) still says the same run: `--config` of it gives every field the value it
records, and a run started from it resolves to the same config."""

from __future__ import annotations

from pathlib import Path

import yaml

from grouprl.config.parsing import parse_train_args
from grouprl.config.resolution import resolve

FIXTURE = Path(__file__).parent.parent / "fixtures" / "config_v2" / "config.yaml"


def plain(value):
    """A parsed value as YAML writes it (paths as strings, tuples as lists)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def test_every_recorded_field_parses_to_its_value():
    saved = yaml.safe_load(FIXTURE.read_text())
    assert len(saved) > 130  # every field of that day's TrainConfig
    cfg = parse_train_args(["--config", str(FIXTURE)])
    assert {k: plain(getattr(cfg, k)) for k in saved} == saved
    resolved = resolve(cfg, task_max_new_tokens=saved["max_new_tokens"])
    assert {k: plain(getattr(resolved, k)) for k in saved} == saved
