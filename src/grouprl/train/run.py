"""A training run's set-up and its record on disk.

- `setup_run(cfg) -> Run`: everything `train` builds before its first step (the resolved
  config, the process group, the policy, optimizer, engine, task, rewards, held-out rows), with
  every check that can fail done before anything is written.
- `restore(run) -> RunState`: where the run continues from: a fresh state, or a resumed one
  (its newest intact checkpoint loaded, the logs after it replayed), and the run directory's
  config.yaml written.
- `RunState`: the run's progress, the only progress a checkpoint holds besides the weights and
  the optimizer; `save(run, state)` writes one; `committed(run, state)` saves `state` when a
  user's mistake stops the run.

Only rank 0 writes; every write goes through `Dist.on_main`, so a write that fails there (a full
disk, a permission) ends every rank with the same line, and the last complete checkpoint stays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn

from grouprl.config.options import RunConfig, RunOptions, TrainConfig
from grouprl.config.parsing import config_record, to_yaml
from grouprl.config.resolution import resolve
from grouprl.config.validation import report_targets
from grouprl.errors import UserError
from grouprl.models.loading import resolve_device
from grouprl.models.lora import save_final
from grouprl.report import MetricSinks, plot_run
from grouprl.report.runs import FINAL_MARKER, finished_at
from grouprl.report.sinks import NullSinks, trl_names, truncate_groups, truncate_jsonl
from grouprl.report.trackers import Trackers
from grouprl.rollout import stop_token_ids
from grouprl.tasks import Task
from grouprl.tasks.data import PromptStream
from grouprl.train import checkpoint as ckpt
from grouprl.train.build import (
    build_engine,
    build_rewards,
    build_task,
    build_tools,
    estimator_tools,
    forward_dtype,
    keep_freed_memory,
    load_policy,
    load_teacher,
    prompt_budget,
    stop_strings,
    task_defaults,
)
from grouprl.train.collect import Sampler
from grouprl.train.evaluate import EVAL_BATCH_PROMPTS
from grouprl.train.groups import vocabulary
from grouprl.train.parallel import distributed
from grouprl.train.parallel.distributed import Dist
from grouprl.train.parallel.fsdp import Lockstep, full_state, shard
from grouprl.train.plan import check_packing
from grouprl.train.prompts import HeldOut, held_out, no_prompt_fits
from grouprl.train.routing import Routing, routing_for
from grouprl.train.update import grad_scaler, make_optimizer


@dataclass(frozen=True)
class RunState:
    """A run's progress after a number of completed steps: with the weights, optimizer,
    scheduler and random states (which a checkpoint holds beside it), all that a resume needs.
    Each step returns a new one; the driver keeps the last one a step completed."""

    step: int = 0  # steps completed
    data_position: int = 0  # training rows drawn from the prompt stream so far
    nonfinite_in_a_row: int = 0  # the latest steps whose updates were all skipped as non-finite
    initial_eval: dict[str, float] | None = None  # the held-out evaluation at step 0
    entropy_coef: float | None = None  # the adaptive entropy coefficient (None: the config's)
    entropy_last: float | None = None  # the last optimizer step's mean token entropy

    def to_json(self) -> dict[str, Any]:
        """What state.json records, under the field names (`step` is written by the checkpoint
        itself). These are the names checkpoints have always used."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "step"}

    @classmethod
    def from_json(cls, meta: dict[str, Any]) -> RunState:
        """The state a checkpoint's state.json records (a key it lacks takes its default)."""
        defaults = cls()
        return cls(**{f.name: meta.get(f.name, getattr(defaults, f.name))
                      for f in dataclasses.fields(cls)})  # fmt: skip


@dataclass
class Run:
    """What a training run holds from set-up to its end. The model, optimizer, scheduler and
    scaler change in place as it trains; its progress is a `RunState`, kept apart."""

    cfg: RunConfig
    run_dir: Path
    dist: Dist
    lockstep: Lockstep
    device: torch.device
    task: Task
    policy: nn.Module
    tokenizer: Any
    reference: nn.Module | None  # a frozen copy for the KL term (full fine-tuning, beta > 0)
    teacher: nn.Module | None  # on-policy distillation's frozen teacher (--teacher)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    sampler: Sampler
    heldout: HeldOut  # the held-out rows (or episodes), their prompts' ids and seed keys
    console: Console
    sinks: MetricSinks | NullSinks = field(default_factory=NullSinks)
    reported: set[str] = field(default_factory=set)  # the live doctor's findings already printed
    callbacks: tuple[Callable[..., Any], ...] = ()  # told of every step and evaluation
    live: dict[str, str] | None = None  # what identifies each live object (from Python)
    stop_asked: bool = False  # a callback asked the run to end after the current step
    ahead: Any = (
        None  # the asynchronous sampler (`grouprl.train.async_sampler`), --max-staleness > 0
    )
    resumed_from: Path | None = None  # the checkpoint a resume loaded
    routing: Routing | None = None  # a mixture-of-experts policy's (`grouprl.train.routing`)

    def warn(self, message: str) -> None:
        self.console.print(f"[yellow]warning:[/] {message}")

    def on_main(self, compute: Callable[[], Any]) -> Any:
        """`compute()` on rank 0, agreed (see `Dist.on_main`)."""
        return self.dist.on_main(compute)


