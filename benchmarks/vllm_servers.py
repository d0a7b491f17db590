"""vLLM in the training process (`--engine vllm`) against a vLLM server (`--vllm-server`), same
model, same settings, same process: per step, the seconds to bring the engine to the new weights
(the in-process engine's layer-wise reload; the server's file write, pause, reload, prefix-cache
reset, version and resume) and the seconds to sample the step's groups.

The model is the random 20.5M Llama (hidden 512, 8 heads of 64, a 4096-token BPE vocabulary, its
EOS one the model cannot emit so every completion runs to the budget). Each step perturbs the
policy (an update's stand-in), announces the new version and samples B prompts × G completions
at temperature 1; the engines alternate step by step (in-process, server, server, in-process,
...), and each reports its median. The server is started as `--vllm-server local` starts one
(`grouprl.rollout.vllm_server.server_command`), float32, eager, no chunked prefill; the
in-process engine has the options `--engine vllm` gives on a CPU.

Usage (from the repository root; `make test-vllm` builds .venv-vllm):

    .venv-vllm/bin/python benchmarks/vllm_servers.py              # ~2 min on 2 cores
    .venv-vllm/bin/python benchmarks/vllm_servers.py --steps 8 --new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from harness import LLAMA_20M, fmt, md_table, random_llama_dir, versions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="measured steps per engine")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--server-threads", type=int, default=None, help="default: --threads")
    parser.add_argument("--out", type=Path, default=Path("build/benchmarks/vllm_servers"))
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grouprl.rollout.vllm_engine import VLLMEngine, VLLMOptions
    from grouprl.rollout.vllm_server import LocalServer, VLLMServerEngine

    torch.set_num_threads(args.threads)
    model_dir = random_llama_dir(args.out / "model-20m", LLAMA_20M, eos=False, bpe_vocab=4096)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    length = 64 + args.new_tokens
    kv = 2 * args.prompts * args.group_size * length * 8 * 512 * 4  # 2 (K, V) × rows × ... fp32
    options = VLLMOptions(dtype="float32", max_model_len=length, kv_cache_bytes=kv,
                          block_size=32, chunked_prefill=False)  # fmt: skip
    start = time.perf_counter()
    local = LocalServer(model_dir, dtype="float32", max_model_len=length, kv_cache_bytes=kv,
                        env={"OMP_NUM_THREADS": str(args.server_threads or args.threads)})  # fmt: skip
    server_start = time.perf_counter() - start

    def weights():
        return dict(policy.state_dict())

    engines = {
        "in-process": VLLMEngine(policy, tokenizer, options, weights=weights),
        "server": VLLMServerEngine(policy, tokenizer, [local.url], weights=weights),
    }
    prompts = [
        tokenizer(f"def function_{i}(x):\n    return")["input_ids"] for i in range(args.prompts)
    ]
    timings = {name: {"sync": [], "write": [], "sample": []} for name in engines}
    order = ["in-process", "server", "server", "in-process"]
    generator = torch.Generator().manual_seed(0)
    version = 0
    try:
        for step in range(args.steps * 2 + 2):  # 2 warm-up steps, one per engine
            name = order[step % 4]
            engine = engines[name]
            with torch.no_grad():  # an update's stand-in: the weights move
                for p in policy.parameters():
                    p.add_(1e-3 * torch.randn(p.shape, generator=generator))
            version += 1
            engine.policy_updated(version)
            before = (engine.sync_seconds, engine.write_seconds) if name == "server" else None
            begin = time.perf_counter()
            if name == "in-process":
                engine._wake()  # the layer-wise reload, timed alone
                synced, written = time.perf_counter() - begin, 0.0
            else:
                engine.before_sampling()
                synced = engine.sync_seconds - before[0]
                written = engine.write_seconds - before[1]
            begin = time.perf_counter()
            rollout = engine.sample(prompts, group_size=args.group_size,
                                    max_new_tokens=args.new_tokens, seed=step)  # fmt: skip
            sampled = time.perf_counter() - begin
            assert int(rollout.lengths.min()) == args.new_tokens  # full length: equal work
            if step >= 2:
                timings[name]["sync"].append(synced)
                timings[name]["write"].append(written)
                timings[name]["sample"].append(sampled)
            print(
                f"step {step}: {name:10s} sync {synced:.3f} s  sample {sampled:.3f} s", flush=True
            )
    finally:
        for engine in engines.values():
            engine.close()
        local.stop()

    tokens = args.prompts * args.group_size * args.new_tokens
    rows, result = [], {"server_start_seconds": server_start, "versions": versions(),
                        "settings": vars(args) | {"out": str(args.out)}}  # fmt: skip
    for name, t in timings.items():
        sync, sample = statistics.median(t["sync"]), statistics.median(t["sample"])
        result[name] = t
        rows.append([name, fmt(sync), fmt(statistics.median(t["write"])), fmt(sample),
                     fmt(sync + sample), f"{tokens / sample:.0f}"])  # fmt: skip
    table = md_table(["engine", "weight sync s", "of which file write s", "sampling s",
                      "sync + sampling s", "completion tokens/s"], rows)  # fmt: skip
    print(f"\nserver start: {server_start:.1f} s\n{table}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
