"""Prompts as the sampler sees them: each encoded once, by the function that renders exactly what
sampling feeds (chat template, system prompt, and in the chat tool format the tools' schemas), and
budgeted by its length in those ids, for training and evaluation alike."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from grouprl.errors import UserError, option_name, remedy
from grouprl.images import has_images, message_text, row_images, with_image_parts
from grouprl.models import vision
from grouprl.rollout import encode_prompts
from grouprl.rollout.media import encode
from grouprl.tasks.base import Task
from grouprl.tasks.tools.prompt import with_tool_prompt
from grouprl.tasks.tools.use import Episode, ToolUse


def prompt_ids(
    tokenizer: Any, prompt: Any, tools: ToolUse | None = None, row: dict | None = None
) -> list[int]:
    """The token ids the sampler feeds for one prompt (chat template applied to messages; in
    the chat tool format, to string prompts too, with the tools rendered). With `row`, the
    prompt's row: where it has images (`grouprl.images`), an `ImagePrompt` whose ids the model's
    processor expanded, carrying the images' tensors."""
    schemas = None if tools is None else tools.schemas
    chat = schemas is not None
    if tools is not None and tools.description is not None:
        prompt = with_tool_prompt(prompt, tools.description)
    if row is not None and has_images(row):
        return _image_prompt_ids(tokenizer, prompt, row, schemas)
    return encode_prompts(tokenizer, [prompt], chat_template=chat, tools=schemas)[0][0]


def _image_prompt_ids(tokenizer: Any, prompt: Any, row: dict, schemas: Any) -> list[int]:
    """A row's prompt with its images, rendered by the processor's chat template (an image
    part per image in its first user message) and expanded by the processor."""
    text = message_text(prompt[-1]["content"]) if isinstance(prompt, list) else str(prompt)
    where = f"the row whose prompt ends {text[-60:]!r}"
    processor = vision.processor_of(tokenizer)
    if processor is None:
        raise UserError(
            f"{where} has images, but the model is a text model; give a vision-language model "
            "(--model), or drop the rows' image column"
        )
    images = row_images(row, where, vision.image_limit(tokenizer))
    messages = with_image_parts(prompt, len(images))
    if not getattr(processor, "chat_template", None):
        raise UserError(
            "the prompts have images but the model's processor has no chat template to place "
            "them; use a model saved with one (an instruct vision-language model)"
        )
    rendered = processor.apply_chat_template(messages, tools=schemas, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    return encode(processor, rendered, images, where)


def fits(ids: list[int], budget: int | None) -> bool:
    """Whether a prompt of these ids leaves the completion its room (`budget`: the longest
    prompt, None: no limit)."""
    return budget is None or len(ids) <= budget


def rows_that_fit(
    rows: Iterable[dict], limit: int, tokenizer: Any, budget: int | None, tools: ToolUse | None
) -> tuple[list[dict], list[list[int]], int]:
    """The first `limit` rows whose prompts, as the sampler feeds them with `tools`, fit in
    `budget` tokens; their ids; and the lengths of the rows before the last kept that were
    too long."""
    kept: list[dict] = []
    ids: list[list[int]] = []
    over: list[int] = []  # the lengths of those too long
    for row in rows:
        if len(kept) == limit:
            break
        row_ids = prompt_ids(tokenizer, row["prompt"], tools, row)
        if fits(row_ids, budget):
            kept.append(row)
            ids.append(row_ids)
        else:
            over.append(len(row_ids))
    return kept, ids, over


def no_prompt_fits(where: str, shortest: int, budget: int, by_flag: bool) -> UserError:
    """One line for prompts of which none fits the prompt budget: how long the shortest is,
    where the budget comes from (`by_flag`: --max-prompt-length; else the model's context less
    the new tokens) and the ways out, in the caller's names (`grouprl.errors.remedy`)."""
    if by_flag:
        why = f"{option_name('max_prompt_length') or 'max_prompt_length'} {budget}"
        ways = remedy(("raise", "max_prompt_length"), ("lower", "max_new_tokens"),
                      otherwise="shorten the prompts")  # fmt: skip
    else:
        why = "what the model's context leaves after the new tokens"
        ways = remedy(("lower", "max_new_tokens"),
                      otherwise=("shorten the prompts", "use a model with a longer context"))  # fmt: skip
    return UserError(
        f"no prompt of {where} fits the prompt budget of {budget} tokens ({why}): the shortest "
        f"is {shortest} tokens; {ways}"
    )


def reset_prompt_ids(
    tokenizer: Any,
    prompts: Sequence[Any],
    tools: ToolUse,
    budget: int | None,
    rows: Sequence[dict] | None = None,
) -> list[list[int]]:
    """The ids of prompts an environment's `reset` wrote (or added to), which must fit the
    budget like any prompt: one that does not is one line. `rows`: each prompt's row (its
    images go with the prompt reset wrote)."""
    rows = rows if rows is not None else [None] * len(prompts)
    ids = [prompt_ids(tokenizer, p, tools, r) for p, r in zip(prompts, rows, strict=True)]
    longest = max(ids, key=len)
    if not fits(longest, budget):
        name = tools.environment.name if tools.environment is not None else "the environment"
        ways = remedy(("raise", "max_prompt_length"), ("lower", "max_new_tokens"),
                      otherwise="return a shorter prompt from reset")  # fmt: skip
        raise UserError(
            f"environment {name}'s reset made a prompt of {len(longest)} tokens, over the "
            f"prompt budget of {budget} (the model's context less the new tokens, or "
            f"{option_name('max_prompt_length') or 'max_prompt_length'}); {ways}"
        )
    return ids


@dataclass(frozen=True)
class HeldOut:
    """The rows a held-out evaluation samples, their prompts' ids, the keys that seed their
    environments, and how many rows were over the budget."""

    rows: list[dict]
    ids: list[list[int]]
    keys: list[Any]
    too_long: int = 0
    shortest_too_long: int | None = None  # tokens of the shortest prompt over the budget


def held_out(
    task: Task, size: int, tokenizer: Any, budget: int | None, tools: ToolUse | None
) -> HeldOut:
    """`size` held-out rows that fit the budget (`rows_that_fit`); for a task of episodes
    (`Task.heldout_episodes`), `size` fresh episodes of its held-out row, keyed apart from
    training's (`Episode(k, held_out=True)`), whose prompts reset writes or completes."""
    if not task.heldout_episodes:
        rows, ids, over = rows_that_fit(task.heldout, size, tokenizer, budget, tools)
        return HeldOut(rows, ids, list(rows), len(over), min(over, default=None))
    row = dict(task.heldout[0])
    ids = [] if "prompt" not in row else prompt_ids(tokenizer, row["prompt"], tools, row)
    return HeldOut([row] * size, [ids] * size, [Episode(k, held_out=True) for k in range(size)])
