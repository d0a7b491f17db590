"""Atomic, pickle-free training checkpoints.

A checkpoint is a directory `checkpoints/step_000120/` holding
  model.safetensors      the policy's trainable parameters: all of them, or a LoRA adapter's
                         (the frozen base is the model the run started from)
  optimizer.safetensors  the optimizer's per-parameter state tensors
  rng.safetensors        torch's CPU random state
  state.json             step, data position, scheduler step, optimizer hyper-parameters,
                         Python's random state, and whatever else the trainer records.
It is written under a temporary name, every file fsync'ed, then renamed into place, so a crash
leaves either the old set of checkpoints or the new one, never a half-written directory. Loading
reads only safetensors and JSON: nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from grouprl.errors import UserError

PREFIX = "step_"
_KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories are ignored)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / "state.json").is_file()]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value.detach().contiguous().clone()
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_files(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict
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
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The trainable parameters by name when only some are (LoRA); None when all are."""
    named = dict(model.named_parameters())
    trained = {name: p for name, p in named.items() if p.requires_grad}
    return None if len(trained) == len(named) else trained


def _save_trainable(model: torch.nn.Module, file: Path) -> None:
    trained = _trainable(model)
    if trained is None:
        save_model(model, str(file))  # handles tied weights
    else:
        save_file({k: v.detach().contiguous() for k, v in trained.items()}, str(file))


def _load_trainable(model: torch.nn.Module, file: Path) -> None:
    """Restore the trainable parameters; UserError when the checkpoint holds other ones (the
    model, or its LoRA settings, changed since the run started)."""
    saved = load_file(str(file))
    trained = _trainable(model)
    if trained is None:  # full fine-tuning: tied weights are saved once, under either name
        expected = dict(model.state_dict())
        mismatch = not set(saved) <= set(expected) or any(
            expected[name].shape != tensor.shape for name, tensor in saved.items()
        )
    else:
        expected = trained
        mismatch = saved.keys() != trained.keys() or any(
            trained[name].shape != tensor.shape for name, tensor in saved.items()
        )
    if mismatch:
        raise UserError(
            f"checkpoint {file.parent} holds other trainable parameters than this model has "
            "(a different model, or other --lora-r / --lora-target-modules than the run used); "
            "resume with the run's own settings"
        )
    if trained is None:
        missing, unexpected = load_model(model, str(file), strict=True)
        assert not missing and not unexpected, (missing, unexpected)
        return
    with torch.no_grad():
        for name, param in trained.items():
            param.copy_(saved[name])


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write checkpoint `step` atomically and delete all but the newest `keep_last`.

    A step's checkpoint is written once: saving a step that already has a complete checkpoint
    (Ctrl-C right after a periodic save, resuming a finished run) returns the existing one, so no
    moment exists in which that step's only checkpoint is being replaced.
    """
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    if (final / "state.json").is_file():
        return final
    tmp = root / f".tmp-{PREFIX}{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()

    _save_trainable(model, tmp / "model.safetensors")
    opt_tensors, opt_meta = _optimizer_to_files(optimizer)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
    version, internal, gauss = random.getstate()
    meta = {
        **state,
        "step": step,
        "scheduler": scheduler.state_dict(),
        "optimizer": opt_meta,
        "python_random": [version, list(internal), gauss],
    }
    (tmp / "state.json").write_text(json.dumps(meta, indent=1))
    for file in tmp.iterdir():
        _fsync(file)
    _fsync(tmp)

    if final.exists():  # an incomplete directory left by a crash: not a checkpoint
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)

    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and random states in place; return state.json."""
    meta = json.loads((path / "state.json").read_text())
    _load_trainable(model, path / "model.safetensors")
    _optimizer_from_files(
        optimizer, load_file(str(path / "optimizer.safetensors")), meta["optimizer"]
    )
    scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(load_file(str(path / "rng.safetensors"))["torch_cpu"])
    version, internal, gauss = meta["python_random"]
    random.setstate((version, tuple(internal), gauss))
    return meta
