"""Images as they cross layers: a dataset row's images read into RGB PIL images, and chat
prompts with image parts, in TRL's formats. One definition for every layer (data, sampling,
`generate`, the viewer).

A row's images are its `image` column (one image) or its `images` column (a list), and any
image parts inside its messages' content lists (``{"type": "image", "image": ...}``). An image
value is a PIL image, a file path, raw bytes, or `datasets`' Image feature as stored
(``{"bytes": ..., "path": ...}``). A prompt with images is a conversation whose first user
message holds one ``{"type": "image"}`` part per image before its text (what TRL's
`prepare_multimodal_messages` makes); the model's processor renders and expands it.
"""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grouprl.errors import UserError

#: Pixels (width × height) an image may have before the run refuses it (`--max-image-pixels`):
#: 4096 × 4096. A processor resizes every image anyway; this only guards memory and time.
MAX_IMAGE_PIXELS = 4096 * 4096
#: The row columns that hold images.
IMAGE_COLUMNS = ("image", "images")


def directory_sees_images(directory: Any) -> bool:
    """Whether a local model directory holds a vision-language model: its config.json has a
    vision tower's config."""
    import json

    try:
        return "vision_config" in json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def has_images(row: dict) -> bool:
    """Whether a row carries images (an image column with a value, or image parts)."""
    if any(row.get(c) is not None for c in IMAGE_COLUMNS):
        return True
    prompt = row.get("prompt")
    return isinstance(prompt, list) and any(_image_parts(m) for m in prompt)


def row_images(row: dict, where: str, max_pixels: int = MAX_IMAGE_PIXELS) -> list[Any]:
    """The row's images, in order (image parts of its messages that carry an image, then its
    image columns), each read into an RGB PIL image; one line naming the row for a value that
    is not an image, cannot be read, or has more than `max_pixels` pixels."""
    values: list[Any] = []
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        for message in prompt:
            values += [p["image"] for p in _image_parts(message) if p.get("image") is not None]
    single, several = row.get("image"), row.get("images")
    if single is not None:
        values.append(single)
    if several is not None:
        if isinstance(several, (str, bytes, dict)) or not isinstance(several, Sequence):
            several = [several]
        values += list(several)
    return [read_image(v, f"{where}, image {i}", max_pixels) for i, v in enumerate(values)]


def read_image(value: Any, where: str, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """An image value (PIL image, path, bytes, `{"bytes", "path"}`) as an RGB PIL image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, Path)):
            if not Path(value).is_file():
                raise UserError(f"{where}: the image file {str(value)!r} does not exist")
            image = Image.open(value)
        else:
            raise UserError(
                f"{where}: {type(value).__name__} is not an image; give a PIL image, a file "
                "path, bytes, or a datasets Image column"
            )
        if image.width * image.height > max_pixels:
            raise UserError(
                f"{where}: the image is {image.width}x{image.height}, over the limit of "
                f"{max_pixels} pixels; shrink it, or raise --max-image-pixels"
            )
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise UserError(
            f"{where}: the image cannot be read ({type(err).__name__}: {err})"
        ) from None


def _image_parts(message: Any) -> list[dict]:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return []
    return [p for p in content if isinstance(p, dict) and p.get("type") == "image"]


def count_image_parts(prompt: Any) -> int:
    """How many image parts a conversational prompt holds."""
    if not isinstance(prompt, list):
        return 0
    return sum(len(_image_parts(m)) for m in prompt)


def with_image_parts(prompt: Any, count: int) -> list[dict]:
    """A prompt (a string or messages) as messages whose first user message starts with
    `count` image parts, unless the prompt already holds that many; the parts carry no image
    (the processor takes the images beside the text). Content strings become text parts."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    have = count_image_parts(messages)
    if have == count:
        return [_plain_parts(m) for m in messages]
    if have:
        raise UserError(
            f"the prompt has {have} image parts but the row gives {count} images; give one "
            "image per {'type': 'image'} part, or no parts and the images in an image column"
        )
    out = [_plain_parts(m) for m in messages]
    users = [i for i, m in enumerate(out) if m["role"] == "user"]
    at = users[0] if users else len(out)
    if not users:
        out.append({"role": "user", "content": []})
    out[at] = {**out[at], "content": [{"type": "image"}] * count + out[at]["content"]}
    return out


def _plain_parts(message: dict) -> dict:
    """A message whose content is a list of parts: a string becomes one text part, and image
    parts lose their image (the processor is given the images apart)."""
    content = message.get("content")
    if isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    else:
        parts = [{"type": "image"} if p.get("type") == "image" else dict(p) for p in content]
    return {**message, "content": parts}


def message_text(content: Any) -> str:
    """A message content's text: the string, or its text parts joined (an image part is
    written as "<image>")."""
    if isinstance(content, str):
        return content
    return "".join(
        "<image>" if p.get("type") == "image" else str(p.get("text", "")) for p in content
    )


#: What a thumbnail's data URL starts with; the viewer shows no other kind.
THUMBNAIL_PREFIX = "data:image/png;base64,"


def thumbnail(image: Any, size: int = 128) -> str:
    """An image as a PNG data URL at most `size` pixels on its longer side, for the run viewer."""
    small = image.copy()
    small.thumbnail((size, size))
    return data_url(small)


def data_url(image: Any) -> str:
    """An image as a PNG data URL, pixel for pixel (what a vLLM server is sent)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return THUMBNAIL_PREFIX + base64.b64encode(buffer.getvalue()).decode("ascii")


def image_digest(value: Any) -> str:
    """A short digest of a row's image values as stored (paths, bytes, nested lists)."""
    digest = hashlib.blake2b(digest_size=8)

    def feed(v: Any) -> None:
        if isinstance(v, (bytes, bytearray)):
            digest.update(bytes(v))
        elif isinstance(v, dict):
            for k in sorted(v):
                feed(k)
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            for item in v:
                feed(item)
        else:
            digest.update(repr(v).encode())

    feed(value)
    return digest.hexdigest()


def warn_unread_image_columns(features: Any, source: str) -> None:
    """One warning for a dataset whose images sit in a column no prompt reads (a `datasets`
    Image feature under another name than `IMAGE_COLUMNS`)."""
    import warnings

    elsewhere = [name for name, f in features.items()
                 if name not in IMAGE_COLUMNS and "Image" in type(getattr(f, "feature", f)).__name__]  # fmt: skip
    if elsewhere:
        warnings.warn(
            f"dataset {source}: column {elsewhere[0]!r} holds images, but no prompt shows them: "
            f"a row's images come from its {' or '.join(map(repr, IMAGE_COLUMNS))} column; "
            "rename the column to use them",
            UserWarning,
            stacklevel=3,
        )
