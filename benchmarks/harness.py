"""What the benchmark scripts share: child processes with their own peak RSS, models built on
disk, grouprl's config turned into TRL's GRPOConfig, the FLOP floor's matmul rate, and tables.

Every measurement runs in a child process, so that its peak resident set is its own
(`ru_maxrss` from `os.wait4`) and one system's allocations never count against the other's.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: the ~20M-parameter random Llama (hidden 512, 6 layers, MLP 1536): 20.5M parameters
LLAMA_20M = {"hidden_size": 512, "num_layers": 6, "num_heads": 8, "intermediate_size": 1536}
#: a ~100M-parameter random Llama (hidden 768, 12 layers, MLP 3072)
LLAMA_100M = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072}
#: grouprl loss aggregation -> TRL loss_type with the same per-token weights
TRL_LOSS_TYPE = {
    "seq_mean_token_mean": "grpo",
    "token_mean": "dapo",
    "seq_mean_token_sum_norm": "dr_grpo",
}
CHILD_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}
#: grouprl's CLI in a child process (no console-script lookup)
GROUPRL = [sys.executable, "-c", "import sys; from grouprl.cli import main; sys.exit(main())"]


# ---------------------------------------------------------------------------------------------
# Children


@dataclass(frozen=True)
class ChildResult:
    returncode: int
    maxrss_mb: float  # the child's own peak resident set (ru_maxrss of wait4)
    wall_s: float
    log: Path


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ, **CHILD_ENV)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def run_child(
    cmd: list[str],
    log: Path,
    threads: int,
    *,
    poll=None,
    poll_every: float = 1.0,
    env: dict[str, str] | None = None,
) -> ChildResult:
    """Run `cmd` to completion; its peak RSS comes from wait4, so it is this child's alone.

    `poll(proc)` (optional) is called every `poll_every` seconds while it runs; `env` adds to
    the child's environment.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(threads) | (env or {})
        )
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG if poll else 0)
            if pid:
                break
            poll(proc)
            time.sleep(poll_every)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    return ChildResult(
        proc.returncode, usage.ru_maxrss / 1024, time.perf_counter() - t0, log
    )  # ru_maxrss is in KiB on Linux


def log_path(run_dir: Path) -> Path:
    """A child run's log beside its directory: RUN_DIR.log (a name with a dot in it, say
    `entropy_0.2-s0`, keeps it: `with_suffix` would cut it at the dot)."""
    return run_dir.with_name(run_dir.name + ".log")


