"""Teacher-forced log-probs (and entropy) of the completion tokens, for training.

logp[i, t] = log softmax(z_{i,t} / temperature)[y_{i,t}], where z_{i,t} are the logits the model
gives after prompt_i and completion tokens y_{i,<t}. Two things keep this cheap without changing
a single number:

- Prompt sharing: the B prompts go through the decoder once; their KV cache is repeated G times
  (`repeat_interleave`, which autograd differentiates, so the G copies' gradients sum back into
  the one prompt forward), and the N = B·G completions run on top of it. Identical values and
  gradients to running the N full sequences, with B instead of N prompt rows of compute.
- Chunked head: the output projection and log-softmax run only at completion positions under
  the mask, at most `chunk_tokens` positions at a time, so no (N, T, vocab) tensor exists. With
  autograd on, each chunk is checkpointed: its (chunk, vocab) logits are recomputed in backward
  instead of being stored, which is what bounds training memory.

The decoder is `model.get_decoder()` and the head `model.get_output_embeddings()`. Models whose
logits are more than head(decoder(x)) (e.g. Gemma-2's final soft-capping) are detected once per
model by a tiny probe and take the plain path: one full forward with full logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from grouprl.rollout import _hf, prefix, prompt_pass, routes
from grouprl.rollout.media import Media
from grouprl.rollout.packed import packed_states, row_widths
from grouprl.rollout.sampling import check_temperature
from grouprl.rollout.selected import selected_head_logp, selected_logp

# Elements of (tokens × vocab) logits materialised at once: 2^25 fp32 = 128 MiB.
_LOGIT_CHUNK_ELEMENTS = 1 << 25


def completion_logprobs(
    model: nn.Module,
    batch: Any,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int | None = None,
    share_prompt: bool = True,
    buckets: Sequence[torch.Tensor] | None = None,
    packs: Sequence[torch.Tensor] | None = None,
    divergence: Divergence | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Per-token log-probs (N, T) of `batch.completion_ids` under softmax(logits / temperature).

    batch: a `Rollout`, or anything with prompt_ids (B, P) left-padded, prompt_mask (B, P),
        completion_ids (N, T), mask (N, T) and group_size (N = B·G, group-contiguous).
    temperature: divide logits by this (> 0); use the rollout's temperature so the result
        matches `old_logp`.
    with_entropy: also return the entropy (N, T) of softmax(logits / temperature) per position.
    chunk_tokens: positions per head chunk (default: 2^25 / vocab logits at a time).
    share_prompt: run each prompt once for its group (False: the N full sequences, as under
        gradient checkpointing; the same values in exact arithmetic, other float rounding).
    buckets: a partition of the N rows (index tensors); with the prompt shared, each bucket's
        completions run as wide as its own longest, over the one prompt forward (rows of 2
        tokens beside rows of 200 in every group otherwise all run at 200); the same values in
        exact arithmetic (ValueError unless each row is in one bucket). Ignored where the
        prompt is not shared or the cache is not plain full attention (sliding windows).
    packs: a partition of the N rows (index tensors) into packed sequences, a forward each:
        each row its prompt's tokens then its completion's, positions restarting per row
        (`packs_rows`), no padding; the same values in exact arithmetic. Overrides the rest.
    divergence: a `Divergence`, computed chunk by chunk with the head (no (N, T, V) tensor).

    Returns logp (N, T), or (logp, entropy), with the divergence (N, T) after them when given;
    all float32 (float64 for a float64 model) and 0 where `mask` is False.
    Differentiable w.r.t. the model's parameters; wrap in `torch.no_grad()` for old/reference
    log-probs. Positions and masks are built exactly as in `sample_groups`, so on the sampled
    tokens this equals `Rollout.old_logp` to float rounding.

    Prompt sharing needs the KV cache, which transformers drops under gradient checkpointing in
    training mode; then the N full sequences run instead (same numbers, more compute).

    The decoder and head are called directly, not through `model.forward`: a DDP wrapper's
    hooks do not run; pass the wrapped module and sum gradients yourself (or use FSDP2's).
    """
    check_temperature(temperature)
    device = _hf.model_device(model)
    group_size = int(batch.group_size)
    mask = batch.mask.to(device)  # (N, T)
    n, width = mask.shape
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    logp = torch.zeros((n, width), dtype=dtype, device=device)
    used = int(mask.sum(-1).max()) if n else 0  # T' ≤ T: trailing all-pad columns skipped
    wanted = tuple(torch.zeros_like(logp) for _ in range(with_entropy + (divergence is not None)))
    if used == 0:
        return (logp, *wanted) if wanted else logp

    prompt_mask = batch.prompt_mask.to(device).bool()  # (B, P)
    first = int((~prompt_mask.any(0)).long().cumprod(0).sum())  # leading all-pad columns
    prompt_mask, prompt_ids = prompt_mask[:, first:], batch.prompt_ids.to(device)[:, first:]
    completion_ids = batch.completion_ids.to(device)[:, :used]  # (N, T')
    sel = mask[:, :used]  # (N, T')

    plain = _hf.plain_head(model)
    ids = (prompt_ids, prompt_mask, completion_ids, group_size)
    images = _Images.of(model, getattr(batch, "media", None), plain)  # (M, H) or (M, V) below
    out = _selected(model, plain, ids, sel, share_prompt, buckets, packs, images)
    if plain:
        lp, ent, div = _head_logp(model, out, completion_ids[sel], temperature, with_entropy,
                                  chunk_tokens, divergence)  # fmt: skip
    else:
        lp, ent, div = _token_logp(out, completion_ids[sel], temperature, with_entropy,
                                   divergence)  # fmt: skip

    full_sel = torch.zeros_like(mask)
    full_sel[:, :used] = sel
    logp = logp.masked_scatter(full_sel, lp)
    found = [values for values in (ent, div) if values is not None]
    if not found:
        return logp
    return (logp, *(empty.masked_scatter(full_sel, v) for empty, v in zip(wanted, found)))


