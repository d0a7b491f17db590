"""Tiny random Llama and Qwen2 models with a character-level tokenizer, built locally.

Nothing is downloaded: the tokenizer is assembled from a `tokenizers` WordLevel model over single
characters and wrapped in `PreTrainedTokenizerFast` with pad/bos/eos; the models are random
4-layer, hidden-64 configs. Session-scoped, so the suite builds each once.
"""

from __future__ import annotations

import string

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from numerics import to_float64

ALPHABET = string.digits + string.ascii_lowercase + " +-*=?:.,|\n"
PAD, BOS, EOS, UNK = 0, 1, 2, 3


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; `<bos>` prepended on encode; ids 0-3 are pad, bos, eos, unk."""
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(dict.fromkeys(ALPHABET)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", BOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def build_model(
    arch: str,
    vocab_size: int,
    *,
    seed: int = 0,
    logit_scale: float = 1.0,
    sliding_window: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """A random 4-layer, hidden-64 causal LM in eval mode; `logit_scale` sharpens its outputs,
    `sliding_window` (Qwen2 only) makes the last two layers sliding-window layers. float64 for
    the tests that claim two paths compute the same thing (see tests/numerics.py)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        window = dict(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=2)
        model = Qwen2ForCausalLM(Qwen2Config(**common, **(window if sliding_window else {})))
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return (to_float64(model) if dtype == torch.float64 else model.to(dtype)).eval()


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def model(request, tokenizer):
    return build_model(request.param, len(tokenizer))


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def model64(request, tokenizer):
    return build_model(request.param, len(tokenizer), dtype=torch.float64)


@pytest.fixture(scope="session")
def make_model(tokenizer):
    """Factory for a fresh model (for tests that modify it): make_model("llama" | "qwen2")."""
    return lambda arch="llama", **kwargs: build_model(arch, len(tokenizer), **kwargs)


@pytest.fixture(scope="session")
def llama(tokenizer):
    return build_model("llama", len(tokenizer))


@pytest.fixture(scope="session")
def llama64(tokenizer):
    return build_model("llama", len(tokenizer), dtype=torch.float64)


@pytest.fixture(scope="session")
def sharp_llama(tokenizer):
    """Random logits have a std of ~0.1 (near-uniform); ×30 gives a peaked distribution."""
    return build_model("llama", len(tokenizer), seed=1, logit_scale=30.0)
