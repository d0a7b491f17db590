"""Load Hugging Face causal LMs and tokenizers: local directories, `builtin:NAME`, hub ids.

A model spec is
- `builtin:NAME`: a directory shipped inside the package under `models/builtin/NAME`;
- a local path: any directory `save_pretrained` wrote, or a `.gguf` file (llama.cpp's format,
  dequantised by transformers into a plain float32 model of its architecture; needs `gguf`);
- anything else that looks like a hub id (`Qwen/Qwen2.5-0.5B-Instruct`): passed to
  `from_pretrained` as it is, so the hub's cache and download behaviour apply. Offline
  (`HF_HUB_OFFLINE=1`, or no network) an id that is not in the cache fails with one line.

All three go through `AutoModelForCausalLM` / `AutoTokenizer`, so the bundled model takes the
same code path as a user's model. Code from a model repository runs only with
`trust_remote_code=True`.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from grouprl.errors import UserError, one_line
from grouprl.models import vision

BUILTIN_PREFIX = "builtin:"
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"

#: The lowest transformers GGUF loading is tested with: how 5.x attaches its GGUF quantizer and
#: names the dequantised weights has changed between releases, and the suite's lowest-versions
#: environment (transformers 5.0) does not cover it.
GGUF_TRANSFORMERS = "5.24"
#: `--base-dtype` / `--precision` spellings.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# A hub id: "name" or "owner/name", letters, digits, "-", "_", "." (not starting with "." or "-").
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def builtin_models() -> list[str]:
    """Names of the bundled models (`builtin:NAME` specs)."""
    if not BUILTIN_DIR.is_dir():
        return []
    return sorted(p.name for p in BUILTIN_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model_path(spec: str | Path) -> Path | str:
    """The local directory a model spec names, or the spec itself when it is a hub id.

    UserError when it names neither: a bundled model that does not exist, a local path that is
    missing or is not a model directory, or a string that cannot be a hub id.
    """
    spec = str(spec)
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX) :]
        path = BUILTIN_DIR / name
        if not (path / "config.json").is_file():
            valid = ", ".join(BUILTIN_PREFIX + n for n in builtin_models()) or "none"
            raise UserError(f"no bundled model {spec!r}; bundled models: {valid}")
        return path
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise UserError(f"model {spec!r}: no such GGUF file; check the path")
        return path
    if path.exists():
        if is_adapter_dir(path):
            return path
        if path.is_dir() and (path / "config.yaml").is_file() and (path / "final").is_dir():
            raise UserError(
                f"{spec!r} is a grouprl run directory; its trained model is {path / 'final'}"
            )
        if not path.is_dir() or not (path / "config.json").is_file():
            raise UserError(
                f"model {spec!r} is not a Hugging Face model directory (no config.json); give a "
                "directory written by save_pretrained, a hub id, or builtin:arith"
            )
        return path
    if _HUB_ID.fullmatch(spec) and not spec.endswith((".json", ".safetensors", ".bin")):
        return spec
    raise UserError(
        f"model {spec!r} is not a local directory; give a directory written by "
        "save_pretrained, a hub id such as Qwen/Qwen2.5-0.5B-Instruct, or builtin:arith"
    )


def is_adapter_dir(path: Path) -> bool:
    """A peft adapter directory (a LoRA run's checkpoint or final/adapter): it names its base."""
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


def adapter_base(path: Path) -> str:
    """The base model an adapter directory names."""
    try:
        base = json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]
    except (ValueError, KeyError, TypeError):
        base = None
    if not base:
        raise UserError(f"{path}/adapter_config.json does not name its base model")
    return str(base)


def _not_found(spec: str, what: str) -> UserError:
    return UserError(
        f"{what} {spec!r} is neither a local directory nor a hub id found online or in the "
        "Hugging Face cache (offline, or a typo?); download it with `hf download "
        f"{spec} --local-dir DIR` where there is network, then pass --model DIR"
    )


