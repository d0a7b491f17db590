"""Evaluation: pass@1 (sampled and greedy) and pass@k of a model on a task or dataset split, for
`grouprl eval` (`evaluate_model`) and the trainer's held-out evaluations (`run_eval`).

For each problem, k completions are sampled at `temperature` by a `RolloutEngine` (the trainer's
own) and judged by the pass reward (`--pass-reward`, the same one
`grouprl train` uses): a completion counts as solved when that reward is at least 1 (full marks;
None counts as unsolved). With c of n = k samples solved:

    pass@1 = c / n                                   (mean over samples, unbiased)
    pass@k = 1 − C(n − c, k) / C(n, k)               (Chen et al. 2021, "Evaluating Large
                                                      Language Models Trained on Code", eq. 1)

averaged over problems; with k = n the estimator is simply "any of the n samples solved it".
Greedy pass@1 decodes one completion per problem at temperature 0.

Deterministic for a given seed: batch i of prompts samples with seed `seed + i`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from grouprl.config.options import EvalConfig, RunConfig
from grouprl.config.validation import validate_eval
from grouprl.errors import UserError
from grouprl.messages import is_conversational
from grouprl.models.loading import resolve_device
from grouprl.models.precision import autocast
from grouprl.rollout import HFRolloutEngine, Rollout, RolloutEngine, stop_token_ids
from grouprl.tasks import RewardFn
from grouprl.tasks.base import REWARD_TIMEOUT, TrainerState, call_reward, completion_objects
from grouprl.tasks.rewards.scoring import RewardSet
from grouprl.train.build import (
    build_engine,
    build_rewards,
    build_task,
    build_tools,
    load_run_model,
    load_run_tokenizer,
    prompt_budget,
    stop_strings,
)
from grouprl.train.collect import Sampler
from grouprl.train.parallel.fsdp import Lockstep
from grouprl.train.prompts import HeldOut, held_out, prompt_ids, reset_prompt_ids
from grouprl.train.turn_rewards import episode_turns


@dataclass(frozen=True)
class EvalResult:
    """pass@1 and pass@k over `n` problems with `samples` completions each."""

    n: int
    pass_at_1: float
    """Mean correctness over all n·samples sampled completions."""
    pass_at_k: float
    """Unbiased pass@k with k = samples."""
    greedy_pass_at_1: float | None
    """Share of problems the greedy completion solves; None when not measured."""
    samples: int
    mean_length: float = 0.0
    """Mean sampled completion length in tokens (EOS included)."""
    tool_call_rate: float | None = None
    """Share of sampled completions that called a tool at least once; None without tools."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 − C(n−c, k)/C(n, k) (Chen et al. 2021).

    Computed as 1 − Π_{i=n−c+1}^{n} (1 − k/i) to avoid huge binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


Judge = Callable[[Sequence[dict], Rollout], list[bool]]


def reward_judge(reward_fn: RewardFn, timeout: float | None = REWARD_TIMEOUT) -> Judge:
    """Solved flags from one reward function (score >= 1), called as TRL calls it."""
    name = getattr(reward_fn, "__name__", "reward")

    def judge(rows: Sequence[dict], rollout: Rollout) -> list[bool]:
        completions = (
            rollout.turns.transcripts
            if rollout.turns is not None
            else completion_objects(rollout.texts, is_conversational(rows[0]["prompt"]))
        )
        values = call_reward(
            name,
            reward_fn,
            completions,
            rows,
            rollout.group_size,
            timeout=timeout,
            completion_ids=rollout.completion_id_lists(),
            trainer_state=TrainerState(),
            log_metric=lambda *args: None,
            log_extra=lambda *args: None,
            **_multi_turn(rollout),
        )
        return [v >= 1.0 for v in values]  # NaN: False

    return judge


