"""Checkpoints: exact round trip, atomic layout, retention, and nothing pickled."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grouprl.errors import UserError
from grouprl.train import checkpoint as ckpt


def _setup(seed: int):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    return model, optimizer, scheduler


def _train_steps(model, optimizer, scheduler, n: int) -> None:
    for _ in range(n):
        ids = torch.randint(0, 32, (2, 5))
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def test_round_trip_continues_identically(tmp_path):
    model, optimizer, scheduler = _setup(0)
    _train_steps(model, optimizer, scheduler, 3)
    ckpt.save_checkpoint(
        tmp_path,
        3,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        state={"data_position": 42},
        keep_last=2,
    )
    _train_steps(model, optimizer, scheduler, 2)  # the uninterrupted continuation
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    model2, optimizer2, scheduler2 = _setup(1)  # different initial weights
    meta = ckpt.load_checkpoint(
        ckpt.latest_checkpoint(tmp_path), model=model2, optimizer=optimizer2, scheduler=scheduler2
    )
    assert meta["step"] == 3 and meta["data_position"] == 42
    assert scheduler2.last_epoch == 3
    assert optimizer2.param_groups[0]["betas"] == (0.9, 0.95)
    _train_steps(model2, optimizer2, scheduler2, 2)
    for key, value in model2.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0)


def test_layout_is_safetensors_and_json_only(tmp_path):
    model, optimizer, scheduler = _setup(0)
    _train_steps(model, optimizer, scheduler, 1)
    path = ckpt.save_checkpoint(
        tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler, state={}, keep_last=1
    )
    names = sorted(p.name for p in path.iterdir())
    assert names == ["model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"]
    json.loads((path / "state.json").read_text())
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_keeps_last_k_and_ignores_partial_writes(tmp_path):
    model, optimizer, scheduler = _setup(0)
    for step in (10, 20, 30):
        ckpt.save_checkpoint(
            tmp_path,
            step,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            state={},
            keep_last=2,
        )
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000020", "step_000030"]
    # A crash mid-write leaves a temporary directory (and maybe a dir without state.json).
    (tmp_path / "checkpoints" / ".tmp-step_000040").mkdir()
    (tmp_path / "checkpoints" / "step_000050").mkdir()
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000030"


def test_wrong_model_is_rejected(tmp_path):
    model, optimizer, scheduler = _setup(0)
    path = ckpt.save_checkpoint(
        tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler, state={}, keep_last=1
    )
    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )
    opt = torch.optim.AdamW(other.parameters())
    with pytest.raises(UserError, match="holds other trainable parameters than this model"):
        ckpt.load_checkpoint(
            path,
            model=other,
            optimizer=opt,
            scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        )


def test_saving_a_step_again_keeps_the_existing_checkpoint(tmp_path):
    model, optimizer, scheduler = _setup(0)
    first = ckpt.save_checkpoint(
        tmp_path, 5, model=model, optimizer=optimizer, scheduler=scheduler,
        state={"data_position": 1}, keep_last=1,
    )  # fmt: skip
    before = (first / "model.safetensors").stat().st_mtime_ns, (first / "state.json").read_text()
    _train_steps(model, optimizer, scheduler, 1)
    again = ckpt.save_checkpoint(
        tmp_path, 5, model=model, optimizer=optimizer, scheduler=scheduler,
        state={"data_position": 2}, keep_last=1,
    )  # fmt: skip
    assert again == first
    after = (first / "model.safetensors").stat().st_mtime_ns, (first / "state.json").read_text()
    assert after == before


def test_resume_keeps_the_current_optimizer_kernel_and_the_saved_hyperparameters(tmp_path):
    """A checkpoint written by a multi-tensor AdamW resumes into a fused one (and back): the
    kernel is a property of the machine, the learning rate and moments are the checkpoint's."""
    model, optimizer, scheduler = _setup(0)  # default kernel, lr 1e-2
    _train_steps(model, optimizer, scheduler, 2)
    path = ckpt.save_checkpoint(
        tmp_path, 2, model=model, optimizer=optimizer, scheduler=scheduler, state={}, keep_last=1
    )
    model2, _, _ = _setup(1)
    fused = torch.optim.AdamW(model2.parameters(), lr=5.0, fused=True)
    scheduler2 = torch.optim.lr_scheduler.LambdaLR(fused, lambda s: 1.0 / (s + 1))
    ckpt.load_checkpoint(path, model=model2, optimizer=fused, scheduler=scheduler2)
    (group,) = fused.param_groups
    assert group["fused"] is True and not group["foreach"]
    assert group["betas"] == (0.9, 0.95) and group["lr"] == pytest.approx(1e-2 / 3)
    first = next(iter(fused.state.values()))
    assert int(first["step"]) == 2 and first["exp_avg"].abs().sum() > 0
    _train_steps(model2, fused, scheduler2, 1)  # and it steps
