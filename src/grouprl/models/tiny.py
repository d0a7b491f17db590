"""Tiny models: the built-in model's architecture, and a random chat model for smoke tests.

Nothing here is home-made: `tiny_llama_config` fills a `LlamaConfig`, and `build_tiny_llama`
instantiates `LlamaForCausalLM` with transformers' own initialisation (seed torch first). The
default size (hidden 128, 4 layers, 4 heads, MLP 512, tied embeddings, 102-token vocabulary)
has 1.06M parameters, 4.2 MB of float32 safetensors.

`save_tiny_chat_model` writes a random Qwen2 with everything a real instruct model brings: a
byte-level BPE tokenizer (trained on the spot with `tokenizers`), a ChatML chat template and
two EOS ids in its generation config. It says nothing useful, but a pipeline that runs with it
(chat prompts, stop tokens, rewards on messages) runs with Qwen2.5-Instruct too.
`save_tiny_moe_model` writes the same with a mixture-of-experts decoder (Qwen3-MoE, OLMoE or
Mixtral: 4 experts, 2 a token).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)


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


def build_tiny_moe(
    tokenizer: PreTrainedTokenizerBase, size: TinySize, experts: int, per_token: int
):
    """A freshly initialised tiny Qwen3-MoE for `tokenizer`: `size`'s shape with every MLP a
    mixture of `experts` experts, `per_token` a token (renormalised, as Qwen3-MoE's own), each
    of inner size intermediate_size / per_token, so a token costs what the dense MLP costs
    (call torch.manual_seed first)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    dense = tiny_llama_config(tokenizer, size)
    config = Qwen3MoeConfig(
        vocab_size=dense.vocab_size, hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size, num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads, num_key_value_heads=size.num_heads,
        head_dim=size.hidden_size // size.num_heads, max_position_embeddings=size.max_positions,
        tie_word_embeddings=True, num_experts=experts, num_experts_per_tok=per_token,
        moe_intermediate_size=size.intermediate_size // per_token, norm_topk_prob=True,
        bos_token_id=dense.bos_token_id, eos_token_id=dense.eos_token_id,
        pad_token_id=dense.pad_token_id,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


#: Qwen's ChatML chat template, reduced to what prompts and replies need.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Qwen2.5's tool-use template, reduced: tools listed in the system turn as JSON schemas, calls
#: as `<tool_call>` blocks in the assistant turn, consecutive results in one user turn of
#: `<tool_response>` blocks. Prefix-preserving, as Qwen2.5's own is.
QWEN25_TOOLS = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content }}
    {%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and '
        'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
        '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first)
        or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
_CORPUS = [
    "What is 12 plus 30? The answer is 42.",
    "<think>add the tens then the ones</think> <answer>42</answer>",
    "Compute \\boxed{7} and #### 1,200 dollars.",
    "system user assistant question answer solution",
] * 20


def save_tiny_chat_model(
    directory: str | Path,
    *,
    seed: int = 0,
    template: str = CHATML,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    added_tokens: Sequence[str] = (),
):
    """Save a random 2-layer Qwen2 (hidden 32, 2 heads, 1 KV head) with a byte-level BPE
    tokenizer (300 tokens, and `added_tokens` after them, each one token, e.g. Qwen3's
    `<tool_call>`), a ChatML template (or `template`, e.g. `QWEN25_TOOLS`), and EOS ids
    `<|im_end|>` and `<|endoftext|>`; returns (model, tokenizer). `hidden_size` 128 gives heads
    of 64, which vLLM's CPU attention runs (it has no kernel for 16)."""
    tokenizer = tiny_chat_tokenizer(template, added_tokens)
    torch.manual_seed(seed)
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=ends[0],
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    _save(model, tokenizer, ends, directory)
    _no_unknown_token(directory, added_tokens)
    return model.eval(), tokenizer


def tiny_chat_tokenizer(template: str = CHATML, added_tokens: Sequence[str] = ()):
    """`save_tiny_chat_model`'s tokenizer: a byte-level BPE of 300 tokens trained on the spot,
    `added_tokens` after them, `template` as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = template
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))
    return tokenizer


#: The mixture-of-experts families `save_tiny_moe_model` writes: (config class, model class,
#: their experts' settings).
MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2}),
}  # fmt: skip


def save_tiny_moe_model(
    directory: str | Path, family: str = "qwen3_moe", *, seed: int = 0, hidden_size: int = 32
):
    """Save a random 2-layer mixture-of-experts chat model of `family` (`MOE_FAMILIES`: 4
    experts, 2 a token, hidden 32, or 128 for heads of 64, which vLLM's CPU attention runs)
    with `save_tiny_chat_model`'s tokenizer and template; returns (model, tokenizer)."""
    import transformers

    config_class, model_class, experts = MOE_FAMILIES[family]
    _, tokenizer = save_tiny_chat_model(directory, seed=seed)
    torch.manual_seed(seed)
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=ends[0], pad_token_id=tokenizer.pad_token_id,
        head_dim=hidden_size // 2, **experts,
    )  # fmt: skip
    model = getattr(transformers, model_class)(config)
    _save(model, tokenizer, ends, directory)
    return model.eval(), tokenizer


def _save(model, tokenizer, ends: list[int], directory: str | Path) -> None:
    model.generation_config.eos_token_id = ends  # as Qwen2.5-Instruct lists its two
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _no_unknown_token(directory: str | Path, added_tokens: Sequence[str]) -> None:
    if added_tokens:  # no unknown token, as Qwen3's own config says (Qwen2's class default
        # would make <|endoftext|> the unknown token, which renderers' Qwen3 renderer refuses)
        config_file = Path(directory) / "tokenizer_config.json"
        values = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**values, "unk_token": None}, indent=2))


