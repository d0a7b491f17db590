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
import weakref
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

try:  # transformers >= 4.56 splits caches into per-layer objects
    from transformers.cache_utils import DynamicLayer
except ImportError:  # pragma: no cover - older transformers: no in-place fast path
    DynamicLayer = None


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (where inputs must go)."""
    return next(model.parameters()).device


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


def left_pad_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a left-padded batch: 0 at each row's first real token, 0 on padding.

    attention_mask: (R, L) bool or 0/1. Returns (R, L) long. Padding positions are never attended
    to, so their value does not matter; 0 keeps them inside every rotary table.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (R, L)


def new_cache(model: nn.Module) -> DynamicCache:
    """An empty dynamic cache laid out for `model` (sliding-window layers included)."""
    config = getattr(model, "config", None)
    try:
        return DynamicCache(config=config)
    except TypeError:  # pragma: no cover - transformers without the config argument
        return DynamicCache()


class PreallocatedLayer(DynamicLayer if DynamicLayer is not None else object):  # type: ignore[misc]
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
        self._len = length
        self.keys = self._k[:, :, :length]
        self.values = self._v[:, :, :length]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
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


def expand_cache(cache: Any, repeats: int, *, extra: int | None = None) -> None:
    """Repeat every row of a prefilled cache `repeats` times (group-contiguous), in place.

    With `extra` set (decoding without autograd), plain full-attention layers become
    `PreallocatedLayer`s with room for `extra` more positions: the G copies are written straight
    into the new buffer, with no intermediate repeated tensor. Any other layer type (sliding
    window, linear attention, older transformers) uses its own `batch_repeat_interleave`.
    Without `extra` the expansion is `repeat_interleave`, which autograd differentiates, so
    gradients of the G copies sum back into the shared prompt forward.
    """
    layers = getattr(cache, "layers", None)
    if extra is None or layers is None or DynamicLayer is None:
        if repeats > 1:
            cache.batch_repeat_interleave(repeats)
        return
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.numel() > 0:
            capacity = layer.keys.shape[2] + extra
            layers[i] = PreallocatedLayer(layer.keys, layer.values, repeats, capacity)
        elif repeats > 1:
            layer.batch_repeat_interleave(repeats)
