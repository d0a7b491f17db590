"""Generation for `grouprl generate`: a model's completions, a trained run's included, with the
prompt rendering `train` uses (the same data options, chat template and system prompt), so what you see is what
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from grouprl.config.options import DataOptions, GenerateConfig
from grouprl.errors import UserError
from grouprl.models.loading import resolve_device
from grouprl.rollout import RolloutEngine
from grouprl.tasks.base import TrainerState
from grouprl.tasks.data import RowFormat, format_prompt
from grouprl.train.build import (
    build_engine,
    build_rewards,
    build_task,
    load_run_model,
    load_run_tokenizer,
    stop_strings,
)
from grouprl.train.prompts import prompt_ids


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


def prompt_rows(cfg: GenerateConfig, task: Any) -> list[dict]:
    """`--prompt` as a row (with `--answer`), else `--limit` rows of `--split`."""
    if cfg.prompt is not None:
        fmt = RowFormat(chat_template=cfg.chat_template, system_prompt=cfg.system_prompt)
        row = {"prompt": format_prompt({"prompt": cfg.prompt}, fmt, "--prompt")}
        if cfg.image:
            row["images"] = list(cfg.image)
        return [row if cfg.answer is None else {**row, "answer": cfg.answer}]
    if cfg.image:
        raise UserError("--image goes with --prompt (rows of a dataset bring their own images)")
    return list(task.split(cfg.split)[: cfg.limit])


def generate(
    cfg: GenerateConfig,
    rows: list[dict],
    engine: RolloutEngine,
    tokenizer: Any,
    task: Any,
    rewards: Any,
) -> list[dict]:
    """For each row: the prompt as the model sees it and `samples` completions sampled by
    `engine` (with their rewards when `rewards` is given)."""
    ids = [prompt_ids(tokenizer, row["prompt"], row=row) for row in rows]  # encoded once
    rollout = engine.sample(
        ids,
        group_size=cfg.samples,
        max_new_tokens=cfg.max_new_tokens or task.max_new_tokens,
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
    for g, row_ids in enumerate(ids):
        completions = []
        for i in range(g * cfg.samples, (g + 1) * cfg.samples):
            item: dict[str, Any] = {"completion": rollout.texts[i]}
            if scores is not None:
                item["rewards"] = {n: _number(v[i]) for n, v in scores.by_function.items()}
            completions.append(item)
        rendered = tokenizer.decode(row_ids, skip_special_tokens=False)
        out.append({"prompt": rendered, "completions": completions})
    return out


def _number(value: torch.Tensor) -> float | None:
    v = float(value)
    return None if v != v else v  # NaN: not scored


@dataclass
class Generator:
    """What `generate` needs, loaded once for any number of prompts."""

    cfg: GenerateConfig  # with a run directory's data options as defaults (`resolve_run`)
    name: str  # the model loaded
    task: Any
    engine: RolloutEngine  # samples with the model
    tokenizer: Any
    rewards: Any  # a RewardSet when --rewards is given, else None

    def complete(self, cfg: GenerateConfig | None = None) -> list[dict]:
        """`generate` for the rows `cfg` (default: the generator's own) asks for."""
        cfg = cfg or self.cfg
        rows = prompt_rows(cfg, self.task)
        return generate(cfg, rows, self.engine, self.tokenizer, self.task, self.rewards)


def load_generator(cfg: GenerateConfig) -> Generator:
    """Check `cfg`, then load its model (a run directory: its policy), task and rewards."""
    if cfg.samples < 1 or cfg.limit < 1:
        raise UserError("--samples and --limit must be at least 1")
    if cfg.temperature < 0:
        raise UserError("temperature must be >= 0 (0: greedy)")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    cfg, name = resolve_run(cfg)
    task = build_task(cfg)
    device = resolve_device(cfg.device)
    model = load_run_model(cfg, torch.float32, device, name)
    tokenizer = load_run_tokenizer(cfg, name)
    rewards = build_rewards(cfg, task, device) if cfg.rewards else None
    engine = build_engine(cfg, model, tokenizer, dtype=None, rows=cfg.limit * cfg.samples,
                          max_len=None, seed=cfg.seed)  # fmt: skip
    return Generator(cfg, name, task, engine, tokenizer, rewards)
