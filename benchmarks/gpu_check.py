"""The GPU check: on one CUDA GPU, in about 5 minutes, a table of grouprl's training paths with
the HF engine (bf16 full fine-tuning, padded and packed; LoRA, torchrun with NCCL on 1 rank,
FSDP2 on 1 rank): steps
run, step seconds, tokens per second, the peak GPU memory, and the bf16 sampler's log-prob
mismatch against the trainer's recompute.

A GPU machine may lack what grouprl installs (a lent one has its own Python, torch, transformers
and peft, no registry and no tyro), so the check runs grouprl from source and carries the
pure-Python wheels it lacks:

    make gpu-check-wheels                                   # here: the wheels into .whl/
    # there, in a copy of this tree with .whl/:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=src:/tmp/site python3 benchmarks/gpu_check.py --out gpu-check

It first says which module or API it needs is missing, if any. `--dry-run` runs every case on
the CPU instead (a tiny model, 2 steps, fp32, gloo): `make test` runs it (`make gpu-check`), so
everything but CUDA itself is exercised on every commit. The model is a random Llama built here
(no download), with an EOS it cannot emit, so every completion runs to its full length.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What the check imports beyond Python: (module, what to do when it is missing).
NEEDS = [
    ("torch", "install PyTorch with CUDA"),
    ("transformers", "pip install 'transformers>=5'"),
    ("peft", "pip install peft (the LoRA case)"),
    ("tokenizers", "pip install tokenizers"),
    ("safetensors", "pip install safetensors"),
    ("yaml", "pip install pyyaml"),
    ("rich", "pip install rich"),
    ("tyro", "carry its wheels: make gpu-check-wheels"),
    ("docstring_parser", "carry its wheels: make gpu-check-wheels"),
    ("typeguard", "carry its wheels: make gpu-check-wheels"),
]
#: The pure-Python packages `make gpu-check-wheels` downloads wheels of for the GPU machine's
#: Python, at the versions installed here (`wheels()`): what the suite tests is what it gets.
WHEELS = ["tyro", "docstring-parser", "typeguard"]


def wheels() -> list[str]:
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in WHEELS]


#: torch APIs the cases use, by case.
APIS = {"fsdp2": ("torch.distributed.fsdp", "fully_shard")}
#: (name, launched by torchrun, extra flags)
CASES = [
    ("hf-bf16", False, ["--precision", "bf16"]),
    # the same run packed: rows as lines of position-restarting sequences, micro-batches of at
    # most 4,096 tokens (prompts at most 128), against hf-bf16's one padded pass a minibatch
    (
        "hf-bf16-packed",
        False,
        [
            "--precision",
            "bf16",
            "--packing",
            "on",
            "--max-prompt-length",
            "128",
            "--max-tokens-per-micro-batch",
            "4096",
        ],
    ),
    ("lora-bf16", False, ["--precision", "bf16", "--lora-r", "16", "--lr", "1e-4"]),
    ("torchrun-nccl-1", True, ["--precision", "bf16", "--strategy", "ddp"]),
    ("fsdp2-1", True, ["--precision", "bf16", "--strategy", "fsdp"]),
]
#: The random Llama: (size, BPE vocabulary) for a GPU, and for the dry run.
SIZES = {
    "gpu": ({"hidden_size": 1024, "num_layers": 16, "num_heads": 16, "intermediate_size": 4096},
            8192),
    "dry": ({"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128}, 512),
}  # fmt: skip


def missing() -> list[str]:
    """What this machine lacks, one line each (empty: nothing)."""
    lines = []
    for module, fix in NEEDS:
        try:
            importlib.import_module(module)
        except ImportError as err:
            lines.append(f"missing module {module} ({err}); {fix}")
    for case, (module, name) in APIS.items():
        try:
            if not hasattr(importlib.import_module(module), name):
                lines.append(f"torch lacks {module}.{name}: the {case} case will fail")
        except ImportError:
            lines.append(f"torch lacks {module}: the {case} case will fail")
    return lines


def build_model(directory: Path, size: str) -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from harness import random_llama_dir

    shape, vocab = SIZES[size]
    return random_llama_dir(directory, shape, eos=False, bpe_vocab=vocab)


def train_flags(model: Path, dry: bool) -> list[str]:
    steps, prompts, group, new = (2, 4, 4, 16) if dry else (8, 16, 8, 256)
    return ["train", "--model", str(model), "--steps", str(steps), "--prompts-per-step",
            str(prompts), "--group-size", str(group), "--max-new-tokens", str(new),
            "--minibatches", "1", "--eval-every", "0", "--eval-size", str(prompts),
            "--eval-samples", "1", "--save-every", "1000", "--no-progress"]  # fmt: skip


def run_case(args: argparse.Namespace) -> None:
    """One case, in this process (a torchrun rank, or the child of `main`): grouprl's CLI, then
    rank 0 writes the peak memory beside the run's metrics."""
    import torch

    from grouprl.cli import main as cli

    code = cli(args.flags)
    if os.environ.get("RANK", "0") == "0":
        cuda = torch.cuda.is_available()
        peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss * 1024  # fmt: skip
        (Path(args.case_out) / "peak.json").write_text(json.dumps({"bytes": peak, "cuda": cuda}))
    sys.exit(code)


