"""grouprl: critic-free RL (GRPO, GSPO and their variants) for language-model reasoning.

From Python: `grouprl.Trainer` (see `grouprl.api`), configured by `grouprl.TrainConfig`; a
user's mistake raises `grouprl.UserError` with the command line's one-line message. The names
load on first use, so `import grouprl.core` stays torch and the standard library only.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grouprl.api import Trainer, TrainResult
    from grouprl.config.options import TrainConfig
    from grouprl.errors import UserError
    from grouprl.train.events import RunEvent

__version__ = "0.1.0"
__all__ = ["RunEvent", "TrainConfig", "TrainResult", "Trainer", "UserError"]

_HOMES = {
    "Trainer": "grouprl.api",
    "TrainResult": "grouprl.api",
    "TrainConfig": "grouprl.config.options",
    "UserError": "grouprl.errors",
    "RunEvent": "grouprl.train.events",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'grouprl' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
