"""Prompts as the sampler sees them: each encoded once, by the function that renders exactly what
sampling feeds (chat template, system prompt, and in the chat tool format the tools' schemas), and
budgeted by its length in those ids, for training and evaluation alike."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from grouprl.rollout import encode_prompts
from grouprl.tasks.tool_use import ToolUse


def prompt_ids(tokenizer: Any, prompt: Any, tools: ToolUse | None = None) -> list[int]:
    """The token ids the sampler feeds for one prompt (chat template applied to messages; in
    the chat tool format, to string prompts too, with the tools rendered)."""
    schemas = None if tools is None else tools.schemas
    chat = schemas is not None
    return encode_prompts(tokenizer, [prompt], chat_template=chat, tools=schemas)[0][0]


def fits(ids: list[int], budget: int | None) -> bool:
    """Whether a prompt of these ids leaves the completion its room (`budget`: the longest
    prompt, None: no limit)."""
    return budget is None or len(ids) <= budget


def rows_that_fit(
    rows: Iterable[dict], limit: int, tokenizer: Any, budget: int | None, tools: ToolUse | None
) -> tuple[list[dict], list[list[int]], int]:
    """The first `limit` rows whose prompts, as the sampler feeds them with `tools`, fit in
    `budget` tokens; their ids; and how many rows before the last kept were too long."""
    kept: list[dict] = []
    ids: list[list[int]] = []
    too_long = 0
    for row in rows:
        if len(kept) == limit:
            break
        row_ids = prompt_ids(tokenizer, row["prompt"], tools)
        if fits(row_ids, budget):
            kept.append(row)
            ids.append(row_ids)
        else:
            too_long += 1
    return kept, ids, too_long
