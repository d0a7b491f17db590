"""Small adapters over the Hugging Face model and cache APIs, shared by sampling and log-probs.

Everything version- or architecture-specific lives here, so `sampling.py` and `logprobs.py` read
as plain algorithms:

- the name of the cache keyword (`cache` since transformers 5.x, `past_key_values` before);
- whether a model's forward takes `logits_to_keep`;
- left-padded prompt positions (the same formula in both code paths, so sampled log-probs and
  teacher-forced log-probs see identical positions);
- expanding a prefilled B-row KV cache to B·G rows, group-contiguous;
- a pre-allocated cache layer that decoding writes into in place instead of `torch.cat`-ing a
  new copy of the whole cache every step.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grouprl.rollout import prompt_pass


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (where inputs must go)."""
    return next(model.parameters()).device


def sees_images(model: nn.Module) -> bool:
    """Whether the model is a vision-language model (its config has a vision tower's)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def images_base(model: nn.Module) -> nn.Module:
    """A vision-language model's base: the module whose forward takes the prompt's ids with
    its images' tensors and returns the decoder's hidden states (`LlavaModel`, ...), with
    its cache; what `get_decoder()` is for a text model. Looks through a peft wrapper."""
    unwrapped = (
        model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    )
    return getattr(unwrapped, unwrapped.base_model_prefix)


def _forward_params(module: nn.Module) -> set[str]:
    """Names of `module.forward`'s parameters, looking through wrappers whose forward takes only
    `*args, **kwargs` (`peft.PeftModel`, a patched forward) to the model or decoder inside."""
    names = set(inspect.signature(module.forward).parameters)
    base = getattr(module, "get_base_model", None)
    if callable(base) and base() is not module:  # a peft wrapper passes **kwargs through
        names |= _forward_params(base())
    get_decoder = getattr(module, "get_decoder", None)
    if "input_ids" not in names and callable(get_decoder):
        names |= set(inspect.signature(get_decoder().forward).parameters)
    return names


_PARAM_CACHE: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def forward_params(module: nn.Module) -> set[str]:
    """`_forward_params`, memoised per module (inspecting signatures every decode step is slow)."""
    names = _PARAM_CACHE.get(module)
    if names is None:
        names = _PARAM_CACHE[module] = _forward_params(module)
    return names


def cache_kwargs(module: nn.Module, cache: Any) -> dict[str, Any]:
    """Keyword arguments that hand `cache` to `module.forward` under this transformers version."""
    key = "cache" if "cache" in forward_params(module) else "past_key_values"
    return {key: cache, "use_cache": True}


def forward_last(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any,
    inputs: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run the model on new tokens with the cache; (R, V) logits of the last position, in float32
    (float64 for a float64 model). `inputs`: the prompts' other inputs (images' tensors)."""
    extra = {"logits_to_keep": 1} if "logits_to_keep" in forward_params(model) else {}
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **cache_kwargs(model, cache),
        **extra,
        **(inputs or {}),
    )
    logits = out.logits[:, -1]
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def left_pad_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a left-padded batch: 0 at each row's first real token, 0 on padding.

    attention_mask: (R, L) bool or 0/1. Returns (R, L) long. Padding positions are never attended
    to, so their value does not matter; 0 keeps them inside every rotary table.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (R, L)


def new_cache(model: nn.Module) -> DynamicCache:
    """An empty dynamic cache laid out for `model` (sliding-window layers included)."""
    return DynamicCache(config=getattr(model, "config", None))