#: ChatML with image parts: each `{"type": "image"}` part is the processor's image placeholder.
CHATML_IMAGES = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: The vision-language families `save_tiny_vlm` writes; their processors need no torchvision.
VLM_FAMILIES = ("idefics3", "llava", "gemma3")
#: Gemma 3's image parts: its processor expands `<start_of_image>` into the image's tokens.
CHATML_GEMMA_IMAGES = CHATML_IMAGES.replace("<image>", "<start_of_image>")


def save_tiny_vlm(directory: str | Path, family: str = "idefics3", *, seed: int = 0):
    """Save `build_tiny_vlm(family, seed=seed)` with its processor; returns (model, processor)."""
    model, processor = build_tiny_vlm(family, seed=seed)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return model, processor


def build_tiny_vlm(family: str = "idefics3", *, seed: int = 0):
    """A random vision-language chat model of `family` (`VLM_FAMILIES`) with its processor:
    64x64-pixel images in 16-pixel patches through a 2-layer vision encoder (hidden 128),
    a 2-layer Llama decoder (hidden 128, heads of 64, which vLLM's CPU attention runs),
    `tiny_chat_tokenizer` with the image tokens added, and ChatML with image parts; an image is
    4 tokens (Idefics3) or 16 (LLaVA). Returns (model, processor), the model in eval mode."""
    import transformers as hf

    if family == "gemma3":
        return _tiny_gemma3(seed)
    tokenizer = tiny_chat_tokenizer(
        CHATML_IMAGES, ["<image>", "<fake_token_around_image>", "<global-img>"]
    )
    tokenizer.pad_token = "<|endoftext|>"
    torch.manual_seed(seed)
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2)  # fmt: skip
    text = LlamaConfig(
        vocab_size=len(tokenizer), num_key_value_heads=1, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=ends[0], pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False, **shape,
    )  # fmt: skip
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    if family == "idefics3":
        images = hf.Idefics3ImageProcessorPil(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 64},
            do_image_splitting=False,
        )  # fmt: skip
        processor = hf.Idefics3Processor(image_processor=images, tokenizer=tokenizer,
                                         image_seq_len=4, chat_template=CHATML_IMAGES)  # fmt: skip
        config = hf.Idefics3Config(
            vision_config=hf.Idefics3VisionConfig(image_size=64, patch_size=16, **shape),
            text_config=text, image_token_id=image_id, scale_factor=2,
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        model = hf.Idefics3ForConditionalGeneration(config)
    elif family == "llava":
        images = hf.CLIPImageProcessorPil(size={"shortest_edge": 64},
                                          crop_size={"height": 64, "width": 64})  # fmt: skip
        processor = hf.LlavaProcessor(
            image_processor=images, tokenizer=tokenizer, patch_size=16,
            vision_feature_select_strategy="default", num_additional_image_tokens=1,
            chat_template=CHATML_IMAGES,
        )  # fmt: skip
        config = hf.LlavaConfig(
            vision_config=hf.CLIPVisionConfig(image_size=64, patch_size=16, projection_dim=128,
                                              **shape),
            text_config=text, image_token_index=image_id, image_seq_length=16,
            vision_feature_select_strategy="default", vision_feature_layer=-2,
        )  # fmt: skip
        model = hf.LlavaForConditionalGeneration(config)
    else:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(VLM_FAMILIES)}")
    model.generation_config.eos_token_id = ends
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), processor


def _tiny_gemma3(seed: int):
    """`build_tiny_vlm`'s Gemma 3: a 2-layer SigLIP encoder whose 16 patches are pooled into 4
    image tokens, a 2-layer Gemma 3 decoder (its sliding window of 128 as Gemma's layers
    alternate), its processor's image, begin and end tokens added to the tokenizer. Gemma 3
    zero-initialises its projection, which would make a random model blind: drawn here."""
    import transformers as hf

    base = tiny_chat_tokenizer(CHATML_GEMMA_IMAGES)
    specials = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>"}  # fmt: skip
    base.add_tokens(list(specials.values()))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", extra_special_tokens=specials,
    )  # fmt: skip
    tokenizer.chat_template = CHATML_GEMMA_IMAGES
    images = hf.Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    processor = hf.Gemma3Processor(image_processor=images, tokenizer=tokenizer,
                                   image_seq_length=4, chat_template=CHATML_GEMMA_IMAGES)  # fmt: skip
    torch.manual_seed(seed)
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2)  # fmt: skip
    text = hf.Gemma3TextConfig(
        vocab_size=len(tokenizer), num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
        sliding_window=128, max_position_embeddings=1024, bos_token_id=None,
        eos_token_id=ends[0], pad_token_id=tokenizer.pad_token_id, **shape,
    )  # fmt: skip
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in specials.items()}
    config = hf.Gemma3Config(
        text_config=text, vision_config=hf.SiglipVisionConfig(image_size=64, patch_size=16,
                                                              **shape),
        mm_tokens_per_image=4, boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"],
    )  # fmt: skip
    model = hf.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.05)
    model.generation_config.eos_token_id = ends
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), processor
