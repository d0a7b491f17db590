"""`grouprl.rollout.sample_groups` against `model.generate`: completion tokens per second, CPU.

What is compared. The same random-init Llama (built here, nothing downloaded), the same B = 16
prompts, G = 8 completions each, 32 new tokens, fp32, temperature 1, top-k off, top-p 1, KV
cache on for both:

- generate: `model.generate(**batch, do_sample=True, num_return_sequences=8, max_new_tokens=32,
  temperature=1.0, top_k=0, top_p=1.0)` on the left-padded batch of 16 prompts, under
  `torch.inference_mode()`. `num_return_sequences` makes generate repeat each prompt 8 times
  before its prefill (it has no way to share a prompt across samples).
- sample_groups: `sample_groups(model, tokenizer, prompts, group_size=8, max_new_tokens=32,
  seed=...)` (prefills the 16 prompts once, broadcasts the cache to the 128 rows).

Fairness: EOS is disabled for both (the tokenizer has no EOS token and the model's
generation_config none), so every row of both produces exactly 32 tokens and both do the same
4,096 completion tokens of work; the script checks the output shapes. Both include their own
tokenization-free work only: generate gets the pre-tokenized batch, sample_groups tokenizes its
16 prompts itself (its cost is included, against it). Runs alternate generate / sample_groups,
flipping the order every round, so load from other processes hits both; each number is the
median of `repeats` runs after one warm-up run each.

Prompts: 'short' are arithmetic problems like the built-in task's (`123+4567=`, 7-11 tokens
with BOS); 'long' put a 90-130-character instruction in front (103-140 tokens), the size of
a chat-templated prompt. Prompt length matters because generate prefills every prompt G times.

The FLOP floor: 2·P·(completion tokens + prompt tokens counted once) / (measured fp32 GEMM
rate), P = parameters that take part in matmuls (all but the input embedding; a tied head is
counted). Attention's own FLOPs are left out, so it is a lower bound for any implementation
that runs this model's arithmetic; each system's time is shown as a multiple of it.

Usage (from the repository root):

    .venv/bin/python benchmarks/rollout.py            # 1M and 20M models, short and long prompts
    .venv/bin/python benchmarks/rollout.py --quick    # smoke run: 1M model, short prompts, 2 runs
    .venv/bin/python benchmarks/rollout.py --ablations --models 1m   # each lever switched off

Ablations (`--ablations`) time sample_groups with one optimisation removed at a time, each
against the full version in the same alternating loop: 'no prompt sharing' passes every prompt
G times with group_size=1 (G prefills per prompt, as generate does); 'torch.cat cache' keeps
transformers' DynamicLayer (a new copy of the cache every step) instead of the pre-allocated
in-place layer; 'torch.multinomial' samples with torch.multinomial instead of the inverse-CDF
sampler.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from dataclasses import dataclass
from typing import Literal
from unittest import mock

import torch
import tyro
from transformers import LlamaConfig, LlamaForCausalLM

from _gemm import matmul_rates  # benchmarks/ is on sys.path when a script here runs
from grouprl.models import build_char_tokenizer
from grouprl.rollout import _hf, draws, sample_groups

#: Same shapes as the built-in model (1M) and the 20M model of benchmarks/vs_trl.py.
MODELS = {
    "1m": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512),
    "20m": dict(
        hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=1536
    ),
}
PREAMBLE = (
    "You are a careful calculator. Work the sum column by column, least significant digit "
    "first, then give the answer after |. Problem: "
)


@dataclass
class Args:
    """Completion tokens per second of sample_groups vs model.generate (see the docstring)."""

    quick: bool = False
    """Smoke run: the 1M model, short prompts, 2 runs each."""
    models: tuple[Literal["1m", "20m"], ...] = ("1m", "20m")
    """Model sizes to run."""
    prompts: tuple[Literal["short", "long"], ...] = ("short", "long")
    """Prompt sets to run."""
    num_prompts: int = 16
    """B, prompts per batch."""
    group_size: int = 8
    """G, completions per prompt."""
    max_new_tokens: int = 32
    """Tokens generated per completion (EOS disabled: always exactly this many)."""
    repeats: int = 7
    """Timed runs per system and setting (median reported); at least 5 for the record."""
    threads: int = 1
    """torch intra-op threads for both systems."""
    seed: int = 0
    """Seed of the model weights, the prompts and sampling."""
    ablations: bool = False
    """Instead of the comparison, time sample_groups with each optimisation switched off."""


def make_prompts(kind: str, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    problems = [f"{rng.randint(1, 999)}+{rng.randint(1, 9999)}=" for _ in range(count)]
    if kind == "short":
        return problems
    return [PREAMBLE[: rng.randint(90, len(PREAMBLE))] + p for p in problems]


def build_model(name: str, vocab_size: int, pad_id: int, bos_id: int, seed: int):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        num_key_value_heads=MODELS[name]["num_attention_heads"],
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=None,
        **MODELS[name],
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # EOS off for both systems
    model.generation_config.pad_token_id = pad_id
    return model


def matmul_params(model) -> int:
    """Parameters used in matmuls: all but the input embedding, plus a tied output head."""
    embed = model.get_input_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    return (
        total
        - embed.numel()
        + model.get_output_embeddings().weight.numel()
        * (model.get_output_embeddings().weight is embed)
    )


def gemm_rate(hidden: int, intermediate: int, rows: int, reps: int = 20) -> float:
    """Best of the median fp32 GEMM rates (FLOP/s) of a square and a model-shaped GEMM."""
    return max(matmul_rates([(1024, 1024, 1024), (rows, hidden, intermediate)], reps).values())


def run_setting(args: Args, model_name: str, prompt_kind: str, tokenizer) -> dict:
    model = build_model(
        model_name, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, args.seed
    )
    prompts = make_prompts(prompt_kind, args.num_prompts, args.seed)
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    rows, new = args.num_prompts * args.group_size, args.max_new_tokens
    prompt_width = batch["input_ids"].shape[1]

    def generate() -> None:
        with torch.inference_mode():
            out = model.generate(
                **batch,
                do_sample=True,
                num_return_sequences=args.group_size,
                max_new_tokens=new,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=tokenizer.pad_token_id,
            )
        assert out.shape == (rows, prompt_width + new), out.shape

    def grouprl() -> None:
        rollout = sample_groups(
            model,
            tokenizer,
            prompts,
            group_size=args.group_size,
            max_new_tokens=new,
            seed=args.seed,
        )
        assert rollout.completion_ids.shape == (rows, new) and rollout.mask.all()

    systems = {"generate": generate, "sample_groups": grouprl}
    for fn in systems.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in systems}
    for i in range(args.repeats):
        order = list(systems) if i % 2 == 0 else list(reversed(systems))
        for name in order:
            t0 = time.perf_counter()
            systems[name]()
            times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(t) for name, t in times.items()}
    tokens = rows * new
    cfg = model.config
    rate = gemm_rate(cfg.hidden_size, cfg.intermediate_size, rows)
    prompt_tokens = int(batch["attention_mask"].sum())
    floor = 2 * matmul_params(model) * (tokens + prompt_tokens) / rate
    return {
        "model": model_name,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "prompts": prompt_kind,
        "prompt_tokens": f"{int(batch['attention_mask'].sum(-1).min())}-{prompt_width}",
        "gen_tps": tokens / median["generate"],
        "ours_tps": tokens / median["sample_groups"],
        "ratio": median["generate"] / median["sample_groups"],
        "gen_floor": median["generate"] / floor,
        "ours_floor": median["sample_groups"] / floor,
        "gen_s": median["generate"],
        "ours_s": median["sample_groups"],
    }


@contextlib.contextmanager
def _cat_cache():
    expand = _hf.expand_cache
    with mock.patch.object(
        _hf, "expand_cache", lambda cache, repeats, extra=None: expand(cache, repeats)
    ):
        yield


@contextlib.contextmanager
def _multinomial():
    def draw(probs, generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    with mock.patch.object(draws, "sample_categorical", draw):
        yield


def run_ablations(args: Args, model_name: str, prompt_kind: str, tokenizer) -> dict[str, float]:
    """Median seconds of sample_groups with each lever removed, over the full version's."""
    model = build_model(
        model_name, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, args.seed
    )
    prompts = make_prompts(prompt_kind, args.num_prompts, args.seed)
    g, new = args.group_size, args.max_new_tokens
    repeated = [p for p in prompts for _ in range(g)]

    def run(prompt_list, group_size):
        return lambda: sample_groups(
            model, tokenizer, prompt_list, group_size=group_size, max_new_tokens=new, seed=0
        )

    variants = {
        "all levers": (run(prompts, g), contextlib.nullcontext),
        "no prompt sharing": (run(repeated, 1), contextlib.nullcontext),
        "torch.cat cache": (run(prompts, g), _cat_cache),
        "torch.multinomial": (run(prompts, g), _multinomial),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(args.repeats + 1):  # the first round is a warm-up
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for name in order:
            fn, context = variants[name]
            with context():
                t0 = time.perf_counter()
                fn()
                if i:
                    times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["all levers"])
    return {name: statistics.median(t) / base for name, t in times.items()}


