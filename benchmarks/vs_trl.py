"""grouprl against TRL's GRPOTrainer: same model, same prompts, same reward, same settings.

Three measurements, each system in its own subprocess (so peak RSS is the child's own
`ru_maxrss`, read with `os.wait4`):

1. Step speed. For each model (the bundled `builtin:arith`, and a random ~20M-parameter Llama
   with the same character tokenizer, saved to a temporary directory so both systems load it
   from disk) and each ratio level (token = GRPO, sequence = GSPO), the two systems run
   `warmup + measured` steps, alternating grouprl/TRL and TRL/grouprl round after round so that
   load from other processes hits both. Reported per system: median step seconds over the
   measured steps, completion tokens per second (sum of tokens / sum of step seconds), the mean
   completion length (both systems sample their own completions, so it shows the work was
   equal), peak RSS, and the ratios.
   - grouprl runs `grouprl train --algo grpo|gspo ...` and its step time is `step_seconds` in
     RUN_DIR/metrics.jsonl (rollout, scoring, advantages, updates; not logging or evaluation).
   - TRL runs GRPOTrainer; a TrainerCallback times on_step_begin -> on_step_end (generation,
     scoring, the extra old-logprob forward when TRL needs one, forward/backward, optimizer
     step; not TRL's logging). With k minibatches per rollout (GSPO) TRL makes k optimizer
     steps per rollout; a step here is one rollout, the sum of those k.
   - Both see exactly the same prompts in the same order: the rows of grouprl's PromptStream
     for the seed, given to TRL as a datasets.Dataset ("prompt", "answer") with shuffling off.
   - Both are scored by grouprl's `correct` reward; completion tokens are counted up to and
     including EOS in both (TRL's count comes from the `completion_ids` it passes the reward).
2. The FLOP floor: the machine's fp32 matmul rate (median of repeated 1024^3 and model-shaped
   GEMMs, the faster of the two), and per grouprl step the minimum time
   (2·P·generated + 6·P·trained) / rate, with P all parameters, generated = completion tokens +
   one prefill of each prompt, trained = the same tokens (the prompt counted once per group, as
   prefix sharing allows). Attention's own FLOPs are left out (small at these lengths), so the
   floor is a lower bound. grouprl's step time is reported as a multiple of it.
3. Time to accuracy: from `builtin:arith`, training seconds (the sum of step times; evaluation
   excluded) until held-out pass@1 first reaches the target, for grouprl's default GSPO run and
   for TRL with the closest settings. Both are evaluated with grouprl's evaluator on the same
   held-out rows with the same seed every `tta_eval_every` rollouts, and stopped at the target
   or at `tta_cap_s` seconds of training.

Usage (from the repository root, with the bench extra installed):

    .venv/bin/python benchmarks/vs_trl.py                 # everything (40-60 minutes, 2 cores)
    .venv/bin/python benchmarks/vs_trl.py --quick         # smoke run (3-5 minutes)
    .venv/bin/python benchmarks/vs_trl.py --models 20m --levels sequence --no-tta

Output: a settings table, the result tables (Markdown), and RUN/results.json with every raw
number; RUN defaults to runs/bench/vs_trl-<date>-<time>.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import tyro

from harness import (
    GROUPRL,
    LLAMA_20M,
    ChildResult,
    ModelSpec,
    SpeedRun,
    check_trl_equivalent,
    fmt,
    grouprl_speed_run,
    matmul_rate,
    md_table,
    optimizer_steps_per_rollout,
    read_jsonl,
    run_child,
    summarize,
    tail,
    time_trl_generation,
    trl_child_cmd,
    trl_kwargs,
    trl_speed_run,
    versions,
)

SYSTEMS = ("grouprl", "trl")
#: ratio level -> the grouprl preset that trains at that level
LEVEL_ALGO = {"token": "grpo", "sequence": "gspo"}


@dataclass
class BenchArgs:
    """Benchmark grouprl against TRL's GRPOTrainer on this machine (see the module docstring)."""

    quick: bool = False
    """Smoke run: one round of 1 warm-up + 2 measured steps, the small model only (unless
    --models is given), and a 45 s time-to-accuracy cap on 50 held-out problems."""
    models: tuple[str, ...] | None = None
    """Models: 'arith' (builtin:arith; a random 1M Llama if it is not bundled), 'tiny' (random
    1M), '20m' (random 20.5M), or a local model directory. None: arith 20m (quick: arith)."""
    levels: tuple[Literal["token", "sequence"], ...] = ("token", "sequence")
    """Ratio levels to compare: token (grouprl --algo grpo) and sequence (--algo gspo)."""
    prompts_per_step: int = 16
    """Prompts per step (B)."""
    group_size: int = 8
    """Completions per prompt (G); N = B*G completions per step."""
    max_new_tokens: int | None = None
    """Generation budget per completion. None: the task's (38 for arithmetic)."""
    temperature: float = 1.0
    """Sampling temperature (top-p 1, top-k off in both systems)."""
    lr: float = 2e-4
    """Learning rate of the speed runs (constant, no warm-up)."""
    sequence_minibatches: int = 4
    """Optimizer steps per rollout at the sequence level (grouprl --minibatches, TRL
    steps_per_generation); 4 is grouprl's GSPO preset. The token level uses 1."""
    warmup_steps: int = 2
    """Steps run before the measured ones in every speed run (excluded)."""
    measured_steps: int = 5
    """Measured steps per speed run."""
    rounds: int = 2
    """Speed runs per system and configuration; the order alternates each round."""
    threads: int = os.cpu_count() or 1
    """torch threads in every child (torch.set_num_threads, OMP_NUM_THREADS)."""
    seed: int = 0
    """Seed of both systems (prompt order, sampling, evaluation)."""
    speed: bool = True
    """Run the step-speed comparison (and the FLOP floor)."""
    tta: bool = True
    """Run the time-to-accuracy comparison."""
    tta_model: str = "arith"
    """Model of the time-to-accuracy runs (a trained base policy: 'arith')."""
    tta_target: float = 0.8
    """Held-out pass@1 to reach."""
    tta_cap_s: float = 600.0
    """Training seconds after which a system is stopped and reported as not reaching it."""
    tta_eval_every: int = 10
    """Evaluate every this many rollouts (grouprl --eval-every)."""
    tta_eval_size: int = 200
    """Held-out problems per evaluation (grouprl --eval-size)."""
    tta_eval_samples: int = 4
    """Samples per problem; pass@1 is their mean (grouprl --eval-samples)."""
    out_dir: Path | None = None
    """Where runs, logs and results.json go. None: runs/bench/vs_trl-<date>-<time>."""


