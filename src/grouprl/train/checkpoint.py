"""Atomic, verified, pickle-free training checkpoints that are also model directories.

A checkpoint is a directory `checkpoints/step_000120/` holding
  the policy as `save_pretrained` writes it: config.json and model*.safetensors for full
      fine-tuning; for LoRA a peft adapter directory (adapter_config.json, which names the base
      model, and adapter_model.safetensors); with the tokenizer's files, so that
      `grouprl eval --model RUN/checkpoints/step_000120` evaluates it and `grouprl train --model
      ...` forks from it
  optimizer.safetensors  the optimizer's per-parameter state tensors
  rng.safetensors        torch's random states (CPU, and each GPU's)
  state.json             step, data position, scheduler step, optimizer hyper-parameters,
                         Python's random state, and whatever else the trainer records
  manifest.json          every other file's size and sha256
It is written under a temporary name, every file fsync'ed, re-read and checked against its
manifest, then renamed into place; only then are older checkpoints deleted. A crash leaves the
old set or the new one, never a half-written checkpoint. Loading checks the manifest first and
falls back to the newest intact checkpoint (with a warning) when a file was truncated, changed or
lost. Loading reads only safetensors and JSON: nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from grouprl.errors import UserError
from grouprl.faults import fault
from grouprl.train.parallel.fsdp import load_full_state

PREFIX = "step_"
MANIFEST = "manifest.json"
FORMAT = 2
_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories (complete or not, verified or not), oldest first; temporary and
    set-aside directories are not listed."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and p.name[5:].isdigit()]
    return sorted(found, key=step_of)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest(directory: Path) -> dict[str, Any]:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    return {
        "format": FORMAT,
        "files": {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files},
    }


def damage(path: Path, *, checksums: bool = True) -> str | None:
    """Why checkpoint `path` cannot be trusted, or None when every file matches its manifest
    (sizes only with `checksums=False`: a quick look that reads no file)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return "no manifest.json (unfinished, or written by an older grouprl)"
    except (ValueError, KeyError, TypeError):
        return "manifest.json is not valid"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["size"]:
            return f"{name} has {file.stat().st_size} bytes, not {expected['size']}"
        if checksums and _sha256(file) != expected["sha256"]:
            return f"{name} does not match its checksum"
    if "state.json" not in files:
        return "state.json is missing"
    return None


