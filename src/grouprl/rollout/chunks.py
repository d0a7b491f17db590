"""Multi-turn decoding with observations fed to the KV cache in forwards of their own.

The one-token loop of `grouprl.rollout.sampling` feeds an observation to its row one token per
decode step of the whole batch: a 120-token tool result costs 120 batch-wide forwards. Here the
rows keep their own lengths instead: a row's completion position p is cache column P + p (P the
prompt width) whatever the other rows hold. After a step in which some rows' turns end with a
call, those rows alone run a forward of their sampled token and their observation but its last
token (right-aligned in an (R, w) chunk), and then every row runs the usual one-token forward:
its sampled token, or for a fed row its observation's last. So every row samples again at the
next step, no row waits for another's observation, and an observation of L tokens costs a
forward of L tokens of its own rows instead of L forwards of all rows. Such a forward costs
about a decode step whatever it holds, so it runs only once the waiting tokens add up to one
per batch row; until then each fed row takes its tokens one per decode step, as in the
one-token loop, and samples again once its cache holds all it wrote.

Why per-row columns and not a shared column per step with masked holes (the other layout a
column-aligned cache allows): a chunk of w columns for every row would leave w − 1 dead columns
in each row without an observation, at every step in which any row is fed, and attention pays
for dead columns at every later step (64 rows making two calls each at different steps, with
128-token results, would add thousands of columns). Per-row columns cost a scattered write
(`_hf.ChunkFeed`), a 4D mask per forward (each query sees its row's prompt and its row's
completion columns up to its own), and, in the observation forward, a copy of its rows' cache.

Draws: one uniform per row per step, as in the one-token loop, which also draws at the steps in
which a row is fed, so the two loops sample the same trajectories greedily (checked in
tests/rollout/test_chunks.py) and different ones at temperature > 0. Used when the model's cache
and attention allow it (`_hf.feeds_chunks`); otherwise the one-token loop runs. Under FSDP
(`lockstep`) the ranks agree before each observation forward whether any of them runs one, and
a rank with nothing to feed runs it on one blank row that writes nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from grouprl.rollout import _hf, routes
from grouprl.rollout.decoding import Decoded, Settings, stop_or_keep
from grouprl.rollout.draws import pick


def decode(model: nn.Module, cache: Any, logits: torch.Tensor, prompt_mask: torch.Tensor,
           shared: bool, s: Settings, out: Decoded) -> None:  # fmt: skip
    """Decode all rows into `out`, from the prefilled, expanded `cache` and the (n, V) logits of
    the prompts' last positions (repeated per row). `prompt_mask`: (B, P)."""
    device, n = logits.device, logits.shape[0]
    eos = torch.tensor(list(s.eos_ids), dtype=torch.long, device=device)  # (E,)
    prompt_attn = prompt_mask.repeat_interleave(s.group_size, dim=0)  # (n, P)
    start = prompt_attn.sum(-1)  # (n,) position of completion token 0
    cached = torch.zeros(n, dtype=torch.long, device=device)  # (n,) completion tokens in cache
    written = torch.zeros(n, dtype=torch.long, device=device)  # (n,) completion tokens written
    done = torch.zeros(n, dtype=torch.bool, device=device)
    # the key columns each row's decode step sees: its prompt, its completion so far (n, P + T)
    seen = torch.cat([prompt_attn, prompt_attn.new_zeros(n, s.max_new_tokens)], dim=1)
    rows: torch.Tensor | None = None  # batch row -> output row once compaction drops rows
    feed = _hf.ChunkFeed(cache)
    # the shared-prompt attention also attends rows at their own lengths (SDPA models)
    own = shared or model.config._attn_implementation == "sdpa"
    sharing = _hf.SharedPromptDecoding(model, cache) if own else contextlib.nullcontext()
    with sharing, feed:
        while True:
            hit, written = _step(out, logits, done, rows, eos, cached, written, s)
            done |= hit | (written >= s.max_new_tokens)  # an end, or the budget spent
            stop, keep = stop_or_keep(done, s.lockstep)
            if stop:
                break
            if keep is not None:  # compaction: drop finished rows
                cache.batch_select_indices(keep)
                rows = keep if rows is None else rows[keep]
                done, cached, written = done[keep], cached[keep], written[keep]
                start, prompt_attn, seen = start[keep], prompt_attn[keep], seen[keep]
            cached = _observations(model, feed, out, rows, cached, written, done, s, start,
                                   prompt_attn, seen, cache)  # fmt: skip
            logits = _decode_step(model, feed, out, rows, cached, done, s.pad_id, start, seen,
                                  cache)  # fmt: skip
            cached = cached + (~done).long()


