"""Precision: the autocast context every forward of a run enters with the run's one dtype."""

from __future__ import annotations

import contextlib

import torch


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on the model's device type; a no-op context for None (float32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
