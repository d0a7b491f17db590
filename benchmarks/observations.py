"""What a tool result's length costs the sampler: `sample_groups` with tools whose observations
are 8, 32 or 128 tokens long, at the same call rate, on the same random-init Llama.

The rollout with long observations should cost little more than with short ones: the model's
own tokens are the same, only the fed ones grow. Each row's first `--calls` calls (a call closes
at any digit, which the random model writes every few tokens, so every row makes them early)
are answered with an observation of K filler tokens (`|`); later digits are not calls. The budget is 64 + calls x K tokens, so
every row has room for the same sampled tokens whatever K is. Runs alternate the three lengths;
each number is the median of `--repeats` runs after one warm-up each.

    python benchmarks/observations.py [--model 1m|20m] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from grouprl.messages import Observation
from grouprl.models import build_char_tokenizer
from grouprl.rollout import sample_groups
from rollout import build_model, make_prompts  # benchmarks/ is on sys.path when a script here runs

LENGTHS = (8, 32, 128)
BASE_TOKENS = 64


class FixedCalls:
    """A tool handler answering each row's first `calls` calls with `length` filler ids."""

    ends_turns = False

    def __init__(self, filler: int, length: int, calls: int) -> None:
        self.closers = list("0123456789")
        self.filler, self.length, self.calls = filler, length, calls

    def respond(self, requests):
        answers = []
        for request in requests:
            if request.calls_made >= self.calls:
                answers.append(Observation())  # not a call: decoding goes on
                continue
            answers.append(Observation(ids=[self.filler] * self.length, calls=1,
                                       messages=[{"role": "tool", "content": "x"}]))  # fmt: skip
        return answers


def one(model, tokenizer, prompts, length: int, args) -> dict:
    handler = FixedCalls(tokenizer.convert_tokens_to_ids("|"), length, args.calls)
    start = time.perf_counter()
    out = sample_groups(model, tokenizer, prompts, group_size=args.group_size,
                        max_new_tokens=BASE_TOKENS + args.calls * length, seed=args.seed,
                        tools=handler)  # fmt: skip
    seconds = time.perf_counter() - start
    fed = out.mask & ~out.loss_mask
    return {
        "seconds": seconds,
        "calls_per_trajectory": float(out.turns.calls.float().mean()),
        "sampled_tokens": int(out.loss_mask.sum()),
        "fed_tokens": int(fed.sum()),
        "width": int(out.mask.shape[1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("1m", "20m"), default="20m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = build_char_tokenizer()
    model = build_model(args.model, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id,
                        args.seed)  # fmt: skip
    prompts = make_prompts("long", args.prompts, args.seed)
    runs: dict[int, list[dict]] = {k: [] for k in LENGTHS}
    for k in LENGTHS:
        one(model, tokenizer, prompts, k, args)  # warm-up
    for r in range(args.repeats):
        for k in LENGTHS if r % 2 == 0 else reversed(LENGTHS):
            runs[k].append(one(model, tokenizer, prompts, k, args))
        print(f"round {r + 1} of {args.repeats}", file=sys.stderr)
    base = statistics.median(x["seconds"] for x in runs[LENGTHS[0]])
    rows = []
    for k in LENGTHS:
        med = statistics.median(x["seconds"] for x in runs[k])
        last = runs[k][-1]
        rows.append({"observation_tokens": k, "rollout_s": med, "vs_8": med / base,
                     **{key: last[key] for key in ("calls_per_trajectory", "sampled_tokens",
                                                   "fed_tokens", "width")}})  # fmt: skip
    print(f"\n{args.model} Llama, {args.prompts} prompts x G={args.group_size}, {args.calls} calls, "
          f"{args.threads} threads, median of {args.repeats}\n")  # fmt: skip
    print("| observation tokens | rollout s | vs 8 tokens | calls / trajectory | sampled tokens | "
          "fed tokens | width |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['observation_tokens']} | {row['rollout_s']:.3f} | {row['vs_8']:.2f}x | "
              f"{row['calls_per_trajectory']:.2f} | {row['sampled_tokens']} | {row['fed_tokens']} "
              f"| {row['width']} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
