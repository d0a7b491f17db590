"""A Llama decoder's decode step on a CPU in fewer operations, activations kept as (features, rows).

A CPU decode step of 32 rows through transformers' eager Llama forward is mostly not arithmetic:
about a hundred small operations a layer (each RMSNorm eight, each rotary embedding seven, every
linear layer a module call, a LoRA layer's adapters more), and with `grouprl.rollout.narrow`'s
W·xᵀ products a transposing copy after each. Measured on SmolLM2-135M + LoRA r 8 (32 rows, 16 new
tokens, 2 threads of a Xeon with AVX-512), the step's weight products were about half its time.

`LlamaStep` computes the same function as the model's forward for one new token a row, over the
same cache: the hidden states live transposed, (hidden, rows), so every product is W·yᵀ with no
copy after it (the fast shape of `grouprl.rollout.narrow`), q, k and v are one product and gate
and up another (`grouprl.rollout.fused`), the norms reduce over features along dimension 0, q and
k are rotated together, and a peft LoRA layer's adapters are added into its base product in place
(base + scaling · B·(A·yᵀ), the sum peft computes). Only the head's logits are transposed back,
block by block as they are computed (`HEAD_ROWS`). The attention is the cache's own: the
shared-prompt attention of `grouprl.rollout._hf` over a `SharedPromptLayer`, else SDPA over the
row's keys with its padding masked.

It takes a step only where the sampler would: float32 on a CPU without gradients or
autocast, rows in the narrow band, a Llama of the plain shape (no biases, SiLU, its own rotary
module), plain linear layers or plain LoRA adapters over them, no hooks; anything else is the
model's forward.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from grouprl.rollout import _hf
from grouprl.rollout.fused import Fused
from grouprl.rollout.narrow import MAX_ROWS, MIN_FEATURES, MIN_ROWS, is_lora_linear, plain_adapters

# vocabulary rows of the head per product: the 49k-row (49152, 576) product against 32 rows took
# 29 ms in one call and 21.5-22.6 ms in blocks of 512-2048 rows (torch 2.13, 2 cores of an AMD
# EPYC, Zen 3)
HEAD_ROWS = 1024

_FUSED: weakref.WeakKeyDictionary[nn.Module, list[tuple[Fused, Fused]]] = (
    weakref.WeakKeyDictionary()
)
_FUSED_LOCK = threading.Lock()


class LlamaStep:
    """The decode step of `base` (a `LlamaForCausalLM`, the one inside a peft model), built by
    `llama_step`; `step(tokens, positions, mask, cache)` returns the (R, V) logits."""

    def __init__(self, base: nn.Module) -> None:
        self.decoder, self.head = base.model, base.lm_head
        config = base.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.fused = _fused_layers(base)  # per layer: (q, k, v) and (gate, up) as one product

    def takes(self, rows: int, device: torch.device) -> bool:
        """Whether a step of `rows` rows goes this way (else the model's forward): not under
        autocast, whose lower-precision forward is the model's to compute."""
        return (
            MIN_ROWS <= rows <= MAX_ROWS
            and device.type == "cpu"
            and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled(device.type)
        )

    def _linears(self) -> list[nn.Module]:
        out = []
        for layer in self.decoder.layers:
            a, m = layer.self_attn, layer.mlp
            out += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        return out

    def step(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """tokens (R,), positions (R, 1), mask (R, L) bool: the columns each row attends to once
        this step's key is written (L = the cache's length after it). Returns (R, V) float32
        logits (float64 for a float64 model), as `_hf.forward_last` does."""
        rows = tokens.shape[0]
        x = F.embedding(tokens, self.decoder.embed_tokens.weight).T.contiguous()  # (D, R)
        cos, sin = self.decoder.rotary_emb(x, positions)  # (R, 1, Dh) each
        cos = cos.view(rows, self.head_dim).T.contiguous()  # (Dh, R)
        sin = sin.view(rows, self.head_dim).T.contiguous()
        seen = mask[:, None, None, :]  # (R, 1, 1, L) for SDPA over per-row keys
        for i, layer in enumerate(self.decoder.layers):
            x = self._layer(layer, cache.layers[i], x, cos, sin, seen)
        y = _rms_norm(self.decoder.norm, x)
        logits = _head_logits(self.head, y)  # (R, V)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def _layer(
        self,
        layer: nn.Module,
        cache_layer: Any,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seen: torch.Tensor,
    ) -> torch.Tensor:
        """One decoder layer on x (D, R); returns the next (D, R)."""
        attn, mlp = layer.self_attn, layer.mlp
        h, kv, dh, rows = self.heads, self.kv_heads, self.head_dim, x.shape[1]
        qkv_proj, gate_up_proj = self.fused[attn.layer_idx]
        y = _rms_norm(layer.input_layernorm, x)
        qkv = qkv_proj.product(y)  # ((H+2·Hkv)·Dh, R)
        qk = _rotate(qkv[: (h + kv) * dh].view(h + kv, dh, rows), cos, sin).permute(2, 0, 1)
        v = qkv[(h + kv) * dh :].view(kv, dh, rows).permute(2, 0, 1)  # (R, Hkv, Dh)
        keys, values = cache_layer.update(qk[:, h:, None], v[:, :, None], attn.layer_idx)
        q = qk[:, :h, None]  # (R, H, 1, Dh)
        if isinstance(cache_layer, _hf.SharedPromptLayer) and not cache_layer.per_row:
            o = _hf.decode_attention(cache_layer, q, keys, values, attn.scaling)
        else:
            o = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=seen, scale=attn.scaling, enable_gqa=True
            ).transpose(1, 2)  # (R, 1, H, Dh)
        x = x + _product(attn.o_proj, o.reshape(rows, h * dh).T)
        y = _rms_norm(layer.post_attention_layernorm, x)
        gate, up = gate_up_proj.product(y).split(gate_up_proj.sizes)
        y = F.silu(gate) * up
        return x + _product(mlp.down_proj, y)


