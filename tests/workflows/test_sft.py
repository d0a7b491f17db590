"""`grouprl sft` on a tiny model: the loss falls, the output loads, the run is seeded.

Tolerances: the learning-rate schedule is a few float64 operations on given numbers
(pytest.approx's 1e-6 relative is far above their rounding)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grouprl.cli.sft import main
from grouprl.errors import UserError
from grouprl.models import load_model, load_tokenizer
from grouprl.workflows.sft import SFTConfig, encode_batch, lr_at, train_sft

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def _cfg(out: Path, **overrides) -> SFTConfig:
    base = {
        "output_dir": out,
        "steps": 30,
        "batch_size": 16,
        "warmup_steps": 5,
        "log_every": 0,
        "progress": False,
        "threads": 1,
        **TINY,
    }
    return SFTConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "model"
    return train_sft(_cfg(out))


def test_loss_decreases_and_output_loads(run) -> None:
    assert run.final_loss < 0.8 * run.first_loss
    model = load_model(run.output_dir)
    tokenizer = load_tokenizer(run.output_dir)
    assert sum(p.numel() for p in model.parameters()) < 50_000
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert (run.output_dir / "sft_config.json").is_file()


def test_same_seed_same_weights(run, tmp_path) -> None:
    again = train_sft(_cfg(tmp_path / "again"))
    a = load_file(run.output_dir / "model.safetensors")
    b = load_file(again.output_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = train_sft(_cfg(tmp_path / "other", seed=1, steps=2))
    c = load_file(other.output_dir / "model.safetensors")
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_continue_from_a_saved_model(run, tmp_path) -> None:
    cfg = _cfg(tmp_path / "cont", model=str(run.output_dir), steps=3, noise=0.0, lr=1e-4)
    result = train_sft(cfg)
    # It started from the trained weights, not from scratch.
    assert result.first_loss < 0.9 * run.first_loss


def test_loss_covers_exactly_the_completion_and_eos(run) -> None:
    tokenizer = load_tokenizer(run.output_dir)
    ids, mask, labels = encode_batch(tokenizer, ["8+5=", "37+45="], ["8+5=13|13", "x"])
    assert ids.shape == (2, 1 + 4 + 9 + 1)
    assert tokenizer.decode(ids[0]) == "<bos>8+5=8+5=13|13<eos>"
    assert labels[0, :5].eq(-100).all() and labels[0, 5:].eq(ids[0, 5:]).all()
    assert labels[1].ne(-100).sum() == 2 and labels[1, :7].eq(-100).all()
    assert mask[1].sum() == 1 + 6 + 1 + 1 and ids[1, 9:].eq(tokenizer.pad_token_id).all()


@pytest.mark.numerics
def test_learning_rate_schedule() -> None:
    cfg = SFTConfig(steps=100, warmup_steps=10, lr=1.0)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0) and lr_at(100, cfg) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"noise": 1.0}, "--noise"),
        ({"steps": 0}, "--steps"),
        ({"lr": 0.0}, "--lr"),
        ({"hidden_size": 30, "num_heads": 4}, "divisible"),
        ({"task": "nope"}, "unknown task"),
        ({"model": "/no/such/model"}, "not a local directory"),
        ({"tools": ["multiply"]}, "conversations of --data"),
        ({"num_experts": 4, "experts_per_token": 5}, "--experts-per-token"),
        ({"num_experts": 4, "model": "builtin:arith"}, "fresh model"),
    ],
)
def test_user_errors(tmp_path, overrides: dict, match: str) -> None:
    with pytest.raises(UserError, match=match):
        main(_cfg(tmp_path / "out", **overrides))


def test_refuses_a_non_empty_output_dir(tmp_path) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(UserError, match="not empty"):
        main(_cfg(tmp_path))
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_a_fresh_mixture_of_experts_model(tmp_path) -> None:
    """--num-experts: a Qwen3-MoE whose experts share the dense MLP's width (intermediate_size
    / experts_per_token each), fitted with the routers' balancing loss and written as a plain
    model (a forward returns no router logits) that grouprl recognises as routed."""
    from transformers import Qwen3MoeForCausalLM

    from grouprl.rollout import routes

    out = tmp_path / "moe"
    result = train_sft(_cfg(out, num_experts=4, experts_per_token=2, steps=5))
    model = load_model(str(out))
    assert isinstance(model, Qwen3MoeForCausalLM) and result.final_loss < result.first_loss
    config = model.config
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.moe_intermediate_size == TINY["intermediate_size"] // 2
    assert not config.output_router_logits
    assert len(routes.routers(model)) == TINY["num_layers"]
