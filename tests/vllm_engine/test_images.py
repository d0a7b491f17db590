"""vLLM samples prompts with images (a tiny Idefics3, the family vLLM's CPU build runs without
torchvision): it is given each prompt's images and its ids with one placeholder an image, and
expands them into the same prompt the trainer's processor made; it never samples the image
token (its logit lowered by 100), and its behaviour log-probs equal the trainer's renormalised
without that token within float32 rounding (`numerics.forward_bound`, summed over a row's
tokens); another image gives other log-probs. The same through a vLLM server, sent the images
as PNG data URLs."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image, ImageDraw

from grouprl.cli import main
from grouprl.models import load_model, load_tokenizer
from grouprl.models.tiny import save_tiny_vlm
from grouprl.models.vision import processor_of
from grouprl.rollout import completion_logprobs
from grouprl.rollout.logprobs import next_token_log_softmax
from grouprl.rollout.vllm_engine import VLLMEngine, VLLMOptions
from grouprl.train.prompts import prompt_ids
from numerics import forward_bound, logit_magnitude

pytestmark = pytest.mark.numerics

OPTIONS = VLLMOptions(dtype="float32", max_model_len=256, kv_cache_bytes=64 << 20,
                      block_size=32, chunked_prefill=False)  # fmt: skip


def dots(count: int) -> Image.Image:
    image = Image.new("RGB", (64, 64), "white")
    draw = ImageDraw.Draw(image)
    for k in range(count):
        draw.ellipse([6 + 14 * k, 20, 14 + 14 * k, 28 + 4 * k], fill="black")
    return image


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("idefics3")
    save_tiny_vlm(directory, "idefics3")
    return directory


@pytest.fixture(scope="module")
def vlm(vlm_dir):
    return load_model(vlm_dir), load_tokenizer(vlm_dir)


def test_vllm_samples_image_prompts_with_the_trainers_log_probs(vlm):
    model, tokenizer = vlm
    rows = [{"prompt": "How many dots?", "image": dots(k)} for k in (1, 3)]
    ids = [prompt_ids(tokenizer, r["prompt"], row=r) for r in rows]
    engine = VLLMEngine(model, tokenizer, OPTIONS)
    try:
        rollout = engine.sample(ids, group_size=3, max_new_tokens=8, seed=0)
        swapped = engine.sample(ids[::-1], group_size=3, max_new_tokens=8, seed=0)
    finally:
        engine.close()
    assert rollout.media is not None and rollout.media.images() == [[r["image"]] for r in rows]
    image_token = processor_of(tokenizer).image_token_id
    assert image_token not in rollout.completion_ids[rollout.mask].tolist()
    with torch.no_grad():
        mine = completion_logprobs(model, rollout)
        every = next_token_log_softmax(model, rollout)(0, int(rollout.mask.sum()))  # (M, V)
    # vLLM samples with the image token's logit lowered by 100 (never drawn) and reports the
    # log-probs of what it sampled from: the trainer's renormalised without the image token
    expected = mine.clone()
    expected[rollout.mask] -= torch.log1p(-every[:, image_token].exp())
    width = rollout.mask.sum(-1, keepdim=True)  # a row's bound: its tokens' bounds summed
    bound = width * forward_bound(model.config, 2 * logit_magnitude(model))
    assert ((expected - rollout.behaviour_logp).abs().sum(-1, keepdim=True) <= bound).all()
    # the images matter: prompt 0's image under prompt 1's ids samples other log-probs
    assert not torch.equal(swapped.behaviour_logp[3:], rollout.behaviour_logp[:3])


def test_a_vllm_server_samples_image_prompts_with_the_trainers_log_probs(vlm, vlm_dir):
    """The same against a vLLM server (`--vllm-server local`'s command): each request carries
    its images as PNG data URLs beside the placeholder ids; sampled twice (an image the server
    has seen before), its log-probs are the trainer's renormalised without the image token."""
    from grouprl.rollout.vllm_server import LocalServer, VLLMServerEngine

    model, tokenizer = vlm
    rows = [{"prompt": "How many dots?", "image": dots(k)} for k in (2, 4)]
    ids = [prompt_ids(tokenizer, r["prompt"], row=r) for r in rows]
    server = LocalServer(vlm_dir, dtype="float32", max_model_len=256, kv_cache_bytes=64 << 20,
                         env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    engine = VLLMServerEngine(model, tokenizer, [server.url], weights=model.state_dict)
    try:
        first = engine.sample(ids, group_size=2, max_new_tokens=6, seed=0)
        again = engine.sample(ids, group_size=2, max_new_tokens=6, seed=0)
    finally:
        engine.close()
        server.stop()
    assert torch.equal(again.completion_ids, first.completion_ids)  # seeded, the same images
    image_token = processor_of(tokenizer).image_token_id
    with torch.no_grad():
        mine = completion_logprobs(model, first)
        every = next_token_log_softmax(model, first)(0, int(first.mask.sum()))  # (M, V)
    expected = mine.clone()
    expected[first.mask] -= torch.log1p(-every[:, image_token].exp())
    bound = first.mask.sum(-1, keepdim=True) * forward_bound(model.config,
                                                              2 * logit_magnitude(model))  # fmt: skip
    assert ((expected - first.behaviour_logp).abs().sum(-1, keepdim=True) <= bound).all()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_vision_language_model_trains_on_vllm(vlm_dir, tmp_path, lora):
    """3 steps with --engine vllm: vLLM samples the images' prompts with the policy's weights
    after every update (a LoRA policy's merged) and the trainer trains on them."""
    rows = []
    for i in range(16):
        dots(1 + i % 3).rotate(7 * i).save(tmp_path / f"{i}.png")
        rows.append({"prompt": "How many dots?", "image": str(tmp_path / f"{i}.png")})
    (tmp_path / "dots.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "rewards.py").write_text(
        "def varies(completions, **_):\n    return [sum(map(ord, c)) % 3 / 2 for c in completions]\n"
    )
    out = tmp_path / "run"
    assert main(["train", "--model", str(vlm_dir), "--engine", "vllm", "--dataset",
                 str(tmp_path / "dots.jsonl"), "--rewards", f"{tmp_path / 'rewards.py'}:varies",
                 "1", "--steps", "3", "--prompts-per-step", "4", "--minibatches", "1",
                 "--group-size", "4", "--max-new-tokens", "8", "--eval-every", "0",
                 "--eval-size", "2", "--eval-samples", "1", "--no-progress", "--threads", "1",
                 "--lr", "1e-3", "--warmup-steps", "0", "--output-dir", str(out),
                 *(["--lora-r", "4"] if lora else [])]) == 0  # fmt: skip
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["grad_norm"] > 0 for r in records)
    # the mismatch is logged (vLLM's log-probs, renormalised without the image token, against
    # the trainer's: held to rounding by the test above)
    assert all(r["logp_mismatch_max"] >= 0 for r in records)