def pass_judge(rewards: RewardSet, *, state: TrainerState, timeout: float | None) -> Judge:
    """Solved flags by the run's pass reward (`RewardSet.score` with `only_pass`): the one
    definition of correct that train and eval share."""

    def judge(rows: Sequence[dict], rollout: Rollout) -> list[bool]:
        scores = rewards.score(
            rollout.texts,
            rows,
            rollout.group_size,
            completion_ids=rollout.completion_id_lists(),
            state=state,
            timeout=timeout,
            only_pass=True,
            transcripts=None if rollout.turns is None else rollout.turns.transcripts,
            **_multi_turn(rollout),
        )
        return scores.passed.tolist()

    return judge


def _multi_turn(rollout: Rollout) -> dict[str, Any]:
    """A multi-turn rollout's keywords for a reward call: `num_turns`, and `environments=`
    where it played environments."""
    if rollout.turns is None:
        return {}
    envs = rollout.turns.environments
    return {"num_turns": episode_turns(rollout, None),
            **({} if envs is None else {"environments": envs})}  # fmt: skip


#: Problems an evaluation samples together (each with its k samples), unless told.
EVAL_BATCH_PROMPTS = 64


@dataclass(frozen=True)
class EvalSettings:
    """How an evaluation samples, alike for every batch: `samples` completions per problem at
    `temperature` (batch i of `batch_prompts` problems with seed `seed + i`), each at most
    `max_new_tokens` and ended by `stop`; with `greedy`, one more at temperature 0."""

    max_new_tokens: int
    samples: int = 8
    temperature: float = 1.0
    stop: list[str] | None = None
    batch_prompts: int = EVAL_BATCH_PROMPTS
    seed: int = 0
    greedy: bool = True


@dataclass(frozen=True)
class EvalPrompts:
    """The problems' prompts as sampling feeds them (`grouprl.train.prompts.held_out` gives
    both): their `ids` (None: encoded here, `tools` included), the `keys` that seed their
    environments (None: the rows; episodes: `Episode`s), the run's `tools` and the `budget` an
    environment's reset must fit."""

    ids: Sequence[list[int]] | None = None
    keys: Sequence[Any] | None = None
    tools: Any = None
    budget: int | None = None


@dataclass(frozen=True)
class EvalShard:
    """Data-parallel evaluation (the trainer's): the rows are this rank's share, of which the
    first `real_rows` count (under FSDP the rest pad every rank to as many batches, each
    decoded in `lockstep`); `gather` collects every rank's per-problem counts; with `agree`
    (`Dist.check`) a judge's user error is raised on every rank together at the end (a rank in
    lockstep keeps sampling, without judging, so that the others' forwards are matched)."""

    real_rows: int | None = None
    gather: Callable[[Any], list[Any]] | None = None
    agree: Callable[[UserError | None], None] | None = None
    lockstep: Callable[[bool], bool] | None = None


def evaluate(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict],
    settings: EvalSettings,
    *,
    reward_fn: RewardFn | None = None,
    judge: Judge | None = None,
    prompts: EvalPrompts = EvalPrompts(),
    engine: RolloutEngine | None = None,
    shard: EvalShard = EvalShard(),
    progress: bool = True,
    console: Console | None = None,
) -> EvalResult:
    """pass@1, pass@k (k = samples) and greedy pass@1 of `model` on `rows`, sampled as
    `settings` says by `engine` (default: the Hugging Face engine over `model`) from `prompts`,
    and judged by `judge(rows, rollout) -> solved flags`, or by `reward_fn`'s score reaching 1.
    The model is put in eval mode for the measurement and returned to its previous mode. Over
    several ranks (`shard`), the result is that of all ranks' rows; in one process a judge's
    user error ends the evaluation at once."""
    if (reward_fn is None) == (judge is None):
        raise ValueError("give exactly one of reward_fn and judge")
    judge = judge or reward_judge(reward_fn)
    if not rows:
        raise UserError("nothing to evaluate: the split is empty (check --limit and the task)")
    engine = engine or HFRolloutEngine(model, tokenizer, lockstep=shard.lockstep)
    tools = prompts.tools
    ids = (
        list(prompts.ids)
        if prompts.ids is not None
        else [prompt_ids(tokenizer, r["prompt"], tools, r) for r in rows]
    )
    keys = list(prompts.keys) if prompts.keys is not None else list(rows)
    sampling = _Sampling(engine, tokenizer, tools, settings, prompts.budget)
    counts = _Counts(settings.samples, settings.greedy)
    was_training = model.training
    model.eval()
    try:
        with _progress(console, progress) as bar:
            error = _batches(sampling, counts, rows, ids, keys, judge, bar,
                             stop_at_error=shard.lockstep is None,
                             raise_at_once=shard.agree is None)  # fmt: skip
    finally:
        model.train(was_training)
    if shard.agree is not None:
        shard.agree(error)
    mine = counts.first(len(rows) if shard.real_rows is None else shard.real_rows)
    shares = shard.gather(mine) if shard.gather is not None else [mine]
    return _result(shares, settings.samples, settings.greedy, tools)


