"""A reward model as a reward function: a local `AutoModelForSequenceClassification` directory.

It scores prompt + completion, the first logit being the reward, as TRL's GRPOTrainer does:
string prompts are joined with their completion; conversational ones are rendered with the
reward model's own chat template (prompt messages, then the assistant's completion).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from grouprl.errors import UserError, one_line
from grouprl.messages import is_conversational


class RewardModel:
    """Callable with TRL's reward signature; runs without gradients in batches of `batch_size`."""

    def __init__(self, path: Path | str, *, device: Any = "cpu", batch_size: int = 16) -> None:
        """`path`: a directory, or a hub id (from the hub's cache, or downloaded)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        local = Path(path).expanduser().is_dir()
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, local_files_only=local
            )
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local)
        except Exception as err:
            raise UserError(
                f"cannot load a sequence-classification reward model from {path}: {one_line(err)}"
            ) from None
        self.model.to(device).eval().requires_grad_(False)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size
        self.__name__ = Path(path).resolve().name

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """What the reward model reads for each completion."""
        if is_conversational(prompts[0]):
            if not getattr(self.tokenizer, "chat_template", None):
                raise UserError(
                    f"reward model {self.__name__} has no chat template for conversational data"
                )
            return [
                self.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False)
                for p, c in zip(prompts, completions)
            ]
        return [p + c for p, c in zip(prompts, completions)]

    def __call__(self, completions: Sequence[Any], prompts: Sequence[Any], **kwargs: Any):
        return self.score_texts(self.texts(prompts, completions))

    def score_queries(self, queries: Sequence[Any]) -> list[float]:
        """Scores of whole queries (prompt and completion together: `grouprl serve`'s
        /get_reward): strings as they are, message lists rendered by the model's template."""
        texts = []
        for q in queries:
            if isinstance(q, str):
                texts.append(q)
            elif isinstance(q, list) and getattr(self.tokenizer, "chat_template", None):
                texts.append(self.tokenizer.apply_chat_template(q, tokenize=False))
            else:
                raise ValueError("a query is a string, or a list of messages for a reward "
                                 "model with a chat template")  # fmt: skip
        return self.score_texts(texts)

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        device = next(self.model.parameters()).device
        scores: list[float] = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    texts[i : i + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    add_special_tokens=False,
                ).to(device)
                scores += self.model(**batch).logits[:, 0].float().tolist()
        return scores
