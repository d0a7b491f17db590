"""grouprl's own sampler against vLLM (`--engine vllm`), same model, same settings, same run.

Each cell is MODEL:PROMPT_TOKENS:NEW_TOKENS:G (B = 16 prompts a step): `builtin` is the bundled
1M model (heads of 32) on the built-in arithmetic task, `20m` the random 20.5M Llama (hidden
512, 8 heads of 64, the character tokenizer) on random prompts of exactly PROMPT_TOKENS tokens,
its EOS one the model cannot emit so every completion runs to the budget (equal work in both).
Every run is `grouprl train` in a child process of the vLLM environment's Python (both engines
under the same transformers and torch), alternating hf, vllm, vllm, hf, ...; per cell and engine:
the median rollout seconds (sampling and scoring; for vLLM the weight load after each update
too), completion tokens per rollout-second, the median step, and the child's peak RSS. vLLM
runs in float32 here (the trainer's dtype), eager, as `--engine vllm` does on a CPU.

Usage (from the repository root; `make test-vllm` builds .venv-vllm):

    .venv-vllm/bin/python benchmarks/vllm_engine.py                 # both cells (~10 min)
    .venv-vllm/bin/python benchmarks/vllm_engine.py --cells 20m:150:128:8 --rounds 1
    # on a GPU machine with `pip install 'grouprl[vllm]'`:
    python benchmarks/vllm_engine.py --cells 20m:150:512:8 --device cuda
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from harness import (
    LLAMA_20M,
    fmt,
    log_path,
    md_table,
    random_llama_dir,
    read_jsonl,
    run_child,
    versions,
)

REWARD = """
def length(completions, **kwargs):
    return [len(c) / 100 for c in completions]
"""


@dataclass(frozen=True)
class Args:
    cells: tuple[str, ...] = ("builtin:0:38:8", "20m:150:128:8")
    """MODEL:PROMPT_TOKENS:NEW_TOKENS:G cells (builtin's prompts are its task's)."""
    warmup_steps: int = 2
    """Steps before the measured ones (vLLM's first sampling call pays its warm-up)."""
    measured_steps: int = 4
    rounds: int = 2
    """Child runs per engine and cell, alternating."""
    threads: int = 2
    device: str = "cpu"
    out_dir: Path | None = None
    """Where runs, data and results.json go. None: runs/bench/vllm-<date>-<time>."""


def cell_parts(spec: str) -> tuple[str, int, int, int]:
    model, p, t, g = spec.split(":")
    return model, int(p), int(t), int(g)


def write_data(out: Path, prompt_tokens: int, rows: int) -> tuple[Path, Path]:
    rng = random.Random(prompt_tokens)
    alphabet = "abcdefghijklmnopqrstuvwxyz +-=0123456789"
    data = out / f"data-{prompt_tokens}.jsonl"
    with data.open("w") as f:
        for _ in range(rows):
            text = "".join(rng.choice(alphabet) for _ in range(prompt_tokens - 1))
            f.write(json.dumps({"prompt": text, "answer": ""}) + "\n")
    reward = out / "reward.py"
    reward.write_text(REWARD)
    return data, reward


def command(args: Args, spec: str, engine: str, run_dir: Path, out: Path) -> list[str]:
    model, prompt_tokens, new_tokens, group = cell_parts(spec)
    steps = args.warmup_steps + args.measured_steps
    cmd = [sys.executable, "-c", "import sys; from grouprl.cli import main; sys.exit(main())",
           "train", "--engine", engine, "--steps", str(steps), "--prompts-per-step", "16",
           "--group-size", str(group), "--max-new-tokens", str(new_tokens), "--lr", "1e-5",
           "--warmup-steps", "0", "--threads", str(args.threads), "--seed", "0",
           "--device", args.device, "--no-skip-zero-advantage", "--log-ratios", "0",
           "--no-doctor", "--no-progress", "--eval-every", "0", "--eval-size", "1",
           "--eval-samples", "1", "--output-dir", str(run_dir), "--algo", "grpo"]  # fmt: skip
    if model == "builtin":
        return cmd
    path = random_llama_dir(out / "model-20m", LLAMA_20M, eos=False)
    data, reward = write_data(out, prompt_tokens, rows=max(64, 40 * steps))
    return [*cmd, "--model", str(path), "--dataset", str(data), "--rewards", f"{reward}:length",
            "1.0", "--max-prompt-length", str(prompt_tokens + 8)]  # fmt: skip


def main(args: Args) -> None:
    out = args.out_dir or Path("runs/bench") / f"vllm-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    results = {"versions": versions(), "args": {k: str(v) for k, v in vars(args).items()}}
    rows = []
    for spec in args.cells:
        per: dict[str, dict[str, list[float]]] = {}
        order = [("hf", "vllm"), ("vllm", "hf")]
        for r in range(args.rounds):
            for engine in order[r % 2]:
                run_dir = out / f"{spec.replace(':', '-')}-{engine}-{r}"
                child = run_child(command(args, spec, engine, run_dir, out),
                                  log_path(run_dir), args.threads)  # fmt: skip
                if child.returncode != 0:
                    raise SystemExit(f"{spec} {engine} failed: see {child.log}")
                steps = [m for m in read_jsonl(run_dir / "metrics.jsonl")
                         if m["step"] > args.warmup_steps]  # fmt: skip
                got = per.setdefault(engine, {"rollout": [], "step": [], "tokens": [], "rss": []})
                _, _, _, group = cell_parts(spec)
                for m in steps:
                    got["rollout"].append(m["rollout_seconds"])
                    got["step"].append(m["step_seconds"])
                    got["tokens"].append(m["completion_len_mean"] * 16 * group)
                got["rss"].append(child.maxrss_mb)
                print(
                    f"{spec} {engine} round {r}: rollout "
                    f"{statistics.median(got['rollout'][-len(steps) :]):.3f} s",
                    flush=True,
                )
        results[spec] = per
        for engine, got in per.items():
            rollout = statistics.median(got["rollout"])
            rows.append([spec, engine, fmt(rollout), fmt(sum(got["tokens"]) / sum(got["rollout"]), ".0f"),
                         fmt(statistics.median(got["step"])), fmt(max(got["rss"]), ".0f")])  # fmt: skip
        hf, vllm = (statistics.median(per[e]["rollout"]) for e in ("hf", "vllm"))
        rows.append([spec, "vllm / hf", fmt(vllm / hf, ".2f") + "x", "", "", ""])
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(md_table(["cell", "engine", "rollout s", "tokens/rollout-s", "step s", "peak RSS MB"],
                   rows))  # fmt: skip
    print(f"versions: {results['versions']}; results: {out / 'results.json'}")


if __name__ == "__main__":
    main(tyro.cli(Args))
