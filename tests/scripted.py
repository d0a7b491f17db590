"""A scripted causal LM for the multi-turn tests: it writes a fixed script per prompt, greedily,
whatever the sampler feeds it, so a trajectory's ids, masks and log-probs are known in advance."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from transformers import DynamicCache


class ScriptCache(DynamicCache):
    """The scripted model's memory: each row's ids so far (it follows compaction)."""

    rows: list[list[int]]
    prompt: list[int]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        keep = indices.tolist()
        self.rows = [self.rows[i] for i in keep]
        self.prompt = [self.prompt[i] for i in keep]


class Scripted(nn.Module):
    """Writes script[prompt] one character per step, then EOS; logits 2 on the script's token,
    0 elsewhere, so its log-prob is log(e² / (e² + V − 1)) at every sampled position."""

    def __init__(self, tokenizer, scripts: dict[str, str] | None = None, *,
                 ids: dict[tuple[int, ...], list[int]] | None = None) -> None:  # fmt: skip
        """`scripts`: prompt text -> script text; or `ids`: prompt ids -> script ids (for
        scripts whose pieces must keep the ids they are encoded to one by one)."""
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.tokenizer, self.vocab = tokenizer, len(tokenizer)
        self.scripts = dict(ids or {})
        for p, s in (scripts or {}).items():
            key = tuple(tokenizer(p)["input_ids"])
            self.scripts[key] = tokenizer(s, add_special_tokens=False)["input_ids"]
        self.eos = tokenizer.eos_token_id
        self.config = SimpleNamespace(model_type="scripted", _attn_implementation="eager")
        self.generation_config = SimpleNamespace(eos_token_id=self.eos)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=True, logits_to_keep=0):  # fmt: skip
        cache = past_key_values
        if not getattr(cache, "rows", None):  # the prefill: one row per prompt
            cache.rows = [[t for t, m in zip(r, a) if m] for r, a in
                          zip(input_ids.tolist(), attention_mask.tolist())]  # fmt: skip
            cache.prompt = [len(r) for r in cache.rows]
        else:
            if len(cache.rows) < input_ids.shape[0]:  # expanded to the groups
                g = input_ids.shape[0] // len(cache.rows)
                cache.rows = [list(r) for r in cache.rows for _ in range(g)]
                cache.prompt = [p for p in cache.prompt for _ in range(g)]
            for row, ids in zip(cache.rows, input_ids.tolist()):
                row.extend(ids)
        logits = torch.zeros(input_ids.shape[0], 1, self.vocab)
        for i, (row, p) in enumerate(zip(cache.rows, cache.prompt)):
            logits[i, 0, self.next_token(row, p)] = 2.0
        return SimpleNamespace(logits=logits)

    def next_token(self, row: list[int], prompt: int) -> int:
        """The token a row whose first `prompt` ids are its prompt writes next."""
        script = self.scripts[tuple(row[:prompt])]
        done = len(row) - prompt
        return script[done] if done < len(script) else self.eos
