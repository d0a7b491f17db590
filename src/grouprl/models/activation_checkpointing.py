"""Gradient (activation) checkpointing that takes effect while the policy stays in eval mode.

transformers checkpoints a decoder layer only when the layer is in training mode. The trainer
keeps the policy in eval mode so that dropout never makes the ratio noisy; `recomputing` sets the
training flag on the checkpointed layers alone (not on their children: attention dropout and
every other submodule keep eval mode), so the layers recompute their activations in backward
and nothing else changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from transformers import PreTrainedModel

from grouprl.errors import UserError


def enable(model: nn.Module) -> None:
    """Switch on transformers' checkpointing of every decoder layer (non-reentrant)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(
            f"{type(model).__name__} does not support gradient checkpointing; "
            "drop --gradient-checkpointing"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the name in later 5.x releases
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers 5.0 (the floor) has only the older name, later 5.x deprecate it
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _layers(model: nn.Module) -> list[nn.Module]:
    """The checkpointed layers: modules flagged by transformers, except whole models (which carry
    the flag too but checkpoint nothing themselves)."""
    return [
        m
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False) is True
        and not isinstance(m, PreTrainedModel)
    ]


@contextlib.contextmanager
def recomputing(model: nn.Module) -> Iterator[None]:
    """Inside the context the checkpointed layers run in training mode (their submodules do
    not); outside it they are back in their previous mode. A no-op without checkpointing."""
    layers = _layers(model)
    before = [m.training for m in layers]
    for m in layers:
        m.training = True  # this module only: not .train(), which would recurse
    try:
        yield
    finally:
        for m, mode in zip(layers, before):
            m.training = mode
