"""The built-in `dots` task: how many dots an image shows, for vision-language models.

A row's image is a 64 × 64 white square with 1 to `max_dots` black dots (radius 5, apart
from one another), its prompt "How many dots?", its answer the count as digits:

    image       (three dots)
    prompt      How many dots?
    completion  3

The count is the whole completion (then EOS); the `correct` reward is 1 for a completion that
is exactly the count (spaces around it aside), else 0.

Rows are generated lazily and deterministically: row i of a split depends only on (seed, split,
i). `train` and `heldout` never share an image: each layout (the count and the dots' centres)
is hashed with BLAKE2b and the hash alone decides its split, as the arithmetic task's problems.

Noisy answers (`noisy_solution`) are for the supervised warm start (`grouprl sft --task dots`):
with probability `noise` the answer is another count, drawn uniformly. A model fitted to them
puts about `noise` of its mass on wrong counts: at temperature 1 it is often wrong, greedily
it is mostly right, which is the room RL needs.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from grouprl.errors import UserError
from grouprl.tasks.base import Task

SIDE, RADIUS = 64, 5
PROMPT = "How many dots?"


@dataclass(frozen=True)
class Layout:
    """A count's dots by their centres."""

    centres: tuple[tuple[int, int], ...]

    @property
    def count(self) -> int:
        return len(self.centres)

    def key(self) -> str:
        return ";".join(f"{x},{y}" for x, y in sorted(self.centres))

    def image(self):
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (SIDE, SIDE), "white")
        draw = ImageDraw.Draw(image)
        for x, y in self.centres:
            draw.ellipse([x - RADIUS, y - RADIUS, x + RADIUS, y + RADIUS], fill="black")
        return image


def draw_layout(rng: random.Random, max_dots: int) -> Layout:
    """1 to `max_dots` dots, uniformly many, each centre drawn until it is at least 3 radii from
    the others' (so dots never touch) and inside the square."""
    count = rng.randint(1, max_dots)
    centres: list[tuple[int, int]] = []
    while len(centres) < count:
        x, y = (
            rng.randint(RADIUS + 1, SIDE - RADIUS - 2),
            rng.randint(RADIUS + 1, SIDE - RADIUS - 2),
        )
        if all((x - a) ** 2 + (y - b) ** 2 >= (3 * RADIUS) ** 2 for a, b in centres):
            centres.append((x, y))
    return Layout(tuple(centres))


def is_heldout(layout: Layout, heldout_fraction: float) -> bool:
    digest = hashlib.blake2b(layout.key().encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < heldout_fraction


class DotRows(Sequence):
    """Rows of one split, each generated on access from (seed, split, index)."""

    def __init__(self, split: str, size: int, seed: int, max_dots: int, fraction: float) -> None:
        self.split, self.size, self.seed = split, size, seed
        self.max_dots, self.fraction = max_dots, fraction

    def __len__(self) -> int:
        return self.size

    def layout(self, index: int) -> Layout:
        rng = random.Random(f"dots:{self.seed}:{self.split}:{index}")
        while True:
            layout = draw_layout(rng, self.max_dots)
            if is_heldout(layout, self.fraction) == (self.split == "heldout"):
                return layout

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -self.size <= index < self.size:
            raise IndexError(index)
        layout = self.layout(index % self.size)
        answer = str(layout.count)
        return {"prompt": PROMPT, "image": layout.image(), "answer": answer, "solution": answer}


def correct(completions: list, answer: list[str], **_) -> list[float]:
    """1.0 where the completion is exactly the count (spaces around it aside), else 0.0."""
    return [float(_text(c).strip() == a) for c, a in zip(completions, answer, strict=True)]


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def noisy_solution(row: dict, rng: random.Random, noise: float, max_dots: int = 4) -> str:
    """The row's answer, or with probability `noise` another count drawn uniformly."""
    if rng.random() >= noise:
        return row["answer"]
    others = [str(k) for k in range(1, max_dots + 1) if str(k) != row["answer"]]
    return rng.choice(others)


def dots_task(
    train_size: int = 10_000,
    heldout_size: int = 200,
    max_dots: int = 4,
    seed: int = 0,
    heldout_fraction: float = 0.1,
) -> Task:
    """The dots task (see the module docstring)."""
    if not 1 <= max_dots <= 6:
        raise UserError(f"max_dots must be 1 to 6 (dots of radius 5 fit a 64-pixel square), "
                        f"got {max_dots}")  # fmt: skip
    if not 0.0 < heldout_fraction < 1.0:
        raise UserError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    return Task(
        name="dots",
        train=DotRows("train", train_size, seed, max_dots, heldout_fraction),
        heldout=DotRows("heldout", heldout_size, seed, max_dots, heldout_fraction),
        reward_funcs={"correct": correct},
        reward_weights={"correct": 1.0},
        stop=None,
        max_new_tokens=4,
        noisy_solution=lambda r, rng, p: noisy_solution(r, rng, p, max_dots),
        default_model="builtin:dots",
        default_steps=300,
    )
