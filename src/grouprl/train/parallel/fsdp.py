"""FSDP2 for the trainer, and the rule it brings: every rank runs the same forward passes.

Under `--strategy fsdp` every forward of the policy all-gathers parameters, so it is a collective
that every rank must call as many times, in the same order. All that exists only for that rule
lives here, so single-process and DDP code never meet it, and a rollout engine other than the
Hugging Face one need not know about it:

- `shard`: the head probe (`plain_head`, a whole-model forward) runs first, on the unsharded
  model, then every decoder layer and the root are sharded; the trainer's log-prob forward runs
  through the root's hooks (`logprobs`).
- `Lockstep`: sampling keeps stepping until every rank is done (`Lockstep.engine`), evaluation
  pads every rank's rows to the longest share (`pad_rows`), and the update pads every rank's
  minibatch to as many passes with zero-weight copies (`most_passes`). Off (`dist.fsdp` False)
  each of them is the identity.
- `full_state` / `load_full_state`: checkpoints of a sharded model as full model directories, so
  they load at any world size and with either strategy.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from grouprl.errors import UserError
from grouprl.rollout import HFRolloutEngine, Rollout, completion_logprobs
from grouprl.rollout._hf import plain_head
from grouprl.rollout.packed import packs_rows
from grouprl.train.parallel.distributed import SINGLE, Dist

T = TypeVar("T")

#: The name under which FSDP2 runs `completion_logprobs` with the root module's hooks.
LOGPROBS_METHOD = "grouprl_completion_logprobs"


@dataclass(frozen=True)
class Lockstep:
    """Keeps every rank's forward passes in step when they are collectives (FSDP); a no-op
    otherwise. One per run, built from the run's `Dist`."""

    dist: Dist = SINGLE

    @property
    def active(self) -> bool:
        return self.dist.fsdp

    @property
    def all_done(self) -> Callable[[bool], bool] | None:
        """What the sampler asks at each decode check under lockstep (see `sample_groups`)."""
        return self.dist.all_done if self.active else None

    def engine(self, model: nn.Module, tokenizer: Any, tools: Any = None) -> HFRolloutEngine:
        """The Hugging Face engine over `model` (answering calls with `tools`), decoding in
        step with the other ranks."""
        return HFRolloutEngine(model, tokenizer, lockstep=self.all_done, tools=tools)

    def pad_rows(self, share: Sequence[T], items: Sequence[T]) -> list[T]:
        """This rank's `share` of the evaluation's `items` (rows, or their prompt ids), padded
        under lockstep with copies of the first item to the longest share, so every rank
        samples as many batches; the caller counts only the first len(share)."""
        share = list(share)
        if not self.active:
            return share
        longest = max(len(r) for r in self.dist.shares(len(items)))
        return share + [items[0]] * (longest - len(share))

    def most_passes(self, counts: Sequence[int]) -> list[int]:
        """Each minibatch's most forward/backward passes on any rank, under lockstep: a rank
        with fewer, or none (all its groups skipped), runs zero-weight fillers up to it, or it
        would leave the others waiting in a forward (`grouprl.train.plan.pad_passes`). One
        all-reduce; `counts` itself otherwise."""
        if not self.active:
            return list(counts)
        most = torch.tensor([float(c) for c in counts])  # (M,)
        self.dist.all_reduce(most, "max")
        return [int(c) for c in most.tolist()]


def logprobs(model: nn.Module, rollout: Rollout, **kwargs: Any) -> torch.Tensor:
    """`completion_logprobs` of `model`, through FSDP's root hooks when the model is sharded
    (see `shard`)."""
    method = getattr(model, LOGPROBS_METHOD, None)
    if method is not None:
        return method(rollout, **kwargs)
    return completion_logprobs(model, rollout, **kwargs)