def main(args: Args) -> None:
    if args.quick:
        args.models, args.prompts, args.repeats = ("1m",), ("short",), 2
    torch.set_num_threads(args.threads)
    tokenizer = build_char_tokenizer()
    tokenizer.eos_token = None  # EOS off: every row generates exactly max_new_tokens
    print(
        f"B={args.num_prompts} G={args.group_size} new={args.max_new_tokens} fp32 CPU, "
        f"{args.threads} thread(s), median of {args.repeats} alternating runs"
    )
    if args.ablations:
        print("| model | prompts | time with the lever removed / time with all levers |")
        print("|---|---|---|")
        for model_name in args.models:
            for prompt_kind in args.prompts:
                rel = run_ablations(args, model_name, prompt_kind, tokenizer)
                cells = ", ".join(f"{k} {v:.2f}×" for k, v in rel.items() if k != "all levers")
                print(f"| {model_name} | {prompt_kind} | {cells} |", flush=True)
        return
    header = (
        "| model | params | prompts (tokens) | generate tok/s | sample_groups tok/s | ratio "
        "| generate / floor | sample_groups / floor |"
    )
    print(header)
    print("|" + "---|" * 8)
    for model_name in args.models:
        for prompt_kind in args.prompts:
            r = run_setting(args, model_name, prompt_kind, tokenizer)
            print(
                f"| {r['model']} | {r['params_m']:.2f}M | {r['prompts']} ({r['prompt_tokens']}) "
                f"| {r['gen_tps']:,.0f} | {r['ours_tps']:,.0f} | {r['ratio']:.2f}× "
                f"| {r['gen_floor']:.1f}× | {r['ours_floor']:.1f}× |",
                flush=True,
            )


if __name__ == "__main__":
    main(tyro.cli(Args))