def _step(out: Decoded, logits: torch.Tensor, done: torch.Tensor, rows: torch.Tensor | None,
          eos: torch.Tensor, cached: torch.Tensor, written: torch.Tensor,
          s: Settings) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Pick a token for each running row whose cache holds all it wrote (`cached` == `written`,
    (n,) each: its logits are for its next position) and write it there; end rows at EOS or a
    stop string; write the observations of rows whose call was answered after their token.
    Returns which rows ended here (n,) bool and the rows' written lengths (n,)."""
    tok, lp, ent = pick(logits, s.temperature, s.greedy, s.top_k, s.top_p, s.generator,
                        s.banned)  # fmt: skip
    sampling = ~done & (cached == written)  # (n,)
    out_rows = torch.arange(done.numel(), device=done.device) if rows is None else rows
    at, now = out_rows[sampling], written[sampling]
    out.tokens[at, now] = tok[sampling]
    out.old_logp[at, now] = lp[sampling]
    out.entropy[at, now] = ent[sampling]
    hit = torch.isin(tok, eos) & sampling  # (n,)
    turns = s.turns
    if s.stopper is not None:
        hit |= s.stopper.hits(out.tokens, rows, sampling & ~hit, written, since=turns.since)
    hit = turns.after_step(out.tokens, rows, sampling, hit, written, out.old_logp)
    out.stop_at[out_rows] = torch.where(hit, written + 1, out.stop_at[out_rows])
    written = written + sampling.long()  # (n,)
    for b, row, ids in turns.take(rows):  # observations, cut to the budget by `after_step`
        first = int(written[b])
        out.tokens[row, first : first + len(ids)] = torch.as_tensor(ids, device=out.tokens.device)
        turns.fed[row, first : first + len(ids)] = True
        written[b] = first + len(ids)
    return hit, written


def _observations(model: nn.Module, feed: _hf.ChunkFeed, out: Decoded,
                  rows: torch.Tensor | None, cached: torch.Tensor, written: torch.Tensor,
                  done: torch.Tensor, s: Settings, start: torch.Tensor, prompt_attn: torch.Tensor,
                  seen: torch.Tensor, cache: Any) -> torch.Tensor:  # fmt: skip
    """Feed the rows that have tokens waiting (an observation after their sampled token) all
    of them but the last, positions `cached` … `written` − 2, in forwards of their own, when
    they add up to at least one token per batch row (else each goes on feeding one token per
    decode step, as in the one-token loop: on a small model, or on an accelerator, a forward
    costs about as much for a few tokens as for many, so a forward for a few is a loss). Their
    logits are not used: the decode step after feeds each row's next token. Rows of lengths
    within 2× of the shortest go together (padding at most doubles a forward's tokens: one long
    error message does not pad every other row to its length). Under `lockstep` every rank runs
    as many of these forwards as the rank that needs most: one of a blank row, writing nothing.
    Returns `cached` updated."""
    length = (written - cached - 1).masked_fill(done, 0)  # (n,) tokens to feed before the last
    some = int(length.sum()) >= done.numel()  # one host sync a step while nothing is fed
    pending = (length > 0) & some  # (n,)
    prompt_width = prompt_attn.shape[1]
    cached = cached.clone()
    while True:
        if not (some if s.lockstep is None else not s.lockstep(not some)):
            return cached
        if some:
            shortest = int(length[pending].min())
            batch = (pending & (length <= 2 * shortest)).nonzero().squeeze(1)  # (R,)
            blank = torch.zeros_like(batch, dtype=torch.bool)
        else:
            batch = pending.new_zeros(1, dtype=torch.long)
            blank = torch.ones(1, dtype=torch.bool, device=batch.device)
        _forward(model, feed, out, rows, batch, cached[batch], length[batch].clamp(min=1), blank,
                 s.pad_id, start[batch], prompt_attn[batch], cache)  # fmt: skip
        seen[feed.cache_rows, prompt_width + feed.columns] = True
        cached[batch] += torch.where(blank, 0, length[batch])
        pending[batch] = False
        some = bool(pending.any())