def apply_quick(args: BenchArgs) -> BenchArgs:
    """Fill the defaults that depend on --quick."""
    if args.models is None:
        args = dataclasses.replace(args, models=("arith",) if args.quick else ("arith", "20m"))
    if args.quick:
        args = dataclasses.replace(
            args,
            warmup_steps=1,
            measured_steps=2,
            rounds=1,
            tta_cap_s=min(args.tta_cap_s, 45.0),
            tta_eval_every=min(args.tta_eval_every, 5),
            tta_eval_size=min(args.tta_eval_size, 50),
            tta_eval_samples=min(args.tta_eval_samples, 2),
        )
    return args


# ---------------------------------------------------------------------------------------------
# Models


def prepare_model(name: str, workdir: Path) -> ModelSpec:
    """Resolve a --models entry to a directory on disk, building random models as needed."""
    import torch

    from grouprl.models import builtin_models, load_model, resolve_model_path
    from grouprl.models.tiny import TinySize, build_tiny_llama
    from grouprl.models.tokenizer import build_char_tokenizer

    sizes = {"tiny": TinySize(), "20m": TinySize(**LLAMA_20M)}
    note = ""
    if name == "arith" and "arith" not in builtin_models():
        print("note: builtin:arith is not bundled yet; using a random 1M Llama instead ('tiny')")
        name, note = "tiny", "builtin:arith missing: random 1M Llama"
    if name in sizes:
        path = workdir / f"llama-{name}"
        if not (path / "config.json").is_file():
            tokenizer = build_char_tokenizer()
            torch.manual_seed(0)
            model = build_tiny_llama(tokenizer, sizes[name])
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
        note = note or f"random Llama, char tokenizer, {sizes[name]}"
    elif name == "arith":
        path = resolve_model_path("builtin:arith")
        note = "bundled base policy (builtin:arith)"
    else:
        path = resolve_model_path(name)
        note = note or "local model directory"
    model = load_model(str(path))
    params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    return ModelSpec(name, str(path), params, cfg.hidden_size, cfg.intermediate_size, note)


# ---------------------------------------------------------------------------------------------
# Prompts: exactly the rows grouprl's trainer takes, in its order


def train_rows(seed: int, count: int) -> list[dict]:
    """The first `count` training rows grouprl's trainer draws with `seed` (prompt, answer)."""
    from grouprl.tasks import get_task
    from grouprl.tasks.data import PromptStream

    rows = PromptStream(get_task("arithmetic").train, seed).take(0, count)
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]


