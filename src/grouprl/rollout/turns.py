"""Multi-turn decoding: tool calls answered inside the decode loop.

When a row's newest token closes a tool call (one of the handler's `closers`, checked like a
stop string on the row's current turn only), or, for a handler that `ends_turns`, when a row's
turn ends (an end-of-turn token such as `<|im_end|>`, or a stop string), the sampler asks a
`TurnHandler` what follows: the observation's token ids, which the sampler feeds to that row
while the other rows go on sampling: as one chunk in the next forward (`grouprl.rollout.chunks`),
or, for a model whose cache cannot take chunks, one per decode step as forced tokens. The row's KV
cache simply grows by them; nothing is re-prefilled and no text is re-encoded. A fed token has
no log-prob of the policy: `old_logp` and entropy are 0 there, and it is attended (`mask`) but
not trained (`loss_mask`).

Token fidelity by construction: a trajectory's `completion_ids` are exactly the sampled ids and
the observation ids fed to the model, in order. Text is decoded only to find and parse calls and
for the transcript; it is never encoded again. The budget `max_new_tokens` counts both: an
observation longer than what is left is cut to fit and the trajectory ends there (one that fits
exactly is kept whole, and ends it too).

A turn that ends with nothing to answer (no call in it, the episode over) ends the trajectory
there, as EOS always does; one the handler answers goes on after its end-of-turn token, which
stays in the trajectory (sampled, trained) with the observation's boundary tokens after it.

The handler owns what a call means (its format, the tools, their limits); `Turns` owns the
per-row bookkeeping: where each turn starts, the queue of ids still to feed, the transcript, and
the counts the trainer logs.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from grouprl.messages import Observation, ToolRequest
from grouprl.rollout.stops import StopStrings


@runtime_checkable
class TurnHandler(Protocol):
    """What the sampler asks when rows close a tool call (see `grouprl.tasks.tools.calls`)."""

    closers: list[str]  # strings that end a model turn with a call (not the trajectory)
    ends_turns: bool  # also asked when a turn ends at EOS or a stop string (chat calls, step())

    def respond(self, requests: Sequence[ToolRequest]) -> list[Observation]:
        """One observation per request, in order."""
        ...


@dataclass(frozen=True)
class TurnRecord:
    """A rollout's multi-turn facts, one entry per completion row."""

    transcripts: list[list[dict[str, Any]]]  # role-tagged turns: assistant and tool messages
    calls: torch.Tensor  # (N,) long: tool calls run
    failures: torch.Tensor  # (N,) long: calls that gave an error observation
    ended_by_turns: torch.Tensor  # (N,) bool: ended by a call past the limit of calls
    environments: list[Any] | None = None  # each row's environment instance, if any
    starts: list[list[int]] | None = None  # where each row's model turns start (0 first)
    # the turns each row's episode made in rows of its own after it, where those rows are not
    # kept beside it (an evaluation's split trajectories); None: none, or kept as `Branches`
    later: list[int] | None = None

    def select(self, rows: list[int]) -> TurnRecord:
        index = torch.as_tensor(rows, dtype=torch.long)
        envs = None if self.environments is None else [self.environments[i] for i in rows]
        starts = None if self.starts is None else [self.starts[i] for i in rows]
        later = None if self.later is None else [self.later[i] for i in rows]
        return TurnRecord([self.transcripts[i] for i in rows], self.calls[index],
                          self.failures[index], self.ended_by_turns[index], envs,
                          starts, later)  # fmt: skip

    @staticmethod
    def concat(parts: Sequence[TurnRecord]) -> TurnRecord:
        return TurnRecord(
            [t for p in parts for t in p.transcripts],
            torch.cat([p.calls for p in parts]),
            torch.cat([p.failures for p in parts]),
            torch.cat([p.ended_by_turns for p in parts]),
            None
            if any(p.environments is None for p in parts)
            else [e for p in parts for e in p.environments],
            None if any(p.starts is None for p in parts) else [s for p in parts for s in p.starts],
            None
            if all(p.later is None for p in parts)
            else [n for p in parts for n in (p.later or [0] * len(p.transcripts))],
        )


