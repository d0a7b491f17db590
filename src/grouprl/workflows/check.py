"""Before training (`grouprl check`): will this run learn, and how long will it take?

Builds model, data, rewards and templates exactly as `train` does (the same flags, the same
errors; `setup_run`), samples `--check-steps` steps' worth of groups through the trainer's own
`collect_batch`, runs one real update's forwards and backwards without stepping the optimizer
(the weights do not change), and reports: the first prompts as the model sees them with a
completion each, each reward's spread and how often it decides a group's ranking, the pass rate
per prompt and the share of groups that would carry no gradient at this and other group sizes,
completion lengths against the budget, throughput, the time per step and for the run, and the
update's peak memory. Findings as `doctor` writes them; exit 1 when the run would not learn.

Nothing is written.

The zero-gradient share. A group of G completions of a prompt whose pass rate is p carries no
gradient when all pass or all fail: P = pᴳ + (1−p)ᴳ. With n samples of a prompt, k passing, the
measured k/n is often exactly 0 or 1, so p is given the posterior Beta(k+½, n−k+½) (Jeffreys'
prior) and the share is its expectation, in closed form

    E[pᴳ] = Π_{i<G} (a+i)/(a+b+i),  E[(1−p)ᴳ] = Π_{i<G} (b+i)/(a+b+i),  a = k+½, b = n−k+½,

averaged over the prompts sampled.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from grouprl.config.options import TrainConfig
from grouprl.errors import UserError
from grouprl.report.doctor import Finding
from grouprl.train.collect import Collected, collect_batch
from grouprl.train.run import Run, RunState, setup_run

GROUP_SIZES = (2, 4, 8, 16, 32, 64)
NO_GRADIENT_TARGET = 0.5  # a group size is suggested that brings the no-gradient share below this
NO_GRADIENT_STOP = 0.9  # above this share of groups without gradient, the run would not learn
SAME_SCORE = 0.95  # a weighted reward giving one score to this share of completions is a finding
# The sampler's log-probs against the trainer's, k3's KL per token (verl's rollout-correction
# docs: negligible needs no correction; its k3 rejection thresholds run 1e-3 to 1e-2):
MISMATCH_INFO = 1e-4  # from here a correction is suggested
MISMATCH_WARN = 1e-2  # and from here the run is warned: the gap is the size of a policy update


#: check's own flags and the CheckOptions field each sets (every other flag is train's).
OWN_FLAGS = {"--check-steps": "steps", "--json": "json", "--output": "output",
             "--memory-limit": "memory_limit_gb", "--second-temperature": "second_temperature"}  # fmt: skip


@dataclass(frozen=True)
class CheckOptions:
    """`grouprl check`'s own flags (every other flag is `grouprl train`'s)."""

    steps: int = 2
    """Steps' worth of groups to sample."""
    output: Path | None = None
    """Also write the report to this file as JSON (nothing is written without it)."""
    json: bool = False
    """Print the report as JSON instead of tables."""
    memory_limit_gb: float | None = None
    """Say what fits in this many GB: the largest micro-batch, or what to change."""
    second_temperature: float | None = None
    """Sample the first step's prompts again at this temperature too, and compare the reward
    spread."""


def no_gradient_share(k: int, n: int, group_size: int) -> float:
    """E[pᴳ + (1−p)ᴳ] under p ~ Beta(k+½, n−k+½): the chance that a group of `group_size`
    carries no gradient, for a prompt that passed k of n samples."""
    a, b = k + 0.5, n - k + 0.5
    all_pass = math.prod((a + i) / (a + b + i) for i in range(group_size))
    none_pass = math.prod((b + i) / (a + b + i) for i in range(group_size))
    return all_pass + none_pass