# ---------------------------------------------------------------------------------------------
# Children


def grouprl_speed_cmd(args: BenchArgs, model: ModelSpec, level: str, run_dir: Path) -> list[str]:
    steps = args.warmup_steps + args.measured_steps
    cmd = [*GROUPRL, "train", "--algo", LEVEL_ALGO[level], "--model", model.path]
    cmd += ["--steps", str(steps), "--prompts-per-step", str(args.prompts_per_step)]
    cmd += ["--group-size", str(args.group_size), "--max-new-tokens", str(max_new_tokens(args))]
    cmd += ["--temperature", str(args.temperature), "--lr", str(args.lr)]
    cmd += ["--warmup-steps", "0", "--lr-schedule", "constant"]
    cmd += ["--threads", str(args.threads), "--seed", str(args.seed)]
    if level == "sequence":
        cmd += ["--minibatches", str(args.sequence_minibatches)]
    # Equal work: TRL runs every completion through the update, so grouprl does too (on the
    # random 20M model every group scores 0, and skipping would leave nothing to train).
    cmd += ["--no-skip-zero-advantage"]
    # evaluation (start and end only) and checkpoints are outside step_seconds; keep them small
    cmd += ["--eval-every", "0", "--eval-size", "1", "--eval-samples", "1"]
    cmd += ["--save-every", str(steps), "--output-dir", str(run_dir)]
    return cmd


def max_new_tokens(args: BenchArgs) -> int:
    if args.max_new_tokens is not None:
        return args.max_new_tokens
    from grouprl.tasks import get_task

    return get_task("arithmetic").max_new_tokens


# ---------------------------------------------------------------------------------------------
# TRL: its configuration, and the child that runs it


def grouprl_config(algo: str, **overrides) -> Any:
    """grouprl's resolved TrainConfig for `algo` (preset and task defaults filled in)."""
    from grouprl.config import TrainConfig, resolve
    from grouprl.tasks import get_task

    cfg = TrainConfig(algo=algo, **overrides)
    return resolve(cfg, task_max_new_tokens=get_task(cfg.task or "arithmetic").max_new_tokens)


def trl_spec(cfg: Any, model_dir: str, rollouts: int, out_dir: Path, tta: dict | None) -> dict:
    """The TRL child's settings, derived field by field from a resolved grouprl TrainConfig."""
    check_trl_equivalent(cfg)
    return {
        "model_dir": model_dir,
        "out_dir": str(out_dir),
        "threads": cfg.threads,
        "seed": cfg.seed,
        "rollouts": rollouts,
        "prompts_per_step": cfg.prompts_per_step,
        "group_size": cfg.group_size,
        "steps_per_rollout": optimizer_steps_per_rollout(cfg),
        "tta": tta,
        "max_new_tokens": cfg.max_new_tokens,
        "trl": trl_kwargs(cfg, rollouts),
    }