def _forward(model: nn.Module, feed: _hf.ChunkFeed, out: Decoded, rows: torch.Tensor | None,
             batch: torch.Tensor, first: torch.Tensor, length: torch.Tensor,
             blank: torch.Tensor, pad_id: int, start: torch.Tensor, prompt_attn: torch.Tensor,
             cache: Any) -> torch.Tensor:  # fmt: skip
    """One forward of the batch rows `batch` (R,): each feeds its completion tokens at positions
    first … first + length − 1 ((R,) each, length >= 1), right-aligned in (R, w) ids, or, where
    `blank` (R,), pads that write nothing (their outputs are never read). Returns the (R, V)
    logits of each row's last token."""
    max_new, device = out.tokens.shape[1], first.device
    width_in = int(length.max())  # w
    offset = torch.arange(width_in, device=device)[None, :] - (width_in - length)[:, None]
    real = offset >= 0  # (R, w)
    positions = first[:, None] + offset.clamp(min=0)  # (R, w); a left pad repeats the first
    out_rows = batch if rows is None else rows[batch]
    ids = out.tokens[out_rows[:, None], positions.clamp(max=max_new - 1)]  # (R, w)
    ids = ids.masked_fill(~real | blank[:, None], pad_id)
    source_row, source = (real & ~blank[:, None]).nonzero(as_tuple=True)  # (m,), (m,)
    feed.set(source_row, source, positions[source_row, source], batch, int(positions.max()) + 1)
    causal = torch.arange(feed.width, device=device)[None, None, :] <= positions[:, :, None]
    mask = torch.cat([prompt_attn[:, None, :].expand(-1, width_in, -1), causal], dim=-1)
    fed = start[:, None] + positions  # (R, w) position ids
    with (
        routes.feeding(fed, real & ~blank[:, None], out_rows)
        if routes.active() else contextlib.nullcontext()
    ):  # fmt: skip
        return _hf.forward_last(model, ids, _hf.chunk_mask(model, mask), fed, cache)  # (R, V)


def _decode_step(model: nn.Module, feed: _hf.ChunkFeed, out: Decoded, rows: torch.Tensor | None,
                 last: torch.Tensor, done: torch.Tensor, pad_id: int, start: torch.Tensor,
                 seen: torch.Tensor, cache: Any) -> torch.Tensor:  # fmt: skip
    """The forward of every batch row's next token to feed, at its position `last` (n,) (a pad
    for a finished row); marks the column in `seen` (n, P + T), whose prefix is the attention
    mask. Returns the (n, V) logits."""
    n, prompt_width = done.numel(), seen.shape[1] - out.tokens.shape[1]
    batch_rows = torch.arange(n, device=done.device)
    out_rows = batch_rows if rows is None else rows
    ids = out.tokens[out_rows, last].masked_fill(done, pad_id)  # (n,)
    width = int(last.max()) + 1
    feed.set(batch_rows, torch.zeros_like(last), last, None, width, single=True)
    seen[batch_rows, prompt_width + last] = True
    mask = _hf.chunk_mask(model, seen[:, None, : prompt_width + width])  # (n, 1, 1, P + width)
    position = (start + last)[:, None]  # (n, 1)
    with (
        routes.feeding(position, ~done[:, None], out_rows)
        if routes.active() else contextlib.nullcontext()
    ):  # fmt: skip
        return _hf.forward_last(model, ids[:, None], mask, position, cache)  # (n, V)
