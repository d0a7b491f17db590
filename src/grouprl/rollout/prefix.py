"""The batch's common prompt prefix, run once.

Prompts of a chat dataset start alike: the template's system turn and the user turn's header
(in SmolLM2's example, its chat template and default system prompt and the question's first
words make the first 27 of every prompt's 45-47 tokens). The sampler's prefill and the log-prob pass's prompt forward run each
of the B prompts once; here the tokens that every prompt starts with are run once, as one row,
their keys and values broadcast to the B rows, and each prompt's remainder is run against them
(`run_prefix`).

Attention does not depend on where a key sits in the cache, only on its position id and the
mask, so row i's cache columns become [prefix (C) | padding | the rest of prompt i]: the
left-padded layout with the padding moved after the prefix. `Split.mask` (B, P) is that layout
and every later forward over the cache takes it as the prompt mask. The prompt's token count
and each token's position are those of the left-padded prompt. Under autograd the B copies'
gradients sum back into the one prefix forward (the broadcast is differentiated).

Taken (`prefix_split`) where it saves a forward's worth of tokens: at least
`MIN_PREFIX_TOKENS` tokens shared by at least two left-padded prompts, each keeping one token
of its own (the last position's output is the prompt's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grouprl.rollout import _hf

#: The shortest common prefix run apart. Chosen, not measured at the threshold: the split adds
#: a forward through every layer for C tokens and saves (B - 1) x C, and a short prefix's
#: forward is memory-bound (SmolLM2-135M + LoRA, 2 CPU threads: the 27-token prefix of 4
#: prompts ran at a third of the per-row product rate of the 480-row completion pass, and the
#: update still went 5.02 -> 4.50 s).
MIN_PREFIX_TOKENS = 16


@dataclass(frozen=True)
class Split:
    """A batch of B left-padded prompts (B, P) split at their common prefix of `length` C
    tokens: `ids` (B, P - C) each prompt's remainder, left-padded; `mask` (B, P) the cache's
    layout after both forwards (C ones, then the remainder's mask); `positions` (B, P - C) the
    remainder's position ids."""

    length: int
    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor


def common_prefix(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """The number of tokens every prompt of a left-padded batch (B, P) starts with, at most the
    shortest prompt's length less one; 0 for one prompt or a mask that is not left padding."""
    rows, width = prompt_ids.shape
    lengths = prompt_mask.sum(-1)  # (B,)
    shortest = int(lengths.min()) if rows else 0
    if rows < 2 or shortest < 2:
        return 0
    starts = width - lengths  # (B,) each prompt's first column
    columns = torch.arange(width, device=prompt_ids.device)
    if not torch.equal(prompt_mask.bool(), columns >= starts[:, None]):
        return 0
    heads = prompt_ids.gather(1, starts[:, None] + columns[: shortest - 1])  # (B, shortest - 1)
    differ = (heads != heads[:1]).any(0).nonzero()
    return int(differ[0]) if len(differ) else shortest - 1


def prefix_split(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Split | None:
    """The batch split at its common prefix, or None below `MIN_PREFIX_TOKENS` shared tokens."""
    length = common_prefix(prompt_ids, prompt_mask)
    if length < MIN_PREFIX_TOKENS:
        return None
    width = prompt_ids.shape[1]
    starts = width - prompt_mask.sum(-1)  # (B,)
    columns = torch.arange(width - length, device=prompt_ids.device)  # the remainder's
    # remainder column j is prompt column j before the row's prefix, j + C after it
    source = columns + length * (columns >= starts[:, None])  # (B, P - C)
    rest = columns >= starts[:, None]  # (B, P - C)
    mask = torch.cat([rest.new_ones(len(rest), length), rest], dim=1).to(prompt_mask.dtype)
    positions = _hf.left_pad_positions(mask)[:, length:]
    return Split(length, prompt_ids.gather(1, source), mask, positions)


def shares_prefix(model: nn.Module, cache: Any) -> bool:
    """Whether a forward can split at the prefix: an empty cache of plain full-attention layers
    (`_hf.plain_layers`; sliding windows keep their own columns) and a model that is not one
    rank of several (a sharded forward is a collective: every rank must make the same calls)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and torch.distributed.get_world_size() > 1:
        return False
    empty = _hf.plain_layers(cache) and cache.get_seq_length() == 0
    return empty and hasattr(model, "get_decoder")


def run_prefix(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               cache: Any) -> Split | None:  # fmt: skip
    """Run the batch's common prefix once through `model`'s decoder into `cache` (empty) and
    broadcast its keys and values to the B rows; returns the split, whose remainder the caller
    runs with `Split.mask` as the attention mask. None (nothing run) where it does not apply
    (`prefix_split`, `shares_prefix`)."""
    split = prefix_split(prompt_ids, prompt_mask) if shares_prefix(model, cache) else None
    if split is None:
        return None
    start = int(prompt_ids.shape[1] - prompt_mask[0].sum())  # row 0's first column
    head = prompt_ids[:1, start : start + split.length]  # (1, C)
    decoder = model.get_decoder()
    decoder(
        input_ids=head,
        position_ids=torch.arange(split.length, device=head.device)[None],
        **_hf.cache_kwargs(decoder, cache),
    )
    rows = len(prompt_ids)
    for layer in cache.layers:  # views: the remainder's forward writes each row's own columns
        layer.keys = layer.keys.expand(rows, -1, -1, -1)
        layer.values = layer.values.expand(rows, -1, -1, -1)
    return split
