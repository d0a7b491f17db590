"""Models: loading HF causal LMs and tokenizers (local paths, `builtin:NAME`), the character
tokenizer and tiny Llama of the bundled model, and the bundled model itself (`builtin/arith`)."""

from grouprl.models.loading import builtin_models, load_model, load_tokenizer, resolve_model_path
from grouprl.models.tokenizer import build_char_tokenizer, save_tokenizer

__all__ = [
    "build_char_tokenizer",
    "builtin_models",
    "load_model",
    "load_tokenizer",
    "resolve_model_path",
    "save_tokenizer",
]
