"""Linear layers fed few rows, as a CPU decode step feeds them: W·xᵀ instead of x·Wᵀ.

A decode step feeds every linear layer one row per sequence. On CPUs the float32 product
x·Wᵀ of 8 to 48 rows against a weight of hundreds of columns runs at a fraction of the
machine's rate: measured with torch 2.13 (MKL 2024.2) on 2 threads of a Xeon with AVX-512,
32 rows against SmolLM2-135M's weights took 2.0-2.6 times as long as W·xᵀ, the same sums
with the weight as the left operand (the 49k-token head 31 ms against 14 ms), while below 8
rows and from 56 on x·Wᵀ is as fast or faster. `narrow_linears` makes the decode loop's linear
layers take W·xᵀ in that band, and a peft LoRA layer's base and adapter products one call
(peft's own forward is about 70 µs of Python a call: a quarter of a SmolLM2 decode step's
time went to its 210 adapted layers). Every other forward (the trainer's, other threads') is
untouched.

The products are the same sums: measured bit-equal to x·Wᵀ (the result is made contiguous as
x·Wᵀ's is, so later ops add up in the same order too), and the adapters' term is added as peft
adds it (base + (B·A·x)·scaling).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# rows per product where W·xᵀ was measured faster (module docstring); both weight dimensions at
# least MIN_FEATURES (a LoRA adapter's rank-wide matrices alone were slower that way)
MIN_ROWS, MAX_ROWS, MIN_FEATURES = 8, 48, 64

_local = threading.local()  # `active`: this thread is inside a narrow_linears block
_lock = threading.Lock()
_users: dict[int, int] = {}  # id(layer) -> open narrow_linears blocks over it


def _narrow(x: torch.Tensor) -> torch.Tensor | None:
    """xᵀ (features, rows) when this thread decodes and x (..., features) has MIN_ROWS to
    MAX_ROWS rows of float32 on a CPU without gradients; else None."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (
        not getattr(_local, "active", False)
        or not MIN_ROWS <= rows <= MAX_ROWS
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or torch.is_grad_enabled()
    ):
        return None
    return x.reshape(rows, x.shape[-1]).T


def _product(linear: nn.Linear, x_t: torch.Tensor) -> torch.Tensor:
    """W·xᵀ (+ bias) (out, rows)."""
    if linear.bias is None:
        return torch.mm(linear.weight, x_t)
    return torch.addmm(linear.bias[:, None], linear.weight, x_t)