def setup_run(
    cfg: TrainConfig,
    *,
    console: Console | None = None,
    callbacks: tuple[Callable[..., Any], ...] = (),
    live: dict[str, str] | None = None,
) -> Run:
    """Resolve and validate `cfg`, join the torchrun job (if any), pick the run directory, load
    the policy (sharded under FSDP) and build everything a step needs. Nothing is written."""
    console = console or Console(stderr=True, quiet=not distributed.is_main_process())

    def warn(message: str) -> None:
        console.print(f"[yellow]warning:[/] {message}")

    env = distributed.torchrun_env()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = resolve(cfg, world_size=env[1] if env else 1, **task_defaults(cfg))
        task = build_task(cfg)
    for warning in caught:
        warn(str(warning.message))
    device = resolve_device(distributed.rank_device(cfg.device))
    keep_freed_memory(device)  # large CPU tensors reuse freed pages instead of faulting anew
    dist = distributed.init(cfg.strategy, device)
    lockstep = Lockstep(dist)
    run_dir = dist.on_main(lambda: prepare_run_dir(cfg))  # rank 0 picks the name
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    policy, tokenizer, reference, teacher, routing = _models(cfg, dist, device)
    tools = estimator_tools(
        cfg, build_tools(cfg, task, tokenizer, stop_token_ids(policy, tokenizer))
    )
    dtype = forward_dtype(cfg)  # every forward's autocast dtype: the run's one source
    rewards = build_rewards(cfg, task, device, tools)
    rewards.keep_in(run_dir)  # a judge's cache: a resumed run asks it nothing twice
    budget = prompt_budget(cfg, policy, cfg.max_new_tokens)
    check_packing(cfg, policy, budget, warn)
    sampler = Sampler(
        engine=run_engine(cfg, policy, tokenizer, tools, dtype, budget, lockstep),
        tokenizer=tokenizer,
        stream=PromptStream(task.train, cfg.seed),
        rewards=rewards,
        stop=stop_strings(cfg, task),
        budget=budget,
        budget_by_flag=cfg.max_prompt_length is not None,
        dtype=dtype,
        device=device,
        dist=dist,
        warn=warn,
        tools=tools,
        episodes=task.episodes,
    )
    optimizer = make_optimizer(cfg, policy)
    heldout = evaluation_rows(cfg, task, sampler, warn)
    if tools is not None and tools.environment is not None:  # a server's capacity, said now
        tools.environment.preflight(task.train, environments_at_once(cfg, dist, heldout),
                                    chat=tools.chat)  # fmt: skip
    return Run(
        cfg=cfg,
        run_dir=run_dir,
        dist=dist,
        lockstep=lockstep,
        device=device,
        task=task,
        policy=policy,
        tokenizer=tokenizer,
        reference=reference,
        teacher=teacher,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s)),
        scaler=grad_scaler(dtype, device),
        sampler=sampler,
        heldout=heldout,
        console=console,
        callbacks=callbacks,
        live=live,
        routing=routing,
    )


def _models(
    cfg: RunConfig, dist: Dist, device: torch.device
) -> tuple[Any, Any, Any, Any, Routing | None]:
    """The policy, its tokenizer, the reference and the teacher (None where unused), on
    `device`: under FSDP the whole models stay in host memory and each rank moves only its
    shards; otherwise the policy's parameters are rank 0's. And a mixture-of-experts policy's
    routing (`routing_for`: its routers probed before they are sharded, before any engine
    starts)."""
    host = torch.device("cpu") if dist.fsdp else device
    policy, tokenizer, reference = load_policy(cfg, host)
    routing = routing_for(cfg, policy)
    teacher = load_teacher(cfg, tokenizer, policy, host)
    if dist.fsdp:
        for model in (policy, reference, teacher):
            if model is not None:
                shard(model, device=device)
    else:
        dist.broadcast_parameters(policy)
    return policy, tokenizer, reference, teacher, routing