def _batches(sampling: _Sampling, counts: _Counts, rows, ids, keys, judge: Judge, bar: Any, *,
             stop_at_error: bool, raise_at_once: bool) -> UserError | None:  # fmt: skip
    """Sample and judge `rows` batch by batch into `counts`; a judge's user error is raised at
    once (`raise_at_once`) or returned, the remaining batches still sampled unless
    `stop_at_error` (a rank in lockstep keeps the others' forwards matched). Each batch's
    environments go back once it is judged."""
    task_id, error = bar.add_task("eval", total=len(rows)), None
    size = sampling.settings.batch_prompts
    for i, first in enumerate(range(0, len(rows), size)):
        span = slice(first, first + size)
        batch, rollouts = sampling.rollouts(rows[span], ids[span], keys[span], i)
        if error is None:
            try:
                counts.add(batch, rollouts, judge)
            except UserError as err:
                if raise_at_once:
                    raise
                error = err
        for rollout in rollouts if sampling.tools is not None else ():
            sampling.tools.scored(None if rollout.turns is None else rollout.turns.environments)
        if error is not None and stop_at_error:
            break
        bar.advance(task_id, len(batch))
    return error


@dataclass(frozen=True)
class _Sampling:
    """How an evaluation samples: the engine, and the settings every batch shares."""

    engine: RolloutEngine
    tokenizer: Any
    tools: Any  # the run's ToolUse, or None
    settings: EvalSettings
    budget: int | None

    def rollouts(
        self, rows: Sequence[dict], ids: list[list[int]], keys: list[Any], i: int
    ) -> tuple[list[dict], list[Rollout]]:
        """Batch i's `samples` completions per prompt at the temperature (seed `seed + i`), and
        with `greedy` one more at temperature 0; and the rows as rewards see them."""
        s = self.settings
        scored, sampled = self._sample(rows, ids, keys, group_size=s.samples,
                                       temperature=s.temperature, seed=s.seed + i)  # fmt: skip
        out = [sampled]
        if s.greedy:
            out.append(self._sample(rows, ids, keys, group_size=1, temperature=0.0, seed=None)[1])
        return scored, out

    def _sample(
        self, rows: Sequence[dict], ids: list[list[int]], keys: list[Any], **settings: Any
    ) -> tuple[list[dict], Rollout]:
        """One rollout of `rows`; with environments, each group reset from a seed of the run's
        seed and its key (the same in every evaluation, on every rank)."""
        handler, rows = None, list(rows)
        if self.tools is not None:
            start = self.tools.rollout(rows, settings["group_size"], self.settings.seed, "eval",
                                       keys=keys)  # fmt: skip
            handler, rows = start.handler, start.rows
            if start.environments is not None:  # the prompts now hold reset's text
                ids = reset_prompt_ids(self.tokenizer, start.prompts, self.tools, self.budget,
                                       rows)  # fmt: skip
        rollout = self.engine.sample(ids, max_new_tokens=self.settings.max_new_tokens,
                                     stop=self.settings.stop, tools=handler, **settings)  # fmt: skip
        if self.tools is not None:  # an agent's split trajectories run on (scored, not kept)

            def resample(prompts: list[list[int]], k: int) -> Rollout:
                seed = settings.get("seed")
                return self.engine.sample(
                    prompts, max_new_tokens=self.settings.max_new_tokens,
                    stop=self.settings.stop, tools=handler,
                    **{**settings, "group_size": 1,
                       "seed": None if seed is None else seed + 7919 * (k + 1)},
                )  # fmt: skip

            branches = self.tools.sampled(rollout, handler, resample)
            if branches is not None:  # their turns count in their episodes' (num_turns)
                later = [0] * len(rollout.texts)
                for k, n in zip(branches.parents.tolist(), episode_turns(branches.rollout, None),
                                strict=True):  # fmt: skip
                    later[k] += n
                rollout = dataclasses.replace(
                    rollout, turns=dataclasses.replace(rollout.turns, later=later)
                )
        return rows, rollout


