"""`grouprl generate`: talk to a model, a trained run included, with the prompt rendering
`train` uses (the same data options, chat template and system prompt), so what you see is what
training saw.

`--model` takes anything `train` does (a directory, a `.gguf` file, `builtin:NAME`, a hub id)
or a run directory: its `final/` policy, else its newest checkpoint (a LoRA checkpoint is an
adapter over the base the run recorded). For a run directory the run's own data options
(task or dataset, prompt column or template, chat template, system prompt, stop strings) are
the defaults, so `--split heldout` shows the prompts it held out.

Prompts: `--prompt TEXT` (a string prompt, sent through the chat template with
`--chat-template`), else `--limit` rows of `--split` of the task or dataset; with neither a
prompt nor a dataset on a terminal, an interactive loop.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console

from grouprl.errors import UserError
from grouprl.models import load_model, load_tokenizer
from grouprl.models.loading import resolve_device
from grouprl.rollout import sample_groups
from grouprl.tasks.base import TrainerState
from grouprl.tasks.data import RowFormat, format_prompt
from grouprl.train.build import build_rewards, build_task, prompt_ids, stop_strings
from grouprl.train.config import DataOptions, EvalSplit, ModelOptions


@dataclass(frozen=True)
class GenerateConfig(DataOptions, ModelOptions):
    """Print a model's completions for a prompt, or for rows of a task or dataset."""

    prompt: str | None = None
    """The prompt (a string; a user message with --chat-template). None: rows of --split, or
    an interactive prompt on a terminal when no --dataset or --task is given either."""
    answer: str | None = None
    """The reference answer of --prompt, given to --rewards as `answer`."""
    split: EvalSplit = "heldout"
    """Which rows to take without --prompt: held-out (as train holds them out), train, or all."""
    limit: int = 3
    """Rows to take without --prompt."""
    samples: int = 1
    """Completions per prompt."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    seed: int = 0
    """Sampling seed."""
    threads: int | None = None
    """torch CPU threads. None: torch's default."""
    json: bool = False
    """Print one JSON object per prompt instead of text."""


def resolve_run(cfg: GenerateConfig) -> tuple[GenerateConfig, str]:
    """The model to load, and for a run directory the config with the run's data options as
    defaults (a field the command line left at its default takes the run's value)."""
    spec = cfg.model
    path = Path(spec).expanduser() if spec else None
    if path is None or not (path / "config.yaml").is_file() or (path / "config.json").is_file():
        return cfg, spec or "builtin:arith"
    from grouprl.train.checkpoint import latest_checkpoint

    if (path / "final" / "config.json").is_file():
        model = path / "final"
    else:
        newest = latest_checkpoint(path)
        if newest is None:
            raise UserError(f"run {path} has neither final/ nor a checkpoint yet")
        model = newest
    saved = yaml.safe_load((path / "config.yaml").read_text()) or {}
    own = {"rewards", "pass_reward", "reward_timeout"}  # scoring only when asked, with --rewards
    defaults = {f.name: f.default for f in dataclasses.fields(DataOptions) if f.name not in own}
    updates = {
        name: saved[name]
        for name in defaults
        if name in saved and getattr(cfg, name) == defaults[name] and saved[name] is not None
    }
    return dataclasses.replace(cfg, **updates), str(model)


def _prompt_rows(cfg: GenerateConfig, task: Any) -> list[dict]:
    if cfg.prompt is not None:
        fmt = RowFormat(chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
        row = {"prompt": format_prompt({"prompt": cfg.prompt}, fmt, "--prompt")}
        return [row if cfg.answer is None else {**row, "answer": cfg.answer}]
    return list(task.split(cfg.split)[: cfg.limit])


def generate(cfg: GenerateConfig, rows: list[dict], model: Any, tokenizer: Any, task: Any,
             rewards: Any) -> list[dict]:  # fmt: skip
    """For each row: the prompt as the model sees it and `samples` completions (with their
    rewards when `rewards` is given)."""
    max_new_tokens = cfg.max_new_tokens or task.max_new_tokens
    rollout = sample_groups(
        model,
        tokenizer,
        [r["prompt"] for r in rows],
        group_size=cfg.samples,
        max_new_tokens=max_new_tokens,
        temperature=cfg.temperature,
        stop=stop_strings(cfg, task),
        seed=cfg.seed,
    )
    scores = None
    if rewards is not None:
        scores = rewards.score(
            rollout.texts,
            rows,
            cfg.samples,
            completion_ids=rollout.completion_id_lists(),
            state=TrainerState(),
            timeout=cfg.reward_timeout,
        )
    out = []
    for g, row in enumerate(rows):
        completions = []
        for i in range(g * cfg.samples, (g + 1) * cfg.samples):
            item: dict[str, Any] = {"completion": rollout.texts[i]}
            if scores is not None:
                item["rewards"] = {n: _number(v[i]) for n, v in scores.by_function.items()}
            completions.append(item)
        ids = prompt_ids(tokenizer, row["prompt"])
        rendered = tokenizer.decode(ids, skip_special_tokens=False)
        out.append({"prompt": rendered, "completions": completions})
    return out


def _number(value: torch.Tensor) -> float | None:
    v = float(value)
    return None if v != v else v  # NaN: not scored


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
    if cfg.samples < 1 or cfg.limit < 1:
        raise UserError("--samples and --limit must be at least 1")
    if cfg.temperature < 0:
        raise UserError("temperature must be >= 0 (0: greedy)")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    cfg, name = resolve_run(cfg)
    task = build_task(cfg)
    device = resolve_device(cfg.device)
    model = load_model(name, device=device, trust_remote_code=cfg.trust_remote_code)
    tokenizer = load_tokenizer(name, trust_remote_code=cfg.trust_remote_code)
    rewards = build_rewards(cfg, task, device) if cfg.rewards else None
    console = Console(soft_wrap=True)
    interactive = cfg.prompt is None and cfg.dataset is None and cfg.task is None
    if interactive and sys.stdin.isatty():
        console.print(f"{name}: type a prompt, an empty line to stop")
        while True:
            try:
                text = input("prompt> ")
            except EOFError:
                break
            if not text.strip():
                break
            one = dataclasses.replace(cfg, prompt=text)
            for result in generate(one, _prompt_rows(one, task), model, tokenizer, task, rewards):
                _show(console, result, cfg.json)
        return 0
    for result in generate(cfg, _prompt_rows(cfg, task), model, tokenizer, task, rewards):
        _show(console, result, cfg.json)
    return 0