def train_run(run_dir: Path, flags: list[str], label: str) -> Path:
    """`grouprl train --output-dir run_dir *flags` in a child process with one torch thread,
    its output in run_dir.log; a run that finished before (its final/) is kept, one left
    unfinished is started again."""
    if (run_dir / "final").exists():
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "grouprl", "train", "--threads", "1", "--no-progress",
           "--output-dir", str(run_dir), *flags]  # fmt: skip
    with log_path(run_dir).open("w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(1))
    if done.returncode != 0:
        raise SystemExit(f"{label} failed: see {log_path(run_dir)}")
    print(f"{label}: done", flush=True)
    return run_dir


def trl_child_cmd(script: str, spec: dict, run_dir: Path) -> list[str]:
    """Write `spec` into `run_dir` and return the command that runs `script`'s TRL child on it
    (each benchmark script answers `_trl-child SPEC`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "trl_spec.json"
    path.write_text(json.dumps(spec, indent=1))
    return [sys.executable, str(Path(script).resolve()), "_trl-child", str(path)]


def tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(text[-lines:])


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            break
    return out


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "trl", "accelerate", "datasets", "grouprl"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "-"
    return out


# ---------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what the tables call it
    path: str  # the model directory both systems load from disk
    params: int
    hidden_size: int
    intermediate_size: int
    note: str


def random_llama_dir(
    path: Path, size: dict[str, int], *, eos: bool = True, bpe_vocab: int | None = None
) -> Path:
    """A random Llama saved to `path` (kept if already there), with the character tokenizer,
    or with a byte-level BPE tokenizer of `bpe_vocab` tokens trained here (`bpe_tokenizer`).

    eos=False: the EOS token of the tokenizer and of the generation config is one the model
    cannot emit (added to the tokenizer after the model was sized, so it has no logit): both
    systems decode every completion to the full budget (equal work without a trainer flag)."""
    import torch

    from grouprl.models.tiny import TinySize, build_tiny_llama
    from grouprl.models.tokenizer import build_char_tokenizer

    if (path / "config.json").is_file():
        return path
    tokenizer = bpe_tokenizer(bpe_vocab) if bpe_vocab else build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_llama(tokenizer, TinySize(**size, max_positions=1024))
    if not eos:
        tokenizer.add_special_tokens({"eos_token": "<never>"})  # id == the model's vocab size
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def bpe_corpus() -> list[str]:
    """The text a BPE tokenizer is trained on and benchmark prompts are cut from: the Python
    standard library's top-level modules (about 5 MB, on every machine, no download)."""
    root = Path(os.__file__).parent
    return [p.read_text(errors="replace") for p in sorted(root.glob("*.py"))]


def bpe_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on `bpe_corpus()`, with <pad>,
    <bos> (added to every encoded text, as the character tokenizer does) and <eos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(bpe_corpus(), trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        clean_up_tokenization_spaces=False, model_max_length=1024,
    )  # fmt: skip


def model_spec(name: str, path: Path | str, note: str) -> ModelSpec:
    from grouprl.models import load_model

    model = load_model(str(path))
    params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    return ModelSpec(name, str(path), params, cfg.hidden_size, cfg.intermediate_size, note)


# ---------------------------------------------------------------------------------------------
# grouprl's settings as TRL's


def trl_kwargs(cfg: Any, rollouts: int) -> dict[str, Any]:
    """GRPOConfig keyword arguments matching a resolved grouprl TrainConfig on a CPU."""
    k = cfg.minibatches
    steps = optimizer_steps_per_rollout(cfg)  # k per epoch, in both systems
    n = cfg.prompts_per_step * cfg.group_size
    micro = min(cfg.micro_batch_size or n // k, n // k)  # completions per forward/backward
    if (n // k) % micro:
        raise SystemExit(f"micro-batch {micro} does not divide a minibatch of {n // k}")
    return {
        # one rollout of B*G completions, then k optimizer steps (per epoch) on N/k completions
        # each, in forward/backward passes of `micro` completions whose gradients accumulate
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": n // k // micro,
        "steps_per_generation": n // micro,
        "num_generations": cfg.group_size,
        "max_steps": rollouts * steps,
        "num_iterations": cfg.epochs,
        "max_completion_length": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        # objective
        "beta": cfg.beta,
        "epsilon": cfg.clip_low,
        "epsilon_high": cfg.clip_high,
        "importance_sampling_level": cfg.ratio_level,
        "loss_type": TRL_LOSS_TYPE[cfg.loss_agg],
        "scale_rewards": cfg.adv_scale,
        "mask_truncated_completions": cfg.mask_truncated,
        # optimizer and schedule (grouprl's warm-up counts rollouts; TRL's counts optimizer steps)
        "learning_rate": cfg.lr,
        "lr_scheduler_type": "constant_with_warmup" if cfg.warmup_steps else "constant",
        "warmup_steps": cfg.warmup_steps * steps,
        "adam_beta1": cfg.adam_betas[0],
        "adam_beta2": cfg.adam_betas[1],
        "weight_decay": cfg.weight_decay,
        "max_grad_norm": cfg.max_grad_norm,
        # the CPU, grouprl's precision, nothing that trades speed for memory
        "use_cpu": True,
        "bf16": cfg.precision == "bf16",
        "fp16": False,
        # (TRL defaults gradient checkpointing on; `activation_checkpointing` is its new name)
        "activation_checkpointing": False,
        "torch_compile": False,
        # data: grouprl's prompt order, no reshuffling
        "shuffle_dataset": False,
        "dataloader_num_workers": 0,
        "remove_unused_columns": False,
        "seed": cfg.seed,
        # logging and saving off the clock (and off disk)
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "log_completions": False,
    }


def optimizer_steps_per_rollout(cfg: Any) -> int:
    """Optimizer steps one rollout makes in both systems: minibatches × epochs."""
    return cfg.minibatches * cfg.epochs


def time_trl_generation(trainer: Any, seconds: list[float]) -> None:
    """Append the seconds of each of TRL's generation calls (model.generate and EOS masking,
    inside its step) to `seconds`."""
    generate = trainer._generate_single_turn

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        seconds.append(time.perf_counter() - t0)
        return out

    trainer._generate_single_turn = timed_generate


def check_trl_equivalent(cfg: Any) -> None:
    if cfg.loss_agg not in TRL_LOSS_TYPE or cfg.ratio_level not in ("token", "sequence"):
        raise SystemExit(f"TRL has no equivalent of {cfg.loss_agg} / {cfg.ratio_level}")


# ---------------------------------------------------------------------------------------------
# Step speed


@dataclass
class SpeedRun:
    """The measured steps of one child process."""

    system: str
    seconds: list[float]  # per measured step (one rollout each)
    tokens: list[int]  # completion tokens per measured step
    maxrss_mb: float
    failed: str | None = None
    # per measured step: grouprl's rollout_seconds (sampling + scoring); TRL's time in
    # _generate_single_turn (model.generate + EOS masking)
    generation: list[float] = field(default_factory=list)


def grouprl_speed_run(child: ChildResult, run_dir: Path, completions: int, warmup: int) -> SpeedRun:
    """The measured steps of a `grouprl train` child, from RUN_DIR/metrics.jsonl (`completions`
    per step: B·G)."""
    if child.returncode != 0:
        return SpeedRun(
            "grouprl", [], [], child.maxrss_mb, failed=f"exit {child.returncode}: {child.log}"
        )
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["step"] > warmup]
    return SpeedRun(
        "grouprl",
        [m["step_seconds"] for m in metrics],
        [round(m["completion_len_mean"] * completions) for m in metrics],
        child.maxrss_mb,
        generation=[m["rollout_seconds"] for m in metrics],
    )


def trl_speed_run(child: ChildResult, result_path: Path, warmup: int) -> SpeedRun:
    """The measured rollouts of a TRL child, from the JSON it wrote: optimizer-step times summed
    per rollout (k optimizer steps each), completion tokens and generation seconds."""
    if child.returncode != 0 or not result_path.exists():
        return SpeedRun(
            "trl", [], [], child.maxrss_mb, failed=f"exit {child.returncode}: {child.log}"
        )
    result = json.loads(result_path.read_text())
    k = result["steps_per_rollout"]
    opt = result["optimizer_steps"]
    per_rollout = [sum(opt[i * k : (i + 1) * k]) for i in range(len(opt) // k)]
    return SpeedRun(
        "trl",
        per_rollout[warmup:],
        [g["tokens"] for g in result["generations"]][warmup:],
        child.maxrss_mb,
        generation=[g["seconds"] for g in result["generations"]][warmup:],
    )


def summarize(runs: list[SpeedRun]) -> dict | None:
    seconds = [s for run in runs for s in run.seconds]
    tokens = [t for run in runs for t in run.tokens]
    if not seconds or len(tokens) != len(seconds):
        return None
    return {
        "median_step_s": statistics.median(seconds),
        "tokens_per_s": sum(tokens) / sum(seconds),
        "completion_tokens_per_step": statistics.mean(tokens),
        "peak_rss_mb": max(run.maxrss_mb for run in runs),
        "median_generation_s": statistics.median(g for run in runs for g in run.generation),
        "steps": len(seconds),
    }


def matmul_rate(threads: int, shapes: Sequence[tuple[int, int, int]], reps: int = 10) -> dict:
    """Median fp32 GEMM rate (FLOP/s) for each (m, k, n) shape, on `threads` threads."""
    import torch

    from _gemm import matmul_rates  # benchmarks/ is on sys.path when a script here runs

    torch.set_num_threads(threads)
    return matmul_rates(shapes, reps)


# ---------------------------------------------------------------------------------------------
# Tables


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