def run_engine(
    cfg: RunConfig,
    policy: nn.Module,
    tokenizer: Any,
    tools: Any,
    dtype: torch.dtype | None,
    budget: int | None,
    lockstep: Lockstep,
) -> Any:
    """The run's rollout engine: the policy itself (HF, in step with the other FSDP ranks), or
    one with its own copy of the weights (vLLM), sized for the largest batch the run samples (a
    step's groups, or an evaluation's batch), answering tool calls as it goes."""
    rows = max(cfg.prompts_per_step * cfg.group_size,
               min(cfg.eval_size, EVAL_BATCH_PROMPTS) * cfg.eval_samples)  # fmt: skip
    if cfg.vllm_server is not None and cfg.max_staleness > 0:
        # the servers follow the asynchronous sampler's versions; evaluation samples the
        # trainer's current policy here
        cfg = dataclasses.replace(cfg, engine="hf", vllm_server=None)
    return build_engine(
        cfg,
        policy,
        tokenizer,
        dtype=dtype,
        rows=rows,
        max_len=None if budget is None else budget + cfg.max_new_tokens,
        seed=cfg.seed,
        tools=tools and tools.handler,
        lockstep=lockstep,
        processes=lockstep.dist.world_size,
    )


def restore(run: Run) -> tuple[RunState, bool]:
    """The state the run continues from, and whether it is already finished (a resumed run that
    ended at `steps`: nothing to do, nothing written). A resume loads the newest intact
    checkpoint (rank 0 sets damaged ones aside; every rank reads) and replays the logs: lines
    after the checkpoint's step are dropped, and so is a half-written last line. Then the run
    directory and its config.yaml are written."""
    cfg = run.cfg
    state = RunState()
    if cfg.resume is not None:
        checkpoint = run.on_main(
            lambda: ckpt.latest_checkpoint(run.run_dir, warn=run.warn, set_aside=True)
        )
        if checkpoint is not None:
            state = _load(run, checkpoint)
            run.resumed_from = checkpoint
            run.sampler.engine.policy_updated(state.step)  # the weights are the checkpoint's
            if (
                state.step >= cfg.steps
                and run.on_main(lambda: finished_at(run.run_dir)) == state.step
            ):
                run.console.print(
                    f"{run.run_dir} already finished at step {state.step} (steps {cfg.steps}); "
                    f"nothing to do. To train longer: grouprl train --resume {run.run_dir} --steps N"
                )
                return state, True
            run.console.print(f"resuming {run.run_dir} from step {state.step}")
        run.on_main(lambda: _replay_logs(run, state))
    run.on_main(lambda: _write_config(run))
    return state, False


def _load(run: Run, checkpoint: Path) -> RunState:
    meta = ckpt.load_checkpoint(
        checkpoint,
        model=run.policy,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        sharded=run.dist.fsdp,
    )
    apply_hyperparameters(run.cfg, run.optimizer, run.scheduler)  # what --allow-change changed
    if run.scaler is not None and meta.get("grad_scaler"):
        run.scaler.load_state_dict(meta["grad_scaler"])
    saved_world = meta.get("world_size", 1)
    if saved_world != run.dist.world_size:
        run.console.print(
            f"resuming a run saved by {saved_world} process(es) with {run.dist.world_size}: the "
            "checkpoint is a full model, so this works, but the completions sampled from here "
            "on differ from those of an uninterrupted run (each rank has its own seed)"
        )
    return RunState.from_json(meta)


def _last_logged(run: Run, state: RunState) -> int:
    """The last step whose log lines a resumed run keeps (-1: none, the run restarts at 0)."""
    return state.step if state.initial_eval is not None else -1


def _replay_logs(run: Run, state: RunState) -> None:
    last_kept = _last_logged(run, state)
    # a final evaluation at `start` is replayed too: the run ends there
    last_eval = min(last_kept, state.step - 1) if state.step >= run.cfg.steps else last_kept
    for name, keep in (("metrics.jsonl", last_kept), ("eval.jsonl", last_eval),
                       ("samples.jsonl", last_kept), ("ratios.jsonl", last_kept)):  # fmt: skip
        if truncate_jsonl(run.run_dir / name, keep_through_step=keep):
            run.warn(f"{name}: dropped a half-written line (the process was killed mid-write)")
    truncate_groups(run.run_dir, keep_through_step=last_kept)


