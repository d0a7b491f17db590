"""The log-prob pass's attention over a prompt shared by its group: keys and values kept once.

`completion_logprobs` runs each prompt once and every completion of its group over that
prompt's cache. Through transformers' SDPA path the prompt's keys and values were copied to each
of the G rows, then to each query head (SDPA with a mask repeats the kv heads), and the CPU's
flash kernel zero-filled gradients of that size in backward: on SmolLM2-135M (32 rows of 15
tokens over 4 prompts of 47) the completion attention took about 0.3 s of a 2.6 s forward and
backward for some 70 MFLOP of products.

`PromptPassLayer` keeps the prompt's keys and values once, (B, Hkv, P, D), differentiable, and
this forward's completion keys per row; `attention` computes softmax over [q·K_p, q·K_c] with the
prompt's padding and the completion's causal order masked, reading K_p and V_p per group as the
decode's shared attention does (`grouprl.rollout._hf.shared_prompt_attention`, which dispatches
here). The same function as SDPA over the copied rows: the two differ in the order of sums only.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


class PromptPassLayer(DynamicLayer):
    """A cache layer for one forward of every row's completion over its group's prompt: the
    prompt's keys and values once (B, Hkv, P, D); `update` keeps the forward's own (N, Hkv, w,
    D) and returns them (only `attention` reads them). `bias` (N, 1, 1, P) is 0 on the prompt's
    tokens and the dtype's minimum on its left padding, shared by every layer."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, group_size: int, bias: torch.Tensor
    ) -> None:
        super().__init__()
        self.device = keys.device
        self.group_size = group_size
        self.prompt_keys, self.prompt_values, self.bias = keys, values, bias
        self.keys, self.values = keys[:, :, :0], values[:, :, :0]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if self.keys.shape[2]:
            raise RuntimeError("a prompt-pass cache layer takes one forward")
        self.keys, self.values = key_states, value_states
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.prompt_keys.shape[2] + self.keys.shape[2]


def share_prompts(cache: Any, group_size: int, prompt_mask: torch.Tensor) -> None:
    """Turn every layer of a cache prefilled with B prompts (plain `DynamicLayer`s) into a
    `PromptPassLayer` for their N = B·G group-contiguous completions, in place."""
    layers = cache.layers
    dtype = torch.promote_types(layers[0].keys.dtype, torch.float32)
    bias = torch.zeros(prompt_mask.shape, dtype=dtype, device=prompt_mask.device)
    bias.masked_fill_(~prompt_mask.bool(), torch.finfo(dtype).min)  # (B, P)
    bias = bias.repeat_interleave(group_size, dim=0)[:, None, None, :]  # (N, 1, 1, P)
    for i, layer in enumerate(layers):
        layers[i] = PromptPassLayer(layer.keys, layer.values, group_size, bias)


def attention(
    layer: PromptPassLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """query (N, H, w, D), key/value (N, Hkv, w, D): the completion's; returns (N, w, H, D), the
    attention over the group's prompt (all of it but its padding) and the row's completion up to
    each query (causal), as SDPA gives over the concatenated keys."""
    n, heads, w, dim = query.shape
    kv_heads, b, g = key.shape[1], layer.prompt_keys.shape[0], layer.group_size
    rep, p = heads // kv_heads, layer.prompt_keys.shape[2]
    q = query.reshape(n, kv_heads, rep * w, dim) * scale  # (N, Hkv, rep·w, D): head-major rows
    qg = q.view(b, g, kv_heads, rep * w, dim).transpose(1, 2).reshape(b, kv_heads, -1, dim)
    s_p = torch.matmul(qg, layer.prompt_keys.transpose(-1, -2))  # (B, Hkv, G·rep·w, P)
    s_p = s_p.view(b, kv_heads, g, rep * w, p).transpose(1, 2).reshape(n, kv_heads, rep * w, p)
    s_c = torch.matmul(q, key.transpose(-1, -2))  # (N, Hkv, rep·w, w)
    acc = layer.bias.dtype  # scores in float32 at least, as SDPA's kernels accumulate
    future = torch.ones(w, w, dtype=torch.bool, device=query.device).triu(1)  # (w, w)
    causal = (
        torch.zeros(w, w, dtype=acc, device=query.device)
        .masked_fill_(future, torch.finfo(acc).min)
        .repeat(rep, 1)
    )  # (rep·w, w)
    probs = torch.softmax(torch.cat([s_p.to(acc) + layer.bias, s_c.to(acc) + causal], -1), -1)
    o_c = torch.matmul(probs[..., p:].to(value.dtype), value)  # (N, Hkv, rep·w, D)
    probs_p = probs[..., :p].to(value.dtype).view(b, g, kv_heads, rep * w, p)
    probs_p = probs_p.transpose(1, 2).reshape(b, kv_heads, -1, p)  # (B, Hkv, G·rep·w, P)
    o_p = torch.matmul(probs_p, layer.prompt_values)  # (B, Hkv, G·rep·w, D)
    o_p = o_p.view(b, kv_heads, g, rep * w, dim).transpose(1, 2).reshape(o_c.shape)
    out = (o_p + o_c).view(n, kv_heads, rep, w, dim).permute(0, 3, 1, 2, 4)  # (N, w, Hkv, rep, D)
    return out.reshape(n, w, heads, dim)
