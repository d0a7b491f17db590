"""Multi-turn decoding with each observation fed to the KV cache in one forward.

The one-token loop of `grouprl.rollout.sampling` feeds an observation to its row one token per
decode step of the whole batch: a 120-token tool result costs 120 batch-wide forwards. Here the
rows keep their own lengths instead. A row's completion position p is cache column P + p (P the
prompt width) whatever the other rows hold, so after a step in which some rows' turns end with a
call, the next forward takes, per row, the token it just sampled followed by its observation
(rows without one take their token alone), right-aligned in a (R, w) chunk with w the longest.
Every row then samples again from the chunk's last column: no row waits for another's
observation, and the observation costs one forward of width w instead of w forwards.

Why per-row columns and not a shared column per step with masked holes (the other layout a
column-aligned cache allows): a chunk of w columns for every row would leave w − 1 dead columns
in each row without an observation, at every step in which any row is fed, and attention pays
for dead columns at every later step. With 64 rows making two calls each, 128-token results
would add thousands of columns. Per-row columns cost a scattered write (`_hf.ChunkFeed`) and a
4D mask built per forward, (R, w, P + T) bools: each query sees its row's prompt and its row's
completion columns up to its own.

Draws: one uniform per row per forward, as in the one-token loop; that loop also draws for the
steps in which a row is fed, so the two give the same trajectories greedily (checked in
tests/rollout/test_chunks.py) and different ones when sampling. Used when the model's cache and
attention allow it (`_hf.feeds_chunks`); otherwise the one-token loop runs.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from grouprl.rollout import _hf
from grouprl.rollout.draws import pick

if TYPE_CHECKING:
    from grouprl.rollout.sampling import _Decoded, _Settings


def decode(model: nn.Module, cache: Any, logits: torch.Tensor, prompt_mask: torch.Tensor,
           shared: bool, s: _Settings, out: _Decoded) -> None:  # fmt: skip
    """Decode all rows into `out`, from the prefilled, expanded `cache` and the (n, V) logits of
    the prompts' last positions (repeated per row). `prompt_mask`: (B, P)."""
    device, n = logits.device, logits.shape[0]
    max_new = s.max_new_tokens
    eos = torch.tensor(list(s.eos_ids), dtype=torch.long, device=device)  # (E,)
    prompt_attn = prompt_mask.repeat_interleave(s.group_size, dim=0)  # (n, P)
    start = prompt_attn.sum(-1)  # (n,) position of completion token 0
    cached = torch.zeros(n, dtype=torch.long, device=device)  # (n,) completion tokens in cache
    done = torch.zeros(n, dtype=torch.bool, device=device)
    rows: torch.Tensor | None = None  # batch row -> output row once compaction drops rows
    feed = _hf.ChunkFeed(cache)
    sharing = _hf.SharedPromptDecoding(model, cache) if shared else contextlib.nullcontext()
    with sharing, feed:
        while True:
            hit, written = _step(out, logits, done, rows, eos, cached, s)
            done |= hit | (written >= max_new)  # an end, or the budget spent
            running = int((~done).sum())
            if (running == 0) if s.lockstep is None else s.lockstep(running == 0):
                break
            if running > 0 and 2 * running <= done.numel():  # compaction: drop finished rows
                keep = (~done).nonzero().squeeze(1)  # (running,)
                cache.batch_select_indices(keep)
                rows = keep if rows is None else rows[keep]
                done, cached, written = done[keep], cached[keep], written[keep]
                start, prompt_attn = start[keep], prompt_attn[keep]
            ids, positions, seen = _chunk(feed, out, rows, cached, written, done, s.pad_id)
            mask = torch.cat([prompt_attn[:, None, :].expand(-1, seen.shape[1], -1), seen], -1)
            logits = _hf.forward_last(
                model, ids, _hf.chunk_mask(model, mask), start[:, None] + positions, cache
            )  # (n, V)
            cached = torch.where(done, cached, written)


def _step(out: _Decoded, logits: torch.Tensor, done: torch.Tensor, rows: torch.Tensor | None,
          eos: torch.Tensor, cached: torch.Tensor, s: _Settings) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Pick a token per running row and write it at the row's own position (`cached`, (n,));
    end rows at EOS or a stop string; write the observations of rows whose call was answered
    after their token. Returns which rows ended here (n,) bool and each row's written length
    (n,) long: where its next sampled token goes."""
    tok, lp, ent = pick(logits, s.temperature, s.greedy, s.top_k, s.top_p, s.generator)
    live = ~done  # (n,)
    out_rows = torch.arange(done.numel(), device=done.device) if rows is None else rows
    at, now = out_rows[live], cached[live]
    out.tokens[at, now] = tok[live]
    out.old_logp[at, now] = lp[live]
    out.entropy[at, now] = ent[live]
    hit = torch.isin(tok, eos) & live  # (n,)
    turns = s.turns
    if s.stopper is not None:
        hit |= s.stopper.hits(out.tokens, rows, live & ~hit, cached, since=turns.since)
    hit = turns.after_step(out.tokens, rows, live, hit, cached)
    out.stop_at[out_rows] = torch.where(hit, cached + 1, out.stop_at[out_rows])
    written = cached + live.long()  # (n,)
    for b, row, ids in turns.take(rows):  # observations, cut to the budget by `after_step`
        first = int(written[b])
        out.tokens[row, first : first + len(ids)] = torch.as_tensor(ids, device=out.tokens.device)
        turns.fed[row, first : first + len(ids)] = True
        written[b] = first + len(ids)
    return hit, written


def _chunk(feed: _hf.ChunkFeed, out: _Decoded, rows: torch.Tensor | None, cached: torch.Tensor,
           written: torch.Tensor, done: torch.Tensor,
           pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The next forward's input: each running row's unfed tokens (completion positions cached …
    written − 1), right-aligned in (n, w) ids; a finished row feeds one pad at its own column
    (its output is never read). Sets `feed`'s writes; returns the ids, their completion
    positions (n, w) (a left pad repeats the row's first), and which completion columns each
    query sees (n, w, width) bool."""
    n, max_new = done.numel(), out.tokens.shape[1]
    length = torch.where(done, 1, written - cached)  # (n,) >= 1
    width_in = int(length.max())  # w
    offset = torch.arange(width_in, device=done.device)[None, :] - (width_in - length)[:, None]
    real = offset >= 0  # (n, w): right-aligned real tokens
    positions = cached[:, None] + offset.clamp(min=0)  # (n, w) completion positions
    out_rows = torch.arange(n, device=done.device) if rows is None else rows
    ids = out.tokens[out_rows[:, None], positions.clamp(max=max_new - 1)]  # (n, w)
    ids = ids.masked_fill(~real | done[:, None], pad_id)
    batch, source = real.nonzero(as_tuple=True)  # (m,), (m,)
    feed.rows, feed.sources, feed.columns = batch, source, positions[batch, source]
    feed.width = int(positions.max()) + 1
    columns = torch.arange(feed.width, device=done.device)  # (width,)
    seen = columns[None, None, :] <= positions[:, :, None]  # (n, w, width)
    return ids, positions, seen