def _write_config(run: Run) -> None:
    run.run_dir.mkdir(parents=True, exist_ok=True)
    _write_atomically(run.run_dir / "config.yaml", to_yaml(run.cfg, live=run.live))


@contextlib.contextmanager
def open_sinks(run: Run, state: RunState) -> Iterator[None]:
    """The run's metric sinks and trackers (rank 0; nothing elsewhere), closed at the end,
    whatever ends it. On a resumed run TensorBoard forgets what the replayed steps logged before
    (the JSONL logs were truncated by `restore`); the other trackers skip what they already
    have."""
    purge = _last_logged(run, state) + 1 if run.cfg.resume is not None else None

    def open_on_main() -> None:  # rank 0 alone: the sinks hold open files
        try:
            trackers = Trackers(
                run.run_dir,
                report_targets(run.cfg.report_to),
                config=config_record(run.cfg),
                run_name=run.cfg.run_name,
                purge_step=purge,
                warn=run.warn,
                say=lambda line: run.console.print(line, soft_wrap=True, highlight=False),
            )
        except UserError:
            if run.cfg.resume is None:  # nothing ran: leave the directory free for the next try
                (run.run_dir / "config.yaml").unlink(missing_ok=True)
            raise
        aliases = trl_names if run.cfg.trl_metrics else None
        run.sinks = MetricSinks(run.run_dir, trackers, aliases=aliases)
        if run.cfg.log_groups:
            run.sinks.log_vocabulary(vocabulary(run.tokenizer))

    run.on_main(open_on_main)
    ok = False
    try:
        yield
        ok = True
    finally:
        run.sinks.close(ok)
        run.sinks = NullSinks()


class SaveFailed(UserError):
    """A checkpoint could not be written: saving again on the way out would fail the same way."""


def save(run: Run, state: RunState) -> None:
    """Checkpoint `state` with the weights, optimizer and scheduler as they are now: call it
    only where they are `state`'s (between steps). A collective under FSDP (the full state is
    gathered); rank 0 writes, agreed."""
    extra = {"world_size": run.dist.world_size}
    if run.scaler is not None:
        extra["grad_scaler"] = run.scaler.state_dict()
    full = full_state(run.policy, run.optimizer, run.dist)
    versions = None if run.ahead is None else run.ahead.pending(state.step)

    def write() -> Path:
        return ckpt.save_checkpoint(
            run.run_dir,
            state.step,
            model=run.policy,
            tokenizer=run.tokenizer,
            optimizer=run.optimizer,
            scheduler=run.scheduler,
            state={**state.to_json(), **extra},
            keep_last=run.cfg.keep_last,
            full_state=full,
            sampler_versions=versions,
        )

    try:
        run.on_main(write)
    except UserError as err:
        raise SaveFailed(str(err)) from None


@contextlib.contextmanager
def committed(run: Run, state: RunState) -> Iterator[None]:
    """Inside, the weights are `state`'s (no update has begun changing them): a user's mistake
    here (a reward that raises, a run of non-finite steps) saves `state` before it ends the run,
    on every rank together. Nothing is saved when the failure is the save itself."""
    try:
        yield
    except SaveFailed:
        run.dist.barrier()
        raise
    except UserError:
        save(run, state)
        run.dist.barrier()  # torchrun must not end rank 0 while it writes
        raise


def evaluation_rows(
    cfg: RunConfig, task: Task, sampler: Sampler, warn: Callable[[str], None]
) -> HeldOut:
    """The first `eval_size` held-out rows whose prompts, as sampling renders them (tools
    included), fit the prompt budget, with their ids (a warning when there are fewer); for a
    task of episodes, `eval_size` fresh episodes (`grouprl.train.prompts.held_out`)."""
    if cfg.eval_size > len(task.heldout) and not task.heldout_episodes:
        warn(
            f"eval_size {cfg.eval_size} is more than the {len(task.heldout)} held-out rows; "
            "evaluating all of them"
        )
    rows = held_out(task, cfg.eval_size, sampler.tokenizer, sampler.budget, sampler.tools)
    if rows.too_long:
        warn(f"{rows.too_long} held-out prompts are over {sampler.budget} tokens and not evaluated")
    if not rows.rows:
        raise no_prompt_fits("the held-out rows", rows.shortest_too_long, sampler.budget,
                             by_flag=cfg.max_prompt_length is not None)  # fmt: skip
    return rows