def trl_child(spec_path: str) -> int:
    """Run TRL's GRPOTrainer as `spec` says; write the step times and token counts as JSON."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grouprl.models import load_tokenizer
    from grouprl.tasks import get_task

    out_dir = Path(spec["out_dir"])
    task = get_task("arithmetic")
    rows = train_rows(spec["seed"], spec["rollouts"] * spec["prompts_per_step"])
    dataset = Dataset.from_dict(
        {"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]}
    )
    generations: list[dict] = []  # one per rollout: completions, tokens (up to EOS), seconds
    generate_seconds: list[float] = []

    def correct(completions, completion_ids=None, **kwargs):
        generations.append(
            {
                "completions": len(completions),
                "tokens": sum(len(c) for c in completion_ids),
                "seconds": generate_seconds[-1],
            }
        )
        return task.reward_funcs["correct"](completions, **kwargs)

    tta = spec["tta"]
    k = spec["steps_per_rollout"]
    steps: list[float] = []
    evals: list[dict] = []
    train_logs: list[dict] = []

    class Clock(TrainerCallback):
        """Times each optimizer step; evaluates and stops for the time-to-accuracy run."""

        def __init__(self):
            self.begin = 0.0

        def on_train_begin(self, args, state, control, model=None, **kw):
            if tta:
                self.evaluate(model, 0)

        def on_step_begin(self, args, state, control, **kw):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            steps.append(time.perf_counter() - self.begin)
            if not tta or state.global_step % k:
                return
            rollout = state.global_step // k
            trained = sum(steps)
            due = rollout % tta["eval_every"] == 0
            reached = due and self.evaluate(model, rollout)["pass_at_1"] >= tta["target"]
            if reached or trained >= tta["cap_s"]:
                control.should_training_stop = True

        def evaluate(self, model, rollout: int) -> dict:
            from grouprl.train.evaluate import EvalSettings, evaluate

            was_training = model.training
            model.eval()
            t0 = time.perf_counter()
            result = evaluate(
                model,
                tokenizer,
                list(task.heldout[: tta["eval_size"]]),
                EvalSettings(
                    spec["max_new_tokens"],
                    samples=tta["eval_samples"],
                    temperature=spec["trl"]["temperature"],
                    stop=task.stop,
                    seed=spec["seed"],
                    greedy=True,
                ),
                reward_fn=task.reward_funcs["correct"],
                progress=False,
            )
            model.train(was_training)
            record = {
                "step": rollout,
                "train_seconds": sum(steps),
                "pass_at_1": result.pass_at_1,
                "greedy_pass_at_1": result.greedy_pass_at_1,
                "eval_seconds": time.perf_counter() - t0,
            }
            evals.append(record)
            print(json.dumps(record), flush=True)
            return record

    class Logs(TrainerCallback):
        """Keeps TRL's own per-step reward and length logs (for reading, not timing)."""

        def on_log(self, args, state, control, logs=None, **kw):
            keep = ("reward", "frac_reward_zero_std", "completions/mean_length", "loss")
            kept = {key: logs[key] for key in keep if logs and key in logs}
            if kept:
                train_logs.append({"step": state.global_step, **kept})

    tokenizer = load_tokenizer(spec["model_dir"])
    config = GRPOConfig(output_dir=str(out_dir / "trl"), **spec["trl"])
    trainer = GRPOTrainer(
        model=spec["model_dir"],
        reward_funcs=correct,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock(), Logs()],
    )
    time_trl_generation(trainer, generate_seconds)
    t0 = time.perf_counter()
    trainer.train()
    result = {
        "optimizer_steps": steps,
        "steps_per_rollout": k,
        "generations": generations,
        "evals": evals,
        "logs": train_logs,
        "threads": torch.get_num_threads(),
        "effective": {  # what TRL resolved, as a check of the settings above
            "device": str(config.device),
            "bf16": config.bf16,
            "fp16": config.fp16,
            "activation_checkpointing": config.activation_checkpointing,
            "generation_batch_size": config.generation_batch_size,
            "steps_per_generation": config.steps_per_generation,
            "model_dtype": str(trainer.model.dtype),
            "model_training_mode": trainer.model.training,
        },
        "train_wall_s": time.perf_counter() - t0,
        "maxrss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "versions": versions(),
    }
    (out_dir / "trl_result.json").write_text(json.dumps(result))
    return 0


def trl_cmd(spec: dict, run_dir: Path) -> list[str]:
    return trl_child_cmd(__file__, spec, run_dir)


# ---------------------------------------------------------------------------------------------
# Step speed


def speed_grouprl(args: BenchArgs, model: ModelSpec, level: str, run_dir: Path) -> SpeedRun:
    child = run_child(
        grouprl_speed_cmd(args, model, level, run_dir), run_dir / "log.txt", args.threads
    )
    n = args.prompts_per_step * args.group_size
    return grouprl_speed_run(child, run_dir, n, args.warmup_steps)


def speed_config(args: BenchArgs, level: str) -> Any:
    """The resolved grouprl config of a speed run: what `grouprl_speed_cmd`'s flags give."""
    return grouprl_config(
        LEVEL_ALGO[level],
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        max_new_tokens=max_new_tokens(args),
        temperature=args.temperature,
        lr=args.lr,
        warmup_steps=0,
        lr_schedule="constant",
        threads=args.threads,
        seed=args.seed,
        minibatches=args.sequence_minibatches if level == "sequence" else 1,
        skip_zero_advantage=False,
    )


def speed_trl(args: BenchArgs, model: ModelSpec, level: str, run_dir: Path) -> SpeedRun:
    rollouts = args.warmup_steps + args.measured_steps
    spec = trl_spec(speed_config(args, level), model.path, rollouts, run_dir, tta=None)
    child = run_child(trl_cmd(spec, run_dir), run_dir / "log.txt", args.threads)
    return trl_speed_run(child, run_dir / "trl_result.json", args.warmup_steps)


