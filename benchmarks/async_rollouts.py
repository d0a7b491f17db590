"""Asynchronous rollouts (`--max-staleness K`) against synchronous ones (K = 0), same run.

Each cell is MODEL:PROMPT_TOKENS:NEW_TOKENS:G (B = 16 prompts a step), as in
`benchmarks/vllm_engine.py`: `builtin` the bundled 1M model on its arithmetic task, `20m` the
random 20.5M Llama on random prompts of exactly PROMPT_TOKENS tokens, every completion running
to the budget. Each arm is K plus how the cores are shared (trainer threads `t`, sampler threads
`s`); every run is `grouprl train` in a child process, arms alternating in order and reversed
order by round. Per arm: the median step (the trainer's: its wait for the batch plus its update),
steps per second against K = 0's, and where the time goes: the sampler's own time on a batch, the
trainer's update, and the trainer's wait. "separate device" is what a sampler on its own device
would give, from K = 0's measured phases: a step would take max(rollout, update) instead of
their sum.

Usage (from the repository root):

    .venv/bin/python benchmarks/async_rollouts.py                  # both cells (~15 minutes)
    .venv/bin/python benchmarks/async_rollouts.py --cells builtin:0:38:8 --rounds 3
"""

from __future__ import annotations

import json
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
from vllm_engine import write_data


@dataclass(frozen=True)
class Args:
    cells: tuple[str, ...] = ("builtin:0:38:8", "20m:150:128:8")
    arms: tuple[str, ...] = ("k0:t2", "k1:t2:s1", "k1:t1:s1", "k1:t2:s2", "k2:t2:s1")
    """K:trainer threads[:sampler threads] (K = 0 has no sampler thread), or with K = 0
    k0:t2:bf16 (bf16 forwards, the trainer recomputing old_logp) and k0:t2:bf16-bypass (bf16
    with --correction token_band --proximal behaviour: no recompute); a last part `bypass` adds
    --proximal behaviour to any arm (no recompute of old_logp)."""
    warmup_steps: int = 2
    measured_steps: int = 6
    rounds: int = 2
    """Child runs per arm and cell, alternating."""
    out_dir: Path | None = None
    """Where runs, data and results.json go. None: runs/bench/async-<date>-<time>."""


PRECISION = {"bf16": ["--precision", "bf16"],
             "bf16-bypass": ["--precision", "bf16", "--correction", "token_band", "--proximal",
                             "behaviour"],
             "bypass": ["--proximal", "behaviour"]}  # fmt: skip


def arm_parts(arm: str) -> tuple[int, int, int | None]:
    k, t, *s = arm.split(":")
    sampler = int(s[0][1:]) if s and s[0] not in PRECISION else None
    return int(k[1:]), int(t[1:]), sampler


def command(args: Args, spec: str, arm: str, run_dir: Path, out: Path) -> list[str]:
    model, prompt_tokens, new_tokens, group = spec.split(":")
    k, threads, sampler = arm_parts(arm)
    steps = args.warmup_steps + args.measured_steps
    cmd = [sys.executable, "-c", "import sys; from grouprl.cli import main; sys.exit(main())",
           "train", "--steps", str(steps), "--prompts-per-step", "16", "--group-size", group,
           "--max-new-tokens", new_tokens, "--lr", "1e-5", "--warmup-steps", "0",
           "--threads", str(threads), "--seed", "0", "--no-skip-zero-advantage",
           "--log-ratios", "0", "--no-doctor", "--no-progress", "--eval-every", "0",
           "--eval-size", "1", "--eval-samples", "1", "--output-dir", str(run_dir),
           "--algo", "grpo", "--max-staleness", str(k)]  # fmt: skip
    if sampler is not None:
        cmd += ["--sampler-threads", str(sampler)]
    cmd += PRECISION.get(arm.split(":")[-1], [])
    if model == "builtin":
        return cmd
    path = random_llama_dir(out / "model-20m", LLAMA_20M, eos=False)
    data, reward = write_data(out, int(prompt_tokens), rows=max(64, 40 * steps))
    return [*cmd, "--model", str(path), "--dataset", str(data), "--rewards", f"{reward}:length",
            "1.0", "--max-prompt-length", str(int(prompt_tokens) + 8)]  # fmt: skip


def main(args: Args) -> None:
    out = args.out_dir or Path("runs/bench") / f"async-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    results = {"versions": versions(), "args": {k: str(v) for k, v in vars(args).items()}}
    rows = []
    for spec in args.cells:
        per: dict[str, dict[str, list[float]]] = {}
        for r in range(args.rounds):
            for arm in args.arms if r % 2 == 0 else args.arms[::-1]:
                run_dir = out / f"{spec.replace(':', '-')}-{arm.replace(':', '-')}-{r}"
                _, threads, _ = arm_parts(arm)
                child = run_child(command(args, spec, arm, run_dir, out),
                                  log_path(run_dir), threads)  # fmt: skip
                if child.returncode != 0:
                    raise SystemExit(f"{spec} {arm} failed: see {child.log}")
                got = per.setdefault(arm, {"step": [], "wait": [], "sampler": [], "update": []})
                for m in read_jsonl(run_dir / "metrics.jsonl"):
                    if m["step"] <= args.warmup_steps:
                        continue
                    got["step"].append(m["step_seconds"])
                    got["wait"].append(m["rollout_seconds"])
                    got["sampler"].append(m.get("sampler_seconds", m["rollout_seconds"]))
                    got["update"].append(m.get("update_seconds",
                                               m["step_seconds"] - m["rollout_seconds"]))  # fmt: skip
                print(f"{spec} {arm} round {r}: step "
                      f"{statistics.median(got['step'][-args.measured_steps:]):.3f} s", flush=True)  # fmt: skip
        results[spec] = per
        base = statistics.median(per[args.arms[0]]["step"])
        for arm, got in per.items():
            step = statistics.median(got["step"])
            rows.append([spec, arm, fmt(step), fmt(base / step, ".2f") + "x",
                         fmt(statistics.median(got["sampler"])), fmt(statistics.median(got["update"])),
                         fmt(statistics.median(got["wait"]))])  # fmt: skip
        sync = per[args.arms[0]]
        rollout, update = statistics.median(sync["sampler"]), statistics.median(sync["update"])
        rows.append([spec, "separate device", fmt(max(rollout, update)),
                     fmt((rollout + update) / max(rollout, update), ".2f") + "x", "", "", ""])  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(md_table(["cell", "arm", "step s", "steps/s vs K=0", "sampler s", "update s",
                    "trainer wait s"], rows))  # fmt: skip
    print(f"versions: {results['versions']}; results: {out / 'results.json'}")


if __name__ == "__main__":
    main(tyro.cli(Args))
