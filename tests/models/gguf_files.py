"""A tiny Llama with a byte-level BPE tokenizer written as a GGUF file, the way llama.cpp's
converter writes one: llama metadata, the tokenizer's tokens, types and merges, F32 tensors,
and q/k projection rows permuted into llama.cpp's rotary layout (transformers undoes it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HEADS, KV_HEADS, HIDDEN, LAYERS = 4, 2, 32, 2


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["1+1=2", "12+7=19", "what is 3+4? 7", "the answer is 42"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text, trainer)
    return tok


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's layout for q/k rows: each head's two rotary halves interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_tiny_llama(path: Path, *, permute_qk: bool = True, seed: int = 0):
    """(the source LlamaForCausalLM, its `tokenizers` tokenizer) after writing them to `path`."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer()
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    merges = json.loads(tok.to_str())["model"]["merges"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
        bos_token_id=vocab["<|im_start|>"], eos_token_id=vocab["<|im_end|>"],
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(64)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIAL else gguf.TokenType.NORMAL for t in tokens]
    )
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template(CHAT)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    qk = permute if permute_qk else (lambda x, heads: x)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(LAYERS):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(b + "attn_q.weight", qk(sd[p + "self_attn.q_proj.weight"], HEADS))
        w.add_tensor(b + "attn_k.weight", qk(sd[p + "self_attn.k_proj.weight"], KV_HEADS))
        w.add_tensor(b + "attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(b + "attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(b + "ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(b + "ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(b + "ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, tok