class _PeakRSS:
    """The process's resident memory, sampled every few ms on a thread while inside (a CPU has
    no allocator peak to read; /proc/self/statm on Linux, else the lifetime ru_maxrss)."""

    def __enter__(self) -> _PeakRSS:
        self.peak = self.start = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class _NoStep:
    """The optimizer as the update sees it, but `step` does nothing: check measures an update
    and leaves the weights (and AdamW's moments) as they were."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.param_groups = optimizer.param_groups
        self._optimizer = optimizer

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)


class _NoSchedule:
    """A learning-rate schedule that stays where it is (check takes no step)."""

    def step(self) -> None:
        pass


@dataclass
class Report:
    config: dict[str, Any]
    prompts: list[dict[str, Any]]
    rewards: dict[str, dict[str, float]]
    correlations: dict[str, float]
    pass_counts: list[list[int]]  # per prompt: [passes, samples]
    measured_no_gradient: float
    predicted_no_gradient: dict[int, float]
    suggested_group_size: int | None
    lengths: dict[str, float]
    second_temperature: dict[str, float] | None
    timing: dict[str, float]
    memory: dict[str, Any]
    step: dict[str, float]  # the measured step's metrics, as train logs them (timings aside)
    mismatch: dict[str, Any] = field(default_factory=dict)  # sampler against trainer log-probs
    findings: list[Finding] = field(default_factory=list)

    @property
    def would_not_learn(self) -> bool:
        return any(f.code in STOPPERS for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "findings"}
        out["findings"] = [f.to_json() for f in self.findings]
        out["would_not_learn"] = self.would_not_learn
        return out


STOPPERS = {"no_gradient", "all_truncated", "never_passes"}
#: A step's timings, reported under `timing` instead of with the step's metrics.
TIMINGS = ("step_seconds", "rollout_seconds", "tokens_per_s")


def check(cfg: TrainConfig, options: CheckOptions, *, console: Console | None = None) -> Report:
    """The report on the run `cfg` describes: built as `train` builds it, measured as `measure`
    says."""
    run = setup_run(cfg, console=console)
    if run.dist.enabled:
        raise UserError("grouprl check runs in one process; run it without torchrun")
    return measure(run, options)


def measure(run: Run, options: CheckOptions) -> Report:
    cfg, sampler = run.cfg, run.sampler
    G = cfg.group_size
    run.console.print(f"check: sampling {options.steps} step(s) of {cfg.prompts_per_step} x {G}")
    batches, seconds, position = [], 0.0, 0
    for step in range(options.steps):
        collected = collect_batch(cfg, sampler, step, position)
        position = collected.position
        seconds += collected.seconds
        batches.append(collected)
    sampled = [c.sampled for c in batches]
    tokens = sum(int(b.rollout.sampled_lengths.sum()) for b in sampled)
    timing = {"sampling_seconds_per_step": seconds / len(batches), "tokens_per_s": tokens / seconds}
    timing.update(_measure_update(run, batches[0]))
    memory = timing.pop("memory")
    step_metrics = timing.pop("step")
    per_step = timing["sampling_seconds_per_step"] + timing["update_seconds"]
    timing["seconds_per_step"] = per_step
    timing["run_seconds"] = per_step * cfg.steps + _eval_seconds(
        cfg, timing["tokens_per_s"], sampled
    )
    memory.update(_fit(cfg, memory, options.memory_limit_gb))

    counts = _pass_counts(sampled, G)
    rewards, correlations = _reward_stats(sampled, sampler.rewards.weights, G)
    measured = sum(c.counts.zero_std for c in batches) / sum(c.counts.sampled for c in batches)
    predicted = {
        g: sum(no_gradient_share(k, n, g) for k, n in counts) / len(counts) for g in GROUP_SIZES
    }
    if G not in predicted:
        predicted[G] = sum(no_gradient_share(k, n, G) for k, n in counts) / len(counts)
    suggested = next((g for g in sorted(predicted) if predicted[g] < NO_GRADIENT_TARGET), None)
    report = Report(
        config={
            "algo": cfg.algo,
            "model": cfg.model,
            "group_size": G,
            "prompts_per_step": cfg.prompts_per_step,
            "steps": cfg.steps,
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "correction": cfg.correction,
            "max_staleness": cfg.max_staleness,
            "sampler_apart": _sampler_apart(cfg.vllm_server),
        },
        prompts=_first_prompts(run, sampled[0], G),
        rewards=rewards,
        correlations=correlations,
        pass_counts=[list(c) for c in counts],
        measured_no_gradient=measured,
        predicted_no_gradient=predicted,
        suggested_group_size=suggested,
        lengths=_lengths(sampled, cfg.max_new_tokens),
        second_temperature=_at_temperature(run, options.second_temperature),
        timing=timing,
        memory=memory,
        step=step_metrics,
        mismatch=_mismatch(run, batches[0]),
    )
    report.findings = findings(report, sampled, sampler.rewards.pass_reward)
    return report


def _at_temperature(run: Run, temperature: float | None) -> dict[str, float] | None:
    """The first step's prompts sampled again at `temperature`: what it measures there (the
    pass rate and groups without gradient), not an extrapolation."""
    if temperature is None:
        return None
    cfg = dataclasses.replace(run.cfg, temperature=temperature)
    collected = collect_batch(cfg, run.sampler, 0, 0)
    counts = _pass_counts([collected.sampled], cfg.group_size)
    return {
        "temperature": temperature,
        "pass_rate": sum(k for k, _ in counts) / sum(n for _, n in counts),
        "measured_no_gradient": collected.counts.zero_std / collected.counts.sampled,
        "predicted_no_gradient": sum(no_gradient_share(k, n, cfg.group_size) for k, n in counts)
        / len(counts),
    }


def _measure_update(run: Run, collected: Collected) -> dict[str, Any]:
    """The first step's training after sampling, as `train` runs it (`grouprl.train.step.learn`:
    advantages, reference log-probs when beta > 0, every epoch and minibatch, the metrics),
    timed and its peak memory measured, on a copy of the run whose optimizer and schedule never
    step: the weights, AdamW's moments and the learning rate stay as they were. When dynamic
    sampling kept no group, the first round's groups are measured instead."""
    from grouprl.train.step import learn

    if collected.kept is None:
        first = collected.sampled.select_groups(list(range(run.cfg.prompts_per_step)))
        collected = dataclasses.replace(collected, kept=first)
    measured = dataclasses.replace(run, optimizer=_NoStep(run.optimizer), scheduler=_NoSchedule())
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
        torch.cuda.reset_peak_memory_stats(run.device)
    start = time.perf_counter()
    with _PeakRSS() as rss:
        _, log = learn(measured, RunState(), collected)
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
    seconds = time.perf_counter() - start
    run.optimizer.zero_grad(set_to_none=True)
    return {
        "update_seconds": seconds,
        "update_completions": len(collected.kept.rollout.texts),
        "memory": _memory(run, rss, len(collected.kept.rollout.texts)),
        "step": {k: v for k, v in log.metrics.items() if k not in TIMINGS},
    }