def speed_benchmark(args: BenchArgs, models: list[ModelSpec], out: Path) -> dict:
    """All speed runs, alternating the systems; returns {model: {level: {system: [runs]}}}."""
    runners = {"grouprl": speed_grouprl, "trl": speed_trl}
    results: dict = {}
    for model in models:
        for level in args.levels:
            runs: dict[str, list[SpeedRun]] = {s: [] for s in SYSTEMS}
            for r in range(args.rounds):
                order = SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS))
                for system in order:
                    run_dir = out / "speed" / f"{model.name}-{level}-r{r}-{system}"
                    t0 = time.perf_counter()
                    run = runners[system](args, model, level, run_dir)
                    runs[system].append(run)
                    status = run.failed or (
                        f"median {statistics.median(run.seconds):.3f} s/step"
                        if run.seconds
                        else "no steps"
                    )
                    print(
                        f"  {model.name:>6} {level:>8} round {r} {system:>7}: {status}  "
                        f"({time.perf_counter() - t0:.0f} s)",
                        flush=True,
                    )
                    if run.failed:
                        print(tail(run_dir / "log.txt"))
            results.setdefault(model.name, {})[level] = runs
    return results


# ---------------------------------------------------------------------------------------------
# FLOP floor


def prompt_tokens_per_step(args: BenchArgs, model: ModelSpec, steps: int) -> list[int]:
    """Prompt tokens (with BOS) of each step's B prompts, in grouprl's order."""
    from grouprl.models import load_tokenizer

    tokenizer = load_tokenizer(model.path)
    rows = train_rows(args.seed, steps * args.prompts_per_step)
    lengths = [len(tokenizer(r["prompt"])["input_ids"]) for r in rows]
    b = args.prompts_per_step
    return [sum(lengths[i * b : (i + 1) * b]) for i in range(steps)]


def flop_floor(args: BenchArgs, model: ModelSpec, runs: list[SpeedRun], rate: float) -> dict | None:
    """grouprl's measured steps against (2·P·generated + 6·P·trained) / rate."""
    steps = args.warmup_steps + args.measured_steps
    prompts = prompt_tokens_per_step(args, model, steps)[args.warmup_steps :]
    multiples, floors = [], []
    for run in runs:
        if run.failed:
            continue
        for seconds, completion, prompt in zip(run.seconds, run.tokens, prompts):
            tokens = completion + prompt  # each prompt once (prefill / prefix sharing)
            floor = (2 * model.params * tokens + 6 * model.params * tokens) / rate
            floors.append(floor)
            multiples.append(seconds / floor)
    if not multiples:
        return None
    return {
        "floor_s": statistics.median(floors),
        "multiple": statistics.median(multiples),
    }


# ---------------------------------------------------------------------------------------------
# Time to accuracy


def tta_grouprl(args: BenchArgs, model: ModelSpec, run_dir: Path) -> dict:
    """grouprl's default GSPO run; stopped (Ctrl-C, which checkpoints) at the target or cap."""
    steps = 100_000
    cmd = [*GROUPRL, "train", "--model", model.path, "--steps", str(steps)]
    cmd += ["--eval-every", str(args.tta_eval_every), "--eval-size", str(args.tta_eval_size)]
    cmd += ["--eval-samples", str(args.tta_eval_samples), "--save-every", str(steps)]
    cmd += ["--threads", str(args.threads), "--seed", str(args.seed)]
    cmd += ["--output-dir", str(run_dir)]
    state = {"stopped": None}

    def poll(proc):
        if state["stopped"]:
            return
        metrics = read_jsonl(run_dir / "metrics.jsonl")
        trained = sum(m["step_seconds"] for m in metrics)
        evals = read_jsonl(run_dir / "eval.jsonl")
        if any(e["pass_at_1"] >= args.tta_target for e in evals):
            state["stopped"] = "target"
        elif trained >= args.tta_cap_s:
            state["stopped"] = "cap"
        if state["stopped"]:
            proc.send_signal(signal.SIGINT)

    child = run_child(cmd, run_dir / "log.txt", args.threads, poll=poll)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    evals = [
        {**e, "train_seconds": sum(m["step_seconds"] for m in metrics if m["step"] <= e["step"])}
        for e in read_jsonl(run_dir / "eval.jsonl")
    ]
    trained = sum(m["step_seconds"] for m in metrics)
    return tta_result("grouprl", evals, trained, args, child, metrics)


