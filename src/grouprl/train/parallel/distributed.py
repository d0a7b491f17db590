"""torch.distributed for the trainer: the process group, the collectives a step needs, sharding.

Launched with `torchrun --nproc-per-node K -m grouprl train ...`, every rank runs the same loop
on its share of the step's groups. The single-process batch is the global batch: each rank
samples whole groups for a contiguous share of the step's prompts, the loss divides by global
token and sequence counts, and gradients are summed across ranks, so the update is the
single-process update of the same batch (the parity tests hold this to 1e-5).

Strategies (`--strategy`):

- `ddp`: every rank holds the full model; after a minibatch's last backward the gradients are
  summed with one all-reduce over a flat buffer. Not `DistributedDataParallel`: its gradient
  hooks are armed by `DDP.forward`, and the trainer's log-prob forward calls the decoder and head
  directly (no N×T×V logits), so DDP would never reduce. The explicit reduction also runs once
  per minibatch instead of once per micro-batch chunk.
- `fsdp`: FSDP2 (`fully_shard`), for models that do not fit one device; see `train/parallel/fsdp.py`,
  which also owns the rule that comes with it (every forward is a collective, so every rank
  runs the same forwards).

Only rank 0 prints and writes (`on_main`); failures, a user's mistake on any rank or a write
that fails on rank 0, are agreed on at fixed points so that every rank leaves the loop at the
same step with the same message (`check`), and none is left waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from grouprl.errors import UserError

#: How long a rank waits in a collective for the others; a rank that died is noticed by torchrun
#: long before this (it ends the whole job when one worker exits).
TIMEOUT = timedelta(minutes=30)

_CPU = torch.device("cpu")


class PeerFailed(UserError):
    """Another rank hit a user error; that rank's message is this one's text."""


@dataclass(frozen=True)
class Dist:
    """This process's place in the job. The defaults are a single process: every collective
    below is then the identity and nothing touches torch.distributed."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "ddp"
    device: torch.device = _CPU  # where collective tensors live
    group: Any = None  # the process group of these collectives (None: the default one)

    def own_group(self) -> Dist:
        """The same place on a process group of its own, for collectives that run beside this
        one's (the asynchronous sampler's thread). Every rank calls it, in the same order."""
        if not self.enabled:
            return self
        return dataclasses.replace(self, group=dist.new_group(backend=dist.get_backend()))

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def fsdp(self) -> bool:
        return self.enabled and self.strategy == "fsdp"

    # -- collectives -------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`tensor` reduced over ranks (sum, max or min), in place; returned for chaining."""
        if self.enabled:
            moved = tensor.to(self.device)
            dist.all_reduce(moved, group=self.group, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                       "min": dist.ReduceOp.MIN}[op])  # fmt: skip
            if moved is not tensor:
                tensor.copy_(moved)
        return tensor

    def sum(self, *values: float) -> list[float]:
        """Python numbers summed over ranks (one all-reduce)."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self.all_reduce(t).tolist()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable, CPU tensors only), in rank order, on every rank.

        Pickle crosses process boundaries of the same job here, never a file: checkpoints stay
        safetensors and JSON."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank: before a rank leaves with a non-zero status, so that torchrun,
        which then ends the other ranks, does not end rank 0 while it writes a checkpoint."""
        if self.enabled:
            dist.barrier(group=self.group)

    def all_done(self, done: bool) -> bool:
        """True once every rank is done: the `all_done` callable of sampling under FSDP."""
        if not self.enabled:
            return done
        flag = torch.tensor([0 if done else 1], device=self.device)
        return int(self.all_reduce(flag)) == 0

    def first_signal(self, signum: int | None) -> int | None:
        """The stop signal any rank received (the highest number when several did), or None:
        one all-reduce a step, so that every rank stops after the same step."""
        if not self.enabled:
            return signum
        flag = torch.tensor([signum or 0], device=self.device)
        return int(self.all_reduce(flag, "max")) or None

    def check(self, error: UserError | None) -> None:
        """Agree on failure: every rank calls this at the same point; when any rank brought a
        user error, every rank raises (that rank its own error, the others `PeerFailed` with
        the first failing rank's message, which is what rank 0 prints)."""
        if not self.enabled:
            if error is not None:
                raise error
            return
        failed = torch.tensor([0 if error is None else 1], device=self.device)
        if int(self.all_reduce(failed)) == 0:
            return
        messages = self.gather(None if error is None else str(error))
        first = next((m, r) for r, m in enumerate(messages) if m is not None)
        if error is not None and first[1] == self.rank:
            raise error
        raise PeerFailed(f"{first[0]} (on rank {first[1]})")

    def agreed(self, compute: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`compute(*args, **kwargs)`, called on every rank at the same point, with its user errors agreed on
        (`check`): a reward that raises on one rank raises on all, none is left waiting."""
        result, error = None, None
        try:
            result = compute(*args, **kwargs)
        except UserError as err:
            error = err
        self.check(error)
        return result

    def on_main(self, compute: Callable[[], Any]) -> Any:
        """`compute()` on rank 0 (which alone touches the run directory), its result on every
        rank. A user error there, or a write that fails (a full disk, a permission: any
        OSError), is raised on every rank as the same one line (`PeerFailed` on the others)."""
        result, error = None, None
        if self.is_main:
            try:
                result = compute()
            except UserError as err:
                error = str(err)
            except OSError as err:
                error = str(write_failed(err))
        if self.enabled:
            result, error = self.broadcast((result, error))
        if error is not None:
            raise UserError(error) if self.is_main else PeerFailed(error)
        return result

    def shares(self, n: int) -> list[range]:
        """n items split into world_size contiguous ranges (earlier ranks one longer)."""
        return [range(n * r // self.world_size, n * (r + 1) // self.world_size)
                for r in range(self.world_size)]  # fmt: skip

    def mine(self, n: int) -> range:
        return self.shares(n)[self.rank]

    def my_groups(self, n: int, minibatches: int) -> list[int]:
        """This rank's groups of a step's n (divisible by world_size × minibatches): its share
        of each minibatch, so that global minibatch m holds the single-process minibatch m's
        groups (groups m·n/M … (m+1)·n/M − 1) and the off-policy updates match too."""
        per = n // minibatches  # groups per global minibatch
        return [m * per + i for m in range(minibatches) for i in self.mine(per)]

    # -- gradients -----------------------------------------------------------------------------

    def sum_gradients(self, params: Sequence[nn.Parameter]) -> None:
        """Sum the gradients of `params` over ranks (DDP strategy; FSDP reduces in backward).

        One all-reduce over a flat buffer in fp32 (fp64 for fp64 gradients): the loss on every
        rank already divides by the global counts, so the sum is the gradient of the global
        loss."""
        if not self.enabled or self.fsdp:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        dtype = torch.promote_types(grads[0].dtype, torch.float32) if grads else torch.float32
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
        self.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g).to(g.dtype)
            offset += g.numel()

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Rank 0's parameters on every rank (DDP), as `DistributedDataParallel` does at start."""
        if not self.enabled or self.fsdp:
            return
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    moved = p.data.to(self.device)
                    dist.broadcast(moved, src=0)
                    if moved is not p.data:
                        p.data.copy_(moved)


def write_failed(err: OSError) -> UserError:
    """A failed write of the run directory as one line: what, where, and what to do."""
    where = f" {err.filename}" if err.filename else ""
    reason = err.strerror or str(err) or type(err).__name__
    return UserError(
        f"cannot write{where}: {reason}; free disk space or fix the permissions, then continue "
        "with grouprl train --resume RUN_DIR (the last complete checkpoint is kept)"
    )


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when launched by torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return (
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
    )


def is_main_process() -> bool:
    """Whether this process is the one that prints (rank 0, or no torchrun at all)."""
    env = torchrun_env()
    return env is None or env[0] == 0


def init(strategy: str, device: torch.device) -> Dist:
    """Join the torchrun job (gloo on CPU, NCCL on GPUs), or a single-process `Dist`.

    `device` is the rank's own device (under torchrun `--device auto` is cuda:LOCAL_RANK)."""
    env = torchrun_env()
    if env is None:
        return Dist(strategy=strategy, device=device)
    rank, world, local = env
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=TIMEOUT)
    return Dist(rank, world, local, strategy, device if backend == "nccl" else torch.device("cpu"))


def rank_device(spec: str) -> str:
    """The device flag for this rank: under torchrun on a GPU machine `auto` and any `cuda...`
    mean cuda:LOCAL_RANK (one device per rank; two ranks on one GPU would fail in NCCL)."""
    env = torchrun_env()
    if env is None or not spec.strip().lower().startswith(("auto", "cuda")):
        return spec
    if not torch.cuda.is_available():
        return spec
    if env[2] >= torch.cuda.device_count():
        raise UserError(
            f"local rank {env[2]} has no GPU: torch sees {torch.cuda.device_count()}; launch "
            "at most that many processes per node (--nproc-per-node)"
        )
    return f"cuda:{env[2]}"


def shutdown(*, together: bool = False) -> None:
    """Leave the torchrun job. `together` (a run that ended normally on every rank): first wait
    for every rank, so that no rank tears its process group down while rank 0 is still writing
    the final policy and plots (a gloo group destroyed early was seen to abort a rank)."""
    if dist.is_available() and dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()


#: A single process.
SINGLE = Dist()
