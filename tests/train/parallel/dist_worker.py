"""Run by `tests/train/parallel/test_distributed.py` under `torchrun --nproc-per-node 2` (gloo, CPU).

Every check compares what 2 processes compute with what 1 process computes on the same global
batch; the 1-process reference runs on every rank with the single-process `Dist` (no
collectives). Rank 0 writes the measured differences to the JSON file named on the command line;
the test asserts on them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the numerics helpers
from grouprl.config import TrainConfig, resolve
from grouprl.models import load_model, load_tokenizer
from grouprl.models.lora import apply_lora
from grouprl.rollout import HFRolloutEngine, sample_groups
from grouprl.rollout._hf import plain_head
from grouprl.tasks import get_task
from grouprl.tasks.data import PromptStream
from grouprl.train import checkpoint as ckpt
from grouprl.train import collect
from grouprl.train.batch import Batch
from grouprl.train.build import build_rewards
from grouprl.train.metrics import sampling_metrics
from grouprl.train.parallel import distributed, fsdp
from grouprl.train.parallel.distributed import SINGLE, Dist
from grouprl.train.step import batch_advantages
from grouprl.train.update import update
from numerics import F64_SAME, to_float64

B, G = 8, 4
# Groups 0 and 1 all right, group 3 all wrong: rank 0 (groups 0-3) skips 3 groups, rank 1 none.
REWARDS = [[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 1], [0, 0, 0, 0],
           [0, 1, 0, 0], [1, 1, 0, 1], [0, 0, 1, 0], [1, 0, 1, 1]]  # fmt: skip
# A second reward for GDPO, constant where REWARDS is (the same groups stay silent)
SECOND = [[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0], [0.5, 0.5, 0.5, 0.5],
          [1, 0, 0, 1], [0, 0, 1, 1], [1, 1, 0, 0], [0, 1, 0, 1]]  # fmt: skip
WEIGHTS = {"correct": 1.0, "second": 0.5}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def config(algo: str, **extra) -> TrainConfig:
    settings = {"prompts_per_step": B, "group_size": G, "lr": 1e-3, "max_grad_norm": 0.0}
    return resolve(
        TrainConfig(algo=algo, max_new_tokens=20, **settings, **extra), task_max_new_tokens=20
    )


def train_three_steps(cfg, dist: Dist, policy, batch, lora: bool = False):
    """Gradients after step 1 (the last minibatch's, summed over ranks) and parameters after 3
    updates on `batch` (this rank's share)."""
    model = copy.deepcopy(policy)
    if lora:
        torch.manual_seed(1)  # the same adapter initialisation on every rank and reference
        model = apply_lora(model, r=4, alpha=8)
    plain_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    if dist.fsdp:
        fsdp.shard(model, device=torch.device("cpu"))
        params = [p for p in model.parameters() if p.requires_grad]
        # as in training: sampling leaves the root module unsharded before the update
        tokenizer = load_tokenizer("builtin:arith")
        sample_groups(model, tokenizer, ["1+1="], group_size=2, max_new_tokens=4, seed=0,
                      lockstep=dist.all_done)  # fmt: skip
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.adam_betas, eps=1e-4)
    advantages = batch_advantages(cfg, batch, dist, WEIGHTS)
    if dist.fsdp:  # as in training: the step-0 checkpoint gathers states before any update
        fsdp.gather_full_state(model, optimizer)
    grads, diagnostics = {}, None
    for step in range(3):
        out = update(cfg, model, optimizer, batch, advantages, None, dist=dist)
        if step == 0:
            diagnostics = out
            grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    weights = {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}
    return grads, weights, diagnostics


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def scale(a: dict) -> float:
    return max(float(v.abs().max()) for v in a.values())


def fixed_batch(policy, tokenizer) -> Batch:
    """The global batch every check trains on: B arithmetic prompts, sampled with one seed."""
    rows = get_task("arithmetic").train[:B]
    rollout = sample_groups(
        policy, tokenizer, [r["prompt"] for r in rows], group_size=G, max_new_tokens=20, seed=3
    )
    rewards = torch.tensor(REWARDS, dtype=torch.float32).reshape(-1)
    second = torch.tensor(SECOND, dtype=torch.float32).reshape(-1)
    return Batch(rollout, list(rows), rewards, {"correct": rewards, "second": second})


def behind(batch: Batch) -> Batch:
    """`batch` as a sampler other than the trainer would give it: behaviour log-probs off the
    sampled ones by up to 0.8 a token (some token ratios beyond 2, some below 1/2)."""
    rollout = batch.rollout
    n, t = rollout.old_logp.shape
    d = 0.8 * torch.sin(torch.arange(n * t, dtype=torch.float64).reshape(n, t) * 0.7)
    behaviour = torch.where(rollout.mask, rollout.old_logp - d.to(rollout.old_logp.dtype), 0.0)
    return dataclasses.replace(
        batch, rollout=dataclasses.replace(rollout, behaviour_logp=behaviour)
    )


def parity(dist: Dist, policy, tokenizer, out: dict) -> None:
    whole = fixed_batch(policy, tokenizer)
    cases = [(algo, strategy, False, None) for algo in ("grpo", "gspo", "dapo")
             for strategy in ("ddp", "fsdp")]  # fmt: skip
    # LoRA; and micro-batches, where ranks run different numbers of chunks (FSDP pads)
    cases += [("grpo", "ddp", True, None), ("gspo", "ddp", True, None), ("dapo", "fsdp", False, 3)]
    cases += [("gdpo", "ddp", False, None)]  # advantages from the gathered per-reward scores
    # a sampler behind the trainer: behaviour log-probs apart from the trainer's, corrected
    cases += [("grpo", "ddp", False, "token_tis"), ("gspo", "fsdp", False, "icepop")]
    # the batch-global estimators and entropy terms: whitening, a quantile, a bonus, over ranks
    cases += [("reinforce_pp", "ddp", False, {"top_entropy_quantile": 0.5}),
              ("gspo", "fsdp", False, {"entropy_coef": 0.05, "entropy_target": 5.0})]  # fmt: skip
    # packed lines: token-budget micro-batches under FSDP (ranks run different numbers: padded),
    # and LoRA packed under DDP
    cases += [("dapo", "fsdp", False, {"packing": "on", "max_tokens_per_micro_batch": 96}),
              ("gspo", "ddp", True, {"packing": "on"})]  # fmt: skip
    for algo, strategy, lora, micro in cases:
        extra = {"minibatches": 2} if algo == "gspo" else {}
        options = micro if isinstance(micro, dict) else {}
        micro = None if options else micro
        extra.update(options)
        batch, correction = whole, None
        if isinstance(micro, str):  # an off-policy case: micro names the correction
            micro, correction = None, micro
            extra.update(max_staleness=1, correction=correction)
            batch = behind(whole)
        cfg = config(algo, micro_batch_size=micro, **extra)
        ref_grads, ref_weights, ref_diag = train_three_steps(cfg, SINGLE, policy, batch, lora)
        here = Dist(dist.rank, dist.world_size, dist.local_rank, strategy, dist.device)
        mine = batch.select_groups(dist.my_groups(B, cfg.minibatches))
        grads, weights, diag = train_three_steps(cfg, here, policy, mine, lora)
        if lora:  # the adapters' B matrices start at 0
            moved = scale({n: w for n, w in ref_weights.items() if "lora_B" in n})
        else:
            moved = worst(ref_weights, {n: p for n, p in policy.named_parameters()})
        name = f"{algo}-{strategy}{'-lora' if lora else ''}{f'-micro{micro}' if micro else ''}"
        if correction:
            name += f"-{correction}"
        if options:
            name += "-" + "-".join(options)
        off = (
            "is_weight_mean",
            "is_weight_min",
            "is_weight_max",
            "is_truncated_frac",
            "is_masked_frac",
            "logp_mismatch_mean",
            "logp_mismatch_max",
            "logp_mismatch_kl",
        )
        out[name] = {
            "grad_rel": worst(grads, ref_grads) / scale(ref_grads),
            "weights_rel": worst(weights, ref_weights) / scale(ref_weights),
            "dtype": str(next(iter(weights.values())).dtype),
            "moved": moved,
            "trained_frac": [diag["trained_frac"], ref_diag["trained_frac"]],
            "diagnostics": {
                k: [diag[k], ref_diag[k]]
                for k in (
                    "loss",
                    "grad_norm",
                    "clip_frac_low",
                    "clip_frac_high",
                    "ratio_mean",
                    *(off if correction else ()),
                )
            },
        }


VAULT = str(Path(__file__).resolve().parents[3] / "examples" / "vault" / "env.py") + ":Vault"


def tool_batch(environment: bool) -> tuple[torch.nn.Module, Batch]:
    """builtin:lookup (float64) and a global batch of B lookup prompts sampled with its tool,
    or with the vault environment (each group reset from its seed); fixed rewards as above."""
    from grouprl.train.build import build_tools
    from grouprl.train.prompts import prompt_ids

    policy = to_float64(load_model("builtin:lookup")).eval()
    tokenizer = load_tokenizer("builtin:lookup")
    task = get_task("lookup")
    rows = task.train[:B]
    opts = TrainConfig(task="lookup", environment=VAULT if environment else None)
    uses = build_tools(opts, task, tokenizer)
    start = uses.rollout(rows, G, 0, 0, 0)
    ids = [prompt_ids(tokenizer, p, uses) for p in start.prompts]
    rollout = sample_groups(policy, tokenizer, ids, group_size=G, max_new_tokens=40, seed=3,
                            tools=start.handler)  # fmt: skip
    assert not bool(rollout.loss_mask.equal(rollout.mask))  # observations are in the batch
    rewards = torch.tensor(REWARDS, dtype=torch.float32).reshape(-1)
    return policy, Batch(rollout, list(rows), rewards, {"correct": rewards})


def fsdp_tool_sampling(dist: Dist, out: dict) -> None:
    """Sampling with the lookup tool on an FSDP-sharded model, the ranks holding different
    prompts, rank 0 answering calls and rank 1 ending trajectories at them (`max_turns` 0), so
    only rank 0 feeds observations and rank 1 finishes first: every rank runs the same forwards
    (`lockstep`) and samples what one unsharded process samples."""
    from grouprl.train.build import build_tools
    from grouprl.train.prompts import prompt_ids

    policy = to_float64(load_model("builtin:lookup")).eval()
    tokenizer = load_tokenizer("builtin:lookup")
    task = get_task("lookup")
    rows = task.train[8 * dist.rank : 8 * dist.rank + 2 + 4 * dist.rank]  # 2 and 6 prompts
    uses = build_tools(TrainConfig(task="lookup", max_turns=4 - 4 * dist.rank), task, tokenizer)

    def sample(model, lockstep):
        start = uses.rollout(rows, G, 0, 0, 0)
        ids = [prompt_ids(tokenizer, p, uses) for p in start.prompts]
        return sample_groups(model, tokenizer, ids, group_size=G, max_new_tokens=40,
                             seed=3 + dist.rank, tools=start.handler, lockstep=lockstep)  # fmt: skip

    alone = sample(policy, None)
    sharded = copy.deepcopy(policy)
    fsdp.shard(sharded, device=torch.device("cpu"))
    together = sample(sharded, dist.all_done)
    same = together.completion_ids.equal(alone.completion_ids)
    same = same and together.loss_mask.equal(alone.loss_mask)
    same = same and bool((together.old_logp - alone.old_logp).abs().max() <= F64_SAME)
    fed = torch.zeros(dist.world_size + 1)
    fed[dist.rank], fed[-1] = float((alone.mask & ~alone.loss_mask).sum()), 0.0 if same else 1.0
    totals = dist.all_reduce(fed).tolist()
    out["fsdp_tool_sampling"] = {"fed_tokens_by_rank": totals[:-1], "mismatched_ranks": totals[-1]}


def tool_parity(dist: Dist, out: dict) -> None:
    """The update on a batch with tool observations (loss_mask) and with environments equals
    the single process's, under DDP and FSDP; with an environment, every rank's groups start
    from the single-process state of their prompt (the seed is the row's, not the rank's)."""
    for environment in (False, True):
        policy, whole = tool_batch(environment)
        for strategy in ("ddp", "fsdp"):
            cfg = config("grpo")
            ref_grads, ref_weights, _ = train_three_steps(cfg, SINGLE, policy, whole)
            here = Dist(dist.rank, dist.world_size, dist.local_rank, strategy, dist.device)
            mine = whole.select_groups(dist.my_groups(B, cfg.minibatches))
            grads, weights, _ = train_three_steps(cfg, here, policy, mine)
            out[f"{'env' if environment else 'tools'}-{strategy}"] = {
                "grad_rel": worst(grads, ref_grads) / scale(ref_grads),
                "weights_rel": worst(weights, ref_weights) / scale(ref_weights),
                "moved": worst(ref_weights, {n: p for n, p in policy.named_parameters()}),
            }
    # collect_batch with the environment: each rank's groups and their secrets
    from grouprl.train.build import build_tools

    task = get_task("lookup")
    cfg = resolve(TrainConfig(task="lookup", environment=VAULT, prompts_per_step=B,
                              group_size=G), task_max_new_tokens=40)  # fmt: skip
    tokenizer = load_tokenizer("builtin:lookup")
    uses = build_tools(cfg, task, tokenizer)

    def sampler(d: Dist) -> collect.Sampler:
        return collect.Sampler(
            engine=HFRolloutEngine(policy, tokenizer, tools=uses.handler),
            tokenizer=tokenizer,
            stream=PromptStream(task.train, cfg.seed),
            rewards=build_rewards(cfg, task, torch.device("cpu"), uses),
            stop=None, budget=None, dtype=None, device=torch.device("cpu"), dist=d, tools=uses,
        )  # fmt: skip

    def secrets(d: Dist) -> dict[str, list[int]]:
        batch = collect.collect_batch(cfg, sampler(d), 1, 0).kept
        envs = batch.rollout.turns.environments
        return {row["prompt"]: [e.value for e in envs[g * G : (g + 1) * G]]
                for g, row in enumerate(batch.rows)}  # fmt: skip

    mine, single = secrets(dist), secrets(SINGLE)
    everyone = {k: v for part in dist.gather(mine) for k, v in part.items()}
    out["env_states_equal_single_process"] = everyone == single and len(everyone) == B
    out["env_groups_share_state"] = all(len(set(v)) == 1 for v in single.values())


def prompts_and_completions(dist: Dist, policy, tokenizer, out: dict) -> None:
    """Each step's prompts across ranks are the single-process prompts; ranks sampling the same
    prompt draw different completions."""
    task = get_task("arithmetic")
    cfg = config("grpo")

    def sampler(d: Dist, rows) -> collect.Sampler:
        return collect.Sampler(
            engine=HFRolloutEngine(policy, tokenizer),
            tokenizer=tokenizer,
            stream=PromptStream(rows, cfg.seed),
            rewards=build_rewards(cfg, task, torch.device("cpu")),
            stop=None,
            budget=None,
            dtype=None,
            device=torch.device("cpu"),
            dist=d,
        )

    spread, alone = sampler(dist, task.train), sampler(SINGLE, task.train)
    same, position, single_position = [], 0, 0
    for step in range(2):
        collected = collect.collect_batch(cfg, spread, step, position)
        batch, stats, position = collected.kept, sampling_metrics(collected), collected.position
        everyone = {p for part in dist.gather([r["prompt"] for r in batch.rows]) for p in part}
        single, _, _, single_position, _ = collect.draw_prompts(alone, single_position, B)
        mine = [single[i]["prompt"] for i in dist.my_groups(B, cfg.minibatches)]
        same.append(
            everyone == {r["prompt"] for r in single}
            and [r["prompt"] for r in batch.rows] == mine
            and stats["groups"] == B
            and position == single_position
        )
    out["prompts_equal_single_process"] = same
    one_prompt = sampler(dist, [task.train[0]] * 64)
    batch = collect.collect_batch(cfg, one_prompt, 0, 0).kept
    texts = dist.gather(batch.rollout.texts)
    out["same_prompt_on_both_ranks"] = len({r["prompt"] for r in batch.rows}) == 1
    out["completions_differ"] = texts[0] != texts[1]

    # Dynamic sampling: kept groups counted across ranks and handed round evenly.
    dapo = config("dapo")
    kept = []
    for step in range(2):
        collected = collect.collect_batch(dapo, sampler(dist, task.train), step, 0)
        batch, stats = collected.kept, sampling_metrics(collected)
        groups = dist.gather(
            [(batch.rows[g]["prompt"], tuple(batch.rollout.texts[g * G : (g + 1) * G]),
              tuple(batch.passed[g * G : (g + 1) * G].tolist())) for g in range(len(batch.rows))]
        )  # fmt: skip
        every = [g for part in groups for g in part]
        kept.append({
            "per_rank": [len(part) for part in groups],
            "groups": stats["groups"],
            "distinct": len(set(every)) == len(every),
            "all_mixed": all(any(p) and not all(p) for _, _, p in every),
            "rounds": stats["sample_rounds"],
        })  # fmt: skip
    out["dynamic_sampling"] = kept


def fsdp_checkpoint(dist: Dist, policy, run_dir: Path, out: dict) -> None:
    """A sharded model and its optimizer saved as a full checkpoint load back to the same state."""
    here = Dist(dist.rank, dist.world_size, dist.local_rank, "fsdp", dist.device)
    cfg = config("grpo")
    batch = fixed_batch(policy, load_tokenizer("builtin:arith"))
    batch = batch.select_groups(dist.my_groups(B, cfg.minibatches))

    def fresh():
        model = copy.deepcopy(policy)
        plain_head(model)
        fsdp.shard(model, device=torch.device("cpu"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        return model, optimizer, scheduler

    model, optimizer, scheduler = fresh()
    update(cfg, model, optimizer, batch, batch_advantages(cfg, batch, here), None, dist=here)
    weights, opt_state = fsdp.gather_full_state(model, optimizer)
    if here.is_main:
        ckpt.save_checkpoint(run_dir, 1, model=model, optimizer=optimizer, scheduler=scheduler,
                             state={}, keep_last=1, full_state=(weights, opt_state))  # fmt: skip
    here.broadcast(None)  # the files are written
    again, optimizer2, scheduler2 = fresh()
    ckpt.load_checkpoint(
        ckpt.checkpoint_dir(run_dir) / "step_000001",
        model=again,
        optimizer=optimizer2,
        scheduler=scheduler2,
        sharded=True,
    )
    weights2, opt_state2 = fsdp.gather_full_state(again, optimizer2)
    if here.is_main:
        moments = [
            float((opt_state["state"][i][k] - opt_state2["state"][i][k]).abs().max())
            for i in opt_state["state"]
            for k in ("exp_avg", "exp_avg_sq")
        ]
        out["fsdp_checkpoint"] = {
            "weights": worst(weights, weights2),
            "moved": worst(weights, {k: v for k, v in policy.state_dict().items() if k in weights}),
            "moments": max(moments),
            "optimizer_entries": [len(opt_state["state"]), len(opt_state2["state"])],
        }


def main() -> None:
    out_file, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist = distributed.init("ddp", torch.device("cpu"))
    # float64: every check is "the same computation" split over ranks (tests/numerics.py)
    policy = to_float64(load_model("builtin:arith")).eval()
    tokenizer = load_tokenizer("builtin:arith")
    out: dict = {"world_size": dist.world_size}
    parity(dist, policy, tokenizer, out)
    tool_parity(dist, out)
    fsdp_tool_sampling(dist, out)
    prompts_and_completions(dist, policy, tokenizer, out)
    fsdp_checkpoint(dist, policy, run_dir, out)
    if dist.is_main:
        out_file.write_text(json.dumps(out, indent=1))
    distributed.shutdown()


if __name__ == "__main__":
    main()