def plain_layers(cache: Any) -> bool:
    """Whether every layer of `cache` is a plain full-attention `DynamicLayer` (its keys and
    values all the positions it was given)."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer with room for `capacity` positions, written in place.

    `DynamicLayer.update` concatenates, copying the whole cache every step (O(L) per step,
    O(L²) per sequence); on a 1M-parameter model that copy was 24% of a decode step. This layer
    allocates (R, H, capacity, D) once and returns views of the filled prefix, so attention sees
    exactly the same keys and values as with a dynamic cache.
    """

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, repeats: int, capacity: int
    ) -> None:
        super().__init__()
        rows, heads, length, _ = keys.shape
        self.device = keys.device
        self._k = keys.new_empty(rows * repeats, heads, capacity, keys.shape[-1])  # (N, H, C, Dk)
        self._v = values.new_empty(rows * repeats, values.shape[1], capacity, values.shape[-1])
        # Broadcast each prompt row into its G group rows: no intermediate repeated tensor.
        self._k.view(rows, repeats, *self._k.shape[1:])[:, :, :, :length] = keys[:, None]
        self._v.view(rows, repeats, *self._v.shape[1:])[:, :, :, :length] = values[:, None]
        self._len = self._prompt_len = length
        self.keys = self._k[:, :, :length]
        self.values = self._v[:, :, :length]
        self.is_initialized = True
        self.feed: ChunkFeed | None = None  # set while rows write at their own columns

    def update(self, key_states, value_states, *args, **kwargs):
        if self.feed is not None:
            return self.feed.write(self, key_states, value_states, self._prompt_len)
        end = self._len + key_states.shape[-2]
        if end > self._k.shape[2]:
            raise RuntimeError(f"cache capacity {self._k.shape[2]} exceeded ({end} positions)")
        self._k[:, :, self._len : end] = key_states
        self._v[:, :, self._len : end] = value_states
        self._len = end
        self.keys = self._k[:, :, :end]
        self.values = self._v[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k = self._k[indices]
        self._v = self._v[indices]
        self.keys = self._k[:, :, : self._len]
        self.values = self._v[:, :, : self._len]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._k = self._k.repeat_interleave(repeats, dim=0)
        self._v = self._v.repeat_interleave(repeats, dim=0)
        self.keys = self._k[:, :, : self._len]
        self.values = self._v[:, :, : self._len]


def expand_cache(
    cache: Any, repeats: int, *, extra: int | None = None, prompt_mask: torch.Tensor | None = None
) -> None:
    """Repeat every row of a prefilled cache `repeats` times (group-contiguous), in place.

    With `extra` set (decoding without autograd), plain full-attention layers become
    `PreallocatedLayer`s with room for `extra` more positions: the G copies are written straight
    into the new buffer, with no intermediate repeated tensor. Any other layer type (sliding
    window, linear attention, older transformers) uses its own `batch_repeat_interleave`.
    Without `extra` the expansion is `repeat_interleave`, which autograd differentiates, so
    gradients of the G copies sum back into the shared prompt forward. With `prompt_mask`
    (B, P) also given, they become `SharedPromptLayer`s instead, which keep one copy of each
    prompt (see `SharedPromptDecoding`).
    """
    layers = getattr(cache, "layers", None)
    if extra is None or layers is None:
        if repeats > 1:
            cache.batch_repeat_interleave(repeats)
        return
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel() > 0:
            capacity = layer.keys.shape[2] + extra
            if prompt_mask is not None:
                layers[i] = SharedPromptLayer(
                    layer.keys, layer.values, repeats, capacity, prompt_mask
                )
            else:
                layers[i] = PreallocatedLayer(layer.keys, layer.values, repeats, capacity)
        elif repeats > 1:
            layer.batch_repeat_interleave(repeats)


# ---------------------------------------------------------------------------------------------
# Rows that write at their own columns (observations fed as chunks)

#: Attention implementations that take the 4D mask `ChunkFeed` needs (flash attention does not).
_CHUNK_ATTENTION = {"sdpa": torch.bool, "eager": None}


class ChunkFeed:
    """One forward's cache writes when rows are at different lengths: the cache's columns past
    the prompt are completion positions, and each row writes its new tokens at its own.

    While entered, every `PreallocatedLayer` / `SharedPromptLayer` of the cache writes input
    column `sources[i]` of input row `rows[i]` to completion column `columns[i]` (only the real
    tokens of a padded chunk, so the columns are distinct) and returns keys spanning `width`
    completion columns, of every cache row, or with `batch` (R,) set of those cache rows only
    (the input's rows are then `batch`'s, and the keys hold each one's prompt); the caller's 4D
    attention mask says which columns each query sees.
    """

    def __init__(self, cache: Any) -> None:
        self.layers = list(cache.layers)
        for layer in self.layers:  # a shorter row's columns up to `width` are read before it
            layer._k[:, :, layer._len :].zero_()  # writes them: masked out, they must still be
            layer._v[:, :, layer._len :].zero_()  # finite (a weight of 0 times NaN is NaN)
        self.set(*(torch.empty(0, dtype=torch.long),) * 3, None, 0)
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (mask, its additive form)

    def set(self, rows: torch.Tensor, sources: torch.Tensor, columns: torch.Tensor,
            batch: torch.Tensor | None, width: int, single: bool = False) -> None:  # fmt: skip
        """The next forward's writes (see the class) and key width; `single`: one token for
        every cache row (rows 0 … R−1, sources all 0)."""
        self.rows, self.sources, self.columns = rows, sources, columns
        self.batch, self.width, self.single = batch, width, single
        self.cache_rows = rows if batch is None else batch[rows]  # (m,)

    def __enter__(self) -> ChunkFeed:
        for layer in self.layers:
            layer.feed = self
        return self

    def __exit__(self, *exc: Any) -> None:
        for layer in self.layers:
            layer.feed = None

    def write(self, layer: Any, key_states: torch.Tensor, value_states: torch.Tensor,
              base: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Write one layer's new keys/values (R, H, w, D) at the rows' columns (offset by the
        `base` columns the layer keeps before completion column 0); returns its keys/values."""
        at, rows = base + self.columns, self.cache_rows  # (m,)
        if self.single:  # one token per row (the decode step): no gather of the input
            layer._k[rows, :, at] = key_states[:, :, 0]  # (R, H, D)
            layer._v[rows, :, at] = value_states[:, :, 0]
        else:
            layer._k[rows, :, at] = key_states[self.rows, :, self.sources]  # (m, H, D)
            layer._v[rows, :, at] = value_states[self.rows, :, self.sources]
        end = base + self.width
        layer._len = max(layer._len, end)
        if self.batch is None:
            layer.keys, layer.values = layer._k[:, :, :end], layer._v[:, :, :end]
            return layer.keys, layer.values
        keys, values = layer._k[self.batch, :, :end], layer._v[self.batch, :, :end]
        if isinstance(layer, SharedPromptLayer) and not layer.per_row:
            group = torch.div(self.batch, layer.group_size, rounding_mode="floor")  # (R,)
            keys = torch.cat([layer.prompt_keys[group], keys], dim=2)
            values = torch.cat([layer.prompt_values[group], values], dim=2)
        return keys, values


def feeds_chunks(model: nn.Module, cache: Any) -> bool:
    """Whether decoding `model` with `cache` (expanded) can feed rows chunks of different
    lengths: every layer written in place, and an attention implementation that takes a 4D mask
    (sliding-window layers, flash attention and custom caches feed one token per step)."""
    layers = getattr(cache, "layers", None)
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return (
        bool(layers)
        and all(type(x) in (PreallocatedLayer, SharedPromptLayer) for x in layers)
        and impl in _CHUNK_ATTENTION
    )


def chunk_mask(model: nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """The 4D mask (R, 1, w, K) of `allowed` (R, w, K) bool in the form the model's attention
    takes: bool for SDPA (and the shared-prompt attention), additive for eager attention."""
    impl = model.config._attn_implementation
    mask = allowed[:, None]
    if _CHUNK_ATTENTION.get(impl, torch.bool) is torch.bool:
        return mask
    dtype = next(model.parameters()).dtype
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, torch.finfo(dtype).min
    )


# ---------------------------------------------------------------------------------------------
# Decode attention over a prompt shared by its group

#: The attention implementation name the decode loop switches plain full-attention models to.
SHARED_PROMPT_ATTENTION = "grouprl_shared_prompt"
#: Model types whose attention is plain scaled dot-product attention over one full cache per
#: layer (no sliding window, logit soft-capping, attention sinks or ALiBi), so that the shared
#: form below computes exactly what their SDPA path does.
_PLAIN_ATTENTION_MODELS = {"llama", "qwen2", "qwen3", "mistral"}
#: The decode loop's cache layers, by layer_idx, while it runs: per thread (an asynchronous
#: run's sampler thread decodes while the trainer's thread evaluates).
_active = threading.local()


class SharedPromptLayer(DynamicLayer):
    """A cache layer that keeps each prompt's keys and values once for its G rows.

    Decoding G completions of B prompts, a per-row cache holds G copies of every prompt and each
    decode step's attention reads all of them: at 150-token prompts, 128 new tokens and G = 8,
    reading those copies made attention 42% of generation. Here the prompt part is (B, H, P, D)
    and only the completion part is per row, (N, H, C, D) pre-allocated and written in place;
    `shared_prompt_attention` attends to both and merges the two softmax parts. `update` returns
    the completion part, which only that function reads.

    When finished rows are dropped (`batch_select_indices`), the rows stop being whole groups:
    the layer then writes out per-row copies once and works as a plain in-place layer, and the
    attention falls back to SDPA over them.
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        repeats: int,
        capacity: int,
        prompt_mask: torch.Tensor,
    ) -> None:
        super().__init__()
        rows, heads, length, dim = keys.shape
        self.device = keys.device
        self.group_size = repeats
        self.prompt_keys, self.prompt_values = keys, values  # (B, Hkv, P, D)
        # additive mask over the prompt positions: left padding is never attended to
        self.prompt_bias = torch.zeros(prompt_mask.shape, device=keys.device)  # fp32 scores
        self.prompt_bias.masked_fill_(~prompt_mask.bool(), torch.finfo(torch.float32).min)
        n = rows * repeats
        self._k = keys.new_empty(n, heads, capacity - length, dim)  # (N, Hkv, C, D)
        self._v = values.new_empty(n, values.shape[1], capacity - length, values.shape[-1])
        self._prompt_len, self._len = length, 0
        self.per_row = False  # True once compaction wrote out per-row copies
        self.keys, self.values = self._k[:, :, :0], self._v[:, :, :0]
        self.is_initialized = True
        self.feed: ChunkFeed | None = None  # set while rows write at their own columns

    def update(self, key_states, value_states, *args, **kwargs):
        if self.feed is not None:
            base = self._prompt_len if self.per_row else 0
            return self.feed.write(self, key_states, value_states, base)
        end = self._len + key_states.shape[-2]
        if end > self._k.shape[2]:
            raise RuntimeError(f"cache capacity exceeded ({self._prompt_len + end} positions)")
        self._k[:, :, self._len : end] = key_states
        self._v[:, :, self._len : end] = value_states
        self._len = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len if self.per_row else self._prompt_len + self._len

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.per_row:  # write out each kept row's prompt copy before its completion
            group = torch.div(indices, self.group_size, rounding_mode="floor")  # (R,)
            self._k = torch.cat([self.prompt_keys[group], self._k[indices]], dim=2)
            self._v = torch.cat([self.prompt_values[group], self._v[indices]], dim=2)
            self._len += self._prompt_len
            self.per_row = True
        else:
            self._k, self._v = self._k[indices], self._v[indices]
        self.keys, self.values = self._k[:, :, : self._len], self._v[:, :, : self._len]


def shared_prompt_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of one decode step against a `SharedPromptLayer` (else plain SDPA).

    query (N, H, 1, D), key/value (N, Hkv, t, D): the completion part. With s_p = q·K_p the
    scores against the row's prompt (shared by its group) and s_c = q·K_c against its own
    completion tokens, softmax over [s_p, s_c] is exp(s - m) / (Σ exp(s_p - m) + Σ exp(s_c - m))
    with m the largest score, so out = (e_p·V_p + e_c·V_c) / z: the prompt product runs once per
    group as one (G·rep, D) x (D, P) matmul per prompt and head. Returns (N, 1, H, D).

    While a `ChunkFeed` writes (rows at their own lengths; `chunks.decode` switches every SDPA
    model to this function), `attention_mask` (N, 1, w, P + t) bool says which columns each
    query sees: a decode step of all rows over shared prompts adds it to s_c; any other forward
    (per-row caches, an observation forward over some rows' keys with their prompts) is SDPA
    with that mask and the kv heads shared in place (HF's SDPA path copies them per query head
    whenever there is a mask).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layers = getattr(_active, "layers", ())
    layer = layers[module.layer_idx] if module.layer_idx < len(layers) else None
    if isinstance(layer, prompt_pass.PromptPassLayer):  # the log-prob pass's completions
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return prompt_pass.attention(layer, query, key, value, scale), None
    feed = getattr(layer, "feed", None)
    shared = isinstance(layer, SharedPromptLayer) and not layer.per_row and query.shape[2] == 1
    if feed is not None and not (shared and feed.batch is None):
        # rows at their own lengths (`ChunkFeed`), keys of every row or of some rows with their
        # prompts: the caller's 4D bool mask, the kv heads shared without copies
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )  # (N, H, w, D)
        return out.transpose(1, 2).contiguous(), None
    if not shared:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    acc = torch.promote_types(query.dtype, torch.float32)
    bias = None
    if feed is not None:  # rows at their own lengths: each row sees its own columns only
        if feed.bias is None or feed.bias[0] is not attention_mask:  # once per forward
            seen = attention_mask[:, :, :, -key.shape[2] :]  # (N, 1, 1, t) bool
            bias = torch.zeros(seen.shape, dtype=acc, device=seen.device)
            feed.bias = (attention_mask, bias.masked_fill_(~seen, torch.finfo(acc).min))
        bias = feed.bias[1]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return decode_attention(layer, query, key, value, scale, bias), None


def decode_attention(
    layer: SharedPromptLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step's attention over `layer`'s shared prompt and each row's completion
    (`shared_prompt_attention`'s sum); `bias` (N, 1, 1, t): added to the completion's scores.
    Returns (N, 1, H, D)."""
    n, heads, _, dim = query.shape
    kv_heads, b, g = key.shape[1], layer.prompt_keys.shape[0], layer.group_size
    rep = heads // kv_heads
    q = query.reshape(n, kv_heads, rep, dim) * scale  # (N, Hkv, rep, D)
    qg = q.view(b, g, kv_heads, rep, dim).transpose(1, 2).reshape(b, kv_heads, g * rep, dim)
    # scores and softmax in fp32 whatever the cache dtype (as SDPA's kernels accumulate; a
    # float64 model stays float64)
    acc = torch.promote_types(query.dtype, torch.float32)
    s_p = torch.matmul(qg, layer.prompt_keys.transpose(-1, -2)).to(acc)  # (B, Hkv, G·rep, P)
    s_p = s_p + layer.prompt_bias[:, None, None, :]
    s_c = torch.matmul(q, key.transpose(-1, -2)).to(acc)  # (N, Hkv, rep, t)
    if bias is not None:
        s_c = s_c + bias
    p_width = s_p.shape[-1]
    s_p_rows = s_p.view(b, kv_heads, g, rep, p_width).transpose(1, 2)  # (B, G, Hkv, rep, P)
    m = torch.maximum(s_p_rows.amax(-1).reshape(n, kv_heads, rep), s_c.amax(-1)).unsqueeze(
        -1
    )  # (N, Hkv, rep, 1)
    m_g = m.view(b, g, kv_heads, rep, 1).transpose(1, 2).reshape(b, kv_heads, g * rep, 1)
    e_p = (s_p - m_g).exp_()  # (B, Hkv, G·rep, P)
    e_c = (s_c - m).exp_()  # (N, Hkv, rep, t)
    z = e_p.sum(-1, keepdim=True).view(b, kv_heads, g, rep, 1).transpose(1, 2).reshape(
        n, kv_heads, rep, 1
    ) + e_c.sum(-1, keepdim=True)  # (N, Hkv, rep, 1)
    o_p = torch.matmul(e_p.to(value.dtype), layer.prompt_values)  # (B, Hkv, G·rep, D)
    o_p = o_p.view(b, kv_heads, g, rep, dim).transpose(1, 2).reshape(n, kv_heads, rep, dim)
    out = (o_p.to(acc) + torch.matmul(e_c.to(value.dtype), value).to(acc)) / z  # (N, Hkv, rep, D)
    return out.to(query.dtype).reshape(n, 1, heads, dim)


def shares_prompt_attention(model: nn.Module) -> bool:
    """Whether decoding `model` can use `shared_prompt_attention`: a plain full-attention
    architecture on its SDPA or eager path."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    if getattr(config, "model_type", None) not in _PLAIN_ATTENTION_MODELS:
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    return getattr(config, "_attn_implementation", None) in ("sdpa", "eager")


class SharedPromptDecoding:
    """While decoding: the model attends through `shared_prompt_attention` over `cache`'s
    `SharedPromptLayer`s (restored on exit, also on error)."""

    def __init__(self, model: nn.Module, cache: Any) -> None:
        self.config = model.config
        self.layers = list(getattr(cache, "layers", []))

    def __enter__(self) -> SharedPromptDecoding:
        _register()
        self.previous = self.config._attn_implementation
        _active.layers = self.layers
        self.config._attn_implementation = SHARED_PROMPT_ATTENTION
        return self

    def __exit__(self, *exc: Any) -> None:
        self.config._attn_implementation = self.previous
        _active.layers = ()


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SHARED_PROMPT_ATTENTION, shared_prompt_attention)
    AttentionMaskInterface.register(SHARED_PROMPT_ATTENTION, sdpa_mask)


_PLAIN_HEAD: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def plain_head(model: nn.Module) -> bool:
    """Whether model(x).logits == output_embeddings(decoder(x)), checked once per model.

    A two-token probe in eval mode without gradients; models with extra logit processing
    (soft-capping, logit scaling) or without the accessors answer False.
    """
    known = _PLAIN_HEAD.get(model)
    if known is not None:
        return known
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
        plain = decoder is not None and head is not None and decoder is not model
        if plain:
            # every module's own mode, not just the model's: `model.train(mode)` would also
            # reset layers switched on for gradient checkpointing alone
            modes = [(m, m.training) for m in model.modules()]
            model.eval()
            try:
                with torch.no_grad():
                    ids = torch.ones((1, 2), dtype=torch.long, device=model_device(model))
                    logits = model(input_ids=ids).logits.float()
                    mine = head(decoder(input_ids=ids).last_hidden_state).float()
                plain = mine.shape == logits.shape and torch.allclose(
                    mine, logits, rtol=1e-4, atol=1e-4
                )
            finally:
                for module, mode in modes:
                    module.training = mode
    except (AttributeError, NotImplementedError, TypeError):
        plain = False
    _PLAIN_HEAD[model] = plain
    return plain
