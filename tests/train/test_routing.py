"""A step's routing metrics (`grouprl.train.routing`) checked by hand on a one-layer
mixture-of-experts model: each completion run alone through transformers' own forward, its
router's top-k read by a hook before and after the weights move, the changed sets counted over
the completion tokens the trainer feeds. Float64 with the experts' eager path, so that batching
flips no near-tie."""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from grouprl.config import TrainConfig
from grouprl.config.resolution import resolve
from grouprl.models.tiny import save_tiny_chat_model
from grouprl.rollout import completion_logprobs, routes, sample_groups
from grouprl.train.parallel.distributed import SINGLE
from grouprl.train.routing import Routing, StepRoutes

G = 4


def _one_layer(tmp_path):
    _, tokenizer = save_tiny_chat_model(tmp_path)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=16, num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, tie_word_embeddings=False,
                            pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    model = Qwen3MoeForCausalLM(config).to(torch.float64).eval()
    model.set_experts_implementation("eager")
    return model, tokenizer


def _routes_alone(model, rollout) -> list[list[frozenset]]:
    """Each row's completion tokens' expert sets, as the trainer feeds them (all but the widest
    rows' last token), from a forward of that row alone."""
    seen = []
    gate = routes.routers(model)[0]
    hook = gate.register_forward_hook(lambda _m, _a, out: seen.append(out[2]))
    used = int(rollout.lengths.max())
    out = []
    try:
        for r in range(rollout.completion_ids.shape[0]):
            prompt = rollout.prompt_ids[r // G][rollout.prompt_mask[r // G]]
            fed = min(int(rollout.lengths[r]), used - 1)
            ids = torch.cat([prompt, rollout.completion_ids[r, :fed]])[None]
            with torch.no_grad():
                model(input_ids=ids)
            chosen = seen.pop()  # (p + fed, 2)
            out.append([frozenset(chosen[len(prompt) + t].tolist()) for t in range(fed)])
    finally:
        hook.remove()
    return out


def test_routes_changed_by_a_step_and_from_the_sampler_by_hand(tmp_path):
    model, tokenizer = _one_layer(tmp_path)
    tap = routes.tap(model)
    tap.sampling = True
    rollout = sample_groups(model, tokenizer, ["1+2=", "a longer prompt here"], group_size=G,
                            max_new_tokens=6, temperature=1.0, seed=3)  # fmt: skip
    cfg = resolve(TrainConfig(prompts_per_step=2, group_size=G, minibatches=1),
                  task_max_new_tokens=6)  # fmt: skip
    step = StepRoutes(Routing(tap, "off", 1, 0.0), rollout, 0, torch.device("cpu"))
    before = _routes_alone(model, rollout)
    with step.recording(), routes.forwarding(torch.arange(len(rollout.texts))):
        completion_logprobs(model, rollout, temperature=1.0)  # the step's first forward
    with torch.no_grad():  # an "update": the router moves
        gate = routes.routers(model)[0]
        gate.weight.add_(
            0.5
            * torch.randn(
                gate.weight.shape,
                generator=torch.Generator().manual_seed(1),
                dtype=gate.weight.dtype,
            )
        )
    after = _routes_alone(model, rollout)
    got = step.metrics(cfg, model, rollout, None, SINGLE)
    changed = sum(a != b for row_a, row_b in zip(before, after) for a, b in zip(row_a, row_b))
    tokens = sum(len(row) for row in before)
    assert 0 < changed < tokens  # the router's move changed some routes, not all
    assert got["routing_update_changed"] == changed / tokens
    assert got["routing_update_changed_layer0"] == changed / tokens
    assert got["routing_sampler_changed"] == 0.0  # the sampler routed as the trainer did


def test_replay_on_routers_whose_scores_no_rule_reproduces_is_refused(tmp_path):
    """A router scoring its experts by sigmoid (as DeepSeek-V3's do) is recognised by its class
    and watched, but none of the replay rules reproduces its scores: one line."""
    import pytest

    from grouprl.errors import UserError
    from grouprl.train.routing import routing_for

    model, _ = _one_layer(tmp_path)
    gate = routes.routers(model)[0]

    def sigmoid_scores(hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
        scores, chosen = torch.sigmoid(logits).topk(gate.top_k, dim=-1)
        return logits, scores, chosen

    gate.forward = sigmoid_scores
    cfg = resolve(TrainConfig(routing_replay="r2"), task_max_new_tokens=6)
    with pytest.raises(UserError, match=r"Qwen3MoeTopKRouter.*cannot be replayed"):
        routing_for(cfg, model)
    watched = resolve(TrainConfig(), task_max_new_tokens=6)
    assert routing_for(watched, model).tap.replayable is False  # watching needs no rule
