"""LoRA adapters with `peft`: wrap a policy, use the base model as the reference, save.

peft is imported inside these functions: it costs several seconds to import, and only runs
that ask for LoRA should pay that.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from grouprl.errors import UserError


def apply_lora(
    model: nn.Module,
    *,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: Sequence[str] | None = None,
) -> nn.Module:
    """`model` wrapped in a peft LoRA adapter; only the adapter's weights require grad.

    target_modules None: every linear layer but the output head (peft's "all-linear"). The
    adapter's B matrix starts at zero, so the wrapped model computes exactly what `model` did.
    Adapter weights are float32 whatever the base dtype (peft's autocast_adapter_dtype).
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules) if target_modules else "all-linear",
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():  # peft reads attributes transformers 5 deprecates
            warnings.simplefilter("ignore", FutureWarning)
            wrapped = get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as err:  # e.g. target modules that match nothing
        from grouprl.errors import one_line

        raise UserError(
            f"cannot add LoRA adapters: {one_line(err)}; check --lora-target-modules"
        ) from None
    if target_modules:  # peft is silent about a name that matches nothing if another matches
        names = [name for name, _ in model.named_modules()]
        unmatched = [t for t in target_modules
                     if not any(n == t or n.endswith(f".{t}") for n in names)]  # fmt: skip
        if unmatched:
            warnings.warn(
                f"LoRA target modules {', '.join(map(repr, unmatched))} match no module of the "
                "model and get no adapter (a typo, or a stray comma on the command line?)",
                stacklevel=2,
            )
    return wrapped.eval()


def is_lora(model: nn.Module) -> bool:
    """Whether `model` is a peft model (LoRA adapters over a frozen base)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "merge_and_unload")


def base_model_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """A context in which a LoRA model computes its base model (adapters off): the reference
    policy without a second copy of the weights. A no-op context for other models."""
    if is_lora(model):
        return model.disable_adapter()
    return contextlib.nullcontext()


@contextlib.contextmanager
def adapter_dropout(model: nn.Module, active: bool) -> Iterator[None]:
    """Turn the LoRA dropout layers on (training mode) inside the context, leaving every other
    module in its mode: the policy stays in eval mode, so its own dropout never fires."""
    layers = [m for name, m in model.named_modules() if name.endswith("lora_dropout")]
    layers = [sub for m in layers for sub in m.modules()] if active else []
    before = [m.training for m in layers]
    for m in layers:
        m.training = True
    try:
        yield
    finally:
        for m, mode in zip(layers, before):
            m.training = mode


def checkpoint_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under their Hugging Face checkpoint names (what `from_pretrained`
    reads), for an engine that holds its own copy (vLLM). A LoRA model's are the merged
    weights W + s·B·A of each adapted layer, computed apart in float32 (base upcast, as
    `save_final` merges), so the model itself is never changed: merging into the base and
    unmerging again, as TRL does, would leave W + s·B·A − s·B·A, not W, in float rounding.
    Other tensors are the model's own (no copy). A model whose tensors transformers lays out
    otherwise on disk (a mixture-of-experts model's fused experts: one key an expert there)
    gives them in the checkpoint's layout, as `save_pretrained` writes it."""
    if not is_lora(model):
        return disk_layout(model, dict(model.state_dict()))
    if adapts_parameters(model):  # the engines refuse it at set-up (`grouprl.train.build`)
        raise ValueError("merged weights of adapters on bare parameters are not computed yet")
    base = model.get_base_model()
    with torch.no_grad():
        deltas = {name: module.get_delta_weight(adapter).float()
                  for name, module in base.named_modules()
                  if (adapter := _active_adapter(module)) is not None}  # fmt: skip
    out = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        module, found, param = key.partition(".base_layer.")
        if found:
            key = f"{module}.{param}"
            if param == "weight":
                value = value.float() + deltas[module]
        out[key] = value
    return disk_layout(base, out)


def adapts_parameters(model: nn.Module) -> bool:
    """Whether a peft model's adapters act on bare parameters (peft's `target_parameters`:
    the fused experts or router of a mixture-of-experts model) rather than on linear layers."""
    return any(type(m).__name__ == "ParamWrapper" for m in model.modules())


def disk_layout(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the model's tensors by name) in the layout transformers writes to disk."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # an older transformers lays tensors out as it writes them
        return state
    return dict(revert_weight_conversion(model, state))


def _active_adapter(module: nn.Module) -> str | None:
    """The adapter a peft LoRA layer applies (grouprl trains one), or None for other modules."""
    names = getattr(module, "active_adapters", None)
    if not hasattr(module, "get_delta_weight") or not names:
        return None
    return names[0] if names[0] in getattr(module, "lora_A", {}) else None


def save_final(model: nn.Module, tokenizer, directory: Path, state_dict=None) -> None:
    """`directory`: a full model `AutoModelForCausalLM` loads, and for a LoRA model also
    `directory/adapter` (the adapter alone, which peft loads over the base model).

    The merge runs in float32 (base weights upcast), so small adapter updates are not rounded
    away in a bf16/fp16 base; the merged model is saved in float32. It consumes the LoRA
    wrapper: call it last. `state_dict`: the full weights of a sharded model (no LoRA).
    """
    directory = Path(directory)
    if is_lora(model):
        model.save_pretrained(directory / "adapter")
        tokenizer.save_pretrained(directory / "adapter")
        model = model.merge_and_unload() if _all_float32(model) else _merged_float32(model)
    model.save_pretrained(directory, state_dict=state_dict)
    tokenizer.save_pretrained(directory)


def _all_float32(model: nn.Module) -> bool:
    return all(p.dtype == torch.float32 for p in model.parameters())


def _merged_float32(model: nn.Module) -> nn.Module:
    model = model.float()
    merged = model.merge_and_unload()
    merged.config.dtype = torch.float32
    return merged