def _mismatch(run: Run, collected: Collected) -> dict[str, Any]:
    """How far the sampler's log-probs of the first step's trained tokens are from the
    trainer's own forward of them, whatever the options make the sampler (grouprl's, in fp32:
    the same function to float rounding; under bf16; vLLM): one no-grad forward."""
    from grouprl.core import logp_mismatch
    from grouprl.train.nograd import no_grad_logprobs
    from grouprl.train.update import mismatch_metrics

    batch = collected.kept or collected.sampled
    rollout = batch.rollout
    trainer = no_grad_logprobs(run.cfg, run.policy, rollout, run.sampler.dtype)  # (N, T)
    sums = logp_mismatch(rollout.sampler_logp, trainer, rollout.loss_mask)
    return {**mismatch_metrics(sums), "tokens": sums.tokens,
            "sampler": run.cfg.engine + ("" if run.sampler.dtype is None else " bf16")}  # fmt: skip


def _memory(run: Run, rss: _PeakRSS, completions: int) -> dict[str, Any]:
    """The update's peak memory: the CUDA allocator's, or the process's resident set."""
    cfg = run.cfg
    trained = sum(p.numel() for p in run.policy.parameters() if p.requires_grad)
    if run.device.type == "cuda":
        peak, base = torch.cuda.max_memory_allocated(run.device), None
        method = "CUDA allocator peak"
    else:
        peak, base, method = rss.peak, rss.start, "process RSS sampled every 5 ms"
    per_forward = cfg.micro_batch_size or (completions // cfg.minibatches)
    return {"peak_gb": peak / 1e9, "before_gb": None if base is None else base / 1e9,
            "method": method, "completions_per_forward": per_forward,
            "adamw_state_gb": 2 * 4 * trained / 1e9}  # fmt: skip


def _fit(cfg: Any, memory: dict[str, Any], limit_gb: float | None) -> dict[str, Any]:
    """What fits `limit_gb`: the update's activations (peak − before) grow in proportion to the
    completions per forward (--micro-batch-size); AdamW's two moments (8 bytes per trained
    parameter), not yet allocated because check never steps, are added."""
    if limit_gb is None or memory["before_gb"] is None:
        return {}
    base = memory["before_gb"] + memory["adamw_state_gb"]
    per_completion = (
        max(memory["peak_gb"] - memory["before_gb"], 0) / memory["completions_per_forward"]
    )
    room = limit_gb - base
    fits = int(room // per_completion) if per_completion > 0 else memory["completions_per_forward"]
    return {
        "limit_gb": limit_gb,
        "predicted_gb": base + per_completion * memory["completions_per_forward"],
        "micro_batch_size_that_fits": max(0, min(fits, memory["completions_per_forward"])),
        "prediction": "before + AdamW moments + (peak - before) x micro-batch / measured",
    }


def _eval_seconds(cfg: Any, tokens_per_s: float, sampled: list[Any]) -> float:
    """The run's evaluations at the measured sampling speed and mean completion length."""
    lengths = torch.cat([b.rollout.sampled_lengths.float().cpu() for b in sampled])
    evals = 2 + (cfg.steps // cfg.eval_every if cfg.eval_every else 0)
    completions = cfg.eval_size * (cfg.eval_samples + 1)  # sampled, and one greedy each
    return evals * completions * float(lengths.mean()) / tokens_per_s


def _pass_counts(sampled: list[Any], G: int) -> list[tuple[int, int]]:
    counts = []
    for batch in sampled:
        passed = batch.passed.view(-1, G)
        counts += [(int(row.sum()), G) for row in passed]
    return counts


def _reward_stats(
    sampled: list[Any], weights: dict[str, float], G: int
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Per reward: mean, std, unscored share, the share of completions given its most common
    score, and the share of groups it ranks (its scores differ inside the group); and the
    Pearson correlation of each pair over completions both scored."""
    stats, columns = {}, {}
    for name, weight in weights.items():
        values = torch.cat([b.by_function[name].double().cpu() for b in sampled])
        scored = values[~values.isnan()]
        columns[name] = values
        groups = values.view(-1, G)
        filled = torch.nan_to_num(groups, nan=-math.inf)
        ranks = (filled.amax(-1) > filled.amin(-1)).double().mean()
        common = scored.unique(return_counts=True)[1].max() / len(scored) if len(scored) else 1.0
        stats[name] = {
            "weight": weight,
            "mean": float(scored.mean()) if len(scored) else math.nan,
            "std": float(scored.std(unbiased=False)) if len(scored) else math.nan,
            "unscored": float(1 - len(scored) / len(values)),
            "same_score": float(common),
            "ranks_groups": float(ranks),
        }
    correlations = {}
    names = list(columns)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            both = ~(columns[a].isnan() | columns[b].isnan())
            x, y = columns[a][both], columns[b][both]
            if len(x) > 1 and x.std() > 0 and y.std() > 0:
                correlations[f"{a}~{b}"] = float(torch.corrcoef(torch.stack([x, y]))[0, 1])
    return stats, correlations


def _lengths(sampled: list[Any], budget: int) -> dict[str, float]:
    lengths = torch.cat([b.rollout.sampled_lengths.double().cpu() for b in sampled])
    truncated = torch.cat([b.rollout.truncated.cpu() for b in sampled])
    q = torch.quantile(lengths, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    return {"max_new_tokens": budget, "truncated": float(truncated.double().mean()),
            "min": float(lengths.min()), "p10": float(q[0]), "p50": float(q[1]),
            "p90": float(q[2]), "max": float(lengths.max())}  # fmt: skip


def _first_prompts(run: Run, batch: Any, G: int, k: int = 3) -> list[dict[str, Any]]:
    """The first prompts exactly as the model saw them (the ids it was fed: template, system
    prompt, tools, an environment's reset text and special tokens visible), with the first
    completion sampled for each."""
    out, rollout = [], batch.rollout
    for g, row in enumerate(batch.rows[:k]):
        ids = rollout.prompt_ids[g][rollout.prompt_mask[g]].tolist()
        out.append({
            "rendered": run.tokenizer.decode(ids, skip_special_tokens=False),
            "tokens": len(ids),
            "completion": batch.rollout.texts[g * G],
            "passed": bool(batch.passed[g * G]),
            "answer": row.get("answer"),
        })  # fmt: skip
    return out


def findings(report: Report, sampled: list[Any], pass_reward: str) -> list[Finding]:
    """What would stop the run learning (warnings that make check exit 1), and what would slow
    it, each with its number and one suggestion."""
    out = []
    passes = sum(k for k, _ in report.pass_counts)
    if passes == 0:
        examples = [{"prompt": p["rendered"][-80:], "completion": p["completion"],
                     "answer": p["answer"]} for p in report.prompts]  # fmt: skip
        out.append(Finding(
            "never_passes", "warning", f"the pass reward ({pass_reward}) never passes",
            f"0 of {sum(n for _, n in report.pass_counts)} completions scored >= 1",
            "look at the completions below: the model may not answer in the format the reward "
            "expects (fix the prompt, template or reward), or the task is too hard for it",
            examples,
        ))  # fmt: skip
    if report.lengths["truncated"] >= 1.0:
        out.append(Finding(
            "all_truncated", "warning", "every completion hit --max-new-tokens",
            f"{report.lengths['truncated']:.0%} truncated at {report.lengths['max_new_tokens']} "
            "tokens",
            "raise --max-new-tokens (or add a --stop string the model writes at the end)",
        ))  # fmt: skip
    elif report.lengths["truncated"] > 0.5:
        out.append(Finding(
            "mostly_truncated", "warning", "most completions hit --max-new-tokens",
            f"{report.lengths['truncated']:.0%} truncated at {report.lengths['max_new_tokens']} "
            f"tokens (median length {report.lengths['p50']:.0f})",
            "raise --max-new-tokens: a cut-off completion rarely holds an answer",
        ))  # fmt: skip
    if report.measured_no_gradient > NO_GRADIENT_STOP:
        out.append(Finding(
            "no_gradient", "warning", "almost no group carries a gradient",
            f"{report.measured_no_gradient:.0%} of groups scored alike (all pass or all fail; "
            f"threshold {NO_GRADIENT_STOP:.0%})",
            _group_advice(report),
        ))  # fmt: skip
    elif report.predicted_no_gradient[report.config["group_size"]] > NO_GRADIENT_TARGET:
        out.append(Finding(
            "little_gradient", "info", "many groups would carry no gradient",
            f"predicted {report.predicted_no_gradient[report.config['group_size']]:.0%} at "
            f"G = {report.config['group_size']}", _group_advice(report),
        ))  # fmt: skip
    for name, s in report.rewards.items():
        if s["weight"] != 0 and s["same_score"] >= SAME_SCORE:
            out.append(Finding(
                f"same_score_{name}", "info" if name != pass_reward else "warning",
                f"reward {name} gives nearly everything the same score",
                f"{s['same_score']:.0%} of completions got its most common score (threshold "
                f"{SAME_SCORE:.0%}); it ranks {s['ranks_groups']:.0%} of groups",
                "check it on a few completions by hand; a reward that never varies adds nothing",
            ))  # fmt: skip
        if s["unscored"] > 0.5:
            out.append(Finding(
                f"unscored_{name}", "info", f"reward {name} leaves most completions unscored",
                f"{s['unscored']:.0%} None", "check the columns it reads and when it returns None",
            ))  # fmt: skip
    kl = report.mismatch.get("logp_mismatch_kl", math.nan)
    if kl >= MISMATCH_INFO and report.config.get("correction", "none") == "none":
        out.append(Finding(
            "logp_mismatch", "warning" if kl >= MISMATCH_WARN else "info",
            "the sampler's log-probs differ from the trainer's",
            f"KL {kl:.2e} per token (k3), mean |d log p| "
            f"{report.mismatch['logp_mismatch_mean']:.2e}, max "
            f"{report.mismatch['logp_mismatch_max']:.2e}, over {report.mismatch['tokens']} tokens",
            "correct for it: --correction token_tis (truncated importance weights), or "
            "--correction geo_mask_token_tis for long completions",
        ))  # fmt: skip
    out += _async_findings(report)
    memory = report.memory
    if "limit_gb" in memory and memory["predicted_gb"] > memory["limit_gb"]:
        fits = memory["micro_batch_size_that_fits"]
        out.append(Finding(
            "memory", "warning", "the update is predicted not to fit --memory-limit",
            f"predicted {memory['predicted_gb']:.2f} GB against {memory['limit_gb']:g} GB",
            f"--micro-batch-size {fits} (the same update, in chunks)" if fits
            else "--gradient-checkpointing, a smaller --max-new-tokens, or LoRA (--lora-r)",
        ))  # fmt: skip
    return sorted(out, key=lambda f: f.severity != "warning")


def _async_findings(report: Report) -> list[Finding]:
    """Asynchronous sampling where sampler and trainer share a machine: measured, it does not
    pay there."""
    if report.config.get("max_staleness", 0) > 0 and not report.config.get("sampler_apart"):
        return [Finding(
            "async_shared_device", "info",
            "asynchronous sampling here shares the trainer's machine",
            f"--max-staleness {report.config['max_staleness']} overlaps sampling with the update, "
            "which only hides time one side leaves idle: measured on 2 CPU cores, 0.85-0.99x the "
            "steps/s of --max-staleness 0 (1.06x with --proximal behaviour)",
            "keep --max-staleness 0 where sampler and trainer share a device; sample on another "
            "machine's devices (--vllm-server URL) for the overlap to pay",
        )]  # fmt: skip
    return []


def _sampler_apart(servers: str | None) -> bool:
    """Whether `--vllm-server` names a server on another machine (one on this machine shares
    its cores or GPUs with the trainer)."""
    from urllib.parse import urlparse

    if servers is None:
        return False
    hosts = {urlparse(u if "://" in u else "http://" + u).hostname for u in servers.split(",")}
    return not hosts & {"local", "127.0.0.1", "localhost", "::1", "0.0.0.0"}


def _group_advice(report: Report) -> str:
    if report.lengths["truncated"] > 0.5:
        return "raise --max-new-tokens first: most completions are cut off before they answer"
    passes = sum(k for k, _ in report.pass_counts) / max(1, sum(n for _, n in report.pass_counts))
    side = "easier prompts" if passes < 0.5 else "harder prompts"
    if report.suggested_group_size is not None:
        return (
            f"--group-size {report.suggested_group_size} is predicted to bring it below "
            f"{NO_GRADIENT_TARGET:.0%}; or {side}, or --algo dapo (dynamic sampling)"
        )
    return f"use {side} (pass rate {passes:.0%}): no group size up to 64 helps enough"