def environments_at_once(cfg: RunConfig, dist: Dist, heldout: HeldOut) -> int:
    """Environment instances this rank holds at once: a step's groups (a sampling round's,
    scored before the next), or an evaluation batch's problems with their samples and the
    greedy one, whichever is more."""
    step = cfg.prompts_per_step // dist.world_size * cfg.group_size
    rows = min(EVAL_BATCH_PROMPTS, len(dist.mine(len(heldout.rows))))
    return max(step, rows * (cfg.eval_samples + 1))


def lr_factor(cfg: RunConfig, step: int) -> float:
    """Linear warm-up to 1, then constant, a linear decay (1 at the end of warm-up, 1/(steps -
    warmup_steps) at the last step, 0 after it: transformers' get_linear_schedule_with_warmup
    after its warm-up) or a cosine decay to 0 at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return 1.0
    if cfg.lr_schedule == "linear":
        return max(0.0, (cfg.steps - step) / max(1, cfg.steps - cfg.warmup_steps))
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def apply_hyperparameters(cfg: RunConfig, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """The config's learning rate, weight decay and betas over what a checkpoint restored, so
    that `--resume --allow-change lr` means what it says (equal values change nothing)."""
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group.update(
            initial_lr=cfg.lr,
            lr=cfg.lr * lr_factor(cfg, scheduler.last_epoch),
            weight_decay=cfg.weight_decay,
            betas=tuple(cfg.adam_betas),
        )  # (the scheduler's record of its last rate follows at its next step; nothing reads it)


def prepare_run_dir(cfg: RunOptions) -> Path:
    """The run directory, checked before anything is written: an earlier run is never touched,
    and a directory that cannot be written is found before the model loads."""
    if cfg.resume is not None:
        run_dir = Path(cfg.resume)
    else:
        run_dir = Path(
            cfg.output_dir or Path("runs") / f"{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        if (run_dir / "config.yaml").exists():
            raise UserError(
                f"{run_dir} already holds a run; pass --resume {run_dir} to continue it "
                "or choose another --output-dir"
            )
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"cannot create the run directory {run_dir}: {probe} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot write the run directory {run_dir}: {probe} is not writable (permissions or "
            "a read-only file system); choose another --output-dir"
        )
    return run_dir


def write_final(run: Run, step: int) -> Path | None:
    """final/ (the policy, merged when LoRA, and its tokenizer), plots: rank 0 writes; a
    collective under FSDP (the full weights are gathered). final/ is written under a temporary
    name, marked with its step, then swapped in: a kill midway leaves the previous final/ (or
    none), never a half-written one."""
    weights = full_state(run.policy, None, run.dist)

    def write() -> Path:
        run_dir = run.run_dir
        final, tmp, old = run_dir / "final", run_dir / ".final-tmp", run_dir / ".final-old"
        for leftover in (tmp, old):
            shutil.rmtree(leftover, ignore_errors=True)
        save_final(run.policy, run.tokenizer, tmp, None if weights is None else weights[0])
        (tmp / FINAL_MARKER).write_text(json.dumps({"step": step}) + "\n")
        if final.exists():
            os.replace(final, old)  # the previous final policy of this same run, now superseded
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        plots = plot_run(run_dir)
        run.sinks.log_plots(step, plots)
        return plots[0].parent if plots else None

    return run.on_main(write)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _count(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def describe(run: Run) -> None:
    """What is about to train, on what, from which data, scored how."""
    model = run.policy
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dist = run.dist
    where = (
        f"{run.device}"
        if not dist.enabled
        else f"{dist.world_size} processes ({dist.strategy}, {run.device.type})"
    )
    rewards = run.sampler.rewards
    weights = ", ".join(f"{n} x{w:g}" for n, w in rewards.weights.items())
    say = run.console.print
    say(f"run directory: {run.run_dir}")
    say(
        f"policy:  {run.cfg.model} ({_count(total)} parameters, {_count(trained)} trained) on {where}"
    )
    say(f"data:    {_data(run)}")
    say(f"rewards: {weights}; pass reward: {rewards.pass_reward}")


def _data(run: Run) -> str:
    """What a run trains on and evaluates, in words."""
    task, evaluated = run.task, len(run.heldout.rows)
    if task.episodes:
        source = "the environment owns the data" if not len(task.train[0]) else (
            f"{task.name}, one prompt")  # fmt: skip
        heldout = (
            f"held-out: {evaluated} fresh episodes, seeded apart from training's"
            if task.heldout_episodes
            else f"{evaluated} held-out rows evaluated"
        )
        return f"fresh episodes of {run.cfg.environment} ({source}); {heldout}"
    return f"{task.name} ({len(task.train)} train rows, {evaluated} held-out rows evaluated)"
