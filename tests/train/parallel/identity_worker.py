"""Run by `tests/train/parallel/test_distributed.py` under `torchrun --nproc-per-node 2`: each
rank computes what identifies a run's live objects (grouprl.api), and rank 0 writes every
rank's to the JSON file given, for the test to compare."""

from __future__ import annotations

import functools
import json
import sys

import datasets
import torch.distributed as dist

from grouprl.api import callable_identity, dataset_identity, model_identity
from grouprl.models import load_model


def reward(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]


class Scorer:
    def __call__(self, completions, **kwargs):
        return [0.0 for _ in completions]


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    mine = {
        "function": callable_identity(reward),
        "lambda": callable_identity(lambda completions, **kw: [1.0] * len(completions)),
        "partial": callable_identity(functools.partial(reward, answer=[object()])),
        "instance": callable_identity(Scorer()),
        "dataset": dataset_identity(datasets.Dataset.from_list(rows)),
        "rows": dataset_identity(rows),
        "model": model_identity(load_model("builtin:arith")),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
