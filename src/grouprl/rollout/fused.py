"""Linear layers fed the same input, as one product: a decode step's q/k/v and gate/up.

A CPU decode step multiplies each weight by a few dozen rows, a shape MKL runs far below its
rate: measured with torch 2.13 on 2 cores of an AMD EPYC (Zen 3, AVX2), 32 rows against SmolLM2's
(1536, 576) gate weight took 0.93 ms (61 GFLOP/s) where one product against gate and up stacked,
(3072, 576), took 1.24 ms (92 GFLOP/s); q, k and v stacked (960, 576) 0.38 ms against 0.46 ms
apart. Thirty layers and fifteen decode steps make that about 0.3 s of a 3.4 s generation.

`Fused` keeps the stacked copy of its layers' base weights (and of their LoRA adapters' A
matrices) and rebuilds it when one of them changed: a weight is known by its storage and its
version counter, which every in-place write (an optimizer step, a checkpoint's load) moves on.
The copies cost memory: for SmolLM2-135M, 278 MB beside its 541 MB of weights. Each adapter's B
adds its term into its own rows of the stacked output (base + scaling · B·(A·yᵀ), peft's sum).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn

from grouprl.rollout.narrow import is_lora_linear


@dataclass(frozen=True)
class _Stacked:
    """The stacked weights of one version of the layers."""

    key: tuple
    weight: torch.Tensor  # (Σ out, in): the base weights, one under the other
    a: torch.Tensor | None  # (Σ rank, in): the active adapters' A, one under the other
    adapters: tuple[tuple[slice, slice, torch.Tensor, float], ...]  # rows, ranks, B, scaling


class Fused:
    """One product W·yᵀ for `layers` (plain nn.Linear without bias, or peft LoRA layers over
    one) that take the same input: `product(y_t)` returns their outputs stacked, (Σ out, R)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers
        self.sizes = [_base(layer).weight.shape[0] for layer in layers]
        self._stacked: _Stacked | None = None
        self._lock = threading.Lock()  # two samplers may share a model

    def product(self, y_t: torch.Tensor) -> torch.Tensor:
        """The layers' outputs for input yᵀ (in, R), stacked in their order: (Σ out, R)."""
        s = self._current()
        out = torch.mm(s.weight, y_t)
        if s.a is not None:
            a = torch.mm(s.a, y_t)  # (Σ rank, R)
            for rows, ranks, b, scaling in s.adapters:
                out[rows].addmm_(b, a[ranks], alpha=scaling)
        return out

    def _current(self) -> _Stacked:
        key = _key(self.layers)
        with self._lock:
            if self._stacked is None or self._stacked.key != key:
                self._stacked = _stack(self.layers, key)
            return self._stacked


def _base(layer: nn.Module) -> nn.Linear:
    return layer.base_layer if is_lora_linear(layer) else layer


def _adapters(layer: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(A, B, scaling) of each active adapter of a LoRA layer; none for a plain linear."""
    if not is_lora_linear(layer):
        return []
    return [(layer.lora_A[name].weight, layer.lora_B[name].weight, float(layer.scaling[name]))
            for name in layer.active_adapters]  # fmt: skip


def _version(w: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    return (w.data_ptr(), w._version, tuple(w.shape))


def _key(layers: list[nn.Module]) -> tuple:
    """What the stacked copy depends on: each base weight and each active adapter's A, by
    storage and version, and the adapters' B and scaling."""
    parts = []
    for layer in layers:
        parts.append(_version(_base(layer).weight))
        for a, b, scaling in _adapters(layer):
            parts.append((_version(a), id(b), scaling))
    return tuple(parts)


def _stack(layers: list[nn.Module], key: tuple) -> _Stacked:
    with torch.no_grad():
        weight = torch.cat([_base(layer).weight for layer in layers])
        a_parts, adapters, row, rank = [], [], 0, 0
        for layer in layers:
            out = _base(layer).weight.shape[0]
            for a, b, scaling in _adapters(layer):
                a_parts.append(a)
                adapters.append((slice(row, row + out), slice(rank, rank + a.shape[0]), b,
                                 scaling))  # fmt: skip
                rank += a.shape[0]
            row += out
        a_all = torch.cat(a_parts) if a_parts else None
    return _Stacked(key, weight, a_all, tuple(adapters))
