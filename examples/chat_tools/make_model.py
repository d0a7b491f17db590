"""Builds the chat-format tool example: a tiny Qwen2 chat model that calls `add` in the
Qwen2.5/Hermes convention, and its data.

    python examples/chat_tools/make_model.py            # writes runs/chat_tools/{model,*.jsonl}

The task: sum a list of numbers from 1 to 20 (`17 + 4 + 20`), which a model of this size does
badly in its head, with the tool `add(a, b)`: one call per `+`, each on the last result, then the
sum as the reply; a list of n numbers takes n assistant turns. The model is fitted to such
conversations, rendered by the Qwen2.5 tool template (`grouprl.models.tiny.QWEN25_TOOLS`, the
schema from `get_json_schema(add)`), with two kinds of mistakes kept in, so that reinforcement learning has something to fix (as
`builtin:lookup` was made): 40% of them (`--guess`) answer at once with a nearby wrong number,
and 10% of the calls (`--slip`) copy a wrong argument (the chain goes on from its result).

The tokenizer is a byte-level BPE trained on the rendered conversations, with every number up
to 999 and the four tool tags as whole tokens (as Qwen2.5 has its tags), so a call copies a
number as one token. Loss falls on the assistant turns only: the model never learns to write a
tool's result. Each turn is encoded as the trainer encodes it at run time (the prompt through the
template, a reply as its own text and `<|im_end|>`, a tool result as the template's text between
`<|im_end|>` and the next assistant header), so the fitted model sees at RL time the token
boundaries it was fitted on.

Deterministic from --seed on a given machine and thread count.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tools import add  # noqa: E402

SYSTEM = "Sum the numbers with the add tool, one call at a time. Reply with the sum only."
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


NUMBERS = (1, 20)  # the range of the numbers a problem sums


def problem(
    rng: random.Random, sizes: tuple[int, ...], numbers: tuple[int, int] = NUMBERS
) -> list[int]:
    return [rng.randint(*numbers) for _ in range(rng.choice(sizes))]


def row(numbers: list[int]) -> dict:
    """A dataset row in TRL's conversational shape, with its answer."""
    question = " + ".join(str(n) for n in numbers)
    prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"prompt": prompt, "answer": str(sum(numbers))}


def call(a: int, b: int) -> dict:
    return {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}


def conversation(numbers: list[int], rng: random.Random, guess: float, slip: float) -> list[dict]:
    """The model's side of a solution: assistant turns and tool results, after the prompt."""
    if rng.random() < guess:
        wrong = sum(numbers) + rng.choice([-1, 1]) * rng.randint(1, 30)
        return [{"role": "assistant", "content": str(wrong)}]
    turns, total = [], numbers[0]
    for n in numbers[1:]:
        a, b = total, n
        if rng.random() < slip:  # copy a wrong argument; the chain goes on from its result
            b = rng.choice([m for m in numbers if m != n] or [n + 1])
        turns.append({"role": "assistant", "content": "", "tool_calls": [call(a, b)]})
        total = add(a, b)
        turns.append({"role": "tool", "name": "add", "content": str(total)})
    turns.append({"role": "assistant", "content": str(total)})
    return turns