def latest_checkpoint(
    run_dir: Path, *, warn: Callable[[str], None] | None = None, set_aside: bool = False
) -> Path | None:
    """The newest intact checkpoint. Damaged ones newer than it are reported through `warn`,
    and with `set_aside` (a resume, which will write steps after the intact one) renamed out of
    the way, so that none of them can later pass for the newest checkpoint.

    None when the run has no checkpoint at all; UserError when it has some and none is intact.
    """
    found = list_checkpoints(run_dir)
    problems = []
    for path in reversed(found):
        reason = damage(path)
        if reason is None:
            for damaged, problem in problems:
                if set_aside:
                    _set_aside(damaged, "damaged")
                if warn is not None:
                    warn(f"{problem}; resuming from {path.name} instead")
            return path
        problems.append((path, f"checkpoint {path.name} is damaged ({reason})"))
    if found:
        reasons = "; ".join(problem for _, problem in problems)
        raise UserError(f"no intact checkpoint in {run_dir}: {reasons}; start a new run")
    return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _optimizer_to_files(
    optimizer: torch.optim.Optimizer, sd: dict[str, Any] | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    sd = sd if sd is not None else optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.detach().contiguous().clone()
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_files(
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    meta: dict,
    sharded: torch.nn.Module | None = None,
) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, value in [*tensors.items(), *meta["scalars"].items()]:
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = value
    # Hyper-parameters come from the checkpoint; the kernel choice (fused, foreach, ...) stays
    # the current optimizer's, made for this machine (load_state_dict would take the saved one).
    groups = [
        {
            **{k: tuple(v) if k == "betas" else v for k, v in saved.items()},
            **{k: current[k] for k in _KERNEL_KEYS if k in current},
        }
        for saved, current in zip(meta["param_groups"], optimizer.param_groups, strict=True)
    ]
    if sharded is not None:  # FSDP: each rank keeps its shards of the full state
        load_full_state(sharded, optimizer, None, {"state": state, "param_groups": groups})
        return
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _mismatch(path: Path) -> UserError:
    return UserError(
        f"checkpoint {path} holds other trainable parameters than this model has (a different "
        "model, or other --lora-r / --lora-target-modules than the run used); resume with the "
        "run's own settings"
    )


def _load_weights(model: torch.nn.Module, path: Path, *, sharded: bool = False) -> None:
    """Restore the trainable weights from a checkpoint directory: the adapter of a LoRA model,
    or every parameter of a fully trained one (tied weights are stored once)."""
    if _is_peft(model):
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        file = path / "adapter_model.safetensors"
        if not file.is_file():
            raise _mismatch(path)
        saved = load_file(str(file))
        expected = get_peft_model_state_dict(model)
        if saved.keys() != expected.keys() or any(
            saved[k].shape != expected[k].shape for k in saved
        ):
            raise _mismatch(path)
        set_peft_model_state_dict(model, saved)
        return
    shards = [p for p in path.glob("model*.safetensors")]
    if not shards:
        raise _mismatch(path)
    saved = {k: v for shard in shards for k, v in load_file(str(shard)).items()}
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    if any(k not in params and k not in buffers for k in saved):
        saved = _as_loaded(model, path, saved)
    if any(k not in params and k not in buffers for k in saved) or any(
        (params.get(k, buffers.get(k))).shape != v.shape for k, v in saved.items()
    ):
        raise _mismatch(path)
    loaded = {id(params[k]) for k in saved if k in params}
    if any(id(p) not in loaded for p in params.values()):  # a parameter no file restores
        raise _mismatch(path)
    if sharded:
        load_full_state(model, None, saved, None)
        return
    with torch.no_grad():
        for name, tensor in saved.items():
            (params.get(name) if name in params else buffers[name]).copy_(tensor)


def _as_loaded(model: torch.nn.Module, path: Path, saved: dict[str, torch.Tensor]) -> dict:
    """A checkpoint whose keys are not the model's parameters': transformers' own layout on
    disk (a mixture-of-experts model's fused experts are written one expert a key), read back
    as `from_pretrained` reads it into the model's layout. `saved` itself where it cannot be."""
    from_pretrained = getattr(type(model), "from_pretrained", None)
    if from_pretrained is None:
        return saved
    dtype = next(model.parameters()).dtype
    try:
        loaded = from_pretrained(path, dtype=dtype)
    except Exception:  # not a checkpoint transformers reads: the caller's mismatch
        return saved
    return dict(loaded.state_dict())


def _rng_states() -> dict[str, torch.Tensor]:
    """torch's CPU random state and, where there are GPUs, each one's."""
    states = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            states[f"torch_cuda_{index}"] = state
    return states


def _restore_rng(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["torch_cpu"])
    cuda = [states[f"torch_cuda_{i}"] for i in range(len(states)) if f"torch_cuda_{i}" in states]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


#: The asynchronous sampler's weight versions a checkpoint keeps (`grouprl.train.async_sampler`).
SAMPLER_VERSIONS = "sampler_versions.safetensors"


def _write(tmp: Path, step: int, model, tokenizer, optimizer, scheduler, state, full,
           versions) -> None:  # fmt: skip
    weights, optimizer_state = full if full is not None else (None, None)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=weights)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    fault("checkpoint")  # half written: the model files are there, the rest is not
    opt_tensors, opt_meta = _optimizer_to_files(optimizer, optimizer_state)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    save_file(_rng_states(), str(tmp / "rng.safetensors"))
    if versions:
        flat = {f"{v}/{name}": t.detach().contiguous().cpu()
                for v, weights in versions.items() for name, t in weights.items()}  # fmt: skip
        save_file(flat, str(tmp / SAMPLER_VERSIONS))
    version, internal, gauss = random.getstate()
    meta = {
        **state,
        "step": step,
        "scheduler": scheduler.state_dict(),
        "optimizer": opt_meta,
        "python_random": [version, list(internal), gauss],
    }
    (tmp / "state.json").write_text(json.dumps(meta, indent=1))
    (tmp / MANIFEST).write_text(json.dumps(_manifest(tmp), indent=1))
    for file in tmp.iterdir():
        _fsync(file)
    _fsync(tmp)


