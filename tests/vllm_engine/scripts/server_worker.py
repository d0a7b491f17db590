"""Run by `tests/vllm_engine/test_server.py` under `torchrun --nproc-per-node 2` (gloo, CPU), with
the model directory, the servers' URLs and an output file on its command line.

Each rank samples its share of a batch through the vLLM servers (rank 0 syncs the weights, rank
1 waits until the servers report them), the shares are gathered into the global batch, and 3
updates on 2 ranks are compared with 3 updates of one process on that batch (the update code of
`tests/train/parallel/dist_worker.py`). Then version 3 is synced and both ranks sample it. Rank 0
writes what it measured to the output file.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(TESTS))  # numerics
sys.path.insert(0, str(TESTS / "train" / "parallel"))  # dist_worker's update checks
from dist_worker import scale, train_three_steps, worst  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from grouprl.config import TrainConfig, resolve  # noqa: E402
from grouprl.train.batch import Batch  # noqa: E402
from grouprl.train.build import server_engine  # noqa: E402
from grouprl.train.parallel import distributed  # noqa: E402
from grouprl.train.parallel.distributed import SINGLE  # noqa: E402
from numerics import to_float64  # noqa: E402

TEXTS = ["12+30=", "What is 7 plus 5?", "answer", "1,200 dollars"]
G = 4


def main() -> None:
    model_dir, urls, out_file = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    dist = distributed.init("ddp", torch.device("cpu"))
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = resolve(TrainConfig(model=model_dir, vllm_server=urls, prompts_per_step=len(TEXTS),
                              group_size=G, minibatches=1, lr=1e-3, max_grad_norm=0.0,
                              max_new_tokens=16),
                  world_size=2, task_max_new_tokens=16)  # fmt: skip
    engine = server_engine(cfg, policy, tokenizer, dtype=None, rows=len(TEXTS) * G,
                           max_len=None, seed=0, dist=dist)  # fmt: skip
    mine = list(dist.mine(len(TEXTS)))
    ids = [tokenizer(TEXTS[i])["input_ids"] for i in mine]
    rollout = engine.sample(ids, group_size=G, max_new_tokens=16, seed=3 + dist.rank)
    lengths = rollout.lengths.float()
    rewards = (lengths / 16).reshape(-1)  # spreads within groups
    # the updates compared in float64: "the same computation" split over ranks (numerics.py)
    rollout = dataclasses.replace(rollout, old_logp=rollout.old_logp.double(),
                                  behaviour_logp=rollout.behaviour_logp.double())  # fmt: skip
    share = Batch(rollout, [{"prompt": TEXTS[i]} for i in mine], rewards,
                  {"correct": rewards, "second": rewards})  # fmt: skip
    whole = Batch.concat(dist.gather(share))
    trainer = to_float64(copy.deepcopy(policy))
    two = train_three_steps(cfg, dist, trainer, share)
    one = train_three_steps(cfg, SINGLE, trainer, whole)
    # version 3: rank 0 syncs the servers, rank 1 waits for it; both sample it
    engine.policy_updated(3)
    again = engine.sample(ids, group_size=2, max_new_tokens=4, seed=5)
    versions = engine.synced, [s.get("/weight_info")["weight_version"] for s in engine.servers]
    if dist.is_main:
        out_file.write_text(json.dumps({
            "grad_diff": worst(two[0], one[0]), "grad_scale": scale(one[0]),
            "weight_diff": worst(two[1], one[1]), "weight_scale": scale(one[1]),
            "moved": worst(one[1], dict(trainer.named_parameters())),
            "rows": int(whole.rollout.completion_ids.shape[0]), "tokens": int(lengths.sum()),
            "again_rows": int(again.completion_ids.shape[0]), "synced": versions[0],
            "servers": versions[1], "syncs": engine.syncs,
        }))  # fmt: skip
    engine.close()
    distributed.shutdown()


if __name__ == "__main__":
    main()
