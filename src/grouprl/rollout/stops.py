"""Stop strings: finding, one decode step at a time, the rows whose newest token completed one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class StopStrings:
    """Finds rows whose newest token completed a stop string, by decoding only a short tail.

    Every token decodes to at least one character for the tokenizers we meet, so a stop string
    of L characters ends inside the last L tokens; the window adds two tokens of context so the
    first token of the stop string is never the window's first token (SentencePiece drops a
    leading space there). Rows are checked every step, so an occurrence is found at the token
    that completes it. Cost: one `batch_decode` of (running rows × window) ids per step.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.window = max(len(s) for s in self.stop) + 2

    def hits(
        self,
        tokens: torch.Tensor,
        rows: torch.Tensor | None,
        running: torch.Tensor,
        t: int | torch.Tensor,
        since: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """(n,) bool: batch rows (among `running`) whose completion now ends with a stop string.

        tokens: (N, max_new) completion buffer; rows: (n,) map from batch row to buffer row
        (None = identity); running: (n,) bool; t: the newest token's position, the same for
        every row or (n,) long per batch row; since: per buffer row, the position its current
        model turn starts at (a multi-turn row: text fed before it is not the model's).
        """
        hit = torch.zeros_like(running)
        active = running.nonzero().squeeze(1)  # (a,)
        if active.numel() == 0:
            return hit
        buffer_rows = active if rows is None else rows[active]
        if isinstance(t, int):
            low = max(0, t + 1 - self.window)
            tails = tokens[buffer_rows, low : t + 1].tolist()
            lows = [low] * len(tails)
        else:  # each row's own last `window` positions
            ends = t[active] + 1  # (a,)
            cols = ends[:, None] - self.window + torch.arange(self.window, device=ends.device)
            tails = tokens[buffer_rows[:, None], cols.clamp(min=0)].tolist()  # (a, window)
            starts = (ends - self.window).tolist()
            tails = [ids[max(0, -start) :] for ids, start in zip(tails, starts)]
            lows = [max(0, start) for start in starts]
        if since is not None:
            tails = [ids[max(0, since[r] - low) :]
                     for ids, r, low in zip(tails, buffer_rows.tolist(), lows)]  # fmt: skip
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        found = [i for i, text in enumerate(texts) if any(s in text for s in self.stop)]
        if found:
            hit[active[found]] = True
        return hit

    def first_hit(self, ids: Sequence[int], begin: int, end: int, since: int = 0) -> int | None:
        """The first position t in [begin, end) at which `hits` finds a stop string in a row
        holding `ids` (its completion, at least `end` long), with its current turn starting at
        `since`; None if at none. For a sampler that writes many tokens before it is asked (an
        engine running its own decode): the same windows `hits` decodes at each step, in one
        `batch_decode`, after a decode of the whole span has shown a stop string is in it."""
        first = max(0, since, begin + 1 - self.window)
        if begin >= end or not any(
            s in self.tokenizer.decode(ids[first:end], skip_special_tokens=True) for s in self.stop
        ):
            return None
        tails = [ids[max(0, t + 1 - self.window, since) : t + 1] for t in range(begin, end)]
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        return next(
            (t for t, text in zip(range(begin, end), texts) if any(s in text for s in self.stop)),
            None,
        )

    def cut(self, text: str) -> str:
        """`text` up to and including the stop string occurrence that ends first."""
        ends = [text.find(s) + len(s) for s in self.stop if s in text]
        return text[: min(ends)] if ends else text