def _set_aside(path: Path, why: str) -> Path:
    """Move a directory out of the way under a name nothing lists; nothing is deleted."""
    target = path.with_name(f".{why}-{path.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.replace(path, target)
    return target


def _remove_checkpoint(path: Path, root: Path) -> None:
    """Delete an old checkpoint, only inside `root`, never following a symlink out of it."""
    if path.parent != root or not path.name.startswith(PREFIX):
        raise ValueError(f"refusing to delete {path}: not a checkpoint of {root}")
    if path.is_symlink():
        path.unlink()  # the link only, never what it points to
    elif path.is_dir():
        shutil.rmtree(path)


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
    keep_last: int,
    tokenizer: Any = None,
    full_state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None,
    sampler_versions: dict[int, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write checkpoint `step` atomically, verify it, then delete all but the newest `keep_last`.

    A step's checkpoint is written once: saving a step that already has an intact checkpoint
    (Ctrl-C right after a periodic save, resuming a finished run) returns it, so there is no
    moment in which that step's only checkpoint is being replaced. A damaged directory of the
    same name is set aside (renamed), not deleted.

    `full_state`: the (weights, optimizer state) of a sharded model, gathered on this rank
    (`fsdp.gather_full_state`); they are written in place of the model's own.
    `sampler_versions`: older versions of the trainable weights an asynchronous sampler still
    samples with (`grouprl.train.async_sampler`), by version.
    """
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    if final.exists():
        if damage(final) is None:
            return final
        _set_aside(final, "damaged")
    tmp = root / f".tmp-{PREFIX}{step:06d}"
    if tmp.is_symlink():
        tmp.unlink()
    shutil.rmtree(tmp, ignore_errors=True)  # our own leftover from a crash mid-write
    tmp.mkdir()
    _write(tmp, step, model, tokenizer, optimizer, scheduler, state, full_state, sampler_versions)
    reason = damage(tmp)  # re-read from disk before anything older goes
    if reason is not None:
        raise OSError(f"checkpoint {final.name} did not verify after writing: {reason}")
    os.replace(tmp, final)
    _fsync(root)
    # The newest keep_last up to this step, this one included; never this one, never a later
    # step (a resume sets damaged later ones aside before it writes).
    older = [
        p
        for p in list_checkpoints(run_dir)
        if step_of(p) < step and damage(p, checksums=False) is None
    ]
    for old in older[: max(0, len(older) - (keep_last - 1))]:
        _remove_checkpoint(old, root)
    return final


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    sharded: bool = False,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and random states in place; return state.json.
    `sharded`: the model is FSDP-sharded; every rank reads the full files and keeps its shards.

    UserError when the checkpoint holds other parameters than `model` trains."""
    meta = json.loads((path / "state.json").read_text())
    _load_weights(model, path, sharded=sharded)
    _optimizer_from_files(
        optimizer,
        load_file(str(path / "optimizer.safetensors")),
        meta["optimizer"],
        sharded=model if sharded else None,
    )
    scheduler.load_state_dict(meta["scheduler"])
    _restore_rng(load_file(str(path / "rng.safetensors")))
    version, internal, gauss = meta["python_random"]
    random.setstate((version, tuple(internal), gauss))
    return meta


def load_sampler_versions(path: Path) -> dict[int, dict[str, torch.Tensor]]:
    """The sampler weight versions checkpoint `path` keeps (empty when it keeps none)."""
    file = path / SAMPLER_VERSIONS
    if not file.exists():
        return {}
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(file)).items():
        version, name = key.split("/", 1)
        out.setdefault(int(version), {})[name] = tensor
    return out
