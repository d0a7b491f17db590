"""Checkpoints: exact round trip, atomic layout, retention, and nothing pickled.

Tolerances: none, where a value is stored and read back (atol 0: safetensors keeps the bits);
the learning rate after a resume is one float64 product of given numbers (pytest.approx)."""

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


@pytest.mark.numerics
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


def _save(tmp_path, step, model, optimizer, scheduler, keep_last=2, **state):
    return ckpt.save_checkpoint(
        tmp_path, step, model=model, optimizer=optimizer, scheduler=scheduler, state=state,
        keep_last=keep_last,
    )  # fmt: skip


@pytest.mark.numerics
def test_a_checkpoint_is_a_verified_model_directory(tmp_path):
    """save_pretrained files (they load with transformers, so an interrupted run can be evaluated
    and forked), optimizer and RNG safetensors, state.json, and a manifest of sizes and
    sha256; no pickle anywhere, no temporary directory left."""
    import hashlib

    from transformers import AutoModelForCausalLM

    model, optimizer, scheduler = _setup(0)
    _train_steps(model, optimizer, scheduler, 1)
    path = _save(tmp_path, 1, model, optimizer, scheduler, keep_last=1)
    names = sorted(p.name for p in path.iterdir())
    assert names == [
        "config.json", "generation_config.json", "manifest.json", "model.safetensors",
        "optimizer.safetensors", "rng.safetensors", "state.json",
    ]  # fmt: skip
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(manifest) == [n for n in names if n != "manifest.json"]
    for name, entry in manifest.items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    loaded = AutoModelForCausalLM.from_pretrained(path)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_keeps_last_k_and_ignores_partial_writes(tmp_path):
    model, optimizer, scheduler = _setup(0)
    for step in (10, 20, 30):
        _save(tmp_path, step, model, optimizer, scheduler)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000020", "step_000030"]
    # A crash mid-write leaves a temporary directory; a directory without a manifest is not a
    # checkpoint to trust.
    (tmp_path / "checkpoints" / ".tmp-step_000040").mkdir()
    (tmp_path / "checkpoints" / "step_000050").mkdir()
    warnings = []
    assert ckpt.latest_checkpoint(tmp_path, warn=warnings.append).name == "step_000030"
    assert warnings == [
        "checkpoint step_000050 is damaged (no manifest.json (unfinished, or written by an "
        "older grouprl)); resuming from step_000030 instead"
    ]


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:-9]),
         "model.safetensors has"),
        (lambda p: (p / "state.json").write_text("{broken"), "state.json has 7 bytes"),
        (lambda p: _flip_last_byte(p / "optimizer.safetensors"),
         "optimizer.safetensors does not match its checksum"),
        (lambda p: (p / "optimizer.safetensors").unlink(), "optimizer.safetensors is missing"),
        (lambda p: (p / "manifest.json").write_text("[]"), "manifest.json is not valid"),
    ],
)  # fmt: skip
def test_a_damaged_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, corrupt, reason):
    model, optimizer, scheduler = _setup(0)
    _save(tmp_path, 1, model, optimizer, scheduler)
    _train_steps(model, optimizer, scheduler, 1)
    newest = _save(tmp_path, 2, model, optimizer, scheduler)
    corrupt(newest)
    warnings = []
    assert ckpt.latest_checkpoint(tmp_path, warn=warnings.append).name == "step_000001"
    assert len(warnings) == 1 and reason in warnings[0]
    corrupt(ckpt.checkpoint_dir(tmp_path) / "step_000001")
    with pytest.raises(UserError, match="no intact checkpoint in"):
        ckpt.latest_checkpoint(tmp_path)


def test_saving_over_a_damaged_step_sets_it_aside(tmp_path):
    model, optimizer, scheduler = _setup(0)
    path = _save(tmp_path, 3, model, optimizer, scheduler)
    (path / "rng.safetensors").unlink()
    again = _save(tmp_path, 3, model, optimizer, scheduler)
    assert again == path and ckpt.damage(path) is None
    aside = [
        p.name for p in ckpt.checkpoint_dir(tmp_path).iterdir() if p.name.startswith(".damaged")
    ]
    assert len(aside) == 1  # kept, not deleted


def test_old_checkpoints_are_deleted_without_following_symlinks(tmp_path):
    """A checkpoint slot that is a symlink to somewhere else is unlinked; what it points to
    stays (deletion never leaves the run directory)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("keep me")
    run = tmp_path / "run"
    model, optimizer, scheduler = _setup(0)
    first = _save(run, 1, model, optimizer, scheduler, keep_last=1)
    for file in first.iterdir():
        (elsewhere / file.name).write_bytes(file.read_bytes())
    import shutil

    shutil.rmtree(first)
    first.symlink_to(elsewhere, target_is_directory=True)
    assert ckpt.latest_checkpoint(run).name == "step_000001"  # intact through the link
    _save(run, 2, model, optimizer, scheduler, keep_last=1)
    assert not first.exists() and not first.is_symlink()
    assert (elsewhere / "precious.txt").read_text() == "keep me"


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


@pytest.mark.numerics
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


def test_after_falling_back_the_damaged_newer_checkpoint_cannot_outlive_the_new_ones(tmp_path):
    """Resume falls back from a damaged step 100 to step 50 and sets 100 aside; the next save
    (step 75, keep_last 1) keeps itself rather than deleting everything but the damaged one."""
    model, optimizer, scheduler = _setup(0)
    _save(tmp_path, 50, model, optimizer, scheduler, keep_last=2)
    newest = _save(tmp_path, 100, model, optimizer, scheduler, keep_last=2)
    _flip_last_byte(newest / "model.safetensors")  # same size: only the checksum tells
    assert ckpt.latest_checkpoint(tmp_path, set_aside=True).name == "step_000050"
    _save(tmp_path, 75, model, optimizer, scheduler, keep_last=1)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_000075"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000075"
