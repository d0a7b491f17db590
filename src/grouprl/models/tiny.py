"""The architecture of the built-in model: a standard transformers Llama, about 1M parameters.

Nothing here is home-made: `tiny_llama_config` fills a `LlamaConfig`, and `build_tiny_llama`
instantiates `LlamaForCausalLM` with transformers' own initialisation (seed torch first). The
default size (hidden 128, 4 layers, 4 heads, MLP 512, tied embeddings, 102-token vocabulary)
has 1.06M parameters, 4.2 MB of float32 safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase


@dataclass(frozen=True)
class TinySize:
    """Shape of a tiny Llama."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    max_positions: int = 256


def tiny_llama_config(tokenizer: PreTrainedTokenizerBase, size: TinySize) -> LlamaConfig:
    """A LlamaConfig sized by `size` whose special-token ids match `tokenizer`."""
    if size.hidden_size % size.num_heads:
        raise ValueError(f"hidden_size {size.hidden_size} not divisible by {size.num_heads} heads")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_heads,
        max_position_embeddings=size.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_llama(tokenizer: PreTrainedTokenizerBase, size: TinySize) -> LlamaForCausalLM:
    """A freshly initialised tiny Llama for `tokenizer` (call torch.manual_seed first)."""
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, size))
    # generation_config.json: generate() stops at <eos> and pads with <pad> by default.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model
