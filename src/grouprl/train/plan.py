"""How one step's update is cut up: minibatches of whole groups (one optimizer step each), each
in forward/backward passes (micro-batch chunks, or passes by width), with the counts every pass's
loss divides by. Pure planning: nothing here runs the model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from grouprl.config.options import RunConfig
from grouprl.config.training import ComputeOptions
from grouprl.config.validation import dense_gradients
from grouprl.errors import UserError, remedy
from grouprl.models import vision
from grouprl.rollout import Rollout
from grouprl.train.parallel.distributed import Dist
from grouprl.train.parallel.fsdp import Lockstep


@dataclass(frozen=True)
class Chunk:
    """One forward/backward's completions: a rollout and its rows in the step's rollout."""

    rollout: Rollout
    rows: torch.Tensor  # (n,) long
    weight: float = 1.0  # 0: a filler whose forward/backward only keeps FSDP's collectives in step
    #: rows of `rollout` whose completions run at their own width over the pass's one prompt
    #: forward (`completion_logprobs`' buckets); None: all at the longest's
    buckets: tuple[torch.Tensor, ...] | None = None
    #: the rows as packed lines of one forward (`completion_logprobs`' packs: indices of
    #: `rollout`'s rows, each line its rows' prompts and completions, positions restarting per
    #: row); `rollout` then holds groups of one. None: the rows run padded
    packs: tuple[torch.Tensor, ...] | None = None

    @property
    def packed(self) -> bool:
        return self.packs is not None


def packs_every_pass(cfg: ComputeOptions, model: Shape) -> bool:
    """Whether every pass of the update runs packed whatever the lengths (`plan_rows`): a token
    budget or `--packing on`, on a model that packs."""
    on = cfg.max_tokens_per_micro_batch is not None or cfg.packing == "on"
    return model.packs and cfg.packing != "off" and on


#: A forward/backward pass's fixed cost, in completion positions (rows × width) of a model of
#: `_OVERHEAD_PARAMS` parameters; it scales as 1 / parameters, since a pass's fixed cost is about
#: constant while a position's grows with the model. Measured on a 20.5M Llama (2 CPU threads):
#: a pass over 8 completions costs about 0.06 s + 0.29 ms per position, i.e. about 200
#: positions; set 10x higher so that a split must clearly pay.
_OVERHEAD_POSITIONS, _OVERHEAD_PARAMS = 2048, 20_500_000
#: ... but never below this, whatever the model's size
_MIN_OVERHEAD_POSITIONS = 256
#: A width of its own inside a pass (some rows' completions over the pass's one prompt forward)
#: costs an extra decoder forward and backward, less than a pass; its fixed cost is taken as a
#: pass's measured one (`pass_overhead` without its 10x margin). On the 1M chat model (4,304
#: positions) a 6-turn rollout's forward and backward, rows of 2 and of ~200 tokens in every
#: group, took 1.39 s at one width and 0.76 s at two.
_WIDTH_MARGIN = 10


def pass_overhead(model: nn.Module) -> int:
    """A forward/backward pass's fixed cost in completion positions for `model` (see above)."""
    params = sum(p.numel() for p in model.parameters())
    return max(_MIN_OVERHEAD_POSITIONS, _OVERHEAD_POSITIONS * _OVERHEAD_PARAMS // max(params, 1))


def width_chunks(rollout: Rollout, rows: torch.Tensor, overhead: int) -> list[Chunk]:
    """`rollout`'s whole groups in chunks of similar longest completion, where that pays, and in
    each chunk its rows at widths of their own, where that pays.

    `completion_logprobs` runs each call only as wide as its longest completion, so one pass
    over a minibatch pays every row at the width of the minibatch's longest. With natural
    lengths (most completions far shorter than the longest) that is mostly padding. Groups are
    sorted by their longest completion and cut into contiguous runs that minimise Σ rows ×
    width + `overhead` per pass (`_cheapest_runs`). Groups stay whole, so each prompt still runs
    once; the loss is a sum over rows, so the update is the same. Within a pass the rows are cut
    the same way by their own lengths, at a width's cost (`overhead` / `_WIDTH_MARGIN`): lengths
    spread within groups (a row that answers at once beside one that calls tools five times)
    leave every group as wide as its longest. Returns one chunk (in the original order) when
    splitting groups does not pay.
    """
    g = rollout.group_size
    longest = rollout.lengths.view(-1, g).amax(-1).clamp(min=1).tolist()  # (b,)
    order = sorted(range(len(longest)), key=lambda i: -longest[i])
    runs = _cheapest_runs([longest[i] for i in order], g, overhead)
    if len(runs) <= 1:
        return [_with_buckets(Chunk(rollout, rows), overhead // _WIDTH_MARGIN)]
    by_group = rows.view(-1, g)  # (b, G): each group's rows in the step's rollout
    chunks = [
        Chunk(rollout.select_groups(order[i:j]), by_group[order[i:j]].reshape(-1)) for i, j in runs
    ]
    return [_with_buckets(chunk, overhead // _WIDTH_MARGIN) for chunk in chunks]


def _with_buckets(chunk: Chunk, overhead: int) -> Chunk:
    """`chunk` with its rows cut by their own lengths (`_cheapest_runs` over rows, a width
    costing `overhead`), where that pays."""
    lengths = chunk.rollout.lengths.clamp(min=1)  # (n,)
    order = torch.argsort(lengths, descending=True, stable=True)  # (n,)
    runs = _cheapest_runs(lengths[order].tolist(), 1, overhead)
    if len(runs) <= 1:
        return chunk
    return dataclasses.replace(chunk, buckets=tuple(order[i:j] for i, j in runs))


def _cheapest_runs(widths: list[int], weight: int, overhead: int) -> list[tuple[int, int]]:
    """Contiguous runs [i, j) of `widths` (non-increasing: each run is as wide as its first)
    that minimise Σ weight × (j − i) × widths[i] + `overhead` per run, exact by dynamic
    programming; in order. Equal widths never need a cut between them (the later run is as
    wide), so the programme runs over the distinct widths: O(distinct²)."""
    starts = [i for i in range(len(widths)) if i == 0 or widths[i] != widths[i - 1]]
    ends = [*starts[1:], len(widths)]
    k = len(starts)
    best, cut = [0] + [math.inf] * k, [0] * (k + 1)
    for j in range(1, k + 1):  # best[j]: the cheapest runs of the first j distinct widths
        for i in range(j):  # a last run over distinct widths i … j−1, as wide as i
            cost = best[i] + weight * (ends[j - 1] - starts[i]) * widths[starts[i]] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], k
    while j > 0:
        runs.append((starts[cut[j]], ends[j - 1]))
        j = cut[j]
    return runs[::-1]


def plan_rows(
    cfg: ComputeOptions,
    rollout: Rollout,
    rows: torch.Tensor,
    overhead: int | None = None,
    model: Shape | None = None,
) -> list[Chunk]:
    """`rollout` (whose completions are `rows` of the step's rollout) in forward/backward
    chunks: with `--max-tokens-per-micro-batch`, `token_chunks` (packed where `model` packs,
    padded otherwise); with a micro-batch size, chunks of that many completions; otherwise
    `width_chunks` when `overhead` is given, or packed lines where `--packing` asks for them
    (`on`) or they cost less (`auto`: `Shape.cost`). `model`: the policy's `Shape`."""
    can_pack = model is not None and model.packs and cfg.packing != "off"
    line = model.pack_tokens(rollout) if can_pack else None
    if cfg.max_tokens_per_micro_batch is not None:
        return token_chunks(rollout, rows, cfg.max_tokens_per_micro_batch, line)
    if cfg.micro_batch_size is not None:
        pieces = rollout.chunks(cfg.micro_batch_size)
        if can_pack and cfg.packing == "on":
            return [
                c for piece, span in pieces for c in token_chunks(piece, rows[span], None, line)
            ]
        return [Chunk(piece, rows[span]) for piece, span in pieces]
    if can_pack and (cfg.packing == "on" or (overhead is not None and cfg.packing == "auto")):
        packed = token_chunks(rollout, rows, None, line)
        if cfg.packing == "on":
            return packed
        chunks = width_chunks(rollout, rows, overhead)
        return packed if model.cost(packed) < model.cost(chunks) else chunks
    if overhead is not None:
        return width_chunks(rollout, rows, overhead)
    return [Chunk(rollout, rows)]


def row_tokens(rollout: Rollout) -> torch.Tensor:
    """(N,) long: the positions each row's own forward computes, its prompt and its completion
    but the last token (an empty completion: the prompt alone)."""
    prompt = rollout.prompt_mask.sum(-1).repeat_interleave(rollout.group_size)  # (N,)
    return prompt.cpu() + rollout.lengths.cpu().clamp(min=1) - 1


def token_chunks(
    rollout: Rollout, rows: torch.Tensor, budget: int | None, line: int | None
) -> list[Chunk]:
    """`rollout`'s rows in chunks of at most `budget` positions a forward (None: one chunk).

    Packed (`line` given): rows into lines of at most min(`line`, `budget`) positions
    (`row_tokens`), by first-fit decreasing: the rows in decreasing length, each into the first
    line it fits. FFD minimises the number of lines to within 11/9 of the fewest; Karmarkar–Karp
    balances a given number of bins, which matters for spreading work over ranks, not here.
    Then the lines (padded, `line` None: each row alone) into chunks the same way, a chunk's
    size its units × its longest (what its forward computes). Deterministic: a function of the
    lengths, ties in row order. A chunk holds groups of one (`Rollout.regroup`), so rows of
    different groups share it, each with its own prompt. Raises UserError naming the row when
    one alone exceeds the budget."""
    tokens = row_tokens(rollout).tolist()  # (n,)
    order = sorted(range(len(tokens)), key=lambda i: -tokens[i])
    if budget is not None and order and tokens[order[0]] > budget:
        i = order[0]
        raise UserError(
            f"--max-tokens-per-micro-batch {budget} is smaller than a row: its prompt and "
            f"completion are {tokens[i] + 1} tokens ({tokens[i]} forwarded); raise it to at "
            f"least {tokens[i]}"
        )
    if line is None:
        units = [([i], tokens[i]) for i in order]
    else:
        cap = line if budget is None else min(line, budget)
        units = _first_fit(order, tokens, cap)
        units.sort(key=lambda unit: -unit[1])  # stable: equal lines keep their order
    chunks: list[list[tuple[list[int], int]]] = []
    for unit in units:  # decreasing: a chunk's first unit is its longest
        for chunk in chunks:
            if budget is None or (len(chunk) + 1) * chunk[0][1] <= budget:
                chunk.append(unit)
                break
        else:
            chunks.append([unit])
    single = rollout.regroup(1)
    out = []
    for chunk in chunks:
        members = [i for unit, _ in chunk for i in unit]
        packs, start = [], 0
        for unit, _ in chunk:
            packs.append(torch.arange(start, start + len(unit)))
            start += len(unit)
        out.append(Chunk(single.select_groups(members), rows[torch.tensor(members)],
                         packs=None if line is None else tuple(packs)))  # fmt: skip
    return out


def _first_fit(order: list[int], tokens: list[int], cap: int) -> list[tuple[list[int], int]]:
    """The rows `order` (decreasing `tokens`) into bins of at most `cap` tokens, each into the
    first it fits (a row over `cap` alone): (rows, their tokens) per bin."""
    bins: list[tuple[list[int], int]] = []
    for i in order:
        for b, (members, used) in enumerate(bins):
            if used + tokens[i] <= cap:
                members.append(i)
                bins[b] = (members, used + tokens[i])
                break
        else:
            bins.append(([i], tokens[i]))
    return bins


@dataclass(frozen=True)
class Shape:
    """What planning needs of the policy: whether it packs rows (`packs_rows`) and the cost of
    attention per (query, key) pair in positions (a position costs its linear layers, about 2 ×
    the parameters outside the embeddings; a pair 4 × hidden × layers FLOPs)."""

    packs: bool
    pair_cost: float
    overhead: int  # a forward/backward's fixed cost in positions (`pass_overhead`)

    @staticmethod
    def of(model: nn.Module) -> Shape:
        from grouprl.rollout.packed import packs_rows

        config = getattr(model, "config", None)
        hidden = getattr(config, "hidden_size", 0)
        layers = getattr(config, "num_hidden_layers", 0)
        embeddings = (
            model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        )
        inside = sum(p.numel() for p in model.parameters())
        if embeddings is not None:
            inside -= embeddings.weight.numel()
        pair = 4 * hidden * layers / max(2 * inside, 1)
        return Shape(packs=packs_rows(model), pair_cost=pair, overhead=pass_overhead(model))

    def pack_tokens(self, rollout: Rollout) -> int:
        """A packed chunk's length when no budget says. SDPA's mask is dense, so a pack of L
        positions costs about c + L + pair_cost·L² (c: a forward's measured fixed cost, the
        overhead without its margin, as a width's): a position costs least at L = √(c /
        pair_cost), about 800 on the 20M Llama (measured: 10 packs of ≤ 600 positions 4.9 s, 3
        of ≤ 2,048 6.2 s, one of 5,400 12 s); never below the longest row."""
        longest = int(row_tokens(rollout).max()) if len(rollout.lengths) else 1
        fixed = self.overhead / _WIDTH_MARGIN
        return max(longest, int(math.sqrt(fixed / max(self.pair_cost, 1e-12))))

    def cost(self, chunks: list[Chunk]) -> float:
        """A plan's estimated cost in positions: per forward (a pass, a pack or a bucket's
        width) its measured fixed cost (the overhead without its margin), its positions, and
        its attention pairs."""
        fixed, total = self.overhead / _WIDTH_MARGIN, 0.0
        for chunk in chunks:
            r = chunk.rollout
            if chunk.packs is not None:
                tokens = row_tokens(r)
                k, longest = len(chunk.packs), max(int(tokens[p].sum()) for p in chunk.packs)
                total += fixed + k * longest * (1 + self.pair_cost * longest)
                continue
            prompt = r.prompt_mask.shape[1]
            total += fixed + r.num_prompts * prompt
            lengths = r.lengths.clamp(min=1)
            for rows in chunk.buckets or (torch.arange(len(lengths)),):
                width = int(lengths[rows].max())
                total += len(rows) * width * (1 + self.pair_cost * (prompt + width))
            total += max(len(chunk.buckets or ()) - 1, 0) * fixed
        return total


@dataclass(frozen=True)
class Minibatch:
    """One optimizer step's share of a rollout: the groups it trains (in micro-batch chunks),
    and the counts its loss divides by (those of all its groups, skipped ones included)."""

    rollout: Rollout | None  # the trained groups; None when every group was skipped
    rows: torch.Tensor  # (n,) long, their rows in the step's rollout
    num_tokens: torch.Tensor  # () loss tokens in the whole minibatch
    num_seqs: torch.Tensor  # () sequences with at least one loss token, likewise
    chunks: tuple[Chunk, ...] = ()
    first_group: int = 0  # the minibatch's first group in the step's rollout, trained or not
    num_rows: int = 0  # completions in the whole minibatch, trained or not


def plan_minibatches(
    cfg: RunConfig,
    rollout: Rollout,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    overhead: int | None = None,
    model: Shape | None = None,
    parents: torch.Tensor | None = None,
) -> list[Minibatch]:
    """`cfg.minibatches` minibatches of whole groups, in order, without the groups that have
    nothing to learn (all advantages 0) when `skip_zero_advantage` applies (beta = 0, and no
    `dense_gradients`), each cut
    into chunks of at most `cfg.micro_batch_size` completions, or, without one and with
    `overhead`, into passes by width (`width_chunks`).

    A group is never cut across minibatches: its advantages are normalised over all G of its
    completions. Raises ValueError unless B is divisible by `cfg.minibatches`. advantages: (N,)
    or (N, T);
    mask: (N, T), the loss mask; overhead: a pass's fixed cost in positions (`pass_overhead`),
    which lets a minibatch without a micro-batch size be cut by width (`width_chunks`).
    parents: (K,) long, or None: the last K groups of `rollout` are branches (groups of one:
    `grouprl.rollout.types.Branches`), each trained in the minibatch of its parent group.
    """
    b = rollout.num_prompts - (0 if parents is None else len(parents))  # the batch's own groups
    if b % cfg.minibatches:
        raise ValueError(f"cannot split {b} prompts into {cfg.minibatches} equal minibatches")
    per = b // cfg.minibatches  # groups per minibatch
    skip = cfg.skip_zero_advantage and cfg.beta == 0 and not dense_gradients(cfg)
    of = [] if parents is None else parents.tolist()
    plans = []
    for first in range(0, b, per):
        groups = list(range(first, first + per))
        groups += [b + k for k, p in enumerate(of) if first <= p < first + per]  # branches
        every = rollout.group_rows(groups)  # the minibatch's rows
        if skip:
            given = advantages[every]  # (rows,) or per token (rows, T)
            live = (given.reshape(len(groups), -1) != 0).any(-1).tolist()
            groups = [g for g, keep in zip(groups, live) if keep]
        m = mask[every]  # (rows, T)
        trained = rollout.select_groups(groups) if groups else None
        rows = rollout.group_rows(groups)
        plans.append(
            Minibatch(
                rollout=trained,
                rows=rows,
                num_tokens=m.sum(),
                num_seqs=m.any(-1).sum(),
                chunks=tuple(plan_rows(cfg, trained, rows, overhead, model))
                if trained is not None
                else (),
                first_group=first,
                num_rows=len(every),
            )
        )
    return plans


def with_global_counts(plans: list[Minibatch], dist: Dist) -> list[Minibatch]:
    """The minibatches with the job's global loss counts: each rank's loss then divides by the
    whole global minibatch's tokens and sequences, so summed gradients are the global gradient
    (one all-reduce; the plans themselves in one process)."""
    if not dist.enabled:
        return plans
    counts = torch.stack([torch.stack([p.num_tokens, p.num_seqs]) for p in plans]).double()
    dist.all_reduce(counts)  # (M, 2)
    return [
        dataclasses.replace(
            plan,
            num_tokens=tokens.to(plan.num_tokens.device, torch.float32),
            num_seqs=seqs.to(plan.num_seqs.device, torch.float32),
        )
        for plan, (tokens, seqs) in zip(plans, counts, strict=True)
    ]


def pad_passes(
    plans: list[Minibatch], rollout: Rollout, lockstep: Lockstep, packed: bool = False
) -> list[Minibatch]:
    """Under lockstep (FSDP), each minibatch with zero-weight filler passes (a forward/backward
    of its first group whose loss is multiplied by 0) up to the most passes any rank runs
    (`Lockstep.most_passes`); the plans themselves otherwise. `packed`: the passes run packed
    (one decoder forward each, where a shared prompt takes two), and so does a filler: every
    rank must call the sharded decoder as often."""
    if not lockstep.active:
        return plans
    out = []
    for plan, most in zip(plans, lockstep.most_passes([len(p.chunks) for p in plans]), strict=True):
        missing = most - len(plan.chunks)
        if missing > 0:
            group = [plan.first_group]
            g = rollout.group_size
            filler = Chunk(rollout.select_groups(group), rollout.group_rows(group), weight=0.0,
                           packs=(torch.arange(g),) if packed else None)  # fmt: skip
            plan = dataclasses.replace(plan, chunks=plan.chunks + (filler,) * missing)
        out.append(plan)
    return out


def check_packing(cfg: RunConfig, policy: nn.Module, budget: int | None, warn) -> None:
    """Before anything runs: a `--max-tokens-per-micro-batch` below the longest row the run can
    sample (`budget` prompt tokens and `--max-new-tokens`, all but the last forwarded) is one
    line; a model whose attention cannot keep packed rows apart (`packs_rows`) is one line
    under `--packing on` and otherwise one warning: its passes run padded."""
    tokens = cfg.max_tokens_per_micro_batch
    if tokens is not None and budget is not None and budget + cfg.max_new_tokens - 1 > tokens:
        longest = budget + cfg.max_new_tokens - 1
        ways = remedy(("raise", "max_tokens_per_micro_batch"), ("lower", "max_prompt_length"),
                      ("lower", "max_new_tokens"), otherwise="shorten the prompts")  # fmt: skip
        raise UserError(
            f"--max-tokens-per-micro-batch {tokens} is smaller than the longest row this run can "
            f"sample: {budget} prompt + {cfg.max_new_tokens} completion tokens, {longest} "
            f"forwarded; it must be at least {longest}: {ways}"
        )
    if cfg.packing == "off" and tokens is None:
        return
    from grouprl.rollout.packed import packs_rows

    if packs_rows(policy):
        return
    if vision.vision_tower(policy) is not None:  # its prompts' images: never packed
        if cfg.packing == "on":
            raise UserError(
                "--packing on: a vision-language model's prompts carry images, which packed "
                "forwards do not take; use --packing auto or off (its passes share each prompt)"
            )
        if tokens:
            warn("a vision-language model's passes run padded (their prompts carry images): "
                 "--max-tokens-per-micro-batch counts rows × the longest")  # fmt: skip
        return
    if cfg.packing == "on":
        raise UserError(
            "--packing on: this model's attention does not keep packed rows apart (a probe of "
            "two rows packed by their position ids saw the second attend to the first); use "
            "--packing auto or off"
        )
    warn(
        "this model's attention does not keep packed rows apart: its passes run padded"
        + (", and --max-tokens-per-micro-batch counts rows × the longest" if tokens else "")
    )