class _Counts:
    """Per problem: solved samples, greedy solved, sampled tokens, samples that called a tool."""

    def __init__(self, samples: int, greedy: bool) -> None:
        self.samples, self.greedy = samples, greedy
        self.solved: list[int] = []
        self.greedy_solved: list[bool] = []
        self.lengths: list[int] = []
        self.calls: list[int] = []

    def add(self, rows: Sequence[dict], rollouts: list[Rollout], judge: Judge) -> None:
        """Judge a batch's rollouts, then count (nothing is counted when the judge raises)."""
        flags = [judge(rows, rollout) for rollout in rollouts]
        n, k = len(rows), self.samples
        self.solved += [sum(flags[0][j * k : (j + 1) * k]) for j in range(n)]
        self.lengths += rollouts[0].sampled_lengths.view(n, k).sum(-1).tolist()
        if rollouts[0].turns is not None:
            self.calls += (rollouts[0].turns.calls > 0).view(n, k).sum(-1).tolist()
        self.greedy_solved += flags[1] if self.greedy else []

    def first(self, n: int) -> tuple[list, ...]:
        return self.solved[:n], self.greedy_solved[:n], self.lengths[:n], self.calls[:n]


def _result(shares: list[tuple], samples: int, greedy: bool, tools: Any) -> EvalResult:
    """pass@1, pass@k and greedy pass@1 from every rank's per-problem (solved samples, greedy
    solved, sampled tokens, samples that called a tool)."""
    solved, greedy_solved, lengths, calls = (
        [x for share in shares for x in share[i]] for i in range(4)
    )
    n = len(solved)
    return EvalResult(
        n=n,
        pass_at_1=sum(solved) / (n * samples),
        pass_at_k=sum(pass_at_k(samples, c, samples) for c in solved) / n,
        greedy_pass_at_1=sum(greedy_solved) / n if greedy else None,
        samples=samples,
        mean_length=sum(lengths) / (n * samples),
        tool_call_rate=sum(calls) / (n * samples) if tools is not None else None,
    )