def llama_step(model: nn.Module) -> LlamaStep | None:
    """A `LlamaStep` for `model` where its shape allows one (module docstring), else None."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    try:
        from transformers.models.llama import modeling_llama as llama
    except ImportError:  # pragma: no cover - transformers always has Llama
        return None
    config = getattr(base, "config", None)
    if type(base) is not llama.LlamaForCausalLM or getattr(config, "model_type", None) != "llama":
        return None
    if config.hidden_act != "silu" or config.attention_bias or config.mlp_bias:
        return None
    if getattr(config, "pretraining_tp", 1) != 1:
        return None
    decoder = base.model
    if any("forward" in vars(m) for m in (model, base, decoder)):  # someone's own forward
        return None
    if type(decoder) is not llama.LlamaModel or type(decoder.embed_tokens) is not nn.Embedding:
        return None
    for layer in decoder.layers:
        if (
            type(layer) is not llama.LlamaDecoderLayer
            or type(layer.self_attn) is not llama.LlamaAttention
            or type(layer.mlp) is not llama.LlamaMLP
        ):
            return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in base.modules()):
        return None
    head = base.lm_head
    if type(head) is not nn.Linear or type(head.weight) is not nn.Parameter:
        return None
    step = LlamaStep(base)
    return step if all(_plain(layer) for layer in step._linears()) else None


def _plain(module: nn.Module) -> bool:
    """A plain float32 nn.Linear of at least MIN_FEATURES both ways (no bias), or a peft LoRA
    layer over one whose adapters are plain products now (`narrow.plain_adapters`)."""
    if is_lora_linear(module):
        return _plain(module.base_layer) and plain_adapters(module, torch.float32)
    return (
        type(module) is nn.Linear
        and type(module.weight) is nn.Parameter
        and module.weight.dtype == torch.float32
        and module.bias is None
        and min(module.weight.shape) >= MIN_FEATURES
    )


def _product(layer: nn.Module, y_t: torch.Tensor) -> torch.Tensor:
    """`layer`'s output transposed, (out, R), from its input transposed y_t (in, R): W·yᵀ, plus
    scaling · B·(A·yᵀ) for each active LoRA adapter, added into it (as peft adds them)."""
    if not is_lora_linear(layer):
        out = torch.mm(layer.weight, y_t)
        return out if layer.bias is None else out.add_(layer.bias[:, None])
    out = torch.mm(layer.base_layer.weight, y_t)
    for name in layer.active_adapters:
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
        out.addmm_(b, torch.mm(a, y_t), alpha=layer.scaling[name])
    return out


def _fused_layers(base: nn.Module) -> list[tuple[Fused, Fused]]:
    """Each layer's (q, k, v) and (gate, up) as `Fused` products, kept with `base` from one
    sampling call to the next (their stacked weights are rebuilt only when one changes)."""
    layers = base.model.layers
    members = [(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                layer.mlp.gate_proj, layer.mlp.up_proj) for layer in layers]  # fmt: skip
    with _FUSED_LOCK:
        kept = _FUSED.get(base)
        if (
            kept is None
            or len(kept) != len(members)
            or any(
                [*qkv.layers, *gate_up.layers] != list(m)
                for (qkv, gate_up), m in zip(kept, members)
            )
        ):
            kept = [(Fused(list(m[:3])), Fused(list(m[3:]))) for m in members]
            _FUSED[base] = kept
        return kept


def _head_logits(head: nn.Linear, y_t: torch.Tensor) -> torch.Tensor:
    """The head's logits (R, V) from y_t (D, R), HEAD_ROWS vocabulary rows of W·yᵀ at a time,
    each block transposed into the output while it is in cache."""
    weight, rows = head.weight, y_t.shape[1]
    out = torch.empty(rows, weight.shape[0], dtype=torch.promote_types(weight.dtype, y_t.dtype))
    for i in range(0, weight.shape[0], HEAD_ROWS):
        out[:, i : i + HEAD_ROWS] = torch.mm(weight[i : i + HEAD_ROWS], y_t).T
    return out if head.bias is None else out.add_(head.bias)


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' Llama RMSNorm over the features of x (D, R), in x's dtype (float32 here, as
    the module computes)."""
    variance = x.pow(2).mean(0, keepdim=True)  # (1, R)
    return norm.weight[:, None] * (x * torch.rsqrt(variance + norm.variance_epsilon))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (heads, Dh, R) with cos, sin (Dh, R): x·cos + rotate_half(x)·sin."""
    half = x.shape[1] // 2
    return x * cos + torch.cat((-x[:, half:], x[:, :half]), dim=1) * sin
