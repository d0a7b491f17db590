"""Vision-language models: their processor beside the tokenizer, their vision tower frozen.

A vision-language model (a config with a `vision_config`: LLaVA, Idefics3, SmolVLM, Gemma 3,
Qwen2/2.5/3-VL, ...) loads with `AutoModelForImageTextToText` and its `AutoProcessor`. The
processor's tokenizer is the run's tokenizer, with the processor attached to it
(`processor_of`): everything that takes a tokenizer keeps taking it, and what renders a prompt
with images asks it for its processor. Saving the tokenizer saves the processor with it, so
every checkpoint and final model reloads as the same vision-language model.

transformers 5.25 builds the Qwen2-VL, Qwen2.5-VL, Qwen3-VL and SmolVLM processors only with
torchvision installed (their video processor); without it loading one is one line saying so.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from grouprl.errors import UserError, one_line
from grouprl.images import MAX_IMAGE_PIXELS, directory_sees_images

_PROCESSOR = "_grouprl_processor"
_LIMIT = "_grouprl_max_image_pixels"
#: The base model's children that hold the vision encoder, by the names transformers uses.
VISION_TOWERS = ("vision_tower", "vision_model", "visual", "vision_encoder")


def config_sees_images(source: Path | str, loader: Any = None) -> bool:
    """Whether the model at `source` (a local directory, or a hub id through `loader`, the
    caller's config loader) is a vision-language model."""
    if isinstance(source, Path):
        return directory_sees_images(source)
    if loader is None:
        return False
    try:
        return getattr(loader(source), "vision_config", None) is not None
    except Exception:  # not found or not a config: the model's own load says why
        return False


def load_processor(source: Path | str, spec: str, **kwargs: Any) -> Any:
    """The model's `AutoProcessor`, or one line saying why it cannot be built."""
    from transformers import AutoProcessor
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoProcessor.from_pretrained(
            source, local_files_only=isinstance(source, Path), **kwargs
        )
    except Exception as err:  # a processor fails to build in many library-specific ways
        reason = one_line(err)
        if "VIDEO_PROCESSOR_MAPPING" in reason or "orchvision" in reason:
            reason += (
                " (transformers builds this family's processor only with torchvision; install "
                "the torchvision build that matches your torch)"
            )
        raise UserError(f"cannot load the image processor of {spec}: {reason}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def with_processor(tokenizer: Any, processor: Any) -> Any:
    """`tokenizer` (the processor's own) carrying `processor`; its `save_pretrained` saves the
    processor with it."""
    setattr(tokenizer, _PROCESSOR, processor)
    tokenizer.save_pretrained = functools.update_wrapper(
        functools.partial(_save_both, tokenizer, processor), _save_both
    )
    return tokenizer


def _save_both(tokenizer: Any, processor: Any, directory: Any, *args: Any, **kwargs: Any) -> Any:
    """The processor's `save_pretrained`, which saves the tokenizer by the tokenizer's own."""
    mine = tokenizer.__dict__.pop("save_pretrained")
    try:
        return processor.save_pretrained(directory, *args, **kwargs)
    finally:
        tokenizer.save_pretrained = mine


def processor_of(tokenizer: Any) -> Any | None:
    """The processor a vision-language model's tokenizer carries, or None."""
    return getattr(tokenizer, _PROCESSOR, None)


def with_image_limit(tokenizer: Any, pixels: int) -> Any:
    """`tokenizer`, whose prompts' images may have at most `pixels` pixels (`--max-image-pixels`)."""
    setattr(tokenizer, _LIMIT, int(pixels))
    return tokenizer


def image_limit(tokenizer: Any) -> int:
    """The most pixels an image of this tokenizer's prompts may have."""
    return getattr(tokenizer, _LIMIT, MAX_IMAGE_PIXELS)


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder of a vision-language model (looking through a peft wrapper), or None."""
    unwrapped = (
        model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    )
    base = getattr(unwrapped, getattr(unwrapped, "base_model_prefix", ""), None)
    for owner in (base, unwrapped):
        for name in VISION_TOWERS:
            found = getattr(owner, name, None) if owner is not None else None
            if isinstance(found, nn.Module):
                return found
    return None


def check_positions(model: nn.Module, spec: str) -> None:
    """One line for a model whose rotary positions depend on its images (Qwen2/2.5/3-VL's
    multimodal RoPE, `get_rope_index`): grouprl's forwards give every model position ids of
    their own (0, 1, … per row, left padding skipped), which such a model would take as its
    text positions and so train on other positions than it samples with."""
    unwrapped = (
        model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    )
    base = getattr(unwrapped, getattr(unwrapped, "base_model_prefix", ""), unwrapped)
    if callable(getattr(base, "get_rope_index", None)):
        raise UserError(
            f"{spec} places its image tokens by image-dependent rotary positions "
            f"({type(unwrapped).__name__}), which grouprl does not compute yet; use a model of "
            "another family (Idefics3/SmolVLM, LLaVA, Gemma 3)"
        )


def freeze_vision_tower(model: nn.Module) -> int:
    """Stop the vision encoder's parameters from training; returns how many were frozen."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    count = 0
    for p in tower.parameters():
        if p.requires_grad:
            p.requires_grad_(False)
            count += p.numel()
    return count


def language_targets(model: nn.Module, names: Sequence[str] | None) -> list[str]:
    """LoRA target modules inside the language model only: the full names of its linear layers
    (`names` None) or of its modules `names` end with, so that neither the vision encoder nor
    the projector gets adapters. One line when none matches."""
    decoder = model.get_decoder()
    prefix = next(n for n, m in model.named_modules() if m is decoder)
    inside = [n for n, _ in decoder.named_modules()]
    unmatched = [t for t in names or () if not any(n == t or n.endswith(f".{t}") for n in inside)]
    if unmatched and len(unmatched) < len(names or ()):  # peft would say nothing of these
        warnings.warn(
            f"LoRA target modules {', '.join(map(repr, unmatched))} match no module of the "
            "language model and get no adapter (a typo, or a stray comma on the command line?)",
            stacklevel=3,
        )
    found = [
        f"{prefix}.{n}"
        for n, m in decoder.named_modules()
        if isinstance(m, nn.Linear)
        and (names is None or any(n == t or n.endswith(f".{t}") for t in names))
    ]
    if not found:
        raise UserError(
            f"LoRA target modules {', '.join(map(repr, names or ()))} match no linear layer "
            "of the language model; check --lora-target-modules"
        )
    return found
