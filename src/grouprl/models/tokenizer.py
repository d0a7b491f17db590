"""The character-level tokenizer of the built-in model, made with the `tokenizers` library.

One token per character: a WordLevel vocabulary over single characters, a pre-tokenizer that
isolates every character (spaces and newlines included), and a Fuse decoder that joins tokens
back without inserting spaces, so ``decode(encode(s)) == s`` for every string over the
alphabet. It is saved as an ordinary `PreTrainedTokenizerFast` (`tokenizer.json` plus
`tokenizer_config.json`) that `AutoTokenizer.from_pretrained` loads.

Special tokens: ``<pad>`` (id 0), ``<bos>`` (1), ``<eos>`` (2), ``<unk>`` (3). Encoding with
``add_special_tokens=True`` (the default) puts ``<bos>`` before the text, as Llama tokenizers do;
`grouprl sft` trains with it and `grouprl.rollout` samples with it, so a prompt always starts
with ``<bos>``. ``<eos>`` is never added by encoding: the model writes it to end a completion.

A character outside the alphabet (``€``, an emoji, a non-ASCII digit) becomes one ``<unk>``
token, and decoding with ``skip_special_tokens=True`` drops it: such strings do not round-trip,
and the model has never seen ``<unk>``. As in every Hugging Face tokenizer, the literal text of a
special token (``"<eos>"``) in a string is read as that special token.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

#: Printable ASCII (letters, digits, punctuation, space, tab, newline): the arithmetic task uses
#: only digits and ``+-=,|``; the rest lets other plain-text tasks run through the same model.
DEFAULT_ALPHABET = "".join(c for c in string.printable if c not in "\x0b\x0c")


def build_char_tokenizer(
    alphabet: str = DEFAULT_ALPHABET, *, model_max_length: int = 1024
) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over `alphabet` (duplicates ignored, order kept)."""
    chars = list(dict.fromkeys(alphabet))
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # [\s\S] rather than "." so that newlines are characters too.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, path: str | Path) -> None:
    """`save_pretrained`, naming the class `PreTrainedTokenizerFast` in tokenizer_config.json.

    transformers 5 writes its new class name `TokenizersBackend`, which transformers 4 cannot
    load; `PreTrainedTokenizerFast` names the same class in both (in 5 it is an alias).
    """
    tokenizer.save_pretrained(path)
    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
