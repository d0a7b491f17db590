"""Every command's `--help`, as recorded in tests/fixtures/help/ before the package's rooms and
the options' sections were rearranged: moving code must not change a flag, a default or a help
text. A change that means to alter a help text re-records the file
(`GROUPRL_RECORD_HELP=1 pytest tests/cli/test_help_golden.py`) and the diff shows it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grouprl.cli import COMMANDS, main

GOLDEN = Path(__file__).parent.parent / "fixtures" / "help"
#: The top-level usage, every command, and `trl grpo` (TRL's own parser: its text is TRL's).
CASES = ["", *COMMANDS, "trl grpo"]


@pytest.mark.parametrize("command", CASES, ids=[c or "grouprl" for c in CASES])
def test_help_is_as_recorded(command, capsys, monkeypatch):
    if command == "trl grpo":
        pytest.importorskip("trl", reason="TRL's parser prints trl grpo's help")
    monkeypatch.setenv("COLUMNS", "100")  # the help's layout follows the terminal's width
    try:
        status = main([*command.split(), "--help"])
    except SystemExit as stop:  # tyro and argparse exit after printing the help
        status = stop.code
    assert status in (0, None)
    printed = capsys.readouterr().out
    golden = GOLDEN / f"{command.replace(' ', '_') or 'grouprl'}.txt"
    if os.environ.get("GROUPRL_RECORD_HELP"):
        golden.write_text(printed)
    assert printed == golden.read_text()