def tta_trl(args: BenchArgs, model: ModelSpec, run_dir: Path) -> dict:
    cfg = grouprl_config("gspo", threads=args.threads, seed=args.seed)
    rollouts = int(args.tta_cap_s * 5) + 10  # more than TRL can run in the cap
    tta = {
        "target": args.tta_target,
        "cap_s": args.tta_cap_s,
        "eval_every": args.tta_eval_every,
        "eval_size": args.tta_eval_size,
        "eval_samples": args.tta_eval_samples,
    }
    spec = trl_spec(cfg, model.path, rollouts, run_dir, tta=tta)
    child = run_child(trl_cmd(spec, run_dir), run_dir / "log.txt", args.threads)
    path = run_dir / "trl_result.json"
    result = json.loads(path.read_text()) if path.exists() else {"evals": []}
    trained = sum(result.get("optimizer_steps", []))
    return tta_result("trl", result["evals"], trained, args, child, result.get("logs", []))


def tta_result(
    system: str, evals: list[dict], trained: float, args: BenchArgs, child: ChildResult, log
) -> dict:
    """`evals`: [{step, train_seconds, pass_at_1, ...}]; `trained`: all training seconds run."""
    reached = next((e for e in evals if e["pass_at_1"] >= args.tta_target), None)
    return {
        "system": system,
        "reached": reached is not None,
        "seconds": reached["train_seconds"] if reached else None,
        "step": reached["step"] if reached else None,
        "trained_s": trained,
        "start_pass_at_1": evals[0]["pass_at_1"] if evals else None,
        "best_pass_at_1": max((e["pass_at_1"] for e in evals), default=None),
        "evals": evals,
        "wall_s": child.wall_s,
        "peak_rss_mb": child.maxrss_mb,
        "returncode": child.returncode,
        "log": str(child.log),
        "train_log": log,
    }


def tta_benchmark(args: BenchArgs, model: ModelSpec, out: Path) -> dict:
    results = {}
    runners = {"grouprl": tta_grouprl, "trl": tta_trl}
    for system in SYSTEMS:
        t0 = time.perf_counter()
        results[system] = res = runners[system](args, model, out / "tta" / system)
        status = (
            f"pass@1 {args.tta_target} at {res['seconds']:.1f} s (rollout {res['step']})"
            if res["reached"]
            else f"not reached in {res['trained_s']:.0f} s (best {res['best_pass_at_1']})"
        )
        print(f"  {system:>7}: {status}  ({time.perf_counter() - t0:.0f} s wall)", flush=True)
        if res["returncode"] not in (0, 130):
            print(tail(Path(res["log"])))
    return results


# ---------------------------------------------------------------------------------------------
# Report


def describe(cfg: Any) -> str:
    """One line of the grouprl settings that define the objective and the optimizer."""
    std = "sample" if cfg.unbiased_std else "population"
    return (
        f"--algo {cfg.algo}: {cfg.ratio_level} ratio, clip {cfg.clip_low}/{cfg.clip_high}, "
        f"{cfg.loss_agg}, {cfg.minibatches} minibatch(es) of whole groups, epochs {cfg.epochs}, "
        f"beta {cfg.beta}, advantages: group mean, {cfg.adv_scale} {std} std + {cfg.adv_eps}; "
        f"AdamW lr {cfg.lr}, betas {tuple(cfg.adam_betas)}, wd {cfg.weight_decay}, grad-norm "
        f"clip {cfg.max_grad_norm}, {cfg.lr_schedule} lr after {cfg.warmup_steps} warm-up steps; "
        + ("zero-advantage groups skipped" if cfg.skip_zero_advantage else "every group trained")
    )


