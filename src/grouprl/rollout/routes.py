"""Expert routes of mixture-of-experts models: which experts each token goes to, recorded from one
forward and replayed in another.

A mixture-of-experts layer sends each token to the top k of its E experts by a router's scores.
After one gradient step a share of those choices flips (the GSPO paper, Zheng et al. 2025 §5.3:
about 10% of the experts a 48-layer Qwen3-30B-A3B activates for a rollout), so a token's ratio
π_θ/π_old then compares two different networks. Routing replay removes that: the trainer forces
the top-k choice a reference forward made (R2: its own first forward of the step; R3: the
sampler's, Ma et al. 2025, "Stabilizing MoE RL by Aligning Training and Inference Routers"),
while the router's softmax stays live, so the router still gets a gradient through the weights
of the experts it was made to pick (as verl's router replay and prime-rl's do).

Routers are recognised by their class (transformers 5's `*TopKRouter` modules: a bare `weight`,
softmax and top-k inside, returning (logits, scores, indices)), never by a module name, and a
forward hook rewrites their output; nothing is copied or patched. How a router turns logits and
chosen experts into scores is found by a probe (`replay_rule`): a router whose scores none of the
known rules reproduce is not replayable.

Routes are kept per row by token position: a table (N, S, L, K) of expert ids (int8 for up to
128 experts, else int16; −1 where unknown), entry [r, j, l] the K experts layer l chose for the j-th token of row r's sequence (its
prompt's unpadded tokens, then its completion's), i.e. the token whose position id is j. Every
forward names its tokens by (row, position id), whatever its layout (a left-padded prompt, a
cached decode step), so tables from the sampler and from the trainer line up.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

#: Scores from live logits (M, E) and chosen experts (M, K) (the order a router's top-k gives).
ReplayRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _softmax_then_pick(normalise: bool) -> ReplayRule:
    """Qwen2/3-MoE, OLMoE, Mixtral: softmax over all experts, the chosen ones' probabilities,
    renormalised to sum to 1 where the router does (norm_topk_prob; Mixtral always)."""

    def rule(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        picked = F.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
        return picked / picked.sum(-1, keepdim=True) if normalise else picked

    return rule


def _pick_then_softmax(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: a softmax over the chosen experts' logits only."""
    return F.softmax(logits.gather(-1, chosen), dim=-1)


_RULES: tuple[ReplayRule, ...] = (
    _softmax_then_pick(True),
    _softmax_then_pick(False),
    _pick_then_softmax,
)


def is_router(module: nn.Module) -> bool:
    """A top-k router of a transformers mixture-of-experts layer, by its class: `*TopKRouter`
    (Qwen2/3-MoE, OLMoE, Mixtral, GPT-OSS, …) with its `top_k` and `weight`."""
    name = type(module).__name__.lower()
    return (
        name.endswith("topkrouter")
        and isinstance(getattr(module, "top_k", None), int)
        and isinstance(getattr(module, "weight", None), torch.Tensor)
    )


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if is_router(m)]


