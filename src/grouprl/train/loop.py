"""The GRPO / GSPO training loop, top to bottom.

Each step:
  1. take B prompts from the task's train split (a seeded permutation; the position is part of
     the run's state), skipping prompts too long for the model's context;
  2. sample G completions for each with the current policy through a `RolloutEngine`: the HF
     engine samples with the policy itself, and its log-probs come back as `old_logp` (no
     extra forward pass); vLLM samples with its own copy of the weights (synced after every
     update), and the trainer recomputes `old_logp`, keeping vLLM's as `behaviour_logp`;
  3. score every completion: the weighted sum of the reward functions (NaN where none scored),
     and pass/fail by the pass reward; DAPO's soft overlong penalty is added when enabled;
  4. optionally (dynamic sampling, DAPO) drop groups whose completions all pass or all fail and
     sample more prompts, up to `max_resample_rounds` extra rounds (steps 1-4: `collect_batch`);
  5. advantages = group_advantages(rewards): the group mean is the baseline, so no critic;
  6. reference log-probs when beta > 0 (the initial policy, frozen);
  7. `epochs` passes over `minibatches` minibatches of whole groups (groups whose advantages are
     all 0 left out of the compute when beta = 0: their gradient is exactly 0): current log-probs,
     `policy_loss` (token ratio for GRPO, sequence ratio for GSPO), backward (in chunks of
     `micro_batch_size` completions, gradients accumulated), gradient clipping, an optimizer
     step. With one epoch and one minibatch the update is exactly on-policy and the ratio is 1;
     only its gradient matters (GRPO paper, mu = 1);
  8. learning-rate schedule, metrics, sample completions (steps 5-8: `learn`, in
     `grouprl.train.step`, which `grouprl check` runs too); then the driver logs, evaluates
     and checkpoints.

A step is split where the weights begin to change: `collect_batch` only reads them, `learn`
changes them in place. The driver keeps the `RunState` of the last completed step, and saves it
only where the weights are that state's: when a user's mistake stops the run before or after
an update (`committed`), never from inside one.

Deviations from the papers: dropout stays off throughout (the model stays in eval mode), so the
ratio compares the same function at two parameter values and is not noisy by construction
(LoRA's own dropout, when asked for, is the one exception).

Everything runs on the policy's device; forward passes run under autocast when the precision
asks for it, and then the trainer recomputes `old_logp` itself (the sampler's rounding differs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from grouprl.config.options import TrainConfig
from grouprl.errors import UserError
from grouprl.faults import fault
from grouprl.report.doctor import diagnose
from grouprl.train.async_sampler import AsyncSampler, lag_version, sampler_threads, stamped
from grouprl.train.checkpoint import load_sampler_versions
from grouprl.train.collect import Collected, collect_batch
from grouprl.train.evaluate import run_eval
from grouprl.train.events import RunEvent
from grouprl.train.parallel import distributed
from grouprl.train.run import (
    Run,
    RunState,
    committed,
    describe,
    open_sinks,
    restore,
    save,
    setup_run,
    write_final,
)
from grouprl.train.step import StepLog, learn


@dataclass(frozen=True)
class TrainSummary:
    run_dir: Path
    steps_done: int
    initial_eval: dict[str, float] | None
    final_eval: dict[str, float] | None
    interrupted: bool = False
    stopped_by: str | None = None  # "SIGINT" or "SIGTERM" when a signal stopped the run
    policy: Any = None  # the trained policy (in eval mode), and its tokenizer
    tokenizer: Any = None


def train(
    cfg: TrainConfig,
    *,
    console: Console | None = None,
    callbacks: Sequence[Callable[[RunEvent], Any]] = (),
    live: dict[str, str] | None = None,
) -> TrainSummary:
    """Run (or resume) a training run described by `cfg`; see the module docstring.
    `callbacks` are told of every step and evaluation (`RunEvent`); `live`: what identifies
    each live object a run from Python was given (recorded in config.yaml).

    Under torchrun every rank calls this; rank 0 prints and writes the run directory."""
    run = setup_run(cfg, console=console, callbacks=tuple(callbacks), live=live)
    with contextlib.closing(run.sampler.engine):  # an engine's own model copy is freed at the end
        try:
            return _train(run)
        finally:
            if run.ahead is not None:  # the sampler's thread ends with the run, however it ends
                run.ahead.close()
            if run.sampler.tools is not None and run.sampler.tools.environment is not None:
                run.sampler.tools.environment.close_all()  # their sessions end with the run


def _train(run: Run) -> TrainSummary:
    """`train` on a run that is set up."""
    state, finished = restore(run)
    if finished:
        return TrainSummary(run.run_dir, state.step, state.initial_eval, None,
                            policy=run.policy, tokenizer=run.tokenizer)  # fmt: skip
    if run.cfg.max_staleness:
        run.ahead = start_ahead(run, state)
    steps, final_eval = run.cfg.steps, None
    # From the first checkpoint on, SIGINT/SIGTERM finish the current step, save and stop.
    with open_sinks(run, state), _StopFlag() as stop, _StepBar(run, state) as bar:
        save(run, state)  # a run directory always holds a checkpoint to resume from
        # what every rank agreed on (a signal that arrives later waits for the next agreement)
        stopping = run.dist.first_signal(stop.requested)
        held_out: tuple[int, dict[str, float] | None] = (-1, None)  # the latest evaluation
        if state.initial_eval is None and stopping is None:  # else: on resume
            describe(run)
            with committed(run, state):
                held_out = (0, evaluate_at(run, 0))
                state = dataclasses.replace(state, initial_eval=held_out[1])
        while state.step < steps and stopping is None and not run.stop_asked:
            with committed(run, state):  # the weights are still `state`'s
                collected = take_batch(run, state)
            state, log = learn(run, state, collected)  # changes the weights in place
            if run.ahead is not None:
                run.ahead.publish(state.step, run.policy)  # the version batch step + K samples
            with committed(run, state):
                log_step(run, state, log, bar)
                notify(run, "step", state.step, log.metrics)
                if (
                    run.cfg.eval_every
                    and state.step % run.cfg.eval_every == 0
                    and state.step < steps
                    and not run.stop_asked
                ):
                    held_out = (state.step, evaluate_at(run, state.step))
                if run.stop_asked:  # a callback ended the run after this step
                    steps = state.step
                if state.step % run.cfg.save_every == 0 and state.step < steps:
                    save(run, state)
                    notify(run, "save", state.step, {})
                check_nonfinite(run, state)
            stopping = run.dist.first_signal(stop.requested)  # all stop together
        with committed(run, state):
            save(run, state)
            notify(run, "save", state.step, {})
        stopping = run.dist.first_signal(stop.requested)  # one arriving during the save counts too
        if stopping is not None:
            return stopped(run, state, stopping)
        with committed(run, state):
            final_eval = held_out[1] if held_out[0] == state.step else evaluate_at(run, state.step)
        stopping = run.dist.first_signal(stop.requested)  # during the final evaluation: the
        if stopping is not None:  # run is saved; a resume evaluates again and writes final/
            return stopped(run, state, stopping)
        with committed(run, state):
            finish(run, state, final_eval)
    return TrainSummary(run.run_dir, state.step, state.initial_eval, final_eval,
                        policy=run.policy, tokenizer=run.tokenizer)  # fmt: skip


def start_ahead(run: Run, state: RunState, *, overlap: bool = True) -> AsyncSampler:
    """The asynchronous sampler from `state` on: the versions a resumed checkpoint kept for its
    in-flight batches, and the trainer's own weights as version `state.step`. With
    `--sampler-threads 0`, GROUPRL_SEQUENTIAL_AHEAD set or `overlap` False, each batch is sampled in the trainer's thread when it is taken, on the
    same schedule: the sequential run an overlapped one equals."""
    saved = {} if run.resumed_from is None else load_sampler_versions(run.resumed_from)
    K = run.cfg.max_staleness
    missing = sorted({lag_version(k, K) for k in range(state.step, state.step + K)}
                     - {*saved, state.step})  # fmt: skip
    if missing:  # a staleness the checkpoint cannot honour is never silently reduced
        raise UserError(
            f"--max-staleness {K} samples step {state.step}'s batches with versions "
            f"{', '.join(map(str, missing))} of the weights, which this checkpoint does not keep "
            "(it was saved with a smaller staleness); resume with the staleness it was saved with"
        )
    threads = sampler_threads(run.cfg)
    overlap = overlap and threads > 0 and not os.environ.get("GROUPRL_SEQUENTIAL_AHEAD")
    ahead = AsyncSampler(run.cfg, run.sampler, run.policy, start_step=state.step,
                         start_position=state.data_position, saved=saved, threads=threads,
                         overlap=overlap)  # fmt: skip
    ahead.publish(state.step, run.policy)
    return ahead


def take_batch(run: Run, state: RunState) -> Collected:
    """Step `state.step`'s batch: sampled now by the current policy, or taken from the
    asynchronous sampler (sampled by version max(0, step − K))."""
    if run.ahead is not None:
        return run.ahead.take(state.step)
    collected = collect_batch(run.cfg, run.sampler, state.step, state.data_position)
    return stamped(collected, state.step, state.step)


def notify(run: Run, kind: str, step: int, metrics: dict[str, float]) -> None:
    """Tell each callback; when any (on any rank) asks the run to end after this step,
    `run.stop_asked`. A callback that raises ends the run in one line naming it (the last step
    is saved)."""
    if not run.callbacks:
        return
    asked = []
    event = RunEvent(kind, step, MappingProxyType(dict(metrics)), run.run_dir,
                     lambda: asked.append(True))  # fmt: skip
    for callback in run.callbacks:
        try:
            callback(event)
        except UserError:
            raise
        except Exception as err:
            name = getattr(callback, "__qualname__", type(callback).__name__)
            raise UserError(f"callback {name} raised {type(err).__name__}: {err}") from err
    (any_rank,) = run.dist.sum(float(bool(asked)))
    run.stop_asked = run.stop_asked or any_rank > 0


def log_step(run: Run, state: RunState, log: StepLog, bar: _StepBar) -> None:
    """The step's metrics, samples and ratios to the sinks (rank 0, agreed), a warning for a
    skipped update, and the progress line."""
    metrics = log.metrics
    if state.nonfinite_in_a_row:
        run.warn(
            f"step {state.step}: non-finite loss or gradient; "
            f"{metrics['nonfinite_updates']} update(s) skipped"
        )

    def write() -> None:
        run.sinks.log_step(state.step, metrics)
        run.sinks.log_samples(state.step, log.samples)
        if log.ratios is not None:
            run.sinks.log_ratios(state.step, *log.ratios)
        if log.groups is not None:
            run.sinks.log_groups(state.step, log.groups)

    run.on_main(write)
    bar.update(
        state.step,
        f"reward {metrics.get('reward_mean', math.nan):.3f}  "
        f"acc {metrics.get('accuracy', math.nan):.3f}  {metrics['tokens_per_s']:.0f} tok/s",
    )


def check_nonfinite(run: Run, state: RunState) -> None:
    if state.nonfinite_in_a_row >= run.cfg.max_nonfinite_steps:
        raise UserError(
            f"{state.nonfinite_in_a_row} steps in a row (to step {state.step}) had a non-finite "
            "loss or gradient, so their updates were skipped; the weights are those of the last "
            "finite update. Lower --lr, check the rewards for NaN, or raise --max-nonfinite-steps"
        )


def evaluate_at(run: Run, step: int) -> dict[str, float]:
    """The held-out evaluation at `step`, logged and printed; then `grouprl doctor`'s checks,
    live, each warning once."""
    fault("eval")
    result = run_eval(run.cfg, run.policy, run.sampler, run.heldout, step, lockstep=run.lockstep)
    run.on_main(lambda: run.sinks.log_eval(step, result))
    notify(run, "evaluation", step, result)
    line = "  ".join(f"{k} {v:.3f}" for k, v in result.items())
    run.console.print(f"step {step:>5}  held-out  {line}")
    if run.cfg.doctor and run.dist.is_main and step > 0 and "off" not in run.reported:
        try:
            findings = diagnose(run.run_dir)
        except Exception as err:  # never let a diagnosis stop training
            run.reported.add("off")
            run.warn(f"doctor: stopped checking this run ({type(err).__name__}: {err})")
            findings = []
        for finding in findings:
            if finding.severity == "warning" and finding.code not in run.reported:
                run.reported.add(finding.code)
                run.warn(f"doctor: {finding.title}: {finding.evidence}; {finding.suggestion}")
    return result


def stopped(run: Run, state: RunState, signum: int) -> TrainSummary:
    """A signal stopped the run after `state` was saved: say how to continue."""
    run.dist.barrier()
    name = signal.Signals(signum).name
    run.console.print(
        f"stopped by {name}: saved a checkpoint at step {state.step}; "
        f"continue with: grouprl train --resume {run.run_dir}"
    )
    return TrainSummary(
        run.run_dir, state.step, state.initial_eval, None, interrupted=True, stopped_by=name
    )


def finish(run: Run, state: RunState, final_eval: dict[str, float]) -> None:
    """final/, the plots and the held-out summary."""
    plots = write_final(run, state.step)
    if run.dist.is_main:
        _print_summary(run.console, state.initial_eval, final_eval)
        run.console.print(f"final policy: {run.run_dir / 'final'}   plots: {plots or '-'}")


class _StepBar:
    """A live progress bar on a terminal and in Jupyter (with ipywidgets); elsewhere a plain
    line every 5% of the steps."""

    def __init__(self, run: Run, state: RunState) -> None:
        self.console, self.steps = run.console, run.cfg.steps
        self.interactive = run.cfg.progress and (
            run.console.is_terminal or (run.console.is_jupyter and _has_widgets())
        )
        self.bar = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=run.console,
            disable=not self.interactive,
            transient=False,
        )
        self.task = self.bar.add_task("train", total=self.steps, completed=state.step, info="")

    def __enter__(self) -> _StepBar:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def update(self, step: int, info: str) -> None:
        self.bar.update(self.task, completed=step, info=info)
        if not self.interactive and (step % max(1, self.steps // 20) == 0 or step == self.steps):
            self.console.print(f"step {step:>5}/{self.steps}  {info}")


def _has_widgets() -> bool:
    """rich draws a live bar in Jupyter through ipywidgets; without it, plain lines."""
    return importlib.util.find_spec("ipywidgets") is not None


def _print_summary(console: Console, before: dict | None, after: dict) -> None:
    table = Table(title="held-out accuracy")
    table.add_column("metric")
    table.add_column("start", justify="right")
    table.add_column("end", justify="right")
    table.add_column("change", justify="right")
    for key, value in after.items():
        start = (before or {}).get(key, math.nan)
        table.add_row(key, f"{start:.3f}", f"{value:.3f}", f"{value - start:+.3f}")
    console.print(table)


class _StopFlag:
    """The first Ctrl-C (SIGINT) or SIGTERM (what cluster schedulers send on preemption) asks
    the loop to save and stop after the current step; a second Ctrl-C interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: int | None = None  # the signal that asked
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        for signum in self.SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = self.requested or signum

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def train_and_leave(cfg: TrainConfig, **options: Any) -> TrainSummary:
    """`train` (with its `options`), then leave the torchrun job (if any): every rank together
    when the run ended (stopped by a signal included), at once when an error ends it."""
    ended = False
    try:
        summary = train(cfg, **options)
        ended = True
    finally:
        distributed.shutdown(together=ended)
    return summary