def settings_table(args: BenchArgs, models: list[ModelSpec]) -> str:
    """Every setting of both systems: a side-by-side table, then the exact grouprl flags and
    TRL GRPOConfig arguments of each configuration."""
    n = args.prompts_per_step * args.group_size
    L = max_new_tokens(args)
    model_list = ", ".join(f"{m.name}: {m.params / 1e6:.2f}M params ({m.note})" for m in models)
    rows = [
        ("models", model_list or "-", "the same directories, loaded from disk"),
        (
            "B prompts x G completions = N per step",
            f"{args.prompts_per_step} x {args.group_size} = {n}",
            f"num_generations={args.group_size}, generation batch {n}",
        ),
        ("max new tokens", L, f"max_completion_length={L}"),
        (
            "sampling",
            f"temperature {args.temperature}, top-p 1, top-k off",
            f"temperature={args.temperature}, top_p=1.0, top_k=0 (model.generate)",
        ),
        (
            "precision, memory",
            "fp32, no gradient checkpointing",
            "use_cpu, no bf16/fp16, no gradient checkpointing",
        ),
        ("threads", f"--threads {args.threads}", f"torch.set_num_threads({args.threads})"),
        (
            "prompts",
            "PromptStream order for the seed",
            "the same rows, in order (shuffle_dataset=False)",
        ),
        ("reward", "grouprl.tasks `correct`", "the same function"),
        (
            "measurement",
            f"{args.rounds} round(s), alternating; {args.warmup_steps} warm-up + "
            f"{args.measured_steps} measured steps; step_seconds from metrics.jsonl",
            "same; on_step_begin -> on_step_end summed over a rollout's optimizer steps",
        ),
        ("advantage std", "population (grouprl default)", "sample (TRL; not configurable)"),
        ("minibatch content", "whole groups", "completions shuffled across groups (TRL)"),
    ]
    lines = [md_table(("setting", "grouprl", "TRL GRPOTrainer"), rows), ""]
    for level in args.levels:
        cfg = speed_config(args, level)
        kwargs = trl_kwargs(cfg, args.warmup_steps + args.measured_steps)
        lines.append(f"- speed, {level} level, grouprl: {describe(cfg)}")
        lines.append(f"- speed, {level} level, TRL GRPOConfig: {fmt_kwargs(kwargs)}")
    if args.tta:
        cfg = grouprl_config("gspo", threads=args.threads, seed=args.seed)
        lines.append(
            f"- time to accuracy, grouprl defaults: {describe(cfg)}; B {cfg.prompts_per_step}, "
            f"G {cfg.group_size}, max new tokens {cfg.max_new_tokens}; evaluation every "
            f"{args.tta_eval_every} rollouts on {args.tta_eval_size} held-out problems x "
            f"{args.tta_eval_samples} samples (seed {args.seed}); target pass@1 "
            f"{args.tta_target}; cap {args.tta_cap_s:.0f} training seconds"
        )
        kwargs = trl_kwargs(cfg, 0)
        kwargs.pop("max_steps")
        lines.append(
            f"- time to accuracy, TRL GRPOConfig: {fmt_kwargs(kwargs)}; grouprl's "
            "evaluator in a callback with the same rows, samples and seed"
        )
    return "\n".join(lines)


