"""Chat messages and tool turns as they cross layers: TRL's conversational format, and what a
sampler and a tool handler say to each other (`grouprl.rollout.turns`, `grouprl.tasks.tools.calls`).
One definition for every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def is_conversational(prompt: Any) -> bool:
    """Whether a prompt is a list of chat messages (``{"role", "content"}`` dicts), TRL's
    conversational format, rather than a string or a list of token ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict)


@dataclass(frozen=True)
class ToolRequest:
    """A row that just closed a tool call."""

    row: int  # the completion row, 0 … N−1 (group-contiguous)
    text: str  # the row's model text since its last observation; ends with a closer
    calls_made: int  # tool calls (and environment steps) the row ran before this turn
    at_end: bool = False  # the turn ended (EOS or a stop string), not at a call's closer
    # the turn's token ids and their log-probs, for a handler that `wants_turn_ids`
    ids: tuple[int, ...] = ()
    logps: tuple[float, ...] = ()


@dataclass(frozen=True)
class Observation:
    """What follows a closed call: ids to feed (none: decoding just goes on), the transcript's
    tool turns, and counts."""

    ids: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # {"role": "tool", ...}
    calls: int = 0  # calls run (successful or not)
    steps: int = 0  # environment steps taken (they count against the limit, as calls do)
    failures: int = 0  # of them, those that gave an error observation
    end: bool = False  # the trajectory ends here (a call past the limit, or the episode is over)
    over_limit: bool = False  # it ends because the row made as many calls as it may
    # it ends with one more turn that holds no token (an agent's request past the limit,
    # answered empty): a turn of the row, as the agent counts it
    empty_turn: bool = False