def _from_pretrained(loader, source: Path | str, what: str, **kwargs):
    """`loader.from_pretrained(source)` with every failure turned into one UserError line (and
    transformers' own load report kept quiet: what matters is checked by the caller)."""
    from transformers.utils import logging as hf_logging

    local = isinstance(source, Path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return loader.from_pretrained(source, local_files_only=local, **kwargs)
    except OSError as err:
        if not local:  # the hub library's "not found / cannot connect" errors are OSErrors
            raise _not_found(str(source), what) from None
        raise UserError(f"cannot load a {what} from {source}: {one_line(err)}") from None
    except ValueError as err:
        if "trust_remote_code" in str(err):
            raise UserError(
                f"{source} needs code from its repository to load; pass --trust-remote-code "
                "if you trust it"
            ) from None
        raise UserError(f"cannot load a {what} from {source}: {one_line(err)}") from None
    except Exception as err:  # a broken user directory fails in many library-specific ways
        raise UserError(f"cannot load a {what} from {source}: {one_line(err)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def is_gguf(source: Path | str) -> bool:
    return isinstance(source, Path) and source.suffix.lower() == ".gguf"


def _check_gguf(path: Path) -> None:
    """A GGUF file that can be read: the `gguf` package installed, the file GGUF's."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"{path} is a GGUF file, which needs gguf: pip install 'grouprl[gguf]'")
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(GGUF_TRANSFORMERS):
        fix = "pip install -U transformers"
        if importlib.util.find_spec("vllm") is not None:  # vLLM 0.32 pins transformers < 5.20
            fix = (
                "vLLM here pins an older one: where transformers is newer, save it as a "
                "directory (grouprl.models.load_model(FILE) and load_tokenizer(FILE), each "
                ".save_pretrained(DIR)) and give DIR"
            )
        raise UserError(
            f"GGUF models need transformers >= {GGUF_TRANSFORMERS} (found "
            f"{transformers.__version__}): {fix}"
        )
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"{path} is not a GGUF file (it does not start with GGUF's magic)")


def _load_gguf(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """A `.gguf` file as a plain model of its architecture: transformers dequantises it to
    float32 but attaches a GGUF quantizer, which `save_pretrained` (every checkpoint, final/)
    refuses; so its weights move into a fresh model built from the same config, without the
    quantization config. The model's name is the file, so a LoRA adapter saved on it names the
    file as its base."""
    _check_gguf(path)
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm  # its own progress bar, which the HF switches do not reach
    gguf_utils.tqdm = lambda items, **kwargs: items
    try:
        quantized = _from_pretrained(
            AutoModelForCausalLM, path.parent, "causal LM", gguf_file=path.name, dtype=torch.float32
        )
    finally:
        gguf_utils.tqdm = bar
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    tied = {k for k in missing if getattr(config, "tie_word_embeddings", False) and "lm_head" in k}
    if set(missing) - tied or unexpected:
        raise UserError(
            f"cannot load {path}: its weights do not match a {type(plain).__name__} "
            f"({len(missing)} missing, {len(unexpected)} unexpected)"
        )
    plain.tie_weights()
    plain.generation_config = quantized.generation_config
    plain.name_or_path = plain.config._name_or_path = str(path)
    # peft looks for a config.json beside the base when it saves an adapter; the file has none
    warnings.filterwarnings("ignore", message=r"Could not find a config file in .*\.gguf")
    del quantized
    return plain.to(dtype)


def resolve_device(spec: str = "auto") -> torch.device:
    """`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`; UserError otherwise."""
    spec = str(spec).strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise UserError(f"unknown device {spec!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                f"device {spec!r} asked for, but torch sees no CUDA GPU; use --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UserError(f"device {spec!r} does not exist: torch sees {count} CUDA GPU(s)")
    elif device.type != "cpu":
        raise UserError(f"unsupported device {spec!r}; use auto, cpu, cuda or cuda:N")
    return device


def load_model(
    spec: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
    revision: str | None = None,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """A causal LM from a local directory, `builtin:NAME` or a hub id, in `dtype` on `device`,
    in eval mode. A LoRA adapter directory loads its base with the adapter merged in.
    `revision` (a hub id's branch, tag or commit) and `attn_implementation` are
    from_pretrained's (None: its defaults)."""
    source = resolve_model_path(spec)
    if isinstance(source, Path) and is_adapter_dir(source):
        from peft import PeftModel

        base = load_model(
            adapter_base(source), dtype=dtype, device=device, trust_remote_code=trust_remote_code,
            revision=revision, attn_implementation=attn_implementation,
        )  # fmt: skip
        with warnings.catch_warnings():  # peft reads attributes transformers 5 deprecates
            warnings.simplefilter("ignore", FutureWarning)
            return PeftModel.from_pretrained(base, source).merge_and_unload().eval()
    if is_gguf(source):
        return _load_gguf(source, dtype).to(device).eval()
    sees_images = _sees_images(source, trust_remote_code, revision)
    model, info = _from_pretrained(
        _image_text_to_text() if sees_images else AutoModelForCausalLM,
        source,
        "vision-language model" if sees_images else "causal LM",
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
        **_hub_kwargs(source, revision),
        **({} if attn_implementation is None else {"attn_implementation": attn_implementation}),
    )
    fresh = sorted(
        {
            *info.get("missing_keys", ()),
            *(k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", ())),
        }
    )
    if fresh:
        raise UserError(
            f"{spec} is not a causal LM whose weights are all there: {len(fresh)} weights would "
            f"start random ({', '.join(fresh[:3])}{', ...' if len(fresh) > 3 else ''}), e.g. a "
            f"{type(model).__name__} head on an encoder; give a model saved as ...ForCausalLM"
        )
    if sees_images:
        vision.check_positions(model, str(spec))
    return model.to(device).eval()


def _sees_images(source: Path | str, trust_remote_code: bool, revision: str | None) -> bool:
    """Whether `source` holds a vision-language model (`grouprl.models.vision`)."""
    from transformers import AutoConfig

    def config(hub_id: str) -> Any:
        return AutoConfig.from_pretrained(hub_id, trust_remote_code=trust_remote_code,
                                          **_hub_kwargs(hub_id, revision))  # fmt: skip

    return vision.config_sees_images(source, config)


def _image_text_to_text() -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText


def _hub_kwargs(source: Path | str, revision: str | None) -> dict[str, str]:
    """from_pretrained's revision for a hub id (a local directory has none)."""
    return {} if revision is None or isinstance(source, Path) else {"revision": revision}


def load_tokenizer(
    spec: str | Path, *, trust_remote_code: bool = False, revision: str | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model, with a pad token.

    A tokenizer without one gets its EOS token as the pad token: no new token, so the
    vocabulary the model sees is unchanged (padded positions are masked everywhere).
    """
    source = resolve_model_path(spec)
    adapter = isinstance(source, Path) and is_adapter_dir(source)
    if adapter and not (source / "tokenizer_config.json").is_file():  # none saved: the base's
        return load_tokenizer(
            adapter_base(source), trust_remote_code=trust_remote_code, revision=revision
        )
    if is_gguf(source):  # the tokenizer, chat template and EOS the file holds
        _check_gguf(source)
        tokenizer = _from_pretrained(
            AutoTokenizer, source.parent, "tokenizer", gguf_file=source.name
        )
    elif _sees_images(source, trust_remote_code, revision):
        processor = vision.load_processor(source, str(spec), trust_remote_code=trust_remote_code,
                                          **_hub_kwargs(source, revision))  # fmt: skip
        return vision.with_processor(with_pad_token(processor.tokenizer, spec), processor)
    else:
        tokenizer = _from_pretrained(
            AutoTokenizer, source, "tokenizer", trust_remote_code=trust_remote_code,
            **_hub_kwargs(source, revision),
        )  # fmt: skip
    return with_pad_token(tokenizer, spec)


def with_pad_token(tokenizer: Any, spec: Any) -> Any:
    """`tokenizer`, given its EOS token as the pad token when it has none."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(f"the tokenizer of {spec} has neither a pad nor an EOS token; add one")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def with_template_variables(tokenizer: Any, variables: dict[str, Any] | None) -> Any:
    """`tokenizer`, its `apply_chat_template` given `variables` (e.g. enable_thinking=False)
    on every call, before the caller's own keywords (which win). The saved tokenizer is
    unchanged: the variables belong to the run, not to the model."""
    if variables:
        render = functools.partial(_render, tokenizer.apply_chat_template, dict(variables))
        tokenizer.apply_chat_template = functools.update_wrapper(render, _render)
    return tokenizer


def _render(render: Any, variables: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
    return render(*args, **{**variables, **kwargs})


def context_length(model: torch.nn.Module) -> int | None:
    """Positions the model can attend over (`max_position_embeddings` and its aliases), or None
    when its config does not say."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
