"""`grouprl generate`: print a model's completions for a prompt, for rows of a task or dataset,
or in an interactive loop (`grouprl.workflows.generate` generates)."""

from __future__ import annotations

import dataclasses
import json
import sys

from rich.console import Console

from grouprl.cli import quiet_hf
from grouprl.config.options import GenerateConfig
from grouprl.config.parsing import parse_args


def run(argv: list[str]) -> int:
    cfg = parse_args(GenerateConfig, argv, prog="grouprl generate", source="the command line")
    quiet_hf()
    return main(cfg)


def _show(console: Console, result: dict, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    console.print("[bold]prompt[/] (as the model sees it):")
    console.print(result["prompt"], markup=False, highlight=False)
    for i, item in enumerate(result["completions"]):
        scored = ""
        if "rewards" in item:
            scored = "  " + ", ".join(f"{n} {v}" for n, v in item["rewards"].items())
        console.print(f"[bold]completion {i}[/]{scored}")
        console.print(item["completion"], markup=False, highlight=False)


def main(cfg: GenerateConfig) -> int:
    """Load, then print the completions of the rows `cfg` names, or of each prompt typed."""
    from grouprl.workflows.generate import load_generator

    generator = load_generator(cfg)
    cfg = generator.cfg
    console = Console(soft_wrap=True)
    interactive = cfg.prompt is None and cfg.dataset is None and cfg.task is None
    if interactive and sys.stdin.isatty():
        console.print(f"{generator.name}: type a prompt, an empty line to stop")
        while True:
            try:
                text = input("prompt> ")
            except EOFError:
                break
            if not text.strip():
                break
            for result in generator.complete(dataclasses.replace(cfg, prompt=text)):
                _show(console, result, cfg.json)
        return 0
    for result in generator.complete():
        _show(console, result, cfg.json)
    return 0
