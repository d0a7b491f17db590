"""The manual is the docs site (docs/, mkdocs.yml): the README is a front page, every example has
a README of its own, a paragraph is written once, and the reference names every flag each
command's --help does. (`make docs` builds the site with --strict: broken links and anchors,
and pages naming flags no command takes, fail there.)"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from grouprl.cli import COMMANDS, main
from grouprl.cli.reference import markdown

ROOT = Path(__file__).parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md"))


def test_the_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) <= 12 * 1024, len(readme.encode())
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in first_block[:2]] == [["make", "demo"], ["make", "test"]]
    assert readme.index("```bash") < readme.index("\n## ")  # the commands before any section


def test_every_example_folder_has_a_readme():
    folders = [p for p in (ROOT / "examples").iterdir() if p.is_dir()]
    assert folders and [f.name for f in folders if not (f / "README.md").is_file()] == []


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a Markdown text (code blocks, tables and headings left out),
    each as one line of single-spaced words, with how many source lines it spans."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines or lines[0].lstrip().startswith(("|", "#", "<!--", "![", ":::")):
            continue
        out.append((" ".join(" ".join(lines).split()), len(lines)))
    return out


def test_no_paragraph_of_more_than_three_lines_is_written_twice():
    seen: dict[str, Path] = {}
    twice = []
    for path in [ROOT / "README.md", *PAGES, *(ROOT / "examples").glob("*/README.md")]:
        for paragraph, lines in paragraphs(path.read_text(encoding="utf-8")):
            if lines <= 3:
                continue
            if paragraph in seen and seen[paragraph] != path:
                twice.append((seen[paragraph].relative_to(ROOT), path.relative_to(ROOT),
                              paragraph[:80]))  # fmt: skip
            seen.setdefault(paragraph, path)
    assert twice == []


def test_the_paragraph_reader_sees_what_it_must():
    text = "A\nb\nc\nd\n\n```\nx\n\ny\n```\n\n| t |\n|---|\n\n# H\n\nshort"
    assert paragraphs(text) == [("A b c d", 4), ("short", 1)]


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "trl"])
def test_the_reference_names_every_flag_the_help_does(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with contextlib.suppress(SystemExit):  # tyro exits after printing the help
        main([command, "--help"])
    helped = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", capsys.readouterr().out)) - {"--help"}
    reference = markdown(command) + (markdown("train") if command in ("compare", "check") else "")
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", reference))
    assert helped <= named, sorted(helped - named)
    assert "| `" in reference  # a table with a row per flag (plot's: its RUN-DIR)


def test_the_reference_names_every_field_of_trls_parser():
    pytest.importorskip("trl")
    from grouprl.trl.fields import FIELDS

    text = markdown("trl")
    assert [name for name in FIELDS if f"--{name}" not in text] == []