def _selected(
    model: nn.Module,
    plain: bool,
    ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
    sel: torch.Tensor,
    share_prompt: bool,
    buckets: Sequence[torch.Tensor] | None,
    packs: Sequence[torch.Tensor] | None,
    images: _Images | None = None,
) -> torch.Tensor:
    """The final hidden states (M, H) at the positions under `sel` (N, T), or with a head that
    is more than a projection (`plain` False) the logits (M, V): packed, or the prompt shared
    (by buckets), or the N full sequences. ids: prompt ids and mask, completion ids, G.
    `images`: the prompts' images, fed with every prompt forward (never packed)."""
    if routes.active():  # routes recorded or replayed: each row whole, one layout
        if plain:
            return _unshared_hidden(model.get_decoder(), *ids, real=sel, images=images)[sel]
        return _full_logits(model, *ids, real=sel, images=images)[sel]
    if packs is not None:
        if images is not None:
            raise ValueError("prompts with images are not packed: pass packs=None")
        module = model.get_decoder() if plain else model
        return packed_states(module, *ids, packs, sel, plain)[sel]
    if plain:
        widths = None if buckets is None else _bucket_widths(buckets, sel)
        return _completion_hidden(model.get_decoder(), *ids, share_prompt, widths,
                                  images=images)[sel]  # fmt: skip
    return _full_logits(model, *ids, images=images)[sel]


@dataclass(frozen=True)
class _Images:
    """A batch's prompt images as its forwards take them: the module that takes the prompt's
    ids with its images (`_hf.images_base` for the decoder's states, the model itself for
    logits) and the prompts' media."""

    base: nn.Module
    media: Media

    @staticmethod
    def of(model: nn.Module, media: Media | None, plain: bool) -> _Images | None:
        if media is None:
            return None
        if not _hf.sees_images(model):
            raise ValueError("the batch's prompts have images but the model takes none")
        return _Images(_hf.images_base(model) if plain else model, media)

    def inputs(self, prompt_ids: torch.Tensor, repeat: int = 1) -> dict[str, torch.Tensor]:
        """The images' tensors for the B prompts of `prompt_ids` (B, P), each `repeat` times."""
        media = self.media if repeat == 1 else self.media.repeat(repeat)
        return media.inputs(prompt_ids.shape[1], prompt_ids.device)


#: A per-position function of the whole next-token distribution (distillation's loss against
#: a teacher, `next_token_log_softmax`): called with the log-softmax (m, V) of m consecutive
#: positions under the mask (row-major) and the first one's index among them; returns (m,).
Divergence = Callable[[torch.Tensor, int], torch.Tensor]


