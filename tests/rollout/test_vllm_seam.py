"""What the vLLM engine needs from grouprl that runs without vLLM: the first stop-string hit
equal to the step-by-step rule, request seeds, the KV cache's size, the engine's options from a
run's, LoRA weights merged apart, and `--engine vllm` without vLLM as one line."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.errors import UserError
from grouprl.models import load_model, load_tokenizer
from grouprl.models.lora import apply_lora, checkpoint_weights
from grouprl.rollout.stops import StopStrings
from grouprl.rollout.vllm_engine import available, kv_bytes_per_token, row_seed

TOKENIZER = load_tokenizer("builtin:arith")


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(3, 101), min_size=1, max_size=30),
    begin=st.integers(0, 29),
    since=st.integers(0, 29),
    stop=st.lists(st.sampled_from(["1", "+", "2=", "<", "3 4", "a"]), min_size=1, max_size=3),
)
def test_first_hit_is_the_first_step_at_which_hits_fires(ids, begin, since, stop):
    stopper = StopStrings(TOKENIZER, stop)
    begin = min(begin, len(ids))
    buffer = torch.tensor([ids])
    steps = [t for t in range(begin, len(ids))
             if bool(stopper.hits(buffer, None, torch.tensor([True]), t, since=[since])[0])]  # fmt: skip
    assert stopper.first_hit(ids, begin, len(ids), since) == (steps[0] if steps else None)


def test_request_seeds_are_distinct_and_stable():
    seeds = {row_seed(7, r, b) for r in range(4) for b in range(0, 512, 8)}
    assert len(seeds) == 4 * 64 and all(0 <= s < 2**62 for s in seeds)
    assert row_seed(7, 0, 8) == row_seed(7, 0, 8) != row_seed(8, 0, 8)
    # a request's children get seed + i: the first 64 children of different requests never meet
    assert min(abs(a - b) for a in seeds for b in seeds if a != b) > 64


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer():
    model = load_model("builtin:arith")  # 4 layers, 4 KV heads of 32
    assert kv_bytes_per_token(model.config, torch.float32) == 2 * 4 * 4 * 32 * 4
    assert kv_bytes_per_token(model.config, torch.bfloat16) == 2 * 4 * 4 * 32 * 2


def test_vllm_options_follow_the_run():
    from grouprl.config import TrainConfig
    from grouprl.train.build import vllm_options

    model = load_model("builtin:arith")
    cfg = TrainConfig(engine="vllm")
    o = vllm_options(cfg, model, None, rows=128, max_len=100, seed=3)
    assert (o.dtype, o.max_model_len, o.enforce_eager, o.block_size, o.seed) == (
        "float32", 100, True, 32, 3)  # fmt: skip
    assert not o.chunked_prefill  # a CPU: vLLM cannot rewind a CPU generator
    assert o.kv_cache_bytes == 128 * 100 * 2 * 4 * 4 * 32 * 4  # every row at full length
    o = vllm_options(cfg, model, torch.bfloat16, rows=128, max_len=None, seed=0)
    assert (o.dtype, o.max_model_len) == ("bfloat16", 256)  # the model's context
    with pytest.raises(UserError, match="sleep mode needs CUDA"):
        vllm_options(TrainConfig(engine="vllm", vllm_sleep=True), model, None, 8, 100, 0)


def test_lora_checkpoint_weights_are_the_merged_model_and_leave_the_policy_alone():
    import copy

    policy = apply_lora(load_model("builtin:arith"), r=4, alpha=8)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    weights = checkpoint_weights(policy)
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert weights.keys() == merged.keys()
    assert all(torch.equal(weights[k], merged[k]) for k in merged)  # peft's own merge, exactly
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing merged in place


@pytest.mark.skipif(available(), reason="vLLM is installed here")
def test_engine_vllm_without_vllm_says_how_to_install_it(tmp_path, capsys):
    from grouprl.cli import main

    run = tmp_path / "run"
    assert main(["train", "--engine", "vllm", "--steps", "1", "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'grouprl[vllm]'" in err[0], err
    assert not run.exists()


def test_the_vllm_process_gets_tied_weights_as_a_file_it_can_read(tmp_path):
    """A model with tied embeddings (the built-in one) hands vLLM's process the same tensor
    under two names: the file holds a copy for the second, equal to the first."""
    import torch
    from safetensors.torch import load_file, save_file

    from grouprl.rollout.vllm_process import _host_tensors

    embed = torch.randn(5, 3)
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": embed,
               "layer.weight": torch.randn(3, 3)}  # fmt: skip
    with pytest.raises(RuntimeError, match="share memory"):
        save_file(dict(weights), str(tmp_path / "as_they_are.safetensors"))
    save_file(_host_tensors(weights), str(tmp_path / "w.safetensors"))
    loaded = load_file(str(tmp_path / "w.safetensors"))
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
