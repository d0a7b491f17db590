"""A prompt's images as the model takes them: its processor's tensors beside its token ids.

A vision-language model's processor turns a conversation with image parts and its images into
token ids (each image's placeholder expanded into the image's tokens) and tensors the forward
takes with those ids: `pixel_values`, and per family `pixel_attention_mask`, `image_sizes`,
`image_grid_thw`, `token_type_ids`, ... `encode` runs it on one prompt at a time and returns an
`ImagePrompt`: the ids (a list, as every engine takes prompts) carrying its `PromptMedia`.

A batch's prompts are joined by `Media.inputs`, per tensor by the one rule that fits every
family's layout, read off the tensors themselves:
- per-token tensors (the prompt's width: `token_type_ids`, `mm_token_type_ids`) are left-padded
  like the ids, with 0;
- tensors of equal trailing shape are concatenated on their first axis: a batch axis (LLaVA's
  one image a prompt, Idefics3's) or an image/patch axis (LLaVA's several, Qwen-VL's patches
  and `image_grid_thw`), which the model splits by the ids' image tokens;
- tensors with a batch axis of 1 whose trailing shapes differ (Idefics3's images per prompt)
  are zero-padded to the largest and stacked: the families that lay them out so treat an
  all-zero image as padding.

Images enter only where a prompt is fed: the sampler's prefill, and the prompt part of the
trainer's forwards. Completions are text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from grouprl.errors import UserError, one_line

#: Processor outputs that are not model inputs beside the ids.
_NOT_INPUTS = ("input_ids", "attention_mask", "labels")


@dataclass(frozen=True)
class PromptMedia:
    """One prompt's images and the processor's tensors for them (each with its leading axis as
    the processor gave it for this prompt alone), on the CPU."""

    images: tuple[Any, ...]  # RGB PIL images, in the prompt's order
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: the prompt's ids before the processor expanded its images' placeholders (one token an
    #: image where the template put it): what vLLM takes, expanding them itself
    placeholder_ids: tuple[int, ...] = ()
    #: the model's image token, which a completion must not contain (the model would take it
    #: for one more image's place in a forward of prompt and completion): never sampled
    image_token_ids: tuple[int, ...] = ()


class ImagePrompt(list):
    """A prompt's token ids (image tokens expanded) with its `media`: a list of ints, so every
    engine and budget takes it as a prompt of ids."""

    def __init__(self, ids: Sequence[int], media: PromptMedia) -> None:
        super().__init__(ids)
        self.media = media

    def __reduce__(self):  # pickled with its media (the vLLM process, the async sampler)
        return (ImagePrompt, (list(self), self.media))


def media_of(prompt: Any) -> PromptMedia | None:
    """The prompt's media, or None for a text prompt."""
    return getattr(prompt, "media", None)


def encode(processor: Any, rendered: str, images: Sequence[Any], where: str) -> ImagePrompt:
    """The ids and tensors of one rendered prompt (the chat template's text, with one image
    placeholder per image) and its images; one line naming `where` for images the processor
    cannot take (too many for the placeholders, a size it refuses)."""
    try:  # the template wrote the special tokens (BOS among them): none added again
        out = processor(text=[rendered], images=[list(images)] if images else None,
                        return_tensors="pt", add_special_tokens=False)  # fmt: skip
    except (ValueError, TypeError, RuntimeError, IndexError) as err:
        raise UserError(
            f"{where}: the model's processor cannot take this prompt's {len(images)} image(s): "
            f"{one_line(err)}"
        ) from None
    ids = out["input_ids"][0].tolist()
    tensors = {
        k: v.detach().cpu()
        for k, v in out.items()
        if k not in _NOT_INPUTS and isinstance(v, torch.Tensor)
    }
    placeholders = tuple(processor.tokenizer(rendered, add_special_tokens=False)["input_ids"])
    image_token = getattr(processor, "image_token_id", None)
    banned = () if image_token is None else (int(image_token),)
    return ImagePrompt(ids, PromptMedia(tuple(images), tensors, placeholders, banned))