def fmt_kwargs(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def speed_tables(speed: dict, floors: dict, rate: float) -> str:
    rows, ratio_rows, floor_rows = [], [], []
    for model, by_level in speed.items():
        for level, runs in by_level.items():
            s = {system: summarize(runs[system]) for system in SYSTEMS}
            for system in SYSTEMS:
                v = s[system]
                if v is None:
                    fails = "; ".join(r.failed or "" for r in runs[system])
                    rows.append((model, level, system, "failed", fails, "", "", "", ""))
                    continue
                rows.append(
                    (
                        model,
                        level,
                        system,
                        fmt(v["median_step_s"]),
                        fmt(v["median_generation_s"]),
                        fmt(v["tokens_per_s"], ".0f"),
                        fmt(v["completion_tokens_per_step"], ".0f"),
                        fmt(v["peak_rss_mb"], ".0f"),
                        v["steps"],
                    )
                )
            g, t = s["grouprl"], s["trl"]
            if g and t:
                ratio_rows.append(
                    (
                        model,
                        level,
                        f"{t['median_step_s'] / g['median_step_s']:.2f}x",
                        f"{g['tokens_per_s'] / t['tokens_per_s']:.2f}x",
                        f"{g['peak_rss_mb'] / t['peak_rss_mb']:.2f}",
                    )
                )
            f = floors.get(model, {}).get(level)
            if f:
                floor_rows.append(
                    (
                        model,
                        level,
                        fmt(f["floor_s"], ".4f"),
                        fmt(g["median_step_s"] if g else None),
                        f"{f['multiple']:.1f}x",
                    )
                )
    out = [
        md_table(
            (
                "model",
                "level",
                "system",
                "median step s",
                "of which generation s",
                "completion tok/s",
                "completion tokens/step",
                "peak RSS MB",
                "steps",
            ),
            rows,
        ),
        "",
        md_table(
            (
                "model",
                "level",
                "TRL step time / grouprl",
                "grouprl tok/s / TRL",
                "grouprl RSS / TRL",
            ),
            ratio_rows,
        ),
        "",
        f"FLOP floor at {rate / 1e9:.1f} GFLOP/s (fp32 matmul, measured):",
        "",
        md_table(
            ("model", "level", "floor s/step", "grouprl s/step", "grouprl / floor"), floor_rows
        ),
    ]
    return "\n".join(out)


def tta_table(tta: dict, args: BenchArgs) -> str:
    rows = []
    for system, r in tta.items():
        when = (
            f"{r['seconds']:.1f} s (rollout {r['step']})"
            if r["reached"]
            else f"not reached in {r['trained_s']:.0f} s"
        )
        rows.append(
            (
                system,
                fmt(r["start_pass_at_1"]),
                fmt(r["best_pass_at_1"]),
                when,
                fmt(r["peak_rss_mb"], ".0f"),
                f"{r['wall_s']:.0f}",
            )
        )
    g, t = tta.get("grouprl"), tta.get("trl")
    table = md_table(
        (
            "system",
            "start pass@1",
            "best pass@1",
            f"training s to pass@1 >= {args.tta_target}",
            "peak RSS MB",
            "wall s (incl. evals)",
        ),
        rows,
    )
    if g and t and g["reached"] and g["seconds"] > 0:
        their = t["seconds"] if t["reached"] else t["trained_s"]
        bound = "" if t["reached"] else " (at least: TRL did not reach it)"
        table += f"\n\nTRL time / grouprl time: {their / g['seconds']:.1f}x{bound}"
    return table


# ---------------------------------------------------------------------------------------------


def main(args: BenchArgs) -> int:
    args = apply_quick(args)
    out = args.out_dir or Path("runs/bench") / f"vs_trl-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    print(f"results: {out}", flush=True)
    with tempfile.TemporaryDirectory(prefix="grouprl-bench-") as tmp:
        names = list(args.models or ())
        if args.tta and args.tta_model not in names:
            names.append(args.tta_model)
        specs = {name: prepare_model(name, Path(tmp)) for name in names}
        models = [specs[name] for name in (args.models or ())]
        ver = versions()
        print("\n## Settings\n")
        print(settings_table(args, models))
        print(
            f"\nmachine: {os.cpu_count()} CPUs, threads {args.threads}, fp32; "
            + ", ".join(f"{k} {v}" for k, v in ver.items()),
            flush=True,
        )
        results: dict[str, Any] = {
            "args": json.loads(json.dumps(dataclasses.asdict(args), default=str))
        }
        results["versions"] = ver
        failures: list[str] = []  # child processes that did not finish cleanly
        results["models"] = [dataclasses.asdict(m) for m in models]
        if args.speed and models:
            widest = max(models, key=lambda m: m.params)
            shapes = [(1024, 1024, 1024), (4096, widest.hidden_size, widest.intermediate_size)]
            rates = matmul_rate(args.threads, shapes)
            print("\nmatmul GFLOP/s: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rates.items()))
            print("\n## Step speed\n", flush=True)
            speed = speed_benchmark(args, models, out)
            rates_after = matmul_rate(args.threads, shapes)
            print(
                "matmul GFLOP/s after: "
                + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in rates_after.items())
            )
            # the floor uses the best rate seen: a floor must not be raised by a busy moment
            rate = max(*rates.values(), *rates_after.values())
            floors = {
                m.name: {
                    level: flop_floor(args, m, speed[m.name][level]["grouprl"], rate)
                    for level in args.levels
                }
                for m in models
            }
            print()
            print(speed_tables(speed, floors, rate), flush=True)
            results["matmul_flops"] = {"before": rates, "after": rates_after, "used": rate}
            results["speed"] = {
                model: {
                    level: {
                        system: {
                            "summary": summarize(runs[system]),
                            "runs": [dataclasses.asdict(r) for r in runs[system]],
                        }
                        for system in SYSTEMS
                    }
                    for level, runs in by_level.items()
                }
                for model, by_level in speed.items()
            }
            results["flop_floor"] = floors
            failures += [
                run.failed
                for by_level in speed.values()
                for runs in by_level.values()
                for system_runs in runs.values()
                for run in system_runs
                if run.failed
            ]
        if args.tta:
            print(
                f"\n## Time to pass@1 >= {args.tta_target} ({specs[args.tta_model].name})\n",
                flush=True,
            )
            tta = tta_benchmark(args, specs[args.tta_model], out)
            print()
            print(tta_table(tta, args))
            results["tta"] = tta
            failures += [r["log"] for r in tta.values() if r["returncode"] not in (0, 130)]
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\nraw numbers: {out / 'results.json'}")
    for failure in failures:
        print(f"failed: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_trl-child":
        sys.exit(trl_child(sys.argv[2]))
    sys.exit(main(tyro.cli(BenchArgs)))
