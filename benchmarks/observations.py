"""What a tool result's length costs the sampler: `sample_groups` with tools whose observations
are 8, 32 or 128 tokens long, at the same call rate, on the same random-init Llama.

The rollout with long observations should cost little more than with short ones: the model's
own tokens are the same, only the fed ones grow. Each row's first `--calls` calls (a call closes
at any digit, which the random model writes every few tokens, so every row makes them early)
are answered with an observation of K filler tokens (`|`); later digits are not calls. The
budget is 64 + calls x K tokens, so every row has room for the same sampled tokens whatever K
is; with `--reply N` EOS is masked out and the budget is N + calls x K, so every row samples N
tokens. Both decode loops run: observations fed in one forward each (chunked, the
sampler's default) and one token per decode step (one-token, as before). Runs alternate the
shapes; each number is the median of `--repeats` runs after one warm-up each.

    python benchmarks/observations.py [--model 1m|20m] [--repeats 5] [--loops chunked,one-token]
                                      [--reply 64] [--json out.json]
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
from grouprl.rollout import _hf, sample_groups
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


def one(model, tokenizer, prompts, length: int, loop: str, args) -> dict:
    """One rollout with `loop`: "chunked" (observations in one forward, the default) or
    "one-token" (one token per decode step, as before chunked feeding)."""
    handler = FixedCalls(tokenizer.convert_tokens_to_ids("|"), length, args.calls)
    chunked = _hf.feeds_chunks
    if loop == "one-token":
        _hf.feeds_chunks = lambda *a: False
    try:
        start = time.perf_counter()
        out = sample_groups(model, tokenizer, prompts, group_size=args.group_size,
                            max_new_tokens=(args.reply or BASE_TOKENS) + args.calls * length, seed=args.seed,
                            tools=handler)  # fmt: skip
        seconds = time.perf_counter() - start
    finally:
        _hf.feeds_chunks = chunked
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
    parser.add_argument("--reply", type=int, default=0,
                        help="0: rows end at the model's EOS, within a budget of 64 + calls x K; "
                        "N: EOS is masked out and the budget is N + calls x K, so every row "
                        "samples N tokens (the shape of long replies)")  # fmt: skip
    parser.add_argument("--loops", default="chunked,one-token",
                        help="chunked, one-token, or both (comma-separated)")  # fmt: skip
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
    if args.reply:  # no row ends before its budget
        eos = torch.tensor([tokenizer.eos_token_id])
        model.get_output_embeddings().register_forward_hook(
            lambda module, inputs, logits: logits.index_fill_(-1, eos, -torch.inf)
        )
    shapes = [(loop, k) for loop in args.loops.split(",") for k in LENGTHS]
    runs: dict[tuple[str, int], list[dict]] = {shape: [] for shape in shapes}
    for loop, k in shapes:
        one(model, tokenizer, prompts, k, loop, args)  # warm-up
    for r in range(args.repeats):
        for loop, k in shapes if r % 2 == 0 else reversed(shapes):
            runs[loop, k].append(one(model, tokenizer, prompts, k, loop, args))
        print(f"round {r + 1} of {args.repeats}", file=sys.stderr)
    rows = []
    for loop, k in shapes:
        med = statistics.median(x["seconds"] for x in runs[loop, k])
        base = statistics.median(x["seconds"] for x in runs[loop, LENGTHS[0]])
        last = runs[loop, k][-1]
        rows.append({"loop": loop, "observation_tokens": k, "rollout_s": med, "vs_8": med / base,
                     **{key: last[key] for key in ("calls_per_trajectory", "sampled_tokens",
                                                   "fed_tokens", "width")}})  # fmt: skip
    print(f"\n{args.model} Llama, {args.prompts} prompts x G={args.group_size}, {args.calls} calls, "
          f"{f'replies of {args.reply} tokens' if args.reply else 'EOS on'}, {args.threads} "
          f"threads, median of "
          f"{args.repeats}\n")  # fmt: skip
    print("| loop | observation tokens | rollout s | vs 8 tokens | calls / trajectory | "
          "sampled tokens | fed tokens | width |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['loop']} | {row['observation_tokens']} | {row['rollout_s']:.3f} | "
              f"{row['vs_8']:.2f}x | {row['calls_per_trajectory']:.2f} | {row['sampled_tokens']} "
              f"| {row['fed_tokens']} | {row['width']} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