def _rows(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(out, rows) → (..., out), contiguous as x·Wᵀ's result is."""
    return out.T.contiguous().view(*x.shape[:-1], out.shape[0])


def linear_forward(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`: W·xᵀ in the narrow band (`_narrow`), else nn.Linear's forward."""
    x_t = _narrow(x)
    if x_t is None:
        return nn.Linear.forward(layer, x)
    return _rows(_product(layer, x_t), x)


def lora_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A peft LoRA linear layer's `layer(x)`: base + (B·A·x)·scaling of its active adapters in
    the narrow band, without dropout (eval mode) or variants (DoRA); else peft's forward (or,
    inside `folded_adapters`, `_folded`)."""
    x_t = _narrow(x)
    if x_t is None and _folding(x) and plain_adapters(layer, x.dtype):
        return _folded(layer, x)
    if x_t is None or not plain_adapters(layer, x.dtype):
        return type(layer).forward(layer, x)
    out = _product(layer.base_layer, x_t)
    for name in layer.active_adapters:
        a, b = layer.lora_A[name], layer.lora_B[name]
        out = out + _product(b, _product(a, x_t)) * layer.scaling[name]
    return _rows(out, x)


def _folding(x: torch.Tensor) -> bool:
    """Whether this thread folds LoRA adapters (`folded_adapters`, or a decode block's forwards
    outside the band: its prefill) for x, not under autocast (peft's forward casts)."""
    inside = getattr(_local, "fold", False) or getattr(_local, "active", False)
    return inside and not torch.is_autocast_enabled(x.device.type)


def _folded(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """base(x) + scaling·(A·x)·Bᵀ for each active adapter, the sum and the scaling inside one
    `addmm` (differentiable) instead of peft's product, multiplication and addition: two
    elementwise passes over (rows, out) fewer in the forward and in the backward."""
    out = layer.base_layer(x)
    flat = out.reshape(-1, out.shape[-1])
    for name in layer.active_adapters:
        a = F.linear(x, layer.lora_A[name].weight).reshape(flat.shape[0], -1)  # (rows, r)
        flat = torch.addmm(flat, a, layer.lora_B[name].weight.T, alpha=layer.scaling[name])
    return flat.view(out.shape)


def plain_adapters(layer: nn.Module, dtype: torch.dtype) -> bool:
    """Whether `layer`'s active adapters are plain LoRA products now: enabled, not merged, no
    dropout acting (eval mode or none), no variant (DoRA), weights of the input's dtype."""
    if layer.disable_adapters or layer.merged:
        return False
    variants = getattr(layer, "lora_variant", ())
    for name in layer.active_adapters:
        if name not in layer.lora_A or name in variants:
            return False
        dropout = layer.lora_dropout[name]  # its own mode: `adapter_dropout` turns it on alone
        if dropout.training and not isinstance(dropout, nn.Identity):
            return False
        if layer.lora_A[name].weight.dtype != dtype or layer.lora_B[name].weight.dtype != dtype:
            return False
    return True


def _forward_of(module: nn.Module) -> Callable[[nn.Module, torch.Tensor], torch.Tensor] | None:
    """The narrow forward `module` takes (None: its own): a plain nn.Linear, or a peft LoRA
    linear layer over one, whose float32 weight is at least MIN_FEATURES wide both ways."""
    if "forward" in vars(module):  # a forward of its own (a wrapper's, or another block's)
        return None
    if type(module) is nn.Linear:
        base, forward = module, linear_forward
    elif is_lora_linear(module):
        base, forward = module.base_layer, lora_forward
    else:
        return None
    weight = base.weight
    if type(base) is not nn.Linear or type(weight) is not nn.Parameter:  # FSDP's DTensors
        return None
    if weight.dtype != torch.float32 or min(weight.shape) < MIN_FEATURES:
        return None
    return forward


def is_lora_linear(module: nn.Module) -> bool:
    """Whether `module` is a peft LoRA linear layer (`peft.tuners.lora.layer.Linear`)."""
    cls = type(module)
    return cls.__name__ == "Linear" and cls.__module__ == "peft.tuners.lora.layer"


@contextlib.contextmanager
def narrow_linears(model: nn.Module) -> Iterator[None]:
    """In this block this thread's forwards of `model`'s linear layers go through
    `linear_forward` / `lora_forward` (restored on exit, also on error). Blocks may overlap
    across threads (an asynchronous sampler's copy, or the same model): a layer keeps the
    override while any block over it is open, and only threads inside a block take it."""
    with _overrides(model), _flag("active"):
        yield


@contextlib.contextmanager
def folded_adapters(model: nn.Module) -> Iterator[None]:
    """In this block this thread's forwards of `model`'s plain float32 LoRA layers outside the
    narrow band add their adapters into the base product in one `addmm` (`_folded`): the same
    sum in another order, with or without gradients. Measured on SmolLM2-135M + LoRA r 8 (32
    rows of 15 tokens over 4 prompts, forward and backward, 2 threads): the adapters' scaling
    and sum were about 0.2 s of 2.6 s. Under autocast, peft's own forward (its casts)."""
    with _overrides(model), _flag("fold"):
        yield


@contextlib.contextmanager
def _flag(name: str) -> Iterator[None]:
    """This thread's `name` flag set inside the block (its previous value after)."""
    previous = getattr(_local, name, False)
    setattr(_local, name, True)
    try:
        yield
    finally:
        setattr(_local, name, previous)


@contextlib.contextmanager
def _overrides(model: nn.Module) -> Iterator[None]:
    """The narrow forwards installed on `model`'s layers for the block (reference-counted)."""
    with _lock:
        layers = []
        for module in model.modules():
            if id(module) in _users:
                _users[id(module)] += 1
            elif (forward := _forward_of(module)) is not None:
                module.forward = _bound(forward, module)
                _users[id(module)] = 1
            else:
                continue
            layers.append(module)
    try:
        yield
    finally:
        with _lock:
            for module in layers:
                _users[id(module)] -= 1
                if not _users[id(module)]:
                    del _users[id(module)], module.forward


def _bound(forward: Callable[[nn.Module, torch.Tensor], torch.Tensor], module: nn.Module) -> Any:
    """`forward` bound to `module`, as an instance attribute `nn.Module.__call__` finds; calls
    with more arguments than x go to the class's forward."""
    own = type(module).forward

    def call(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:
            return own(module, x, *args, **kwargs)
        return forward(module, x)

    return call
