"""Suite-wide settings: offline Hugging Face libraries, a private datasets cache, one torch
thread per test.

Nothing may be downloaded: `HF_HUB_OFFLINE` and `HF_DATASETS_OFFLINE` make a hub id that is not
cached fail at once instead of retrying the network (set before any HF library is imported).

The models in the tests are tiny, so a second thread buys little, and two threads on a 2-core
machine that is also running something else can slow a test down by orders of magnitude (OpenMP
workers spin-waiting for a core). One thread also makes timings and results repeatable.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _private_datasets_cache(tmp_path_factory):
    """`datasets` writes Arrow caches of loaded files: keep them out of the home directory
    (read when `datasets` is first imported, which grouprl does lazily, inside a test)."""
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf_datasets_cache"))


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---------------------------------------------------------------------------------------------
# A tiny chat model of the kind users bring: Qwen2 with a byte-level BPE tokenizer trained here,
# a ChatML chat template and two EOS ids, saved as a model directory.

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "What is 12 plus 30? The answer is 42.",
    "<think>add the tens then the ones</think> <answer>42</answer>",
    "Compute \\boxed{7} and #### 1,200 dollars.",
    "system user assistant question answer solution",
] * 20


def build_chat_model(directory, *, seed: int = 0):
    """Save a random 2-layer Qwen2 (hidden 32) and its BPE tokenizer (vocab ~300) to
    `directory`; returns (model, tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    model.generation_config.eos_token_id = ends  # two EOS ids, as Qwen2.5-Instruct lists
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat_model")
    build_chat_model(directory)
    return directory
