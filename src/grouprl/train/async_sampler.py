"""Asynchronous rollouts on a fixed schedule: batch k is sampled by policy version
v(k) = max(0, k − K) while the trainer updates, K = `--max-staleness`.

Every system that overlaps sampling and training (TRL's AsyncGRPOTrainer, verl's fully async
trainer, prime-rl, AReaL, PipelineRL) decides by wall-clock arrival which policy sampled what, and
none can replay a run. Here the schedule is a function of K alone: the sampler may start batch k
only once version v(k) is published, always samples it with exactly that version, and the trainer
takes batches by index; whichever side is faster waits. So an overlapped run equals, bit for bit,
the sequential run that samples batch k with a saved copy of version v(k) (`overlap=False` runs
exactly that, in the caller's thread).

The sampler is a thread of this process with its own copy of the model (its trainable tensors
refreshed from a snapshot of each version; under LoRA only the adapters), its own torch thread
count (`--sampler-threads`) and, under torchrun, a process group of its own for its collectives.
Versions stay on hand until every batch they sample is taken, and a checkpoint at step n saves
those the in-flight batches n … n+K−1 need (`pending`): a resumed run samples them again,
exactly.

Batch k's rows carry `version` = v(k); from a version older than the trainer's their sampled
log-probs become the rollout's `behaviour_logp`, so the trainer recomputes `old_logp` (or, with
`--proximal behaviour`, clips against them) and can correct for the lag.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
from typing import Any

import torch
from torch import nn

from grouprl.config.options import RunConfig
from grouprl.config.training import AsyncOptions
from grouprl.errors import UserError
from grouprl.rollout import HFRolloutEngine, Rollout, routes
from grouprl.train.batch import Batch
from grouprl.train.collect import Collected, Sampler, collect_batch

Weights = dict[str, torch.Tensor]


def lag_version(step: int, staleness: int) -> int:
    """The policy version that samples batch `step`: max(0, step − K)."""
    return max(0, step - staleness)


def cores() -> int:
    """The cores this process may use."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def sampler_threads(cfg: AsyncOptions) -> int:
    """The sampler's torch threads, 0 for "in the trainer's thread, between updates":
    `--sampler-threads`, or by default half the cores, at least 2 where there are 2. Measured on
    2 cores (BENCHMARKS.md): a sampler of 2 threads beside a trainer of 2 beat 1 + 1, 2 + 1 and
    sampling between updates."""
    if cfg.sampler_threads is not None:
        return cfg.sampler_threads
    return min(cores(), max(2, cores() // 2))


def stamped(collected: Collected, version: int, step: int) -> Collected:
    """`collected` with every row's `version`; sampled by an older version than the trainer's
    (`step`), its sampled log-probs become the rows' `behaviour_logp`."""

    def stamp_rows(rollout: Rollout) -> Rollout:
        versions = torch.full((rollout.completion_ids.shape[0],), version, dtype=torch.int64)
        behaviour = rollout.behaviour_logp
        if version != step and behaviour is None:
            behaviour = rollout.old_logp.clone()
        return dataclasses.replace(rollout, version=versions, behaviour_logp=behaviour)

    def stamp(batch: Batch | None) -> Batch | None:
        if batch is None:
            return None
        branches = batch.branches
        if branches is not None:  # an agent's split trajectories: sampled with the rest
            branches = dataclasses.replace(branches, rollout=stamp_rows(branches.rollout))
        return dataclasses.replace(batch, rollout=stamp_rows(batch.rollout), branches=branches)

    return dataclasses.replace(collected, kept=stamp(collected.kept),
                               sampled=stamp(collected.sampled))  # fmt: skip


class AsyncSampler:
    """Samples batches `start_step`, `start_step + 1`, ... ahead of the trainer, on the
    schedule of the module docstring. `publish(v, policy)` after each optimizer step that made
    version v; `take(k)` returns batch k's `Collected`; `pending(n)` the versions a checkpoint
    at step n keeps; `close()` stops the thread (it finishes the batch it is sampling)."""

    def __init__(
        self,
        cfg: RunConfig,
        sampler: Sampler,
        policy: nn.Module,
        *,
        start_step: int,
        start_position: int,
        saved: dict[int, Weights] | None = None,
        threads: int = 0,
        overlap: bool = True,
    ) -> None:
        self.cfg, self.staleness = cfg, cfg.max_staleness
        self.threads = threads or torch.get_num_threads()  # 0: the trainer's own count
        self.names = [name for name, p in policy.named_parameters() if p.requires_grad]
        model = copy.deepcopy(policy).eval()
        routes.share_tap(policy, model)  # the copy's routers record what it samples too
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model
        self.engine = _engine(cfg, model, sampler)
        self.sampler = dataclasses.replace(sampler, engine=self.engine,
                                           dist=sampler.dist.own_group())  # fmt: skip
        self.versions: dict[int, Weights] = dict(saved or {})
        self.loaded: int | None = None  # the version the copy holds
        self.ready: dict[int, Collected] = {}
        self.error: BaseException | None = None
        self.next_step, self.position = start_step, start_position
        self.overlap, self.closing = overlap, False
        self.changed = threading.Condition()
        self.thread: threading.Thread | None = None
        if overlap:
            self.thread = threading.Thread(target=self._run, name="grouprl-sampler", daemon=True)
            self.thread.start()

    # -- the trainer's side ----------------------------------------------------------------

    def publish(self, version: int, policy: nn.Module) -> None:
        """Version `version` of the weights (the policy as it is now: its trainable tensors,
        copied), for the batches it samples."""
        params = dict(policy.named_parameters())
        snapshot = {name: params[name].detach().clone() for name in self.names}
        with self.changed:
            self.versions[version] = snapshot
            self.changed.notify_all()

    def take(self, step: int) -> Collected:
        """Batch `step` (the trainer's next), waiting for it if the sampler is behind."""
        start = time.perf_counter()
        if not self.overlap:
            self._produce(step, inline=True)
        with self.changed:
            while step not in self.ready and self.error is None:
                self.changed.wait()
            if step not in self.ready:
                raise self.error  # the sampler's error, raised in the trainer
            collected = self.ready.pop(step)
            needed = lag_version(step + 1, self.staleness)
            for version in [v for v in self.versions if v < needed]:
                del self.versions[version]
            self.changed.notify_all()
        waited = time.perf_counter() - start
        return dataclasses.replace(collected, seconds=waited, sampler_seconds=collected.seconds)

    def pending(self, step: int) -> dict[int, Weights]:
        """The versions batches `step` … `step + K − 1` need (a checkpoint at `step` saves them:
        the trainer's own weights are version `step`)."""
        wanted = {lag_version(k, self.staleness) for k in range(step, step + self.staleness)}
        with self.changed:
            return {v: self.versions[v] for v in sorted(wanted) if v in self.versions}

    def close(self) -> None:
        """Stop sampling: the thread finishes the batch it is on and ends (nothing hangs: it
        waits for no version once closing)."""
        with self.changed:
            self.closing = True
            self.changed.notify_all()
        if self.thread is not None:
            self.thread.join()
        self.engine.close()

    # -- the sampler's side ----------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # this thread's own (OpenMP's count is per thread)
        try:
            while True:
                # no queue bound is needed: batch k waits for version k − K, which the trainer
                # publishes as it finishes step k − K − 1, so at most K batches are ever ahead
                # of the one it trains
                with self.changed:
                    if self.closing or self.next_step >= self.cfg.steps:
                        return
                self._produce(self.next_step)
        except BaseException as err:
            with self.changed:
                self.error = err
                self.changed.notify_all()

    def _produce(self, step: int, *, inline: bool = False) -> None:
        """Sample batch `step` with version v(step), once it is published."""
        version = lag_version(step, self.staleness)
        with self.changed:
            while version not in self.versions and not self.closing:
                if inline:
                    raise RuntimeError(f"version {version} of the weights was never published")
                self.changed.wait()
            if self.closing:
                return
            weights = self.versions[version]
        if self.loaded != version:
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, tensor in weights.items():
                    params[name].copy_(tensor)
            self.loaded = version
            self.engine.policy_updated(version)  # vLLM's process loads the copy's weights
        threads = torch.get_num_threads()
        if inline:
            torch.set_num_threads(self.threads)
        try:
            collected = collect_batch(self.cfg, self.sampler, step, self.position)
        finally:
            if inline:
                torch.set_num_threads(threads)
        with self.changed:
            self.ready[step] = stamped(collected, version, step)
            self.position, self.next_step = collected.position, step + 1
            self.changed.notify_all()


def _engine(cfg: RunConfig, model: nn.Module, sampler: Sampler) -> Any:
    """The sampler's engine over its copy: grouprl's own, vLLM servers, or vLLM in a process of
    its own (the trainer's process keeps the one that evaluates the current policy), sized for
    a step."""
    if cfg.engine == "hf":
        return HFRolloutEngine(model, sampler.tokenizer, tools=sampler.engine.tools)
    budget = None if sampler.budget is None else sampler.budget + cfg.max_new_tokens
    if cfg.vllm_server is not None:  # the servers sample; they follow the copy's versions
        from grouprl.train.build import server_engine

        return server_engine(cfg, model, sampler.tokenizer, dtype=sampler.dtype,
                             rows=cfg.prompts_per_step * cfg.group_size, max_len=budget,
                             seed=cfg.seed, tools=sampler.engine.tools, dist=sampler.dist)  # fmt: skip
    if sampler.tools is not None:
        raise UserError(
            "--max-staleness with --engine vllm samples in vLLM's own process, which answers no "
            "tool calls yet; use --engine hf for tools and environments"
        )
    from grouprl.models.lora import checkpoint_weights
    from grouprl.rollout.vllm_process import VLLMProcessEngine
    from grouprl.train.build import vllm_options

    options = vllm_options(cfg, model, sampler.dtype, cfg.prompts_per_step * cfg.group_size,
                           budget, cfg.seed)  # fmt: skip
    return VLLMProcessEngine(model, sampler.tokenizer, options,
                             weights=lambda: checkpoint_weights(model))  # fmt: skip