def segments(tokenizer, prompt: list[dict], turns: list[dict]) -> list[tuple[str, bool]]:
    """(text, trained) pieces whose concatenation is the template's rendering of the whole
    conversation, cut where the trainer cuts it: prompt, each reply up to its `<|im_end|>`, each
    tool result from after that `<|im_end|>` to the next assistant header."""

    def render(messages: list[dict], generation: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, tools=[add], tokenize=False, add_generation_prompt=generation
        )

    pieces, messages = [], list(prompt)
    done = render(messages, True)
    pieces.append((done, False))
    for turn in turns:
        messages.append(turn)
        if turn["role"] == "assistant":
            reply = render(messages, False)[len(done) :]
            reply = reply[: reply.index("<|im_end|>") + len("<|im_end|>")]
            pieces.append((reply, True))
            done += reply
        else:  # a tool result, up to the next assistant header
            text = render(messages, True)
            pieces.append((text[len(done) :], False))
            done = text
    return pieces


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from grouprl.models.tiny import QWEN25_TOOLS

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Numbers and tags become whole tokens below; the merges are learnt on the text between them.
    split = re.compile(r"\d+|" + "|".join(re.escape(t) for t in TAGS) + r"|<\|im_(?:start|end)\|>")
    backend.train_from_iterator((piece for t in texts for piece in split.split(t)), trainer)
    backend.add_tokens([AddedToken(t, normalized=False) for t in TAGS])
    backend.add_tokens([AddedToken(str(n), normalized=False) for n in range(1000)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = QWEN25_TOOLS
    return tokenizer


def encode(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    ids, trained = [], []
    for text, train in pieces:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        trained += [int(train)] * len(piece)
    return ids, trained


def fit(
    model, prefix: torch.Tensor, batches: list[tuple[torch.Tensor, torch.Tensor]], args
) -> None:
    """AdamW with linear warm-up and cosine decay to lr/10. Every conversation starts with the
    same prompt tokens (`prefix`: the system turn and the tools), so each step runs them once
    and the batch's rest attends to their cache (gradients flow through it): the same loss as
    running every conversation whole, for a third of the tokens."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=args.lr
    )
    from transformers import DynamicCache

    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    start = time.perf_counter()
    for step in range(args.steps):
        warm = min(1.0, (step + 1) / args.warmup_steps)
        cosine = 0.1 + 0.45 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * warm * cosine
        ids, labels = batches[step % len(batches)]
        cache = DynamicCache(config=model.config)
        model(input_ids=prefix[None], use_cache=True, **{key: cache})
        cache.batch_repeat_interleave(len(ids))
        # right padding: no loss, and never attended to by the tokens before it
        loss = model(input_ids=ids, labels=labels, use_cache=True, **{key: cache}).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % args.log_every == 0 or step == 0:
            seconds = time.perf_counter() - start
            print(
                f"step {step + 1:>5}/{args.steps}  loss {loss.item():.4f}  {seconds:6.0f} s",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("runs/chat_tools"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--guess", type=float, default=0.4, help="share of answers without calls")
    parser.add_argument(
        "--slip", type=float, default=0.1, help="share of calls with a wrong argument"
    )
    parser.add_argument("--sizes", default="2,3,4", help="how many numbers a problem sums")
    parser.add_argument(
        "--numbers", default="{},{}".format(*NUMBERS), help="the range of the numbers summed"
    )
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    low, high = (int(s) for s in args.numbers.split(","))
    sizes = tuple(int(s) for s in args.sizes.split(","))
    rng = random.Random(args.seed)
    # Held-out problems first, so the fitted ones never include them.
    held = {tuple(problem(rng, sizes, (low, high))) for _ in range(200)}
    fitted = []
    while len(fitted) < max(args.steps * args.batch_size // 4, args.batch_size):  # each ~4 times
        numbers = problem(rng, sizes, (low, high))
        if tuple(numbers) not in held:
            fitted.append(numbers)
    rows_out = {
        "train.jsonl": [row(problem(rng, sizes, (low, high))) for _ in range(4000)],
        "eval.jsonl": [row(list(n)) for n in sorted(held)],
    }

    plain = build_tokenizer(["x"], 300)  # renders only; the real tokenizer is trained on these
    sample = [
        "".join(
            t
            for t, _ in segments(
                plain, row(n)["prompt"], conversation(n, rng, args.guess, args.slip)
            )
        )
        for n in fitted[:500]
    ]
    tokenizer = build_tokenizer(sample, vocab_size=600)
    examples = []
    for numbers in fitted:
        turns = conversation(numbers, rng, args.guess, args.slip)
        examples.append(encode(tokenizer, segments(tokenizer, row(numbers)["prompt"], turns)))
    lengths = sorted(len(ids) for ids, _ in examples)
    print(
        f"{len(tokenizer)} tokens in the vocabulary; conversations of {lengths[0]}-{lengths[-1]} tokens "
        f"(median {lengths[len(lengths) // 2]})"
    )

    shared = min(len(ids) for ids, _ in examples) - 1
    for ids, _ in examples:
        shared = next((i for i in range(shared) if ids[i] != examples[0][0][i]), shared)
    prefix = torch.tensor(examples[0][0][:shared])
    batches = []
    order = list(range(len(examples)))
    rng.shuffle(order)
    for start in range(0, len(order) - args.batch_size + 1, args.batch_size):
        chunk = [
            (ids[shared:], trained[shared:])
            for ids, trained in (examples[i] for i in order[start : start + args.batch_size])
        ]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id)
        labels = torch.full((len(chunk), width), -100)
        for i, (seq, trained) in enumerate(chunk):
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, : len(seq)] = torch.where(torch.tensor(trained) == 1, torch.tensor(seq), -100)
        batches.append((ids, labels))

    torch.manual_seed(args.seed)
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=3 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=ends[0],
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    print(
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
        f"{args.steps} steps of {args.batch_size} conversations"
    )
    model.train()
    fit(model, prefix, batches, args)
    model.eval()
    model.generation_config.eos_token_id = ends
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    out = args.output_dir
    (out / "model").mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    for name, rows in rows_out.items():
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out / 'model'}, {out / 'train.jsonl'} and {out / 'eval.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
