"""The issue's experiment: the chat_tools example with its `add` tool answering in a few tokens
or in about 190 (the sum followed by filler words), the sampler alone with both decode loops.

`sample_groups` on the example's model (fitted for up to 6 turns: `python
examples/chat_tools/make_model.py --output-dir runs/chat_tools6 --sizes 2,3,4,5,6`), 8 problems
of `--numbers` numbers × G = 8, `--tool-format chat`; the chunked loop (the default) and the
one-token loop alternate, `--repeats` rounds after one warm-up each; medians.

    python benchmarks/long_results.py [--model runs/chat_tools6/model] [--numbers 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "chat_tools"))


def add(a: int, b: int) -> str:  # the long-answer tool: the name the model calls
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b) + " " + " ".join(["ok"] * 100)


def main() -> None:
    import make_model  # examples/chat_tools

    from grouprl.config import TrainConfig
    from grouprl.models import load_model, load_tokenizer
    from grouprl.rollout import _hf, sample_groups, stop_token_ids
    from grouprl.tasks import get_task
    from grouprl.train.build import build_tools
    from grouprl.train.prompts import prompt_ids

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "runs/chat_tools6/model"))
    parser.add_argument("--numbers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: no model there; make it with python "
                     "examples/chat_tools/make_model.py --output-dir runs/chat_tools6 "
                     "--sizes 2,3,4,5,6")  # fmt: skip
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model).eval(), load_tokenizer(args.model)
    n = args.numbers
    rng = random.Random(0)
    rows = [make_model.row(make_model.problem(rng, (n,))) for _ in range(8)]
    specs = {
        "short": f"{ROOT / 'examples/chat_tools/tools.py'}:add",
        "long": f"{__file__}:add",
    }
    uses = {
        kind: build_tools(TrainConfig(tools=[spec], tool_format="chat", max_turns=n - 1),
                          get_task("arithmetic"), tokenizer, stop_token_ids(model, tokenizer))
        for kind, spec in specs.items()
    }  # fmt: skip

    def one(kind: str, loop: str, seed: int) -> tuple[float, float, float, float]:
        start = uses[kind].rollout(rows, 8, 0, 0, 0)
        ids = [prompt_ids(tokenizer, p, uses[kind]) for p in start.prompts]
        chunked = _hf.feeds_chunks
        if loop == "one-token":
            _hf.feeds_chunks = lambda *a: False
        try:
            t0 = time.perf_counter()
            out = sample_groups(model, tokenizer, ids, group_size=8, seed=seed,
                                max_new_tokens=48 * (n - 1) + 16 + (n - 1) * 200,
                                tools=start.handler)  # fmt: skip
            seconds = time.perf_counter() - t0
        finally:
            _hf.feeds_chunks = chunked
        calls = float(out.turns.calls.sum())
        fed = float((out.mask & ~out.loss_mask).sum())
        return seconds, calls / len(out.texts), fed / max(calls, 1.0), float(out.loss_mask.sum())

    shapes = [(kind, loop) for loop in ("chunked", "one-token") for kind in ("short", "long")]
    for shape in shapes:
        one(*shape, 0)  # warm-up
    runs: dict[tuple[str, str], list] = {shape: [] for shape in shapes}
    for r in range(args.repeats):
        for shape in shapes if r % 2 == 0 else shapes[::-1]:
            runs[shape].append(one(*shape, r))
    print(f"\n{n} numbers, 8 problems x G=8, median of {args.repeats}\n")
    print("| loop | tool answer | rollout s | long / short | calls / trajectory | fed tokens / call "
          "| sampled tokens |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind, loop in shapes:
        got = runs[kind, loop]
        med = statistics.median(x[0] for x in got)
        short = statistics.median(x[0] for x in runs["short", loop])
        print(f"| {loop} | {kind} | {med:.3f} | {med / short:.2f}x | "
              f"{statistics.mean(x[1] for x in got):.2f} | {statistics.mean(x[2] for x in got):.0f} "
              f"| {statistics.mean(x[3] for x in got):.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
