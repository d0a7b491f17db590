"""The rollout batch and the engine interface every sampler implements."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from grouprl.rollout.media import Media
from grouprl.rollout.routes import widened
from grouprl.rollout.turns import TurnHandler, TurnRecord


@dataclass
class Rollout:
    """B prompts and G sampled completions for each: N = B·G rows, group-contiguous.

    Rows g·G … g·G+G−1 are prompt g's group. Completion tensors are right-padded with the pad id.

    Fields:
        prompt_ids: (B, P) long, left-padded with the pad id.
        prompt_mask: (B, P) bool, True on real prompt tokens.
        completion_ids: (N, T) long, right-padded with the pad id (T = longest completion).
        mask: (N, T) bool, True on completion tokens up to and including the first EOS (or the
            token that completed a stop string), False on padding and everything after: the
            tokens the model attends to.
        loss_mask: (N, T) bool, a subset of `mask`: the tokens the policy sampled, which the
            loss trains. Equal to `mask` for a single-turn rollout; tokens fed to the model
            that it did not sample (a tool's observation) are in `mask` but not here. Every
            "trained tokens" consumer reads it: loss aggregation, GSPO's length normalisation,
            KL, entropy, sampled lengths, the overlong penalty. None at construction: `mask`.
        old_logp: (N, T) float32 (float64 for a float64 model), log-prob of each sampled token
            under softmax(logits / temperature), i.e. the tempered distribution *before* top-k /
            top-p truncation; 0 at masked positions and at tokens fed, not sampled. This is what `completion_logprobs(model, rollout,
            temperature=rollout.temperature)` recomputes, so the importance ratio is exactly 1 at
            the first update. (Truncation is treated as part of the sampler, not the policy, as
            TRL and verl do; the ratio therefore ignores it.)
        truncated: (N,) bool, True where the completion hit max_new_tokens without an EOS token
            or a stop string.
        texts: N decoded completions: special tokens (EOS included) skipped; a stop string that
            ended the completion is kept and the text is cut right after it.
        prompts: B prompt texts as given (decoded, special tokens skipped, if ids were given).
        group_size: G.
        temperature: the temperature of `old_logp`'s distribution (1.0 for greedy sampling,
            which has no finite temperature of its own).
        pad_id: the id used for padding prompts and completions (masked out everywhere).
        entropy: (N, T) float32 (like old_logp) or None, entropy of the sampling distribution
            softmax(logits / temperature) (before top-k / top-p, like `old_logp`) at each
            completion position; 0 where old_logp is. None when the engine does not provide it.
        behaviour_logp: (N, T) float32 or None: each sampled token's log-prob as the sampler
            computed it, when the sampler is not the trainer's own forward (vLLM: in its own
            precision and kernels, after temperature and top-k / top-p, as TRL asks vLLM for
            them); 0 where old_logp is. The trainer then recomputes `old_logp` with its own
            forward and logs how far apart the two are (`grouprl.core.logp_mismatch`). None: the
            sampler is the policy itself, and `old_logp` is its log-prob.
        version: (N,) int64 or None: the policy version (optimizer steps taken) that sampled
            each row, set by the trainer (an asynchronous run samples behind the trainer);
            None where nobody recorded it (evaluation, `generate`).
        turns: for a rollout with tools (`grouprl.rollout.turns`), each row's transcript
            (role-tagged assistant and tool turns) and tool counts; None otherwise. A
            trajectory is the sampled ids and the observation ids fed, exactly; its `texts` are
            the transcript's turns joined. It ends at EOS after the model's last turn (or at a
            stop string, the budget, or a call past the limit of calls).
        routes: (N, S, L, K) int8 (int16 past 128 experts) or None: for a mixture-of-experts policy whose sampler
            records them (`grouprl.rollout.routes`), the K experts each of its L routers chose
            for each token the sampler fed, by position id (row r's j-th token: its prompt's
            unpadded tokens, then its completion's); −1 where none was recorded.
        media: for a vision-language policy, each prompt's images and the processor's tensors
            for them (`grouprl.rollout.media`), fed with the prompt wherever it is fed; None
            for text prompts.
    """

    prompt_ids: torch.Tensor  # (B, P)
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (N, T)
    mask: torch.Tensor  # (N, T)
    old_logp: torch.Tensor  # (N, T)
    truncated: torch.Tensor  # (N,)
    texts: list[str]
    prompts: list[str]
    group_size: int
    temperature: float
    pad_id: int = 0
    entropy: torch.Tensor | None = None  # (N, T)
    loss_mask: torch.Tensor | None = None  # (N, T), ⊆ mask; None: mask
    turns: TurnRecord | None = None  # multi-turn rollouts: transcripts and tool counts
    behaviour_logp: torch.Tensor | None = None  # (N, T); None: old_logp is the sampler's
    version: torch.Tensor | None = None  # (N,) int64: the policy version that sampled each row
    routes: torch.Tensor | None = None  # (N, S, L, K) int8/16: the sampler's expert choices
    media: Media | None = None  # B prompts' images and processor tensors

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.mask
        b, g = self.prompt_ids.shape[0], self.group_size
        n = self.completion_ids.shape[0]
        if g < 1 or n != b * g:
            raise ValueError(f"{n} completion rows do not make {b} groups of {g}")
        if self.mask.shape != self.completion_ids.shape or self.old_logp.shape != self.mask.shape:
            raise ValueError("completion_ids, mask and old_logp must all be (N, T)")
        if self.entropy is not None and self.entropy.shape != self.mask.shape:
            raise ValueError("entropy must be (N, T) like mask")
        if self.behaviour_logp is not None and self.behaviour_logp.shape != self.mask.shape:
            raise ValueError("behaviour_logp must be (N, T) like mask")
        if self.version is not None and self.version.shape != (n,):
            raise ValueError("version must be (N,): one policy version per row")
        if self.routes is not None and (self.routes.dim() != 4 or self.routes.shape[0] != n):
            raise ValueError("routes must be (N, S, L, K): one table of expert ids per row")
        if self.media is not None and len(self.media.prompts) != b:
            raise ValueError("media must hold one entry per prompt")
        if self.loss_mask.shape != self.mask.shape:
            raise ValueError("loss_mask must be (N, T) like mask")
        if self.loss_mask is not self.mask and bool((self.loss_mask & ~self.mask).any()):
            raise ValueError("loss_mask must be a subset of mask: a trained token is attended")
        if len(self.texts) != n or len(self.prompts) != b:
            raise ValueError(
                f"need {n} texts and {b} prompts, got {len(self.texts)}, {len(self.prompts)}"
            )

    @property
    def num_prompts(self) -> int:
        """B."""
        return self.prompt_ids.shape[0]

    @property
    def group_index(self) -> torch.Tensor:
        """(N,) long: the prompt (group) each completion row belongs to, arange(N) // G."""
        n = self.completion_ids.shape[0]
        return torch.arange(n, device=self.completion_ids.device) // self.group_size

    @property
    def lengths(self) -> torch.Tensor:
        """(N,) long: completion tokens under the mask (EOS included): how wide each row is."""
        return self.mask.sum(-1)

    @property
    def sampled_lengths(self) -> torch.Tensor:
        """(N,) long: tokens under the loss mask, the ones the policy sampled (EOS included)."""
        return self.loss_mask.sum(-1)

    def group_rows(self, idx: Sequence[int]) -> torch.Tensor:
        """(b·G,) long: the completion rows of prompts `idx`, group by group in that order."""
        prompt_idx = torch.as_tensor(list(idx), dtype=torch.long)  # (b,)
        if prompt_idx.numel() and (prompt_idx.min() < 0 or prompt_idx.max() >= self.num_prompts):
            raise IndexError(
                f"group index out of range for {self.num_prompts} prompts: {list(idx)}"
            )
        g = self.group_size
        return (prompt_idx[:, None] * g + torch.arange(g)).reshape(-1)

    def select_groups(self, idx: Sequence[int]) -> Rollout:
        """The rollout restricted to prompts `idx` (in that order) and their whole groups."""
        rows = self.group_rows(idx)  # (b·G,)
        prompt_idx = torch.as_tensor(list(idx), dtype=torch.long)  # (b,)
        pi = prompt_idx.to(self.prompt_ids.device)
        ri = rows.to(self.completion_ids.device)
        return Rollout(
            prompt_ids=self.prompt_ids[pi],
            prompt_mask=self.prompt_mask[pi],
            completion_ids=self.completion_ids[ri],
            mask=self.mask[ri],
            old_logp=self.old_logp[ri],
            truncated=self.truncated[ri],
            texts=[self.texts[i] for i in rows.tolist()],
            prompts=[self.prompts[i] for i in prompt_idx.tolist()],
            group_size=self.group_size,
            temperature=self.temperature,
            pad_id=self.pad_id,
            entropy=None if self.entropy is None else self.entropy[ri],
            loss_mask=self._loss_mask_or_none(ri),
            turns=None if self.turns is None else self.turns.select(rows.tolist()),
            behaviour_logp=None if self.behaviour_logp is None else self.behaviour_logp[ri],
            version=None if self.version is None else self.version[ri.to(self.version.device)],
            routes=None if self.routes is None else self.routes[ri.to(self.routes.device)],
            media=None if self.media is None else self.media.select(prompt_idx.tolist()),
        )

    def _loss_mask_or_none(self, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """The loss mask where it differs from `mask` (selected by `rows`); None where it is
        `mask` itself, so that a derived rollout keeps it tied to its own mask."""
        if self.loss_mask is self.mask:
            return None
        return self.loss_mask if rows is None else self.loss_mask[rows]

    def to(self, device: torch.device | str) -> Rollout:
        """The same rollout with its tensors on `device`."""
        tensors = ("prompt_ids", "prompt_mask", "completion_ids", "mask", "old_logp", "truncated")
        moved = {name: getattr(self, name).to(device) for name in tensors}
        optional = {name: None if (t := getattr(self, name)) is None else t.to(device)
                    for name in ("entropy", "behaviour_logp", "version", "routes")}  # fmt: skip
        loss_mask = self._loss_mask_or_none()
        loss_mask = None if loss_mask is None else loss_mask.to(device)
        return dataclasses.replace(self, **moved, **optional, loss_mask=loss_mask)

    def completion_id_lists(self) -> list[list[int]]:
        """Each completion's token ids under the mask (EOS included), as TRL passes
        ``completion_ids`` to reward functions."""
        lengths = self.lengths.tolist()
        return [ids[:n] for ids, n in zip(self.completion_ids.tolist(), lengths)]

    def regroup(self, group_size: int) -> Rollout:
        """The same rows as groups of `group_size`, a divisor of G: each prompt repeated
        G / group_size times, so that a piece smaller than a group still shares its prompt."""
        if group_size < 1 or self.group_size % group_size:
            raise ValueError(f"{group_size} does not divide the group size {self.group_size}")
        repeats = self.group_size // group_size
        if repeats == 1:
            return self
        return dataclasses.replace(
            self,
            prompt_ids=self.prompt_ids.repeat_interleave(repeats, dim=0),
            prompt_mask=self.prompt_mask.repeat_interleave(repeats, dim=0),
            prompts=[p for p in self.prompts for _ in range(repeats)],
            group_size=group_size,
            media=None if self.media is None else self.media.repeat(repeats),
        )

    def chunks(self, max_rows: int | None) -> list[tuple[Rollout, slice]]:
        """Consecutive pieces of at most `max_rows` completions, with the row slice each covers.

        Pieces hold whole groups when `max_rows` >= G (each prompt then runs once per piece);
        otherwise sub-groups of the largest divisor of G that fits. None: one piece.
        """
        n = self.completion_ids.shape[0]
        if max_rows is None or max_rows >= n:
            return [(self, slice(0, n))]
        g = self.group_size
        if max_rows < g:
            size = max(d for d in range(1, max_rows + 1) if g % d == 0)
            return self.regroup(size).chunks(max_rows)
        per = max_rows // g  # groups per piece
        return [
            (self.select_groups(range(first, min(first + per, self.num_prompts))),
             slice(first * g, min(first + per, self.num_prompts) * g))
            for first in range(0, self.num_prompts, per)
        ]  # fmt: skip

    @staticmethod
    def concat(parts: Sequence[Rollout]) -> Rollout:
        """One rollout holding `parts`' groups in order (e.g. several rounds of sampling).

        Prompts are re-left-padded and completions re-right-padded to the widest part with
        `pad_id`; group size and temperature must agree.
        """
        if not parts:
            raise ValueError("nothing to concatenate")
        first = parts[0]
        if any(
            p.group_size != first.group_size or p.temperature != first.temperature for p in parts
        ):
            raise ValueError(
                "cannot concatenate rollouts with different group sizes or temperatures"
            )
        if len(parts) == 1:
            return first
        p_width = max(p.prompt_ids.shape[1] for p in parts)
        t_width = max(p.completion_ids.shape[1] for p in parts)

        def left(x: torch.Tensor, value: float) -> torch.Tensor:  # (R, W) -> (R, p_width)
            return F.pad(x, (p_width - x.shape[1], 0), value=value)

        def right(x: torch.Tensor, value: float) -> torch.Tensor:  # (R, W) -> (R, t_width)
            return F.pad(x, (0, t_width - x.shape[1]), value=value)

        return Rollout(
            prompt_ids=torch.cat([left(p.prompt_ids, first.pad_id) for p in parts]),
            prompt_mask=torch.cat([left(p.prompt_mask, False) for p in parts]),
            completion_ids=torch.cat([right(p.completion_ids, first.pad_id) for p in parts]),
            mask=torch.cat([right(p.mask, False) for p in parts]),
            old_logp=torch.cat([right(p.old_logp, 0.0) for p in parts]),
            truncated=torch.cat([p.truncated for p in parts]),
            texts=[t for p in parts for t in p.texts],
            prompts=[t for p in parts for t in p.prompts],
            group_size=first.group_size,
            temperature=first.temperature,
            pad_id=first.pad_id,
            entropy=(
                torch.cat([right(p.entropy, 0.0) for p in parts])
                if all(p.entropy is not None for p in parts)
                else None
            ),
            loss_mask=(
                None
                if all(p.loss_mask is p.mask for p in parts)
                else torch.cat([right(p.loss_mask, False) for p in parts])
            ),
            turns=(
                TurnRecord.concat([p.turns for p in parts])
                if all(p.turns is not None for p in parts)
                else None
            ),
            behaviour_logp=(
                None
                if all(p.behaviour_logp is None for p in parts)
                else torch.cat([right(p.sampler_logp, 0.0) for p in parts])
            ),
            version=(
                torch.cat([p.version for p in parts])
                if all(p.version is not None for p in parts)
                else None
            ),
            routes=_joined_routes([p.routes for p in parts]),
            media=Media.concat([p.media for p in parts], [p.num_prompts for p in parts]),
        )

    @property
    def sampler_logp(self) -> torch.Tensor:
        """(N, T): the log-probs the sampler computed, `behaviour_logp` or else `old_logp`."""
        return self.old_logp if self.behaviour_logp is None else self.behaviour_logp


def _joined_routes(tables: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Rows' route tables (R, S, L, K) as one, each −1-padded to the widest; None unless
    every part has one."""
    if any(t is None for t in tables):
        return None
    width = max(t.shape[1] for t in tables)
    return torch.cat([widened(t, width) for t in tables])


@dataclass
class Branches:
    """The rows a batch's trajectories went on in after their prefix broke (an agent program
    that sent an earlier turn back rewritten): each a row of its own, exact from its own prompt
    (the rewritten conversation as rendered), trained with the advantage of the trajectory it
    continues (`parents`); never scored or normalised on its own.

    Fields:
        rollout: the K rows as groups of one.
        parents: (K,) long: the row of the batch's rollout (the episode's first row) each one
            continues.
    """

    rollout: Rollout
    parents: torch.Tensor  # (K,)

    def __post_init__(self) -> None:
        if self.rollout.group_size != 1 or self.parents.shape != (self.rollout.num_prompts,):
            raise ValueError("branches are groups of one, each with its parent row")

    def select(self, rows: torch.Tensor) -> Branches | None:
        """The branches of the batch rows `rows` (in that order: the selected batch's rows),
        their parents renumbered; None when none is left."""
        where = {int(r): i for i, r in enumerate(rows.tolist())}
        keep = [k for k, p in enumerate(self.parents.tolist()) if p in where]
        if not keep:
            return None
        parents = torch.tensor([where[int(self.parents[k])] for k in keep], dtype=torch.long)
        return Branches(self.rollout.select_groups(keep), parents)

    @staticmethod
    def concat(parts: Sequence[tuple[Branches | None, int]]) -> Branches | None:
        """The branches of batches joined in order, each part's (its branches, its batch's row
        count)."""
        kept, offset, out = [], 0, []
        for branches, rows in parts:
            if branches is not None:
                kept.append(branches.rollout)
                out.append(branches.parents + offset)
            offset += rows
        if not kept:
            return None
        return Branches(Rollout.concat(kept), torch.cat(out))

    def to(self, device: torch.device | str) -> Branches:
        return Branches(self.rollout.to(device), self.parents)


class RolloutEngine(Protocol):
    """Anything that samples groups of completions: the HF engine today, others later. The one
    way grouprl samples: training, evaluation, `check` and `generate` all call `sample`, with
    exactly these arguments (tests hold every caller to this signature).

    An engine owns its model copy, its batching and its cache. Prompts arrive as token ids,
    encoded once by the caller exactly as the model is to see them. `old_logp` must be the
    log-prob under softmax(logits / temperature) before top-k / top-p, as documented on
    `Rollout`, whatever the backend; temperature 0 decodes greedily (old_logp at temperature 1).
    `tools` answers tool calls inside the decode (`grouprl.rollout.turns`); None: a single turn.
    `entropy` is optional: an engine that cannot provide it returns None, and the trainer then
    logs no entropy. An engine that is not the trainer's own forward sets `behaviour_logp`.

    `policy_updated(version)` is called after every optimizer step that changed the policy's
    weights, `version` counting them: an engine holding its own copy of the weights (vLLM) loads
    them before it next samples; one that samples with the policy itself does nothing. `close()`
    ends the engine's life (the trainer calls it when a run ends).
    """

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        tools: TurnHandler | None = None,
    ) -> Rollout: ...

    def policy_updated(self, version: int) -> None: ...

    def close(self) -> None:
        """Free what the engine holds (its model copy, its cache); it samples no more."""
