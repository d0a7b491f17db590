"""The site's generated parts, and a check on the written ones (mkdocs hooks, `mkdocs.yml`).

- `<!-- generated: NAME -->` in a page is replaced by what `GENERATED[NAME]` makes from the
  code: every command's flags (`grouprl.cli.reference`, from the parser `--help` prints from),
  the presets' table (`grouprl.config.presets.algorithm_table`, from the presets and the
  estimators and objectives they name).
- A written page that names a grouprl flag that no command takes is a warning, so the strict
  build (`make docs`, `make test`) fails on it, not a reader.
"""

from __future__ import annotations

import functools
import logging
import re

log = logging.getLogger("mkdocs.plugins.grouprl")


def _commands() -> str:
    from grouprl.cli.reference import reference

    return reference()


def _algorithms() -> str:
    from grouprl.config import TrainConfig
    from grouprl.config.presets import algorithm_table

    return "\n".join(algorithm_table(TrainConfig().algo)) + "\n"


GENERATED = {"commands": _commands, "algorithms": _algorithms}
MARKER = re.compile(r"<!-- generated: ([a-z_-]+) -->")
#: Flags of other programs the pages name (torchrun, pip, pytest, vLLM, TRL's scripts, ...).
OTHER_FLAGS = {
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--standalone",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--quiet",
    "--upgrade",
    "--version",
    "--help",
    "--count",
    "--dist",
    "--durations",
    "--max-worker-restart",
    "--strict",
    "--host",
    "--port",
    "--tensor-parallel-size",
    "--data-parallel-size",
    "--enable-sleep-mode",
    "--logprobs-mode",
    "--enable-scale-out",
    "--generation-config",
    "--enforce-eager",
    "--block-size",
    "--max-model-len",
    "--no-enable-chunked-prefill",
    "--config_file",
    "--figure",
    "--seeds-from",
    "--out",
    "--runs",
    "--cells",
    "--temperature",
    "--prompts-per-step",
    "--execute",
    "--to",
    "--output",
    "--no-browser",
    "--check",
    "--info-fd",
    "--rdzv-id",
    "--no-deps",
    "--sizes",
    "--backend-store-uri",
    "--project",
}


@functools.cache
def _known_flags() -> frozenset[str]:
    """Every flag of every grouprl command (with its --no- form), and the others' we name."""
    from grouprl.cli import COMMANDS
    from grouprl.cli.reference import command_rows, trl_rows

    names = set(OTHER_FLAGS)
    for command in COMMANDS:
        rows = trl_rows()[0] if command == "trl" else command_rows(command)
        for row in rows:
            names.update(re.findall(r"--[a-z0-9][a-z0-9_-]*", row.flag))
    return frozenset(names)


def _named_flags(markdown: str) -> set[str]:
    """The hyphenated flags a page names in code: `--flag` spans and lines of code blocks."""
    found: set[str] = set()
    fence = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        spans = [line] if fence else re.findall(r"`([^`]*)`", line)
        for span in spans:
            found.update(re.findall(r"(?<![\w.-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w_])", span))
    return found


def on_page_markdown(markdown: str, page, config, files) -> str:
    if not page.file.src_uri.startswith("benchmarks/"):  # benchmarks name their scripts' flags
        for flag in sorted(_named_flags(markdown) - _known_flags()):
            log.warning("%s names %s, which no grouprl command takes", page.file.src_uri, flag)
    for name in set(MARKER.findall(markdown)):
        if name not in GENERATED:
            log.warning("%s: no generated part %r", page.file.src_uri, name)
            continue
        markdown = markdown.replace(f"<!-- generated: {name} -->", GENERATED[name]())
    return markdown
