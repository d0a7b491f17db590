"""Expert routes of mixture-of-experts models (`grouprl.rollout.routes`): recorded from the sampler
and the trainer by position, replayed exactly into the experts while the router keeps its
gradient, compared by hand on one layer; the balancing loss against transformers' own.

Tolerances: the balancing loss is the same float32 formula as transformers' over the same
logits, summed in the same order: equal to within float32 rounding of its sums of at most L·M
terms, 2·L·M·eps relative."""

from __future__ import annotations

import pytest
import torch

from grouprl.core import load_balancing_loss
from grouprl.models.tiny import MOE_FAMILIES, save_tiny_moe_model
from grouprl.rollout import _hf, completion_logprobs, routes, sample_groups
from grouprl.rollout._hf import plain_head

PROMPTS = ["2 + 3 =", "a longer prompt, so the two are padded differently:"]
G = 3


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def moe(request, tmp_path_factory):
    model, tokenizer = save_tiny_moe_model(tmp_path_factory.mktemp(request.param), request.param)
    return model, tokenizer


def _sampled(model, tokenizer, seed=1):
    tap = routes.tap(model)
    tap.sampling = True
    try:
        return sample_groups(model, tokenizer, PROMPTS, group_size=G, max_new_tokens=6,
                             temperature=1.0, seed=seed)  # fmt: skip
    finally:
        tap.sampling = False


def _experts_inputs(model):
    """Hooks on each layer's experts recording the top-k indices they were given, in order
    (the head's one probe forward run first, so that only the forward under test is seen)."""
    plain_head(model)
    seen: list[torch.Tensor] = []
    modules = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert len(modules) == routes.tap(model).layers
    handles = [m.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone()))
               for m in modules]  # fmt: skip
    return seen, handles


def _full_layout(rollout):
    """The table rows and position ids of the tokens `completion_logprobs` feeds under a
    session, in its layout (N full sequences, prompt left-padded), flattened, and which are
    real: the tokens whose routes it keeps."""
    n = rollout.completion_ids.shape[0]
    prompt_mask = rollout.prompt_mask.repeat_interleave(rollout.group_size, 0)
    used = int(rollout.lengths.max())
    attn = torch.cat([prompt_mask, rollout.mask[:, : used - 1]], 1)  # (N, P + T' − 1)
    positions = _hf.left_pad_positions(attn)
    rows = torch.arange(n)[:, None].expand_as(positions)
    return rows.reshape(-1), positions.reshape(-1), attn.reshape(-1)


def _perturbed_routers(model, scale=3.0):
    """Move every router's weight far enough that many tokens change route; returns the undo."""
    saved = [r.weight.detach().clone() for r in routes.routers(model)]
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for r in routes.routers(model):
            r.weight.add_(scale * torch.randn(r.weight.shape, generator=generator))

    def undo():
        with torch.no_grad():
            for r, w in zip(routes.routers(model), saved, strict=True):
                r.weight.copy_(w)

    return undo


def test_routers_are_found_by_class_and_their_scores_reproduced(moe):
    model, _ = moe
    tap = routes.tap(model)
    assert tap.layers == model.config.num_hidden_layers and tap.top_k == 2
    assert tap.replayable and all(name.endswith("TopKRouter") for name in tap.classes)
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert routes.routers(dense) == []


def test_the_trainer_records_the_routes_the_sampler_took(moe):
    """R3's premise: the sampler's table (by row and position id) equals the trainer's first
    forward's on every token both fed, prompt and completion, across two prompt widths."""
    model, tokenizer = moe
    rollout = _sampled(model, tokenizer)
    n, width = rollout.routes.shape[:2]
    first = routes.tap(model).empty(n, width, "cpu")
    with routes.recording(routes.Session(record=(first,))), routes.forwarding(torch.arange(n)):
        completion_logprobs(model, rollout, temperature=rollout.temperature)
    counted = torch.ones((n, width), dtype=torch.bool)
    changed, compared = routes.route_changes(rollout.routes, first, counted)
    prompt = rollout.prompt_mask.sum(-1).repeat_interleave(G)
    fed = prompt + (rollout.lengths - 1).clamp(min=0)  # the trainer feeds all but the last
    assert int(compared[0]) == int(fed.sum()) and changed.sum() == 0