def _progress(console: Console | None, shown: bool) -> Progress:
    return Progress(
        TextColumn("eval"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("problems"),
        TimeElapsedColumn(),
        console=console or Console(stderr=True),
        disable=not shown,
        transient=True,
    )


def run_eval(
    cfg: RunConfig,
    policy: Any,
    sampler: Sampler,
    heldout: HeldOut,
    step: int,
    *,
    lockstep: Lockstep,
) -> dict[str, float]:
    """The trainer's held-out evaluation at `step`: pass@1 (sampled and greedy) and pass@k on
    its fixed rows or episodes (with their prompts' ids and seed keys), with a fixed seed,
    sampled by the run's engine. Data parallel: each rank evaluates a contiguous share of the
    rows and the per-problem counts are gathered; a reward's error on any rank ends every rank's
    evaluation together."""
    dist = sampler.dist
    mine = dist.mine(len(heldout.rows))
    share = {name: [getattr(heldout, name)[i] for i in mine] for name in ("rows", "ids", "keys")}
    padded = {name: lockstep.pad_rows(part, getattr(heldout, name)) for name, part in share.items()}
    state = TrainerState(global_step=step, max_steps=cfg.steps)
    with autocast(sampler.device, sampler.dtype):
        settings = EvalSettings(cfg.max_new_tokens, samples=cfg.eval_samples,
                                temperature=cfg.temperature, stop=sampler.stop, seed=cfg.seed)  # fmt: skip
        prompts = EvalPrompts(padded["ids"], padded["keys"], sampler.tools, sampler.budget)
        shard = EvalShard(real_rows=len(share["rows"]),
                          gather=dist.gather if dist.enabled else None,
                          agree=dist.check if dist.enabled else None, lockstep=lockstep.all_done)  # fmt: skip
        judge = pass_judge(sampler.rewards, state=state, timeout=cfg.reward_timeout)
        result = evaluate(policy, sampler.tokenizer, padded["rows"], settings, judge=judge,
                          prompts=prompts, engine=sampler.engine, shard=shard, progress=False)  # fmt: skip
    out = {"pass_at_1": result.pass_at_1, f"pass_at_{result.samples}": result.pass_at_k}
    if result.greedy_pass_at_1 is not None:
        out["greedy_pass_at_1"] = result.greedy_pass_at_1
    if result.tool_call_rate is not None:
        out["tool_call_rate"] = result.tool_call_rate
    return out


def evaluate_model(cfg: EvalConfig, *, progress: bool = True) -> dict[str, Any]:
    """`grouprl eval`'s measurement: load, evaluate, and return the result as a flat dict (what
    --json prints)."""
    validate_eval(cfg)
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _load_and_evaluate(cfg, progress=progress)
    finally:
        torch.set_num_threads(threads_before)


def _load_and_evaluate(cfg: EvalConfig, *, progress: bool) -> dict[str, Any]:
    task = build_task(cfg)
    device = resolve_device(cfg.device)
    name = cfg.model or task.default_model
    model = load_run_model(cfg, torch.float32, device, name)
    tokenizer = load_run_tokenizer(cfg, name)
    tools = build_tools(cfg, task, tokenizer, stop_token_ids(model, tokenizer))
    rewards = build_rewards(cfg, task, device, tools)
    max_new_tokens = cfg.max_new_tokens or task.max_new_tokens
    budget = prompt_budget(cfg, model, max_new_tokens)
    if task.heldout_episodes and cfg.split != "heldout":
        raise UserError(
            f"{task.name}: an environment's episodes have no {cfg.split} split to evaluate; use "
            "--split heldout (fresh episodes, seeded apart from training's)"
        )
    source = (
        task if task.heldout_episodes else dataclasses.replace(task, heldout=task.split(cfg.split))
    )
    heldout = held_out(source, cfg.limit, tokenizer, budget, tools)
    if heldout.too_long:
        Console(stderr=True).print(
            f"[yellow]warning:[/] skipped {heldout.too_long} prompts longer than {budget} tokens"
        )
    engine = build_engine(cfg, model, tokenizer, dtype=None,
                          rows=cfg.batch_prompts * cfg.samples,
                          max_len=None if budget is None else budget + max_new_tokens,
                          seed=cfg.seed, tools=tools and tools.handler)  # fmt: skip
    start = time.perf_counter()
    with contextlib.closing(engine):
        try:
            settings = EvalSettings(max_new_tokens, samples=cfg.samples,
                                    temperature=cfg.temperature, stop=stop_strings(cfg, task),
                                    batch_prompts=cfg.batch_prompts, seed=cfg.seed,
                                    greedy=cfg.greedy)  # fmt: skip
            prompts = EvalPrompts(heldout.ids, heldout.keys, tools, budget)
            judge = pass_judge(rewards, state=TrainerState(), timeout=cfg.reward_timeout)
            result = evaluate(model, tokenizer, heldout.rows, settings, judge=judge,
                              prompts=prompts, engine=engine, progress=progress)  # fmt: skip
        finally:
            if tools is not None and tools.environment is not None:
                tools.environment.close_all()
    return {
        "model": name,
        "task": task.name,
        "split": cfg.split,
        "pass_reward": rewards.pass_reward,
        "temperature": cfg.temperature,
        "seed": cfg.seed,
        "k": cfg.samples,
        **asdict(result),
        "seconds": round(time.perf_counter() - start, 2),
    }
