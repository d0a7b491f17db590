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


def packs_prompts(model: nn.Module, cache: Any) -> bool:
    """Whether the prompts' forward can be one packed line (`run_packed`): where the prefix
    splits (`shares_prefix`), on a plain full-attention architecture whose SDPA takes the
    line's (1, 1, L, L) boolean mask as it is (`_hf.shares_prompt_attention`)."""
    config = getattr(model, "config", None)
    return (
        shares_prefix(model, cache)
        and _hf.shares_prompt_attention(model)
        and getattr(config, "_attn_implementation", None) == "sdpa"
    )


def run_packed(module: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
               cache: Any) -> tuple[Split, torch.Tensor] | None:  # fmt: skip
    """The batch's common prefix and each prompt's remainder in one forward of `module` (a
    model with its head, or its decoder): one line [prefix | rest of prompt 0 | rest of prompt
    1 | ...], a remainder attending to the prefix and to itself (causally). Its keys and values
    fill `cache` (empty) in the split's layout [prefix | padding | rest of prompt i], as
    `run_prefix` and the remainder's forward leave it. One pass over the weights for the C + Σ
    (len_i − C) tokens instead of two (measured on SmolLM2-135M + LoRA, 2 CPU threads, 27 + 4 ×
    18-20 tokens: the prefill 0.47 -> 0.36 s, the update's forward and backward 3.91 -> 3.53 s).

    Returns the split and the output at each prompt's last token: (B, V) logits in float32 or
    wider from a model with a head, else (B, H) states. None (nothing run) where it does not
    apply (`prefix_split`, `packs_prompts`) or the line is longer than `MAX_PACKED_TOKENS`."""
    split = prefix_split(prompt_ids, prompt_mask) if packs_prompts(module, cache) else None
    if split is None or split.length + int(split.mask[:, split.length :].sum()) > MAX_PACKED_TOKENS:
        return None
    line, positions, allowed, columns = _line(prompt_ids, prompt_mask, split)
    keep = columns[:, -1]  # (B,) each prompt's last token in the line
    extra = {"logits_to_keep": keep} if "logits_to_keep" in _hf.forward_params(module) else {}
    packed = _hf.new_cache(module)
    out = module(input_ids=line, attention_mask=allowed, position_ids=positions,
                 **_hf.cache_kwargs(module, packed), **extra)  # fmt: skip
    rows, width = columns.shape
    flat = columns.reshape(-1)
    for i, layer in enumerate(packed.layers):  # (1, Hkv, L, D) -> (B, Hkv, P, D)
        keys, values = (
            t[0].index_select(1, flat).view(t.shape[1], rows, width, -1).transpose(0, 1)
            for t in (layer.keys, layer.values)
        )
        cache.update(keys.contiguous(), values.contiguous(), i)
    logits = getattr(out, "logits", None)
    if logits is None:
        return split, out.last_hidden_state[0, keep]
    logits = logits[0] if extra else logits[0, keep]
    return split, logits.to(torch.promote_types(logits.dtype, torch.float32))


#: The longest packed line. Its mask and attention are dense, (L, L) a layer: at 512 tokens
#: SmolLM2-135M's attention would be ~1/6 of the line's products (the useful part a fraction of
#: that); longer batches keep `run_prefix`'s two forwards, whose remainder pass is wide enough.
MAX_PACKED_TOKENS = 512


def _line(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, split: Split):
    """The packed line of `split`: ids (1, L), positions (1, L), the (1, 1, L, L) boolean
    mask (True: attends) and, per prompt, the line index of each of the cache's P columns
    (B, P): the prefix's, then padding (index 0, masked), then its remainder's."""
    length, device = split.length, prompt_ids.device
    rows = len(prompt_ids)
    start = int(prompt_ids.shape[1] - prompt_mask[0].sum())  # row 0's first column
    rest = split.mask[:, length:].bool()  # (B, P - C) the remainders' real tokens
    line = torch.cat([prompt_ids[0, start : start + length], split.ids[rest]])[None]
    positions = torch.cat([torch.arange(length, device=device), split.positions[rest]])[None]
    owner = torch.arange(1, rows + 1, device=device)[:, None].expand_as(rest)[rest]  # 0: prefix
    segment = torch.cat([owner.new_zeros(length), owner])  # (L,)
    size = segment.shape[0]
    causal = torch.ones(size, size, dtype=torch.bool, device=device).tril()
    allowed = causal & ((segment[:, None] == segment[None, :]) | (segment[None, :] == 0))
    index = length + rest.reshape(-1).long().cumsum(0).view_as(rest) - 1  # (B, P - C)
    prefix_columns = torch.arange(length, device=device).expand(rows, length)
    columns = torch.cat([prefix_columns, torch.where(rest, index, 0)], dim=1)  # (B, P)
    return line, positions, allowed[None, None], columns
