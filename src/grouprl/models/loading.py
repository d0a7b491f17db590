"""Load Hugging Face causal LMs and tokenizers from local directories or `builtin:NAME`.

Nothing is downloaded: a spec is either a local model directory (anything `save_pretrained`
wrote) or `builtin:NAME`, a directory shipped inside the package under `models/builtin/NAME`.
Loading goes through `AutoModelForCausalLM` / `AutoTokenizer` with `local_files_only=True`, so
the bundled model takes the same code path as a user's model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from grouprl.errors import UserError

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"


def builtin_models() -> list[str]:
    """Names of the bundled models (`builtin:NAME` specs)."""
    if not BUILTIN_DIR.is_dir():
        return []
    return sorted(p.name for p in BUILTIN_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model_path(spec: str | Path) -> Path:
    """The local directory a model spec names; UserError when there is none."""
    spec = str(spec)
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX) :]
        path = BUILTIN_DIR / name
        if not (path / "config.json").is_file():
            valid = ", ".join(BUILTIN_PREFIX + n for n in builtin_models()) or "none"
            raise UserError(f"no bundled model {spec!r}; bundled models: {valid}")
        return path
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(
            f"model {spec!r} is not a local directory (grouprl downloads nothing); give a "
            "directory written by save_pretrained, or builtin:arith"
        )
    if not path.is_dir() or not (path / "config.json").is_file():
        raise UserError(
            f"model {spec!r} is not a Hugging Face model directory (no config.json); give a "
            "directory written by save_pretrained, or builtin:arith"
        )
    return path


def _one_line(err: Exception) -> str:
    first = str(err).strip().splitlines()
    return f"{type(err).__name__}: {first[0] if first else ''}"


def load_model(spec: str | Path, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A causal LM from a local directory or `builtin:NAME`, in `dtype`, in eval mode."""
    path = resolve_model_path(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except Exception as err:  # a broken user directory fails in many library-specific ways
        raise UserError(f"cannot load a causal LM from {path}: {_one_line(err)}") from None
    return model.eval()


def load_tokenizer(spec: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model; its pad token is set (to EOS when it had none)."""
    path = resolve_model_path(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:
        raise UserError(f"cannot load a tokenizer from {path}: {_one_line(err)}") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(f"the tokenizer in {path} has neither a pad nor an EOS token; add one")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
