"""vLLM in its own process (`grouprl.rollout.vllm_process`) and asynchronous runs with it: its
rollouts are the in-process engine's bit for bit, its weights follow each announced version,
and an overlapped `--max-staleness 1` run keeps the schedule of its sequential simulation."""

from __future__ import annotations

import copy
import json

import torch
from test_engine import OPTIONS, TEXTS
from test_train import base
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl.config import TrainConfig
from grouprl.models.lora import checkpoint_weights
from grouprl.rollout.vllm_engine import VLLMEngine
from grouprl.rollout.vllm_process import VLLMProcessEngine
from grouprl.train import loop


def test_the_process_engine_samples_what_the_in_process_one_does(vllm_model_dir):
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    copy_ = copy.deepcopy(model)
    remote = VLLMProcessEngine(copy_, tokenizer, OPTIONS, weights=lambda: checkpoint_weights(copy_))
    try:
        local = VLLMEngine(model, tokenizer, OPTIONS)
        try:
            want = local.sample(ids, group_size=2, max_new_tokens=12, seed=5)
        finally:
            local.close()
        got = remote.sample(ids, group_size=2, max_new_tokens=12, seed=5)
        assert torch.equal(got.completion_ids, want.completion_ids)
        assert torch.equal(got.behaviour_logp, want.behaviour_logp)
        assert got.texts == want.texts
        # a new version: loaded before the next sample, and only when announced
        with torch.no_grad():
            for p in copy_.parameters():
                p.mul_(0.5)
        same = remote.sample(ids, group_size=2, max_new_tokens=12, seed=5)
        assert torch.equal(same.behaviour_logp, want.behaviour_logp)  # not announced yet
        remote.policy_updated(1)
        moved = remote.sample(ids, group_size=2, max_new_tokens=12, seed=5)
        assert not torch.equal(moved.behaviour_logp, want.behaviour_logp)
    finally:
        remote.close()
    assert not remote._process.is_alive()


def test_an_async_vllm_run_keeps_the_schedule_of_its_sequential_simulation(
    vllm_model_dir, files, tmp_path, monkeypatch
):
    options = {**base(vllm_model_dir, files), "max_staleness": 1, "sampler_threads": 1}
    loop.train(TrainConfig(**options, output_dir=tmp_path / "overlapped"))
    monkeypatch.setenv("GROUPRL_SEQUENTIAL_AHEAD", "1")
    loop.train(TrainConfig(**options, output_dir=tmp_path / "sequential"))

    def read(name, run):
        return [json.loads(x) for x in (tmp_path / run / name).read_text().splitlines()]

    a, b = read("metrics.jsonl", "overlapped"), read("metrics.jsonl", "sequential")
    assert [m["staleness"] for m in a] == [0.0, 1.0, 1.0] == [m["staleness"] for m in b]
    # the same requests, seeds and weights: vLLM's CPU kernels give the same tokens here
    assert read("samples.jsonl", "overlapped") == read("samples.jsonl", "sequential")
    for x, y in zip(a, b, strict=True):
        assert x["reward_mean"] == y["reward_mean"] and x["loss"] == y["loss"]
        assert x["logp_mismatch_max"] == y["logp_mismatch_max"]
