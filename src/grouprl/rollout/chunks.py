"""Multi-turn decoding with each observation fed to the KV cache in one forward.

The one-token loop of `grouprl.rollout.sampling` feeds an observation to its row one token per
decode step of the whole batch: a 120-token tool result costs 120 batch-wide forwards. Here the
rows keep their own lengths instead: a row's completion position p is cache column P + p (P the
prompt width) whatever the other rows hold. After a step in which some rows' turns end with a
call, those rows alone run one forward of their sampled token and their observation but its last
token (right-aligned in an (R, w) chunk, w the longest), and then every row runs the usual
one-token forward: its sampled token, or for a fed row its observation's last. So every row
samples again at the next step, no row waits for another's observation, and an observation of
L tokens costs a forward of L tokens of its own rows instead of L forwards of all rows.

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
(`lockstep`) the ranks agree at each step whether any of them feeds an observation, and a rank
without one runs the observation forward on one row, writing nothing that is read.
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
            done |= hit | (written >= s.max_new_tokens)  # an end, or the budget spent
            running = int((~done).sum())
            if (running == 0) if s.lockstep is None else s.lockstep(running == 0):
                break
            if running > 0 and 2 * running <= done.numel():  # compaction: drop finished rows
                keep = (~done).nonzero().squeeze(1)  # (running,)
                cache.batch_select_indices(keep)
                rows = keep if rows is None else rows[keep]
                done, cached, written = done[keep], cached[keep], written[keep]
                start, prompt_attn = start[keep], prompt_attn[keep]
            last = torch.where(done, cached, written - 1)  # (n,) the token each row feeds last
            fed = (last > cached) & ~done  # rows with an observation before it
            some = bool(fed.any())
            if some if s.lockstep is None else not s.lockstep(not some):
                batch = fed.nonzero().squeeze(1) if some else fed.new_zeros(1, dtype=torch.long)
                # the observation forward, its logits unused (one row's column that is written
                # again next, when no row here has an observation and another rank's does)
                _forward(model, feed, out, rows, batch, cached[batch], last[batch] - cached[batch],
                         ~fed[batch], s.pad_id, start[batch], prompt_attn[batch], cache)  # fmt: skip
            logits = _forward(model, feed, out, rows, None, last, torch.ones_like(last), done,
                              s.pad_id, start, prompt_attn, cache)  # fmt: skip
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


def _forward(model: nn.Module, feed: _hf.ChunkFeed, out: _Decoded, rows: torch.Tensor | None,
             batch: torch.Tensor | None, first: torch.Tensor, length: torch.Tensor,
             blank: torch.Tensor, pad_id: int, start: torch.Tensor, prompt_attn: torch.Tensor,
             cache: Any) -> torch.Tensor:  # fmt: skip
    """One forward of the batch rows `batch` (R,) (None: all): each feeds its completion tokens
    at positions first … first + length − 1 ((R,) each, length >= 1), right-aligned in (R, w)
    ids, or, where `blank` (R,), one pad at position `first` (a finished row: its output is
    never read). Returns the (R, V) logits of each row's last token."""
    max_new, device = out.tokens.shape[1], first.device
    width_in = int(length.max())  # w
    offset = torch.arange(width_in, device=device)[None, :] - (width_in - length)[:, None]
    real = offset >= 0  # (R, w)
    positions = first[:, None] + offset.clamp(min=0)  # (R, w); a left pad repeats the first
    batch_rows = torch.arange(blank.numel(), device=device) if batch is None else batch
    out_rows = batch_rows if rows is None else rows[batch_rows]
    ids = out.tokens[out_rows[:, None], positions.clamp(max=max_new - 1)]  # (R, w)
    ids = ids.masked_fill(~real | blank[:, None], pad_id)
    source_row, source = real.nonzero(as_tuple=True)  # (m,), (m,)
    feed.rows, feed.sources, feed.columns = source_row, source, positions[source_row, source]
    feed.batch, feed.width = batch, int(positions.max()) + 1
    seen = torch.arange(feed.width, device=device)[None, None, :] <= positions[:, :, None]
    mask = torch.cat([prompt_attn[:, None, :].expand(-1, width_in, -1), seen], dim=-1)
    return _hf.forward_last(
        model, ids, _hf.chunk_mask(model, mask), start[:, None] + positions, cache
    )  # (R, V)