class Turns:
    """Per-row turn state of one decode loop (rows are output rows, 0 … N−1)."""

    def __init__(self, handler: TurnHandler, tokenizer: Any, n: int, max_new_tokens: int,
                 device: torch.device) -> None:  # fmt: skip
        self.handler, self.tokenizer = handler, tokenizer
        self.max_new_tokens = max_new_tokens
        self.closers = StopStrings(tokenizer, handler.closers) if handler.closers else None
        self.ends_turns = bool(getattr(handler, "ends_turns", False))
        self.since = [0] * n  # where each row's current model turn starts
        self.queue: dict[int, deque[int]] = {}  # ids still to feed, by row
        self.fed = torch.zeros((n, max_new_tokens), dtype=torch.bool, device=device)
        self.tool_turns: list[list[tuple[int, int, dict]]] = [[] for _ in range(n)]
        self.calls, self.failures, self.steps = [0] * n, [0] * n, [0] * n
        self.ended_by_turns = [False] * n

    def force(self, rows: torch.Tensor | None, tok: torch.Tensor, logp: torch.Tensor,
              entropy: torch.Tensor, t: int) -> torch.Tensor:  # fmt: skip
        """Replace, in place, the step-`t` token of every batch row with ids to feed by the next
        one (its log-prob and entropy by 0). Returns (n,) bool: the batch rows fed."""
        fed = torch.zeros(tok.shape[0], dtype=torch.bool, device=tok.device)
        if not self.queue:
            return fed
        out = list(range(tok.shape[0])) if rows is None else rows.tolist()
        for b, row in enumerate(out):
            waiting = self.queue.get(row)
            if waiting:
                tok[b] = waiting.popleft()
                fed[b] = True
                self.fed[row, t] = True
                if not waiting:
                    del self.queue[row]
        logp.masked_fill_(fed, 0.0)
        entropy.masked_fill_(fed, 0.0)
        return fed

    def take(self, rows: torch.Tensor | None) -> list[tuple[int, int, list[int]]]:
        """Every queued observation at once, as (batch row, output row, ids), for a loop that
        feeds them as one chunk (`grouprl.rollout.chunks`); the queue is emptied."""
        if not self.queue:
            return []
        out = range(len(self.since)) if rows is None else rows.tolist()
        batch = {row: b for b, row in enumerate(out)}
        taken = [(batch[row], row, list(ids)) for row, ids in self.queue.items()]
        self.queue.clear()
        return taken

    def after_step(self, tokens: torch.Tensor, rows: torch.Tensor | None, sampled: torch.Tensor,
                   hit: torch.Tensor, t: int | torch.Tensor,
                   logp: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Ask the handler about the rows among `sampled` (n,) bool (those that sampled this
        step's token) whose newest token closed a call, or, if it `ends_turns`, ended their turn
        (`hit`, (n,) bool: EOS or a stop string); queue what it answers. `t`: the newest token's
        position, for every row or (n,) per batch row. Returns `hit` updated: the batch rows
        whose trajectory ends now (a call past the limit ends one; an answered turn end goes
        on). `logp`: the (N, T) sampled log-probs, for a handler that `wants_turn_ids` (its
        requests carry the turn's ids and log-probs)."""
        hit = hit.clone()
        asking = torch.zeros_like(sampled)
        if self.closers is not None:
            asking |= self.closers.hits(tokens, rows, sampled & ~hit, t, since=self.since)
        at_end = sampled & hit if self.ends_turns else torch.zeros_like(sampled)
        asking |= at_end
        if not bool(asking.any()):
            return hit
        batch_rows = asking.nonzero().squeeze(1).tolist()
        out = [b if rows is None else int(rows[b]) for b in batch_rows]
        ends = [t + 1 if isinstance(t, int) else int(t[b]) + 1 for b in batch_rows]
        texts = self.tokenizer.batch_decode(
            [tokens[r, self.since[r] : end].tolist() for r, end in zip(out, ends)],
            skip_special_tokens=True,
        )
        requests = [ToolRequest(r, text, self.calls[r] + self.steps[r], at_end=bool(at_end[b]))
                    for b, r, text in zip(batch_rows, out, texts)]  # fmt: skip
        if logp is not None and getattr(self.handler, "wants_turn_ids", False):
            requests = [dataclasses.replace(q, ids=tuple(tokens[r, self.since[r]:end].tolist()),
                                            logps=tuple(logp[r, self.since[r]:end].tolist()))
                        for q, r, end in zip(requests, out, ends)]  # fmt: skip
        answers = self.handler.respond(requests)
        for b, r, end, answer in zip(batch_rows, out, ends, answers, strict=True):
            self.calls[r] += answer.calls
            self.failures[r] += answer.failures
            self.steps[r] += answer.steps
            if answer.end:
                hit[b] = True
                self.ended_by_turns[r] = answer.over_limit
                if answer.empty_turn:  # a turn of no token after this one: no observation
                    self.tool_turns[r].append((end, end, None))
                continue
            ids = list(answer.ids)[: self.max_new_tokens - end]  # what the budget leaves
            if answer.messages:
                self.tool_turns[r].append((end, end + len(ids), _joined(answer.messages)))
            if ids:
                self.queue[r] = deque(ids)
                self.since[r] = end + len(ids)
            if answer.messages:  # answered: the trajectory goes on (a turn end included)
                hit[b] = False
        return hit

    def record(self, tokens: torch.Tensor, lengths: torch.Tensor, ended: torch.Tensor,
               eos_ids: Sequence[int], cut: Any = None) -> TurnRecord:  # fmt: skip
        """The transcripts (assistant text decoded from the sampled spans, tool turns decoded
        from the ids fed, or the tool's own text where the ids also hold a chat template's
        markup) and counts, once decoding is done. `cut(text)`: the stop-string cut of
        a row's last assistant turn, where the row ended."""
        eos = set(eos_ids)
        spans, pieces = [], []  # (row, role, message) in order, and the ids to decode
        for row, length in enumerate(lengths.tolist()):
            ids = tokens[row, :length].tolist()
            if bool(ended[row]) and ids and ids[-1] in eos:
                ids = ids[:-1]
            start = 0
            for begin, end, message in self.tool_turns[row]:
                spans.append((row, "assistant", None))
                pieces.append(ids[start:begin])
                if message is not None:  # None: the turn after it holds no token, nothing fed
                    spans.append((row, "tool", message))
                    pieces.append(ids[begin:end])
                start = end
            spans.append((row, "assistant", None))
            pieces.append(ids[start:])
        texts = self.tokenizer.batch_decode(pieces, skip_special_tokens=True)
        transcripts: list[list[dict[str, Any]]] = [[] for _ in range(len(lengths))]
        last = {row: i for i, (row, _, _) in enumerate(spans)}  # each row's final turn
        for i, ((row, role, message), text) in enumerate(zip(spans, texts, strict=True)):
            if cut is not None and last[row] == i and bool(ended[row]):
                text = cut(text)
            if role == "tool":  # an observation: a tool's (or an environment's) turn
                keep = getattr(self.handler, "keeps_content", False) and "content" in message
                transcripts[row].append(
                    {**message, "content": message["content"] if keep else text}
                )
            elif text or last[row] == i:  # the final turn even when empty: it is the answer
                transcripts[row].append({"role": "assistant", "content": text})
        return TurnRecord(
            transcripts,
            torch.tensor(self.calls, dtype=torch.long),
            torch.tensor(self.failures, dtype=torch.long),
            torch.tensor(self.ended_by_turns, dtype=torch.bool),
            getattr(self.handler, "environments", None),
            # a model turn starts where an observation ends (one the budget cut short included)
            [[0, *(end for _, end, _ in turns)] for turns in self.tool_turns],
        )


def _joined(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Several calls answered in one observation: one tool turn naming them all."""
    if len(messages) == 1:
        return dict(messages[0])
    return {
        "role": "tool",
        "name": ",".join(str(m.get("name", "")) for m in messages),
        "error": any(m.get("error") for m in messages),
        "content": "\n".join(str(m.get("content", "")) for m in messages),
    }