@dataclass(frozen=True)
class Media:
    """The media of a batch's B prompts (None for a prompt without images), in prompt order,
    with each prompt's token count (to place per-token tensors)."""

    prompts: tuple[PromptMedia | None, ...]
    lengths: tuple[int, ...]

    @staticmethod
    def of(prompts: Sequence[Any]) -> Media | None:
        """The media of prompts (token-id lists, some `ImagePrompt`s); None when none has any."""
        found = tuple(media_of(p) for p in prompts)
        if all(m is None for m in found):
            return None
        return Media(found, tuple(len(p) for p in prompts))

    def select(self, idx: Sequence[int]) -> Media:
        """The media of prompts `idx`, in that order."""
        return Media(tuple(self.prompts[i] for i in idx), tuple(self.lengths[i] for i in idx))

    def repeat(self, times: int) -> Media:
        """Each prompt `times` times in a row (as `repeat_interleave`)."""
        return Media(
            tuple(m for m in self.prompts for _ in range(times)),
            tuple(n for n in self.lengths for _ in range(times)),
        )

    @staticmethod
    def concat(parts: Sequence[Media | None], counts: Sequence[int]) -> Media | None:
        """Batches' media joined in order (`counts`: each part's prompts, for a part without
        media); None when no part has any."""
        if all(p is None for p in parts):
            return None
        prompts: list[PromptMedia | None] = []
        lengths: list[int] = []
        for part, count in zip(parts, counts, strict=True):
            prompts += [None] * count if part is None else list(part.prompts)
            lengths += [0] * count if part is None else list(part.lengths)
        return Media(tuple(prompts), tuple(lengths))

    def banned(self, device: torch.device) -> torch.Tensor | None:
        """(k,) the prompts' image token ids, never to be sampled; None when there are none."""
        ids = sorted({i for m in self.prompts if m is not None for i in m.image_token_ids})
        return torch.tensor(ids, dtype=torch.long, device=device) if ids else None

    def images(self) -> list[list[Any]]:
        """Each prompt's images (an empty list for a text prompt)."""
        return [[] if m is None else list(m.images) for m in self.prompts]

    def inputs(
        self, width: int, device: torch.device, right: bool = False
    ) -> dict[str, torch.Tensor]:
        """The model's keyword inputs for the B prompts, per-token ones padded to `width`
        tokens on the left (the batch's left-padded prompt ids) or the `right`, on `device`."""
        names = sorted({k for m in self.prompts if m is not None for k in m.tensors})
        return {k: self._joined(k, width, right).to(device) for k in names}

    def _joined(self, name: str, width: int, right: bool = False) -> torch.Tensor:
        per_token = [
            m is not None and name in m.tensors and m.tensors[name].dim() == 2
            and m.tensors[name].shape == (1, n)
            for m, n in zip(self.prompts, self.lengths)
        ]  # fmt: skip
        if all(per_token):
            return torch.cat([F.pad(m.tensors[name], (0, width - n) if right else (width - n, 0))  # type: ignore[union-attr]
                              for m, n in zip(self.prompts, self.lengths)])  # fmt: skip
        found = [m.tensors[name] for m in self.prompts if m is not None and name in m.tensors]
        shapes = {t.shape[1:] for t in found}
        if (
            len(found) == len(self.prompts)
            and all(t.shape[0] == 1 for t in found)
            and (len(shapes) > 1)
        ):  # a batch axis: pad the rest with zeros
            dims = max(t.dim() for t in found)
            size = [max(t.shape[d] for t in found) for d in range(1, dims)]
            return torch.cat([_padded(t, size) for t in found])
        if len(shapes) > 1:
            raise UserError(
                f"the prompts' {name} tensors do not stack ({sorted({tuple(t.shape) for t in found})}); "
                "give every prompt of a batch images, or none"
            )
        if len(found) != len(self.prompts) and all(t.shape[0] == 1 for t in found):
            raise UserError(
                f"this model takes {name} one per prompt: a batch mixes prompts with and without "
                "images; give every prompt images, or none"
            )
        return torch.cat(found)


def _padded(t: torch.Tensor, size: list[int]) -> torch.Tensor:
    """`t` (1, ...) zero-padded at the end of each trailing axis to `size`."""
    pad: list[int] = []
    for d in reversed(range(1, t.dim())):
        pad += [0, size[d - 1] - t.shape[d]]
    return F.pad(t, pad)
