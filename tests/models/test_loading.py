"""Model and tokenizer loading: local directories, builtin:NAME, and clear errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from grouprl.errors import UserError
from grouprl.models import (
    build_char_tokenizer,
    builtin_models,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from grouprl.models.loading import BUILTIN_DIR
from grouprl.models.tiny import TinySize, build_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = build_char_tokenizer("0123456789+=|,")
    torch.manual_seed(0)
    build_tiny_llama(tokenizer, TinySize(32, 1, 2, 64, 64)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_builtin_spec_resolves_to_the_package_directory() -> None:
    assert "arith" in builtin_models()
    path = resolve_model_path("builtin:arith")
    assert path == BUILTIN_DIR / "arith" and (path / "config.json").is_file()


def test_local_directory_loads(tiny_dir) -> None:
    model = load_model(str(tiny_dir))
    assert not model.training and model.dtype == torch.float32
    assert load_model(tiny_dir, dtype=torch.bfloat16).dtype == torch.bfloat16
    tokenizer = load_tokenizer(tiny_dir)
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 2


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("builtin:nope", r"no bundled model 'builtin:nope'; bundled models: builtin:arith"),
        ("/no/such/dir", "not a local directory"),
        ("./relative/missing", "not a local directory"),
        ("Qwen/Qwen2.5-0.5B", r"neither a local directory nor a hub id found .* --model DIR"),
    ],
)
def test_missing_models_raise_user_error(spec: str, match: str) -> None:
    with pytest.raises(UserError, match=match):
        load_model(spec)
    with pytest.raises(UserError, match=match):
        load_tokenizer(spec)


def test_directory_without_config_raises_user_error(tmp_path) -> None:
    (tmp_path / "file.txt").write_text("x")
    for spec in (tmp_path, tmp_path / "file.txt"):
        with pytest.raises(UserError, match=r"no config\.json"):
            load_model(str(spec))


def test_broken_weights_raise_user_error(tiny_dir, tmp_path) -> None:
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="cannot load"):
        load_model(tmp_path)


def test_tokenizer_without_pad_gets_eos_as_pad(tiny_dir, tmp_path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == "<eos>" and loaded.pad_token_id == loaded.eos_token_id


def _remote_code_model(tiny_dir, tmp_path, model_type):
    import json
    import shutil

    target = tmp_path / "remote"
    shutil.copytree(tiny_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {
        "AutoConfig": "configuration_custom.CustomConfig",
        "AutoModelForCausalLM": "modeling_custom.CustomLM",
    }
    (target / "config.json").write_text(json.dumps(config))
    for name in ("configuration_custom.py", "modeling_custom.py"):
        (target / name).write_text("raise RuntimeError('repository code ran')\n")
    return target


def test_code_from_a_model_repository_runs_only_when_trusted(tiny_dir, tmp_path) -> None:
    known = _remote_code_model(tiny_dir, tmp_path, "llama")
    load_model(known)  # a known architecture: loaded without running the repository's code
    with pytest.raises(UserError, match="repository code ran"):
        load_model(known, trust_remote_code=True)
    (tmp_path / "remote").rename(tmp_path / "known")
    custom = _remote_code_model(tiny_dir, tmp_path, "custom_arch_xyz")
    with pytest.raises(UserError, match=r"needs code from its repository.*--trust-remote-code"):
        load_model(custom)


def test_devices() -> None:
    from grouprl.models.loading import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert load_model("builtin:arith", device=resolve_device("auto")).device.type == expected
    for spec, message in [("tpu", "unknown device 'tpu'"), ("mps", "unsupported device")]:
        with pytest.raises(UserError, match=message):
            resolve_device(spec)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="torch sees no CUDA GPU; use --device cpu"):
            resolve_device("cuda:0")
