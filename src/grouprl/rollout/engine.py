"""The Hugging Face rollout engine: `RolloutEngine` over `sample_groups`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from grouprl.rollout.sampling import sample_groups
from grouprl.rollout.turns import TurnHandler
from grouprl.rollout.types import Rollout


class HFRolloutEngine:
    """Samples with the training model itself (no weight sync: the engine holds a reference).

    `chat_template=True` renders string prompts as one user turn with the tokenizer's template.
    `lockstep`: decode in step with other processes whose forwards are collectives (see
    `sample_groups`; the trainer's FSDP runs set it, nothing else does). `tools`: answer tool
    calls inside the decode loop (`grouprl.rollout.turns`).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        chat_template: bool = False,
        lockstep: Callable[[bool], bool] | None = None,
        tools: TurnHandler | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.lockstep = lockstep
        self.tools = tools

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        tools: TurnHandler | None = None,
    ) -> Rollout:
        """`RolloutEngine.sample` by `sample_groups`. `tools`: this rollout's handler, instead
        of the engine's (an environment's rows each have their own)."""
        return sample_groups(
            self.model,
            self.tokenizer,
            prompts,
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop=stop,
            seed=seed,
            chat_template=self.chat_template,
            lockstep=self.lockstep,
            tools=tools or self.tools,
        )

    def policy_updated(self, version: int) -> None:
        """Nothing to do: the engine samples with the policy itself."""

    def close(self) -> None:
        """Nothing to free: the policy is the caller's."""
