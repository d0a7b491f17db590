# The dataset-free IncrementEnv example of TRL's docs/source/grpo_trainer.md (huggingface/trl)
# as its authors wrote it, with the import changed to grouprl.trl, the hub model replaced by the
# tiny Qwen2.5-template chat model ($TINY_MODEL), and max_steps and max_completion_length made
# small (report_to is "none" by default).

import os
import random

from grouprl.trl import GRPOConfig, GRPOTrainer


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


trainer = GRPOTrainer(
    model=os.environ["TINY_MODEL"],
    args=GRPOConfig(
        max_steps=2, max_completion_length=48, chat_template_kwargs={"enable_thinking": False}
    ),
    environment_factory=IncrementEnv,
)
trainer.train()
