"""The state one decode loop keeps: its fixed settings and the output rows it writes (shared by
the one-token loop in `grouprl.rollout.sampling` and the chunked one in `grouprl.rollout.chunks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from grouprl.rollout.media import Media
from grouprl.rollout.stops import StopStrings
from grouprl.rollout.turns import TurnRecord, Turns
from grouprl.rollout.types import Rollout


@dataclass(frozen=True)
class Settings:
    """What a decode keeps fixed: the group size and budget, the distribution, the ends."""

    group_size: int
    max_new_tokens: int
    temperature: float  # 1.0 when greedy: old_logp is then taken at temperature 1
    greedy: bool
    top_k: int
    top_p: float
    eos_ids: Sequence[int]
    pad_id: int
    stopper: StopStrings | None
    generator: torch.Generator | None
    lockstep: Callable[[bool], bool] | None
    turns: Turns | None
    media: Media | None = None  # the prompts' images (`grouprl.rollout.media`), fed at prefill
    banned: torch.Tensor | None = None  # (k,) token ids never drawn (the images' own tokens)


@dataclass
class Decoded:
    """The decode's output rows: tokens, old_logp and entropy (N, max_new), where each row
    stopped (N,: max_new + 1 while running)."""

    tokens: torch.Tensor  # (N, max_new) long
    old_logp: torch.Tensor  # (N, max_new)
    entropy: torch.Tensor  # (N, max_new)
    stop_at: torch.Tensor  # (N,) long
    routes: torch.Tensor | None = None  # (N, S, L, K): the experts of each token fed, or None

    @property
    def lengths(self) -> torch.Tensor:
        return self.stop_at.clamp(max=self.tokens.shape[1])  # (N,)

    @property
    def ended(self) -> torch.Tensor:
        return self.stop_at <= self.tokens.shape[1]  # (N,) at EOS or a stop string

    def rollout(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        texts: list[str],
        prompt_texts: list[str],
        settings: Settings,
        record: TurnRecord | None,
    ) -> Rollout:
        """The `Rollout`, cut to its longest row. clone() outside inference mode: inference
        tensors cannot be saved for backward, and the trainer's loss uses old_logp next to
        differentiable log-probs."""
        lengths = self.lengths
        width = int(lengths.max())  # T
        mask = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]  # (N, T)
        turns = settings.turns
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=self.tokens[:, :width].clone(),
            mask=mask,
            old_logp=self.old_logp[:, :width].clone(),
            truncated=~self.ended,
            texts=texts,
            prompts=prompt_texts,
            group_size=settings.group_size,
            temperature=settings.temperature,
            pad_id=settings.pad_id,
            entropy=self.entropy[:, :width].clone(),
            loss_mask=None if turns is None else mask & ~turns.fed[:, :width],
            turns=record,
            routes=None if self.routes is None else self._routes(prompt_mask, width),
            media=settings.media,
        )

    def _routes(self, prompt_mask: torch.Tensor, width: int) -> torch.Tensor:
        """The recorded routes cut to the longest prompt plus the longest completion."""
        return self.routes[:, : int(prompt_mask.sum(-1).max()) + width].clone()


def stop_or_keep(done: torch.Tensor, lockstep: Callable[[bool], bool] | None) -> tuple[bool, Any]:
    """A decode loop's check, `done` (n,) bool: whether it stops (every row done, on every
    participant under `lockstep`), and else the batch rows (running,) to keep when at least half
    of them have finished (compaction: the finished ones are dropped), or None."""
    running = int((~done).sum())
    if (running == 0) if lockstep is None else lockstep(running == 0):
        return True, None
    if running > 0 and 2 * running <= done.numel():
        return False, (~done).nonzero().squeeze(1)
    return False, None