def shard(model: nn.Module, *, device: torch.device) -> nn.Module:
    """FSDP2 over `model`: every decoder layer is its own unit, the root holds the rest
    (embeddings, final norm, head: tied embeddings stay one parameter in one unit). `model` may
    sit on the CPU: each rank's shards move to `device`, so no rank ever holds the whole model
    there.

    First the head probe (`plain_head`: whether logits are head(decoder(x))) and the packing
    probe (`packs_rows`), whole-model forwards that only the unsharded model can run alone. Gradients are reduced in fp32 (fp64
    for an fp64 model) and summed (the loss divides by global counts already). `completion_logprobs` becomes the method
    `LOGPROBS_METHOD`, run with the root's FSDP hooks: it calls the decoder and head directly,
    which alone would see sharded root parameters."""
    plain_head(model)
    packs_rows(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    dtype = next(model.parameters()).dtype
    policy = MixedPrecisionPolicy(reduce_dtype=torch.promote_types(dtype, torch.float32))
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers = _decoder_layers(model)
    if not layers:
        raise UserError(
            f"--strategy fsdp needs a model with a list of decoder layers; {type(model).__name__} "
            "has none that grouprl recognises; use --strategy ddp"
        )
    for layer in layers:  # each moves to `device` as it is sharded: one full layer at a time
        fully_shard(layer, mp_policy=policy, mesh=mesh)
    fully_shard(model, mp_policy=policy, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum: the loss has global denominators
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    setattr(model, LOGPROBS_METHOD, types.MethodType(completion_logprobs, model))
    register_fsdp_forward_method(model, LOGPROBS_METHOD)
    return model


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers causal LM (a ModuleList named `layers` or `h`)."""
    found: list[nn.Module] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
            found.extend(module)
    return found


# -- FSDP checkpoints: full (unsharded) states in the usual checkpoint format ------------------


def full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, dist: Dist
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """`gather_full_state` of a sharded model (a collective: every rank calls it), None for a
    model that is not sharded (its own state dicts are the full ones)."""
    return gather_full_state(model, optimizer) if dist.fsdp else None


def gather_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The sharded model's full state dict and its optimizer's state in `optimizer.state_dict()`'s
    own layout (parameters numbered in optimizer order), on rank 0's CPU (empty elsewhere).

    A collective: every rank calls it. The checkpoint written from it is the same model
    directory a single process writes, so it loads at any world size and with either strategy.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model.reshard()  # after a forward the root module is unsharded; the state dicts want shards
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    if optimizer is None:
        return weights, {}
    # An optimizer that has not stepped has no state; torch's getter would create it by taking
    # a step at lr 0, which counts in AdamW's bias correction: the first real step would then be
    # smaller than the single-process one. (Every rank agrees: no rank has stepped.)
    named = (
        get_optimizer_state_dict(model, optimizer, options=options)
        if optimizer.state
        else {"state": {}}
    )
    names = _trainable_names(model)
    index = {name: i for i, name in enumerate(names)}
    state = {index[name]: value for name, value in named.get("state", {}).items()}
    groups, offset = [], 0
    for group in optimizer.param_groups:  # hyper-parameters as the local optimizer holds them
        count = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(offset, offset + count))})  # fmt: skip
        offset += count
    return weights, {"state": state, "param_groups": groups}


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    weights: dict[str, torch.Tensor] | None,
    optimizer_state: dict[str, Any] | None,
) -> None:
    """Load full states (as `gather_full_state` returns them, read from a checkpoint on every
    rank) into the sharded model and optimizer: each rank keeps its own shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=False)  # tied weights: stored once
    if weights is not None:
        set_model_state_dict(model, weights, options=options)
    if optimizer is None or optimizer_state is None or not optimizer_state["state"]:
        return
    names = _trainable_names(model)
    named = {
        "state": {names[i]: value for i, value in optimizer_state["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]}
            for group in optimizer_state["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, named, options=options)


def _trainable_names(model: nn.Module) -> list[str]:
    """Names of the trainable parameters in optimizer order (`make_optimizer`'s)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]