@pytest.mark.parametrize("source", ["r2", "r3"])
def test_replayed_routes_reach_the_experts_exactly_and_the_router_keeps_its_gradient(moe, source):
    """R2: the routes a first forward recorded; R3: the sampler's. After the routers moved
    (so that live routing differs), the experts receive exactly the replayed choices on every
    real token, and the routers get a gradient."""
    model, tokenizer = moe
    rollout = _sampled(model, tokenizer)
    n, width = rollout.routes.shape[:2]
    tap = routes.tap(model)
    if source == "r2":
        table = tap.empty(n, width, "cpu")
        with routes.recording(routes.Session(replay=table)), routes.forwarding(torch.arange(n)):
            completion_logprobs(model, rollout, temperature=rollout.temperature)
    else:
        table = rollout.routes.clone()
    want = table.clone()
    undo = _perturbed_routers(model)
    try:
        live = tap.empty(n, width, "cpu")
        seen, handles = _experts_inputs(model)
        model.zero_grad()
        session = routes.Session(record=(live,), replay=table)
        try:
            with routes.recording(session), routes.forwarding(torch.arange(n)):
                logp = completion_logprobs(model, rollout, temperature=rollout.temperature)
        finally:
            for h in handles:
                h.remove()
        logp.sum().backward()
        rows, positions, real = _full_layout(rollout)
        for layer, given in enumerate(seen):
            expected = want[rows, positions, layer].long()  # (M, K)
            assert torch.equal(given[real.bool()], expected[real.bool()])
        assert (
            routes.route_changes(want, live, torch.ones((n, width), dtype=torch.bool))[0].sum() > 0
        )
        for r in routes.routers(model):
            assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    finally:
        undo()
        model.zero_grad()


def test_route_changes_by_hand_on_one_layer():
    """One layer, top-2: sets compare, not orders; unknown entries and uncounted tokens are
    left out."""
    before = torch.tensor([[[[0, 1]], [[2, 3]], [[1, 0]], [[-1, -1]], [[3, 2]]]], dtype=torch.int16)
    after = torch.tensor([[[[1, 0]], [[2, 1]], [[3, 2]], [[0, 1]], [[0, 1]]]], dtype=torch.int16)
    counted = torch.tensor([[True, True, True, True, False]])
    changed, compared = routes.route_changes(before, after, counted)
    # token 0: {0,1} = {1,0}; token 1: {2,3} vs {1,2}: changed; token 2: {0,1} vs {2,3}: changed;
    # token 3: unknown before; token 4: not counted
    assert changed.tolist() == [2] and compared.tolist() == [3]


def test_completion_tokens_are_counted_by_position():
    counted = routes.completion_tokens(torch.tensor([2, 3]), torch.tensor([2, 0]), 6)
    assert counted.tolist() == [[False, False, True, True, False, False], [False] * 6]


def test_the_balancing_loss_is_transformers_aux_loss(moe):
    """`load_balancing_loss` of the router logits a session collects, over the real tokens,
    equals the aux_loss transformers' model returns for the same padded batch."""
    model, _ = moe
    top_k = routes.tap(model).top_k  # the hooks that collect the logits
    ids = torch.tensor([[0, 0, 5, 17, 42, 99], [7, 3, 250, 11, 12, 13]])
    attn = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    positions = _hf.left_pad_positions(attn)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=attn, position_ids=positions,
                     output_router_logits=True).aux_loss  # fmt: skip
        with (
            routes.recording(routes.Session()),
            routes.feeding(positions, attn.bool(), torch.arange(2)),
            routes.collecting() as gates,
        ):
            model(input_ids=ids, attention_mask=attn, position_ids=positions)
    got = load_balancing_loss(gates, top_k)
    terms = len(gates) * ids.numel()
    bound = 2 * terms * torch.finfo(torch.float32).eps * float(want)
    assert len(gates) == routes.tap(model).layers
    torch.testing.assert_close(got, want.float(), rtol=0, atol=bound)


def test_the_balancing_loss_by_hand():
    """Two experts, top-1, one layer: tokens routed 0, 0, 1 with probabilities (0.75, 0.25)
    twice and (0.25, 0.75): f = (2/3, 1/3), P = (7/12, 5/12), loss = 2 (2/3·7/12 + 1/3·5/12)
    = 19/18. A padding token changes nothing."""
    p = torch.tensor([[0.75, 0.25], [0.75, 0.25], [0.25, 0.75], [0.9, 0.1]], dtype=torch.float64)
    logits = p.log()
    real = torch.tensor([True, True, True, False])
    got = load_balancing_loss([(logits, real)], top_k=1)
    assert abs(float(got) - 19 / 18) < 1e-6
