"""Packed forwards: a batch's rows concatenated into lines, each row its prompt then its
completion, positions restarting per row, no padding (`completion_logprobs(..., packs=...)`),
and the probe that says whether a model's attention keeps packed rows apart."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from grouprl.rollout import _hf


def row_widths(sel: torch.Tensor) -> torch.Tensor:
    """(N,) long: each row's last position under `sel` (N, T), plus one; 1 for an empty row
    (position 0, the prompt's last state, is computed whatever the mask)."""
    width = sel.shape[1]
    return torch.where(sel.any(-1), width - sel.flip(-1).int().argmax(-1), 1)


def packed_states(
    module: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    group_size: int,
    packs: Sequence[torch.Tensor],
    sel: torch.Tensor,
    hidden: bool,
) -> torch.Tensor:
    """`_completion_hidden`'s (N, T, H) states (`hidden`) or `_full_logits`' (N, T, V) logits
    from one forward of the packs as lines of a batch: a pack's rows are concatenated, each its
    prompt's unpadded tokens then its completion's first w − 1 (w: the row's `row_widths`),
    with position ids 0, 1, … restarting at each row and no attention mask or cache, from
    which transformers builds a block-diagonal causal mask (`packs_rows` probes that the model
    does); a line shorter than the longest ends in filler positions 0, 1, … of their own,
    which no row attends to. A row's states are those at its prompt's last token and at its
    completion tokens; positions past w are 0."""
    n, width = completion_ids.shape
    device = completion_ids.device
    moved = [rows.reshape(-1).to(device) for rows in packs]
    if not torch.equal(torch.cat(moved).sort().values, torch.arange(n, device=device)):
        raise ValueError(f"packs must hold each of the {n} rows once")
    widths = row_widths(sel).tolist()  # (N,)
    prompt_len = prompt_mask.sum(-1).tolist()  # (B,)
    lines, take, rows_at, steps = [], [], [], []  # per line: (ids, positions); per row: picks
    for rows in moved:
        ids, positions, offset = [], [], 0
        for r in rows.tolist():
            b, w = r // group_size, widths[r]
            p = prompt_len[b]
            ids += [prompt_ids[b, prompt_ids.shape[1] - p :], completion_ids[r, : w - 1]]
            positions.append(torch.arange(p + w - 1, device=device))
            take.append(
                (len(lines), torch.arange(offset + p - 1, offset + p + w - 1, device=device))
            )
            rows_at.append(torch.full((w,), r, device=device))
            steps.append(torch.arange(w, device=device))
            offset += p + w - 1
        lines.append((torch.cat(ids), torch.cat(positions)))
    longest = max(len(ids) for ids, _ in lines)
    ids = torch.stack([F.pad(i, (0, longest - len(i))) for i, _ in lines])  # (k, L)
    filler = [torch.arange(longest - len(p), device=device) for _, p in lines]
    positions = torch.stack([torch.cat([p, f]) for (_, p), f in zip(lines, filler, strict=True)])
    states = line_states(module, ids, positions, hidden)  # (k, L, X)
    index = torch.cat([line * longest + at for line, at in take])  # (Σw,) into (k·L)
    picked = states.reshape(-1, states.shape[-1])[index]  # (Σw, X)
    out = picked.new_zeros((n, width, picked.shape[-1]))
    return out.index_put((torch.cat(rows_at), torch.cat(steps)), picked)


def line_states(module: nn.Module, ids: torch.Tensor, positions: torch.Tensor, hidden: bool):
    """One forward of `module` (a decoder, or the whole model) over packed ids (1, L): its last
    hidden states or its logits (1, L, X)."""
    out = module(input_ids=ids, position_ids=positions, use_cache=False)
    return out.last_hidden_state if hidden else out.logits


_PACKS_ROWS: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def packs_rows(model: nn.Module) -> bool:
    """Whether the model's attention keeps packed rows apart by their position ids (what
    `completion_logprobs(..., packs=...)` needs), checked once per model.

    A probe in eval mode without gradients: rows of 3 and 2 tokens, packed (positions 0 1 2 0
    1) and each alone. A model whose attention ignores the restart lets the second row attend
    to the first, which moves its states by about their own size; the comparison allows a
    hundredth of that, far above float rounding (bf16's 2^-8 included) and far below a leak.
    Under FSDP every process probes at once, before sharding (`grouprl.train.parallel.fsdp`).
    """
    known = _PACKS_ROWS.get(model)
    if known is not None:
        return known
    if _hf.sees_images(model):  # its prompts' images are fed through the base, never packed
        _PACKS_ROWS[model] = False
        return False
    module = model.get_decoder() if _hf.plain_head(model) else model
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            device, hidden = _hf.model_device(model), module is not model
            first = torch.tensor([[1, 2, 3]], device=device)
            second = torch.tensor([[4, 5]], device=device)
            packed = line_states(module, torch.cat([first, second], 1),
                             torch.tensor([[0, 1, 2, 0, 1]], device=device), hidden)  # fmt: skip
            alone = line_states(module, second, torch.tensor([[0, 1]], device=device), hidden)
            leak = (packed[:, 3:].float() - alone.float()).abs().max()
            works = bool(leak <= 1e-2 * alone.float().abs().max())
    except (TypeError, ValueError, RuntimeError):  # a forward without position ids
        works = False
    finally:
        for m, mode in modes:
            m.training = mode
    _PACKS_ROWS[model] = works
    return works