def replay_rule(router: nn.Module) -> ReplayRule | None:
    """The rule that recomputes this router's scores for given experts, found by a probe: the
    router on 7 random tokens, each known rule applied to its own logits and choices; the first
    that reproduces its scores (to float rounding of one softmax) is its rule. None: no rule does
    (a router with a bias correction or group-limited choice), so it cannot be replayed."""
    weight = router.weight
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((7, weight.shape[-1]), generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        out = router(x)
        if not (isinstance(out, tuple) and len(out) == 3):
            return None
        logits, scores, chosen = out
        for rule in _RULES:
            mine = rule(logits, chosen).to(scores.dtype)
            if mine.shape == scores.shape and torch.allclose(mine, scores, rtol=1e-5, atol=1e-6):
                return rule
    return None


@dataclass
class Session:
    """What the routers' hooks do during some forwards (`recording`).

    record: tables (R, S, L, K) filled with the live routes where they hold −1 (a token's first
        forward fills its entry; later forwards leave it).
    replay: a table whose known entries replace the routers' choices (−1: the live choice, which
        is then written there, so every later forward replays it).
    rows: the table rows of the current forward's batch rows (`forwarding`).
    """

    record: tuple[torch.Tensor, ...] = ()
    replay: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    logits: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # (M, E) and valid (M,)
    _slots: torch.Tensor | None = field(default=None, repr=False)  # (M,) into R·S; −1: none


_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar("routes", default=None)


class RouteTap:
    """Forward hooks on a model's routers, inert outside a `Session`.

    Installed once on the policy (`tap`); `layers` routers, each choosing `top_k` of
    `num_experts`. `replayable`: every router has a replay rule. `sampling`: grouprl's sampler
    records the routes of what it samples into `Rollout.routes`.
    """

    def __init__(self, model: nn.Module) -> None:
        found = routers(model)
        if not found:
            raise ValueError("the model has no mixture-of-experts routers")
        self.layers = len(found)
        self.top_k = int(found[0].top_k)
        self.num_experts = int(found[0].weight.shape[0])
        self.rules = [replay_rule(r) for r in found]
        self.replayable = all(rule is not None for rule in self.rules)
        self.sampling = False
        self.classes = sorted({type(r).__name__ for r in found})
        self._handles = [
            r.register_forward_hook(self._hook(layer)) for layer, r in enumerate(found)
        ]

    def _hook(self, layer: int):
        def hook(module: nn.Module, args, out):
            session = _SESSION.get()
            if session is None or session._slots is None:
                return None
            logits, scores, chosen = out
            slots = session._slots  # (M,)
            valid = slots >= 0
            at = slots.clamp(min=0)
            if session.logits is not None:
                session.logits.append((logits, valid))
            for table in session.record:
                flat = table.view(-1, self.layers, self.top_k)
                empty = valid & (flat[at, layer, 0] < 0)
                flat[at[empty], layer] = chosen[empty].to(table.dtype)
            if session.replay is None:
                return None
            flat = session.replay.view(-1, self.layers, self.top_k)
            empty = valid & (flat[at, layer, 0] < 0)
            flat[at[empty], layer] = chosen[empty].to(flat.dtype)
            known = flat[at, layer].long()  # (M, K)
            use = valid & (known[:, 0] >= 0)
            replayed = torch.where(use[:, None], known, chosen)
            rule = self.rules[layer]
            if rule is None:
                raise RuntimeError(f"{type(module).__name__} cannot be replayed")
            return logits, rule(logits, replayed).to(scores.dtype), replayed

        return hook

    def empty(self, rows: int, width: int, device: torch.device | str) -> torch.Tensor:
        """A table (rows, width, L, K) of unknown routes (−1): int8 while expert ids fit
        (up to 128 experts: Mixtral, Qwen3-MoE, OLMoE), else int16."""
        shape = (rows, width, self.layers, self.top_k)
        dtype = torch.int8 if self.num_experts <= 128 else torch.int16
        return torch.full(shape, -1, dtype=dtype, device=device)


_TAPS: weakref.WeakKeyDictionary[nn.Module, RouteTap] = weakref.WeakKeyDictionary()


def tap(model: nn.Module) -> RouteTap:
    """The model's `RouteTap`, installed on first call (ValueError for a dense model)."""
    found = _TAPS.get(model)
    if found is None:
        found = _TAPS[model] = RouteTap(model)
    return found


def tap_of(model: nn.Module) -> RouteTap | None:
    """The tap installed on `model`, or None."""
    return _TAPS.get(model)


@contextlib.contextmanager
def recording(session: Session) -> Iterator[Session]:
    """Run forwards under `session` (their rows named by `forwarding`, tokens by `feeding`)."""
    token = _SESSION.set(session)
    try:
        yield session
    finally:
        _SESSION.reset(token)


def active() -> bool:
    """Whether a session is recording or replaying routes."""
    return _SESSION.get() is not None


@contextlib.contextmanager
def forwarding(rows: torch.Tensor | None) -> Iterator[None]:
    """Name the table rows (n,) of the next forwards' batch rows (no-op outside a session)."""
    session = _SESSION.get()
    if session is None or rows is None:
        yield
        return
    before, session.rows = session.rows, rows
    try:
        yield
    finally:
        session.rows = before


@contextlib.contextmanager
def feeding(
    positions: torch.Tensor, valid: torch.Tensor | None = None, rows: torch.Tensor | None = None
):
    """One model call's tokens, (n, L) each: their position ids and whether each is a real token
    of its row (False: padding, whose route is neither kept nor replayed; None: every one is);
    `rows`: the table row of each batch row (default: the session's, `forwarding`). No-op
    outside a session: callers on a hot path build its arguments only when `active()`."""
    session = _SESSION.get()
    rows = rows if rows is not None or session is None else session.rows
    if session is None or rows is None:
        yield
        return
    tables = [*session.record, *([] if session.replay is None else [session.replay])]
    width = tables[0].shape[1] if tables else 1 << 30
    rows = rows.to(positions.device)
    keep = positions < width
    keep = keep if valid is None else keep & valid.bool()
    slots = torch.where(keep, rows[:, None] * width + positions, -1)  # (n, L)
    session._slots = slots.reshape(-1)
    try:
        yield
    finally:
        session._slots = None


def share_prompts(group_size: int, prompt_width: int) -> None:
    """Copy each group's first row's routes of its first `prompt_width` positions to the
    group's other rows, in the session's tables (a prompt run once for its group); no-op
    outside a session."""
    session = _SESSION.get()
    if session is None or group_size == 1:
        return
    for table in session.record:
        groups = table.view(-1, group_size, *table.shape[1:])  # (B, G, S, L, K)
        groups[:, 1:, :prompt_width] = groups[:, :1, :prompt_width]


def route_changes(
    before: torch.Tensor, after: torch.Tensor, counted: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many (token, layer) expert sets differ between two tables (R, S, L, K), per layer:
    (changed (L,), compared (L,)) over the tokens `counted` (R, S) that both tables know. Sets,
    not orders: the same experts in another order are the same route."""
    known = (before[..., 0] >= 0) & (after[..., 0] >= 0) & counted[..., None]  # (R, S, L)
    differ = (before.sort(-1).values != after.sort(-1).values).any(-1) & known
    return differ.sum((0, 1)), known.sum((0, 1))


def completion_tokens(
    prompt_lengths: torch.Tensor, lengths: torch.Tensor, width: int
) -> torch.Tensor:
    """(R, width) bool: each row's completion tokens by position id, [p_r, p_r + len_r), where
    p_r (R,) is its prompt's length and len_r (R,) its completion's."""
    j = torch.arange(width, device=lengths.device)
    start = prompt_lengths.to(lengths.device)[:, None]
    return (j >= start) & (j < start + lengths[:, None])


def widened(table: torch.Tensor, width: int) -> torch.Tensor:
    """The table (R, S, L, K) cut or −1-padded to `width` positions."""
    if table.shape[1] >= width:
        return table[:, :width]
    return F.pad(table, (0, 0, 0, 0, 0, width - table.shape[1]), value=-1)


@contextlib.contextmanager
def collecting(wanted: bool = True) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Collect every router's (logits (M, E), real (M,)) of the forwards inside, in call order,
    into the list yielded (for the balancing loss); an empty list outside a session or when not
    `wanted`."""
    session = _SESSION.get()
    gates: list[tuple[torch.Tensor, torch.Tensor]] = []
    if session is None or not wanted:
        yield gates
        return
    before, session.logits = session.logits, gates
    try:
        yield gates
    finally:
        session.logits = before


def share_tap(model: nn.Module, copy: nn.Module) -> None:
    """Let `copy` (a deep copy of `model`, whose routers' hooks were copied with it) be found as
    tapped too, so that a sampler on the copy records routes as the model's would."""
    found = _TAPS.get(model)
    if found is not None:
        _TAPS[copy] = found
