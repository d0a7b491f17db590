"""A stateful environment in TRL's `environment_factory` shape: each episode hides a new value.

Every episode draws its own secret value (from the `seed` grouprl gives `reset`, shared by the
group), so no policy can know it: the only way to the right answer is to call `lookup` and add.
The last turn (no call in it) is the episode's action: `step` reads the answer after `|` and
ends the episode, and `get_reward` scores it.

    grouprl train --config examples/vault/config.yaml
"""

from __future__ import annotations

import random


class Vault:
    def reset(self, key: int, addend: int, seed: int, **row) -> None:
        """Start an episode on the row's key and addend; the value behind the key is new."""
        self.key, self.addend = int(key), int(addend)
        self.value = random.Random(seed).randint(10, 99)
        self.answer: int | None = None
        self.looked_up = False
        return None  # the prompt already says everything the model may know

    def lookup(self, key: int) -> int:
        """The value stored under a key.

        Args:
            key: the key to look up.

        Returns:
            The value under the key, from 10 to 99.
        """
        if key != self.key:
            raise KeyError(f"no key {key} in this vault")
        self.looked_up = True
        return self.value

    def step(self, text: str) -> None:
        """The final turn: the answer follows the last `|`."""
        tail = text.rpartition("|")[2].strip()
        self.answer = int(tail) if tail.isdigit() else None
        return None  # the episode is over

    def get_reward(self) -> float:
        return 1.0 if self.answer == self.value + self.addend else 0.0
