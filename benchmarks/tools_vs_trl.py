"""grouprl against TRL 1.16's `GRPOTrainer(tools=[...])` on a chat-format tool task.

The task and model are the chat-format tool example's (`examples/chat_tools/`): a ~1M-parameter
Qwen2 chat model that sums a list of two-digit numbers with the tool `add(a, b)`, calling it in
the Qwen2.5/Hermes convention (`<tool_call>{json}</tool_call>`), one call per turn. A problem of n
numbers takes n assistant turns (n - 1 calls and the reply), so the shape is set by n: the
contexts grow by a call and its result each turn, from ~220 prompt tokens.

Both systems load the same model directory, carrying TRL's own Qwen2.5 template (read from the
installed trl package, so TRL recognises it and parses calls itself); the script checks that it
renders the example's conversations exactly as the template the model was fitted with.
Each system runs through its normal path: `grouprl train --tool-format chat --tools ...`, and
TRL's GRPOTrainer with `tools=[add]` and conversational prompts. Per turn, TRL concatenates the
conversation so far and calls `model.generate` on it again (re-prefilling it); grouprl keeps
each trajectory's KV cache and feeds only the tool result's tokens.

Measured, per shape (n), alternating the systems: rollout + update seconds per step and sampled
tokens (the model's own, tool results excluded, as TRL's `completions/mean_length` counts them)
per second of step. Then, from the same start, both train for `--tta-rollouts` rollouts with
grouprl's defaults for GRPO; their checkpoints are evaluated by the same `grouprl eval` command
on the example's 200 held-out problems, and the table gives held-out pass@1 against training
seconds.

    .venv/bin/python benchmarks/tools_vs_trl.py            # about 20 min on 2 cores
    .venv/bin/python benchmarks/tools_vs_trl.py --quick    # a smoke run, a few minutes
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLE = ROOT / "examples" / "chat_tools"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(EXAMPLE))

from harness import (  # noqa: E402
    GROUPRL,
    fmt,
    md_table,
    read_jsonl,
    run_child,
    trl_child_cmd,
    trl_kwargs,
    versions,
)

TOOL = f"{EXAMPLE / 'tools.py'}:add"
REWARD = f"{EXAMPLE / 'rewards.py'}:right_sum"
SYSTEMS = ("grouprl", "trl")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        type=Path,
        default=ROOT / "runs/chat_tools/model",
        help="the example's model (made by examples/chat_tools/make_model.py if absent)",
    )
    p.add_argument("--shapes", default="2,4", help="numbers per problem (= assistant turns)")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--measured-steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--lr",
        type=float,
        default=5e-5,
        help="learning rate of the training runs (grouprl's default)",
    )
    p.add_argument(
        "--speed-lr",
        type=float,
        default=1e-8,
        help="learning rate of the speed runs: the full update runs, the policy (and so "
        "the shape: calls, turns, lengths) stays the starting model's in both systems",
    )
    p.add_argument("--tta-rollouts", type=int, default=30, help="0: no training comparison")
    p.add_argument("--tta-shape", type=int, default=4)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--eval-limit", type=int, default=200)
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--before",
        type=Path,
        default=None,
        help="another grouprl source tree (its src/ directory, e.g. a worktree of an earlier "
        "commit), run as a third system, 'grouprl-before', in the speed runs",
    )
    p.add_argument("--quick", action="store_true", help="one shape, one round, 10 TTA rollouts")
    p.add_argument(
        "--skip-speed",
        action="store_true",
        help="keep the speed results already in --out's results.json; run the training part",
    )
    p.add_argument(
        "--tables-from",
        type=Path,
        default=None,
        help="re-read a finished run's directory (its --out) and print its tables",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.rounds, args.measured_steps = "3", 1, 2
        args.tta_rollouts, args.save_every, args.eval_limit = 10, 5, 50
    args.shapes = [int(s) for s in args.shapes.split(",")]
    if args.before is not None and not (args.before / "grouprl" / "__init__.py").is_file():
        # PYTHONPATH to a tree without the package would run the installed grouprl as "before"
        p.error(f"--before {args.before}: no grouprl package there; give a tree's src/ directory")
    return args


def max_new_tokens(n: int) -> int:
    """The whole trajectory's budget for n numbers: n - 1 calls and results (~43 tokens each) and
    the reply, with room to spare."""
    return 48 * (n - 1) + 16


# ---------------------------------------------------------------------------------------------
# The model and data


def trl_template() -> str:
    return (resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()


def prepare_model(args: argparse.Namespace, out: Path) -> Path:
    """The example's model with TRL's Qwen2.5 template, checked to render the same text."""
    import make_model
    from transformers import AutoTokenizer

    if not (args.model / "config.json").exists():
        print(f"{args.model} is missing; making it (examples/chat_tools/make_model.py)", flush=True)
        code = make_model.main(
            ["--output-dir", str(args.model.parent), "--threads", str(args.threads)]
        )
        if code:
            raise SystemExit(code)
    fitted = AutoTokenizer.from_pretrained(args.model)
    target = out / "model"
    shutil.copytree(args.model, target, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.chat_template = trl_template()
    tokenizer.save_pretrained(target)
    import random

    rng = random.Random(1)
    for n in sorted({2, *args.shapes}):
        numbers = make_model.problem(rng, (n,))
        prompt = make_model.row(numbers)["prompt"]
        messages = prompt + make_model.conversation(numbers, rng, guess=0.0, slip=0.0)
        texts = [
            t.apply_chat_template(messages, tools=[make_model.add], tokenize=False)
            for t in (fitted, tokenizer)
        ]
        if texts[0] != texts[1]:
            raise SystemExit("TRL's qwen2_5.jinja renders the example differently; cannot compare")
    return target


def write_rows(n: int, count: int, seed: int, path: Path) -> Path:
    import random

    import make_model

    rng = random.Random(f"{seed}-{n}")
    rows = [make_model.row(make_model.problem(rng, (n,))) for _ in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def shape_tokens(model: Path, n: int) -> dict:
    """Tokens of a problem of n numbers: its prompt, and the context a correct trajectory ends
    with (prompt, n - 1 calls and their results, the reply)."""
    import random

    import make_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(n)
    numbers = make_model.problem(rng, (n,))
    pieces = make_model.segments(
        tokenizer,
        make_model.row(numbers)["prompt"],
        make_model.conversation(numbers, rng, 0.0, 0.0),
    )
    ids, trained = make_model.encode(tokenizer, pieces)
    return {
        "prompt": len(make_model.encode(tokenizer, pieces[:1])[0]),
        "context": len(ids),
        "sampled": sum(trained),
    }


def grouprl_order(path: Path, seed: int, count: int) -> list[dict]:
    """The first `count` rows `grouprl train --dataset path --seed seed` draws, in its order."""
    from grouprl.tasks.data import PromptStream

    rows = read_jsonl(path)
    return PromptStream(rows, seed).take(0, count)


# ---------------------------------------------------------------------------------------------
# Settings


def grouprl_config(args: argparse.Namespace, n: int, data: Path, steps: int, speed: bool) -> Any:
    """The resolved config of what `grouprl_cmd` runs (TRL's settings are derived from it)."""
    from grouprl.config import TrainConfig, resolve

    cfg = TrainConfig(
        algo="grpo",
        dataset=str(data),
        tools=[TOOL],
        tool_format="chat",
        rewards={REWARD: 1.0},
        max_turns=n - 1,
        max_new_tokens=max_new_tokens(n),
        steps=steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        temperature=1.0,
        lr=args.speed_lr if speed else args.lr,
        warmup_steps=0,
        lr_schedule="constant",
        threads=args.threads,
        seed=args.seed,
        # equal work in the speed runs: TRL runs every completion through the update
        skip_zero_advantage=not speed,
    )
    return resolve(cfg, task_max_new_tokens=max_new_tokens(n))


def grouprl_cmd(
    args, n: int, model: Path, data: Path, heldout: Path, steps: int, speed: bool, run_dir: Path
) -> list[str]:
    cmd = [*GROUPRL, "train", "--algo", "grpo", "--model", str(model), "--dataset", str(data)]
    cmd += ["--eval-dataset", str(heldout), "--tools", TOOL, "--tool-format", "chat"]
    cmd += ["--rewards", REWARD, "1", "--max-turns", str(n - 1)]
    cmd += ["--max-new-tokens", str(max_new_tokens(n)), "--steps", str(steps)]
    cmd += ["--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size)]
    lr = args.speed_lr if speed else args.lr
    cmd += ["--temperature", "1.0", "--lr", str(lr), "--warmup-steps", "0"]
    cmd += ["--lr-schedule", "constant", "--threads", str(args.threads), "--seed", str(args.seed)]
    if speed:
        cmd += ["--no-skip-zero-advantage", "--save-every", str(steps)]
    else:
        cmd += ["--save-every", str(args.save_every), "--keep-last", str(steps)]
    # grouprl's own evaluations (start and end only) are outside step_seconds; keep them small,
    # both systems' checkpoints are evaluated afterwards by the same command
    cmd += ["--eval-every", "0", "--eval-size", "1", "--eval-samples", "1"]
    return [*cmd, "--output-dir", str(run_dir)]


# ---------------------------------------------------------------------------------------------
# TRL's child


def trl_child(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from rewards import right_sum
    from tools import add
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    out_dir = Path(spec["out_dir"])
    dataset = Dataset.from_list(spec["rows"])
    rollouts: list[dict] = []  # per rollout: sampled tokens, all completion tokens, seconds
    steps: list[float] = []
    k = spec["steps_per_rollout"]

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            steps.append(time.perf_counter() - self.begin)

    class Save(TrainerCallback):
        """Checkpoints every `save_every` rollouts, off the clock (after on_step_end)."""

        def on_step_end(self, args, state, control, model=None, **kw):
            every = spec["save_every"]
            if every and state.global_step % (every * k) == 0:
                rollout = state.global_step // k
                path = out_dir / "checkpoints" / f"step_{rollout:06d}"
                model.save_pretrained(path)
                tokenizer.save_pretrained(path)

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    config = GRPOConfig(output_dir=str(out_dir / "trl"), **spec["trl"])
    trainer = GRPOTrainer(
        model=spec["model_dir"],
        reward_funcs=right_sum,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[add],
        callbacks=[Clock(), Save()],
    )
    generate = trainer._generate

    def timed_generate(prompts):
        t0 = time.perf_counter()
        result = generate(prompts)
        seconds = time.perf_counter() - t0
        prompt_ids, completion_ids, tool_mask, completions = (
            result[0],
            result[1],
            result[2],
            result[3],
        )
        sampled = (
            [sum(m) for m in tool_mask]
            if tool_mask is not None
            else [len(c) for c in completion_ids]
        )
        rollouts.append(
            {
                "seconds": seconds,
                "sampled": sum(sampled),
                "completion_tokens": sum(len(c) for c in completion_ids),
                "context_max": max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)),
                "rows": len(completion_ids),
                "calls": sum(m.get("role") == "tool" for c in completions for m in c),
            }
        )
        return result

    trainer._generate = timed_generate
    t0 = time.perf_counter()
    trainer.train()
    result = {
        "optimizer_steps": steps,
        "steps_per_rollout": k,
        "rollouts": rollouts,
        "train_wall_s": time.perf_counter() - t0,
        "maxrss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "versions": versions(),
    }
    (out_dir / "trl_result.json").write_text(json.dumps(result))
    return 0


def trl_cmd(spec: dict, run_dir: Path) -> list[str]:
    return trl_child_cmd(__file__, spec, run_dir)


def trl_spec(
    args, cfg: Any, n: int, model: Path, data: Path, rollouts: int, save_every: int, run_dir: Path
) -> dict:
    kwargs = trl_kwargs(cfg, rollouts)
    kwargs["max_tool_calling_iterations"] = (
        n - 1
    )  # grouprl's --max-turns: calls a trajectory may make
    k = kwargs["max_steps"] // rollouts
    rows = grouprl_order(data, cfg.seed, rollouts * cfg.prompts_per_step)
    return {
        "model_dir": str(model),
        "out_dir": str(run_dir),
        "threads": cfg.threads,
        "rows": [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows],
        "steps_per_rollout": k,
        "save_every": save_every,
        "trl": kwargs,
    }


# ---------------------------------------------------------------------------------------------
# Measuring


def speed_run(
    args, system: str, n: int, model: Path, data: Path, heldout: Path, run_dir: Path
) -> dict:
    steps = args.warmup_steps + args.measured_steps
    env = None
    if system.startswith("grouprl"):
        cmd = grouprl_cmd(args, n, model, data, heldout, steps, True, run_dir)
        if system == "grouprl-before":  # the other tree's package shadows the installed one
            env = {"PYTHONPATH": str(args.before.resolve())}
    else:
        cfg = grouprl_config(args, n, data, steps, speed=True)
        cmd = trl_cmd(trl_spec(args, cfg, n, model, data, steps, 0, run_dir), run_dir)
    child = run_child(cmd, run_dir / "log.txt", args.threads, env=env)
    if child.returncode != 0:
        raise SystemExit(f"{system} failed (exit {child.returncode}); see {child.log}")
    return read_speed_run(
        system, run_dir, args.prompts_per_step * args.group_size, args.warmup_steps
    ) | {"rss_mb": child.maxrss_mb}


def read_speed_run(system: str, run_dir: Path, rows: int, warmup: int) -> dict:
    """A speed run's measured steps, from its run directory: step and rollout seconds, sampled
    tokens (grouprl's `completion_len_mean` counts sampled tokens only, as TRL's tool mask does)."""
    if system.startswith("grouprl"):
        metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["step"] > warmup]
        seconds = [m["step_seconds"] for m in metrics]
        rollout = [m["rollout_seconds"] for m in metrics]
        sampled = [m["completion_len_mean"] * rows for m in metrics]
        calls = [m["tool_calls_mean"] for m in metrics]
    else:
        result = json.loads((run_dir / "trl_result.json").read_text())
        k, opt = result["steps_per_rollout"], result["optimizer_steps"]
        seconds = [sum(opt[i * k : (i + 1) * k]) for i in range(len(opt) // k)][warmup:]
        gens = result["rollouts"][warmup:]
        rollout = [g["seconds"] for g in gens]
        sampled = [g["sampled"] for g in gens]
        calls = [g["calls"] / g["rows"] for g in gens if "calls" in g]
    return {"seconds": seconds, "rollout": rollout, "sampled": sampled, "calls": calls}


def speed(args, model: Path, out: Path) -> dict:
    results = {}
    for n in args.shapes:
        data = write_rows(n, 2000, args.seed, out / f"rows-{n}.jsonl")
        heldout = args.model.parent / "eval.jsonl"
        systems = (*SYSTEMS, "grouprl-before") if args.before else SYSTEMS
        runs = {s: [] for s in systems}
        for r in range(args.rounds):
            for system in systems if r % 2 == 0 else systems[::-1]:
                run_dir = out / "speed" / f"n{n}-r{r}-{system}"
                print(
                    f"speed: {n} numbers ({n} turns), round {r + 1}/{args.rounds}, {system}",
                    flush=True,
                )
                runs[system].append(speed_run(args, system, n, model, data, heldout, run_dir))
        results[n] = {s: summarize(v) for s, v in runs.items()} | {"tokens": shape_tokens(model, n)}
        print(json.dumps({n: results[n]}, indent=1), flush=True)
    return results


def summarize(runs: list[dict]) -> dict:
    seconds = [s for r in runs for s in r["seconds"]]
    sampled = [t for r in runs for t in r["sampled"]]
    return {
        "median_step_s": statistics.median(seconds),
        "median_rollout_s": statistics.median(x for r in runs for x in r["rollout"]),
        "sampled_per_step": statistics.mean(sampled),
        "sampled_tokens_per_s": sum(sampled) / sum(seconds),
        "calls_per_row": statistics.mean(c for r in runs for c in r["calls"])
        if any(r["calls"] for r in runs)
        else None,
        "peak_rss_mb": max(r["rss_mb"] for r in runs),
        "steps": len(seconds),
    }


# ---------------------------------------------------------------------------------------------
# Training: held-out pass@1 against training seconds


def evaluate(args, checkpoint: Path, heldout: Path, data: Path, log: Path) -> dict:
    n = args.tta_shape
    cmd = [*GROUPRL, "eval", "--model", str(checkpoint), "--dataset", str(data)]
    cmd += ["--eval-dataset", str(heldout), "--tools", TOOL, "--tool-format", "chat"]
    cmd += ["--rewards", REWARD, "1", "--max-turns", str(n - 1)]
    cmd += ["--max-new-tokens", str(max_new_tokens(n)), "--limit", str(args.eval_limit)]
    cmd += [
        "--samples",
        str(args.eval_samples),
        "--seed",
        "0",
        "--threads",
        str(args.threads),
        "--json",
    ]
    child = run_child(cmd, log, args.threads)
    if child.returncode != 0:
        raise SystemExit(f"grouprl eval failed on {checkpoint}; see {log}")
    text = log.read_text()
    return json.loads(text[text.index("{") :])


def training(args, model: Path, out: Path) -> dict:
    """Both systems train from the same start for --tta-rollouts rollouts (grouprl's GRPO defaults
    otherwise); every --save-every rollouts their checkpoint is evaluated by `grouprl eval`."""
    n, rollouts = args.tta_shape, args.tta_rollouts
    data, heldout = args.model.parent / "train.jsonl", args.model.parent / "eval.jsonl"
    results = {}
    for system in SYSTEMS:
        run_dir = out / "train" / system
        print(f"training: {system}, {rollouts} rollouts", flush=True)
        if system == "grouprl":
            cmd = grouprl_cmd(args, n, model, data, heldout, rollouts, False, run_dir)
        else:
            cfg = grouprl_config(args, n, data, rollouts, speed=False)
            cmd = trl_cmd(
                trl_spec(args, cfg, n, model, data, rollouts, args.save_every, run_dir), run_dir
            )
        child = run_child(cmd, run_dir / "log.txt", args.threads)
        if child.returncode != 0:
            raise SystemExit(f"{system} failed (exit {child.returncode}); see {child.log}")
        if system == "grouprl":
            seconds = [m["step_seconds"] for m in read_jsonl(run_dir / "metrics.jsonl")]
        else:
            result = json.loads((run_dir / "trl_result.json").read_text())
            k, opt = result["steps_per_rollout"], result["optimizer_steps"]
            seconds = [sum(opt[i * k : (i + 1) * k]) for i in range(len(opt) // k)]
        points = []
        for step in range(0, rollouts + 1, args.save_every):
            checkpoint = model if step == 0 else run_dir / "checkpoints" / f"step_{step:06d}"
            metrics = evaluate(args, checkpoint, heldout, data, run_dir / f"eval-{step}.txt")
            points.append({"rollouts": step, "train_s": sum(seconds[:step]), **metrics})
            print(json.dumps(points[-1]), flush=True)
        results[system] = points
    return results


# ---------------------------------------------------------------------------------------------
# Tables


def speed_table(speed: dict) -> str:
    rows = []
    for n, by in speed.items():
        t = by["trl"]
        shown = [("grouprl", by["grouprl"])]
        if "grouprl-before" in by:
            shown.append(("grouprl (before)", by["grouprl-before"]))
        for system, r in (*shown, ("TRL", t)):
            rows.append(
                [
                    (
                        f"{n} numbers: {n} turns, prompt {by['tokens']['prompt']}, context "
                        f"{by['tokens']['context']} tokens"
                        if system == "grouprl"
                        else ""
                    ),
                    system,
                    fmt(r["median_step_s"], ".2f"),
                    fmt(r["median_rollout_s"], ".2f"),
                    fmt(r["calls_per_row"], ".2f"),
                    fmt(r["sampled_per_step"], ".0f"),
                    fmt(r["sampled_tokens_per_s"], ".0f"),
                    fmt(r["peak_rss_mb"], ".0f"),
                    f"**{r['sampled_tokens_per_s'] / t['sampled_tokens_per_s']:.2f}x**"
                    if system != "TRL"
                    else "",
                ]
            )
    header = [
        "shape",
        "system",
        "step s (median)",
        "rollout s",
        "calls / trajectory",
        "sampled tokens / step",
        "sampled tokens / step-s",
        "peak RSS MB",
        "grouprl / TRL",
    ]
    return md_table(header, rows)


def training_table(training: dict) -> str:
    rows = []
    for system, points in training.items():
        for p in points:
            rows.append(
                [
                    system if p is points[0] else "",
                    p["rollouts"],
                    fmt(p["train_s"], ".0f"),
                    fmt(p["pass_at_1"], ".3f"),
                    fmt(p["greedy_pass_at_1"], ".3f"),
                    fmt(p["tool_call_rate"], ".2f"),
                ]
            )
    header = [
        "system",
        "rollouts",
        "training s",
        "held-out pass@1 (T=1)",
        "greedy pass@1",
        "call rate",
    ]
    return md_table(header, rows)


def write_tables(out: Path, results: dict) -> None:
    text = speed_table(results["speed"])
    if "training" in results:
        text += "\n\n" + training_table(results["training"])
    (out / "tables.md").write_text(text + "\n")
    print(text)


def tables_from(out: Path) -> int:
    """Rebuild results.json's summaries from the run directories under `out` (peak RSS is kept
    from results.json: it was measured by the parent) and print the tables."""
    results = json.loads((out / "results.json").read_text())
    saved = results["args"]
    rows = int(saved["prompts_per_step"]) * int(saved["group_size"])
    for n, by in results["speed"].items():
        for system in [s for s in (*SYSTEMS, "grouprl-before") if s in by]:
            runs = [
                read_speed_run(system, d, rows, int(saved["warmup_steps"]))
                | {"rss_mb": by[system]["peak_rss_mb"]}
                for d in sorted((out / "speed").glob(f"n{n}-r*-{system}"))
            ]
            by[system] = summarize(runs)
        by.setdefault("tokens", shape_tokens(out / "model", int(n)))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_tables(out, results)
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "_trl-child":
        return trl_child(sys.argv[2])
    args = parse_args(argv)
    if args.tables_from:
        return tables_from(args.tables_from)
    out = args.out or ROOT / "runs/bench" / time.strftime("tools_vs_trl-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(versions()), flush=True)
    model = prepare_model(args, out)
    results = {"versions": versions(), "args": {k: str(v) for k, v in vars(args).items()}}
    if args.skip_speed:
        results["speed"] = json.loads((out / "results.json").read_text())["speed"]
    else:
        results["speed"] = speed(args, model, out)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if args.tta_rollouts:
        results["training"] = training(args, model, out)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_tables(out, results)
    print(f"wrote {out / 'results.json'} and {out / 'tables.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