def launch(name: str, torchrun: bool, flags: list[str], out: Path, dry: bool) -> dict:
    """Run one case in a child (1-rank torchrun for the torchrun cases) and read its numbers."""
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    python = [sys.executable]
    if torchrun:
        python += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    command = [*python, str(Path(__file__).resolve()), "--case-out", str(run_dir), "--flags",
               *flags, "--output-dir", str(run_dir / "run")]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}  # fmt: skip
    if dry:
        env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    seconds = time.perf_counter() - start
    row = {"case": name, "ok": done.returncode == 0, "wall_s": seconds}
    metrics_file = run_dir / "run" / "metrics.jsonl"
    if not row["ok"] or not metrics_file.is_file():
        lines = (run_dir / "log.txt").read_text(errors="replace").strip().splitlines()
        errors = [x for x in lines if "rror" in x and "error_file" not in x]  # the cause first
        row.update(ok=False, error=" | ".join((errors or lines)[-2:]))
        return row
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    timed = records[1:] or records  # the first step compiles and warms up
    row.update(
        steps=len(records),
        step_s=statistics.median(r["step_seconds"] for r in timed),
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
        mismatch_max=max((r.get("logp_mismatch_max", 0.0) for r in records), default=0.0),
        mismatch_mean=statistics.mean(r.get("logp_mismatch_mean", 0.0) for r in records),
        reward_first=records[0].get("reward_mean"),
        loss_finite=all(r["loss"] == r["loss"] for r in records),
    )
    peak = json.loads((run_dir / "peak.json").read_text())
    row.update(peak_gib=peak["bytes"] / 2**30, peak_kind="cuda" if peak["cuda"] else "host RSS")
    return row


def table(rows: list[dict]) -> str:
    header = ("case", "steps", "step s", "tokens/s", "peak GiB", "mismatch max", "mismatch mean")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['case']} | failed: {r['error'][:200]} |" + " |" * 5)
            continue
        lines.append(f"| {r['case']} | {r['steps']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} "
                     f"| {r['peak_gib']:.2f} ({r['peak_kind']}) | {r['mismatch_max']:.2e} "
                     f"| {r['mismatch_mean']:.2e} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"))
    parser.add_argument("--dry-run", action="store_true", help="on the CPU: tiny, fp32, gloo")
    parser.add_argument("--cases", nargs="*", default=[c[0] for c in CASES])
    parser.add_argument("--case-out", help=argparse.SUPPRESS)
    parser.add_argument("--flags", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case_out:
        run_case(args)
        return 0
    problems = missing()
    for line in problems:
        print(line)
    if any(line.startswith("missing module") for line in problems):
        return 2
    import torch

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or --dry-run to check everything else")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model = build_model(args.out / f"model-{'dry' if dry else 'gpu'}", "dry" if dry else "gpu")
    device = "cpu" if dry else "cuda"
    print(f"grouprl GPU check ({'dry run, CPU' if dry else torch.cuda.get_device_name()}): "
          f"torch {torch.__version__}, {device}")  # fmt: skip
    rows = []
    for name, torchrun, extra in CASES:
        if name not in args.cases:
            continue
        if dry:  # fp32 on the CPU: the same paths without bf16 kernels
            extra = [f for f in extra if f not in ("--precision", "bf16")]
        flags = [*train_flags(model, dry), *extra,
                 "--device", device, "--threads", "1" if dry else "8"]  # fmt: skip
        row = launch(name, torchrun, flags, args.out, dry)
        rows.append(row)
        print(f"{name}: {'ok' if row['ok'] else 'FAILED: ' + row['error']} ({row['wall_s']:.0f} s)")
    text = table(rows)
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