def next_token_log_softmax(
    model: nn.Module, batch: Any, *, temperature: float = 1.0
) -> Callable[[int, int], torch.Tensor]:
    """The model's next-token log-softmax(logits / temperature) at the completion positions
    under `batch.mask`, in `completion_logprobs`'s row-major order: a function of (start,
    stop) giving those positions' (m, V), without gradients. The decoder runs once here; the
    head runs per call, so only the (M, H) hidden states are kept (a head that is more than a
    projection keeps its (M, V) logits). For a teacher's side of `divergence`."""
    check_temperature(temperature)
    device = _hf.model_device(model)
    mask = batch.mask.to(device)
    used = int(mask.sum(-1).max()) if mask.numel() else 0
    prompt_mask = batch.prompt_mask.to(device).bool()
    ids = batch.prompt_ids.to(device), batch.completion_ids.to(device)[:, : max(used, 1)]
    sel = mask[:, : max(used, 1)]
    plain = _hf.plain_head(model)
    images = _Images.of(model, getattr(batch, "media", None), plain)
    with torch.no_grad():
        if plain:
            hidden = _completion_hidden(model.get_decoder(), ids[0], prompt_mask, ids[1],
                                        int(batch.group_size), images=images)[sel]  # fmt: skip
            head = model.get_output_embeddings()
        else:
            hidden = _full_logits(model, ids[0], prompt_mask, ids[1], int(batch.group_size),
                                  images=images)[sel]  # fmt: skip
            head = nn.Identity()

    def log_softmax(start: int, stop: int) -> torch.Tensor:
        with torch.no_grad():
            scores = head(hidden[start:stop])
            scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
            return F.log_softmax(scores / temperature if temperature != 1.0 else scores, dim=-1)

    return log_softmax


def _head_logp(
    model: nn.Module,
    h: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int | None,
    divergence: Divergence | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The head's log-probs (M,) of `targets` (M,) from hidden states h (M, H), and entropies
    and divergences (or None), in chunks of `chunk_tokens` positions (default: 2^25 / vocab
    logits at a time). One chunk's logits fit the memory budget as they are; only several
    chunks need the recompute-in-backward that bounds memory (and costs a second head matmul)."""
    head = model.get_output_embeddings()
    step = chunk_tokens or max(1, _LOGIT_CHUNK_ELEMENTS // _vocab_size(model, head))
    recompute = h.shape[0] > step
    parts = []
    for i in range(0, h.shape[0], step):
        parts.append(_chunk_logp(head, h[i : i + step], targets[i : i + step], temperature,
                                 with_entropy, recompute, divergence, i))  # fmt: skip
    lp = torch.cat([p[0] for p in parts])  # (M,)
    ent = torch.cat([p[1] for p in parts]) if with_entropy else None
    return lp, ent, (torch.cat([p[2] for p in parts]) if divergence is not None else None)


def _token_logp(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    divergence: Divergence | None = None,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """logits (M, V), targets (M,) → log-prob (M,) float32 (float64 logits stay float64),
    entropy (M,) or None, and `divergence` of the positions from `start` on (M,) or None.
    The log-probs alone skip the (M, V) log-softmax (`grouprl.rollout.selected`)."""
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if not with_entropy and divergence is None:
        return selected_logp(scores, targets, temperature), None, None
    if temperature != 1.0:
        scores = scores / temperature
    logp_all = F.log_softmax(scores, dim=-1)  # (M, V)
    lp = logp_all.gather(-1, targets[:, None]).squeeze(1)  # (M,)
    ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None  # (M,)
    return lp, ent, (None if divergence is None else divergence(logp_all, start))


def _chunk_logp(
    head: nn.Module,
    h: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    recompute: bool,
    divergence: Divergence | None = None,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Head + log-softmax on one chunk of hidden states h (m, H), the chunk's first position
    `start`; with `recompute`, checkpointed under autograd so that its (m, vocab) logits are
    not kept for backward."""

    def run(h_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not with_entropy and divergence is None and _blocked_head(head, h_):
            lp, ent, div = selected_head_logp(h_, head.weight, targets, temperature), None, None
        else:
            lp, ent, div = _token_logp(head(h_), targets, temperature, with_entropy, divergence,
                                       start)  # fmt: skip
        none = lp.new_zeros(())
        return lp, (none if ent is None else ent), (none if div is None else div)

    if (
        recompute
        and torch.is_grad_enabled()
        and (h.requires_grad or any(p.requires_grad for p in head.parameters()))
    ):
        lp, ent, div = checkpoint(run, h, use_reentrant=False)
    else:
        lp, ent, div = run(h)
    return lp, (ent if with_entropy else None), (div if divergence is not None else None)


def _blocked_head(head: nn.Module, h: torch.Tensor) -> bool:
    """Whether the head's log-probs go block by block (`selected_head_logp`): a plain
    nn.Linear without bias of h's dtype, no hooks, on a CPU (where it was measured) without
    autocast."""
    return (
        type(head) is nn.Linear
        and head.bias is None
        and type(head.weight) is nn.Parameter
        and head.weight.dtype == h.dtype
        and h.device.type == "cpu"
        and not torch.is_autocast_enabled(h.device.type)
        and not (head._forward_hooks or head._forward_pre_hooks)
    )


def _completion_hidden(
    decoder: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    group_size: int,
    share_prompt: bool = True,
    buckets: list[tuple[torch.Tensor, int]] | None = None,
    images: _Images | None = None,
) -> torch.Tensor:
    """Final hidden states (N, T, H) that predict completion_ids (N, T).

    Position t's state comes from prompt + completion[:t]: t = 0 is the prompt's last position,
    t ≥ 1 the completion token t − 1. Runs the B prompts once and shares their cache across
    each group, unless asked not to or the cache would be dropped (gradient checkpointing while
    training). `buckets`: (rows, width) pairs partitioning the N rows (`_bucket_widths`); each
    bucket's states past its width are 0 (the caller reads only positions under the mask).
    `images`: the prompts' images, fed (through the model's base) with the prompt forward only.
    """
    width = completion_ids.shape[1]
    prompt_pos = _hf.left_pad_positions(prompt_mask)  # (B, P)
    prompt_len = prompt_mask.sum(-1)  # (B,)
    if not share_prompt or _checkpointing(decoder):
        return _unshared_hidden(decoder, prompt_ids, prompt_mask, completion_ids, group_size,
                                images=images)  # fmt: skip

    cache = _hf.new_cache(decoder)
    out, layout = _prompt_forward(decoder, prompt_ids, prompt_mask, prompt_pos, cache, images)
    if buckets is not None and len(buckets) > 1 and _hf.plain_layers(cache):
        hidden = _bucketed_hidden(decoder, out.last_hidden_state[:, -1], cache, layout,
                                  completion_ids, group_size, buckets)  # fmt: skip
        if hidden is not None:
            return hidden
        return _unshared_hidden(decoder, prompt_ids, prompt_mask, completion_ids, group_size,
                                images=images)  # fmt: skip
    first = out.last_hidden_state[:, -1].repeat_interleave(group_size, dim=0)  # (N, H)
    if width == 1:
        return first[:, None]
    # the prompt's keys and values once per group (`prompt_pass`) on a CPU (where it was
    # measured) and where the prompt is at least as wide as the completions: its scores are
    # materialised, (N, H, w, P + w) a layer, where SDPA tiles them; the built-in task's 10-token
    # prompts and 12-38-token completions keep SDPA
    shared = (
        prompt_ids.device.type == "cpu"
        and prompt_ids.shape[1] >= width
        and _hf.plain_layers(cache)
        and _shares_prompt(decoder)
    )
    if shared:
        prompt_pass.share_prompts(cache, group_size, layout)
    else:
        _hf.expand_cache(cache, group_size)
    attn = torch.cat(
        [
            layout.repeat_interleave(group_size, dim=0),
            layout.new_ones(completion_ids.shape[0], width - 1),
        ],
        dim=1,
    )  # (N, P + T − 1)
    pos = prompt_len.repeat_interleave(group_size)[:, None] + torch.arange(
        width - 1, device=prompt_ids.device
    )  # (N, T − 1)
    with _hf.SharedPromptDecoding(decoder, cache) if shared else contextlib.nullcontext():
        rest = decoder(
            input_ids=completion_ids[:, :-1],
            attention_mask=attn,
            position_ids=pos,
            **_hf.cache_kwargs(decoder, cache),
        ).last_hidden_state  # (N, T − 1, H)
    if cache.get_seq_length() != prompt_ids.shape[1] + width - 1:  # the cache was not used
        return _unshared_hidden(decoder, prompt_ids, prompt_mask, completion_ids, group_size,
                                images=images)  # fmt: skip
    return torch.cat([first[:, None], rest], dim=1)


def _prompt_forward(
    decoder: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_pos: torch.Tensor,
    cache: Any,
    images: _Images | None,
) -> tuple[Any, torch.Tensor]:
    """The B prompts' forward into `cache` (empty): their common prefix and remainders packed in
    one forward, or the prefix once and each one's remainder against it
    (`grouprl.rollout.prefix`), or whole (with images through the base).
    Returns the decoder's output (its last position is each prompt's last token) and the (B, P)
    mask of the cache's prompt columns."""
    split = None  # with images the prompt forward is the base's, whole
    if images is None:
        packed = prefix.run_packed(decoder, prompt_ids, prompt_mask, cache)  # one forward
        if packed is not None:
            split, last = packed
            return SimpleNamespace(last_hidden_state=last[:, None]), split.mask
        split = prefix.run_prefix(decoder, prompt_ids, prompt_mask, cache)
    if split is not None:
        out = decoder(input_ids=split.ids, attention_mask=split.mask,
                      position_ids=split.positions, **_hf.cache_kwargs(decoder, cache))  # fmt: skip
        return out, split.mask
    module = decoder if images is None else images.base
    out = module(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=prompt_pos,
        **_hf.cache_kwargs(module, cache),
        **({} if images is None else images.inputs(prompt_ids)),
    )
    return out, prompt_mask


def _shares_prompt(decoder: nn.Module) -> bool:
    """Whether the completions' forward can attend through `prompt_pass` (a plain attention
    architecture, `_hf.shares_prompt_attention`, without attention dropout acting)."""
    dropout = getattr(decoder.config, "attention_dropout", 0.0) if decoder.training else 0.0
    return _hf.shares_prompt_attention(decoder) and not dropout


def _bucket_widths(
    buckets: Sequence[torch.Tensor], sel: torch.Tensor
) -> list[tuple[torch.Tensor, int]]:
    """Each bucket's rows (on `sel`'s device) and width: the last position under `sel` (N, T)
    of any of its rows, plus one (at least 1)."""
    n = sel.shape[0]
    moved = [rows.reshape(-1).to(sel.device) for rows in buckets]
    if not torch.equal(torch.cat(moved).sort().values, torch.arange(n, device=sel.device)):
        raise ValueError(f"buckets must hold each of the {n} rows once")
    last = row_widths(sel)  # (N,)
    return [(rows, int(last[rows].max()) if rows.numel() else 1) for rows in moved]


def _bucketed_hidden(
    decoder: nn.Module,
    last: torch.Tensor,
    cache: Any,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    group_size: int,
    buckets: list[tuple[torch.Tensor, int]],
) -> torch.Tensor | None:
    """`_completion_hidden` with each bucket's rows run as wide as the bucket: its rows' prompt
    caches are gathered from the one prompt forward (`cache`; `last` (B, H) its final states),
    which autograd differentiates, so every bucket's gradient sums back into that forward.
    None when the decoder did not use the cache."""
    n, width = completion_ids.shape
    prompt_len = prompt_mask.sum(-1)  # (B,)
    layers = [(layer.keys, layer.values) for layer in cache.layers]  # (B, Hkv, P, D) each
    pieces, order = [], []
    for rows, w in buckets:
        group = torch.div(rows, group_size, rounding_mode="floor")  # (R,)
        states = [last[group][:, None]]  # (R, 1, H)
        if w > 1:
            own = _hf.new_cache(decoder)
            for i, (keys, values) in enumerate(layers):
                own.update(keys[group], values[group], i)
            attn = torch.cat([prompt_mask[group], prompt_mask.new_ones(len(rows), w - 1)], dim=1)
            pos = prompt_len[group][:, None] + torch.arange(w - 1, device=rows.device)
            states.append(
                decoder(
                    input_ids=completion_ids[rows, : w - 1],
                    attention_mask=attn,
                    position_ids=pos,
                    **_hf.cache_kwargs(decoder, own),
                ).last_hidden_state
            )  # (R, w − 1, H)
            if own.get_seq_length() != prompt_mask.shape[1] + w - 1:  # the cache was not used
                return None
        pieces.append(F.pad(torch.cat(states, dim=1), (0, 0, 0, width - w)))  # (R, T, H)
        order.append(rows)
    inverse = torch.empty(n, dtype=torch.long, device=completion_ids.device)
    inverse[torch.cat(order)] = torch.arange(n, device=completion_ids.device)
    return torch.cat(pieces)[inverse]  # (N, T, H)


def _full_forward(
    module: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    group_size: int,
    real: torch.Tensor | None = None,
    images: _Images | None = None,
) -> Any:
    """One forward of `module` over the N concatenated prompt + completion[:-1] sequences.

    The caller keeps positions P − 1 … of the output: the states (or logits) that predict the T
    completion tokens. `real` (N, T): the completion tokens that are not padding (default: all),
    for a routes session (`grouprl.rollout.routes`), which names each token by its position.
    `images`: the prompts' images, each prompt's fed with each of its G rows (`module` is then
    `images.base` or the model).
    """
    ids = torch.cat(
        [prompt_ids.repeat_interleave(group_size, dim=0), completion_ids[:, :-1]], dim=1
    )  # (N, P + T − 1)
    attn = torch.cat(
        [
            prompt_mask.repeat_interleave(group_size, dim=0),
            prompt_mask.new_ones(completion_ids.shape[0], completion_ids.shape[1] - 1),
        ],
        dim=1,
    )  # (N, P + T − 1)
    positions = _hf.left_pad_positions(attn)
    extra = {} if images is None else _row_inputs(images, prompt_ids, ids.shape[1], group_size)
    if not routes.active():
        return module(input_ids=ids, attention_mask=attn, position_ids=positions,
                      use_cache=False, **extra)  # fmt: skip
    valid = attn if real is None else torch.cat([attn[:, : prompt_ids.shape[1]], real[:, :-1]], 1)
    with routes.feeding(positions, valid):
        return module(input_ids=ids, attention_mask=attn, position_ids=positions,
                      use_cache=False, **extra)  # fmt: skip


def _row_inputs(
    images: _Images, prompt_ids: torch.Tensor, width: int, group_size: int
) -> dict[str, torch.Tensor]:
    """The images' tensors for the N rows (each prompt's G times), per-token ones (the
    prompt's width) extended with 0 over the completion's `width` − P positions."""
    inputs = images.inputs(prompt_ids, repeat=group_size)
    p = prompt_ids.shape[1]
    return {
        k: F.pad(v, (0, width - p))
        if v.dim() == 2 and v.shape[1] == p and k.endswith("type_ids")
        else v
        for k, v in inputs.items()
    }


def _unshared_hidden(
    decoder: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    group_size: int,
    real: torch.Tensor | None = None,
    images: _Images | None = None,
) -> torch.Tensor:
    """Hidden states (N, T, H) from one forward of the N full sequences (no cache)."""
    module = decoder if images is None else images.base
    out = _full_forward(module, prompt_ids, prompt_mask, completion_ids, group_size, real, images)
    return out.last_hidden_state[:, prompt_ids.shape[1] - 1 :]  # (N, T, H)


def _full_logits(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    group_size: int,
    real: torch.Tensor | None = None,
    images: _Images | None = None,
) -> torch.Tensor:
    """Logits (N, T, V) from the model's own forward: the path for heads we cannot split off."""
    out = _full_forward(model, prompt_ids, prompt_mask, completion_ids, group_size, real, images)
    return out.logits[:, prompt_ids.shape[1] - 1 :]  # (N, T, V)


def _checkpointing(decoder: nn.Module) -> bool:
    """True when transformers would drop the KV cache: a layer with gradient checkpointing on
    is in training mode and gradients are recorded."""
    if not torch.is_grad_enabled():
        return False
    return any(
        getattr(m, "gradient_checkpointing", False) and m.training for m in decoder.modules()
    )


def _vocab_size(model: nn.Module, head: nn.Module) -> int:
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    return int(model.config.get_text_config().vocab_size)
