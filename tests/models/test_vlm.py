"""Vision-language models: tiny Idefics3, LLaVA and Gemma 3 models (their processors need no
torchvision; Gemma 3's adds per-token `token_type_ids` and a sliding-window decoder) sample and
train with images from a dataset's image column.

- The trainer's shared-prompt log-probs (the prompt with its images run once per group) equal a
  plain per-row forward of the whole model (each row its prompt's images, its ids, no cache),
  and the sampler's own log-probs, on float64 models to `numerics.F64_SAME`.
- The images reach the model: the same ids with another prompt's images give other log-probs.
- 3 steps train, full and LoRA: the language model moves, the vision encoder stays as loaded
  (frozen by default), LoRA adapters sit on the language model only; the final directory
  loads back as the same vision-language model with its processor.
- A user's mistakes are one line each: images with a text model, a missing image file, an
  image over --max-image-pixels, --packing on with a vision-language model.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file

from grouprl.cli import main
from grouprl.errors import UserError
from grouprl.models import load_model, load_tokenizer
from grouprl.models.tiny import VLM_FAMILIES, save_tiny_vlm
from grouprl.models.vision import processor_of
from grouprl.rollout import completion_logprobs, sample_groups
from grouprl.rollout.media import Media
from grouprl.train.prompts import prompt_ids
from numerics import assert_same_f64

FLAGS = ["--steps", "3", "--prompts-per-step", "4", "--minibatches", "1", "--group-size", "4",
         "--max-new-tokens", "6", "--eval-every", "0", "--eval-size", "2", "--eval-samples", "1",
         "--no-progress", "--threads", "1", "--lr", "1e-3", "--log-ratios", "0"]  # fmt: skip


def dots(count: int, seed: int) -> Image.Image:
    """A 64x64 white image with `count` black dots (never blank: Idefics3 drops all-zero
    images as padding)."""
    rng = torch.Generator().manual_seed(seed)
    image = Image.new("RGB", (64, 64), "white")
    draw = ImageDraw.Draw(image)
    for _ in range(count):
        x, y = (int(v) for v in torch.randint(4, 52, (2,), generator=rng))
        draw.ellipse([x, y, x + 8, y + 8], fill="black")
    return image


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Both tiny models, a dataset of 24 dot images (paths in an `image` column) and a reward
    that varies with what a random model writes."""
    root = tmp_path_factory.mktemp("vlm")
    for family in VLM_FAMILIES:
        save_tiny_vlm(root / family, family)
    rows = []
    for i in range(24):
        dots(1 + i % 4, i).save(root / f"dots{i}.png")
        rows.append({"prompt": [{"role": "user", "content": "How many dots?"}],
                     "image": str(root / f"dots{i}.png"), "answer": str(1 + i % 4)})  # fmt: skip
    (root / "dots.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (root / "rewards.py").write_text(
        "def varies(completions, **_):\n"
        "    return [sum(map(ord, c[0]['content'])) % 3 / 2 for c in completions]\n"
    )
    return root


def part(name: str) -> str:
    """Which part of a vision-language model a weight or module name is in (LLaVA saves the
    legacy layout, `language_model.model.layers...`; Idefics3 `model.text_model...`)."""
    if "vision_tower" in name or "vision_model" in name:
        return "vision"
    if "multi_modal_projector" in name or "connector" in name:
        return "projector"
    return "language"


def _prompts(tokenizer, n: int = 2):
    rows = [{"prompt": "How many dots?" if i else "Count the dots, please.",
             "image": dots(i + 1, i)} for i in range(n)]  # fmt: skip
    return [prompt_ids(tokenizer, r["prompt"], row=r) for r in rows]


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_shared_prompt_logprobs_equal_a_plain_per_row_forward(root, family):
    model = load_model(root / family, dtype=torch.float64)
    tokenizer = load_tokenizer(root / family)
    prompts = _prompts(tokenizer)
    assert len(set(map(len, prompts))) == 2  # left padding is exercised
    rollout = sample_groups(model, tokenizer, prompts, group_size=3, max_new_tokens=6, seed=0)
    assert rollout.media is not None and len(rollout.media.prompts) == 2
    with torch.no_grad():
        shared = completion_logprobs(model, rollout)
        rows = completion_logprobs(model, rollout, share_prompt=False)
        plain = torch.zeros_like(shared)
        for r in range(rollout.completion_ids.shape[0]):  # the model's own forward, row alone
            b = r // rollout.group_size
            inputs = rollout.media.select([b]).inputs(len(prompts[b]), torch.device("cpu"))
            ids = torch.tensor([list(prompts[b]) + rollout.completion_ids[r].tolist()])
            logits = model(input_ids=ids, **inputs).logits[0, len(prompts[b]) - 1 : -1]
            taken = logits.log_softmax(-1).gather(-1, rollout.completion_ids[r][:, None])[:, 0]
            plain[r] = taken.masked_fill(~rollout.mask[r], 0.0)
    assert_same_f64(shared, plain)
    assert_same_f64(rows, plain)
    assert_same_f64(rollout.old_logp, plain)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_the_images_reach_the_model(root, family):
    model = load_model(root / family, dtype=torch.float64)
    tokenizer = load_tokenizer(root / family)
    prompts = _prompts(tokenizer)
    rollout = sample_groups(model, tokenizer, prompts, group_size=2, max_new_tokens=4, seed=0)
    swapped = Media(rollout.media.prompts[::-1], rollout.media.lengths)
    other = type(rollout)(**{**rollout.__dict__, "media": swapped})
    with torch.no_grad():
        mine = completion_logprobs(model, rollout)
        theirs = completion_logprobs(model, other)
    # another image moves a log-prob by about its own size: far beyond float64 rounding
    assert float((mine - theirs).abs().max()) > 1e-3


@pytest.mark.parametrize("family", VLM_FAMILIES)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_vision_language_model_trains_with_images(root, tmp_path, family, lora):
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "run"
    extra = ["--lora-r", "4", "--lora-alpha", "8", "--lora-target-modules", "q_proj", "v_proj"]
    assert main(["train", "--model", str(root / family), "--dataset", str(root / "dots.jsonl"),
                 "--rewards", f"{root / 'rewards.py'}:varies", "1", *FLAGS,
                 *(extra if lora else []), "--output-dir", str(out)]) == 0  # fmt: skip
    before = load_file(str(root / family / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    moved = {part(k) for k in after if not torch.equal(after[k], before[k])}
    assert "language" in moved and "vision" not in moved  # the vision encoder is frozen
    assert ("projector" in moved) is not lora  # full fine-tuning trains the projector too
    if lora:
        config = json.loads((out / "final" / "adapter" / "adapter_config.json").read_text())
        assert config["target_modules"]
        assert {part(t) for t in config["target_modules"]} == {"language"}
    final = AutoModelForImageTextToText.from_pretrained(out / "final")
    assert type(final).__name__ == type(load_model(root / family)).__name__
    assert processor_of(load_tokenizer(out / "final")) is not None
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["ratio_max"] == pytest.approx(1.0, abs=1e-5)  # sampler == trainer
    assert any(m["grad_norm"] > 0 for m in metrics)


def test_images_in_content_parts_and_an_images_list(root):
    tokenizer = load_tokenizer(root / "idefics3")
    processor = processor_of(tokenizer)
    image = dots(2, 0)
    parts = {"prompt": [{"role": "user", "content": [{"type": "image", "image": image},
                                                     {"type": "text", "text": "How many?"}]}]}  # fmt: skip
    listed = {"prompt": "How many?", "images": [image]}
    a, b = prompt_ids(tokenizer, parts["prompt"], row=parts), prompt_ids(tokenizer, "How many?",
                                                                         row=listed)  # fmt: skip
    assert list(a) == list(b)
    assert torch.equal(a.media.tensors["pixel_values"], b.media.tensors["pixel_values"])
    assert list(a).count(processor.image_token_id) == 4  # image_seq_len 4, one image


def test_mistakes_are_one_line(root, tmp_path, capsys):
    tokenizer = load_tokenizer(root / "idefics3")
    with pytest.raises(UserError, match="does not exist"):
        prompt_ids(tokenizer, "How many?", row={"prompt": "How many?", "image": "/no/such.png"})
    big = Image.new("RGB", (300, 300), "white")
    limited = load_tokenizer(root / "idefics3")
    from grouprl.models.vision import with_image_limit

    with_image_limit(limited, 256 * 256)
    with pytest.raises(UserError, match="300x300, over the limit of 65536 pixels"):
        prompt_ids(limited, "How many?", row={"prompt": "How many?", "image": big})
    from grouprl.models.tiny import save_tiny_chat_model

    save_tiny_chat_model(tmp_path / "text")
    text = load_tokenizer(tmp_path / "text")
    with pytest.raises(UserError, match="has images, but the model is a text model"):
        prompt_ids(text, "How many?", row={"prompt": "How many?", "image": big})
    code = main(["train", "--model", str(root / "idefics3"), "--dataset",
                 str(root / "dots.jsonl"), "--rewards", f"{root / 'rewards.py'}:varies", "1",
                 *FLAGS, "--packing", "on", "--output-dir", str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("error:") == 1, err
    assert "--packing on: a vision-language model's prompts carry images" in err


def test_a_qwen_vl_model_is_refused_in_one_line(tmp_path):
    """Qwen2-VL's rotary positions depend on its images (`get_rope_index`): loading one is one
    line, not a run on positions other than its own."""
    import transformers as hf

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, vocab_size=300,
                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})  # fmt: skip
    config = hf.Qwen2VLConfig(text_config=text, vision_config=dict(
        depth=1, embed_dim=32, hidden_size=64, num_heads=2, in_channels=3, patch_size=14))  # fmt: skip
    hf.Qwen2VLForConditionalGeneration(config).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="image-dependent rotary positions"):
        load_model(tmp_path)


def test_text_prompts_on_a_vision_language_model_are_plain_text(root):
    """A text-only row on a VLM: no media, the tokenizer's chat template, and the trainer's
    log-probs are the sampler's (float64)."""
    model = load_model(root / "idefics3", dtype=torch.float64)
    tokenizer = load_tokenizer(root / "idefics3")
    row = {"prompt": [{"role": "user", "content": "How many dots?"}]}
    ids = prompt_ids(tokenizer, row["prompt"], row=row)
    assert not hasattr(ids, "media") and processor_of(tokenizer).image_token_id not in ids
    rollout = sample_groups(model, tokenizer, [ids], group_size=2, max_new_tokens=4, seed=0)
    assert rollout.media is None
    with torch.no_grad():
        assert_same_f64(completion_logprobs(model, rollout), rollout.old_logp)


def test_the_image_token_is_never_sampled(root):
    """A completion holding the image token would make the model look for one more image where
    prompt and completion are run together (gradient checkpointing, heads that are more than a
    projection). With the head biased to it, the sampler still never draws it, the log-probs
    stay the untruncated distribution's (as top-k's), and the per-row forward runs."""
    from torch import nn

    model = load_model(root / "idefics3", dtype=torch.float64)
    tokenizer = load_tokenizer(root / "idefics3")
    image_token = processor_of(tokenizer).image_token_id
    head = model.get_output_embeddings()
    biased = nn.Linear(head.in_features, head.out_features, bias=True, dtype=torch.float64)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[image_token] = 50.0  # every position's most likely token by far
    model.lm_head = biased
    rollout = sample_groups(model, tokenizer, _prompts(tokenizer), group_size=3,
                            max_new_tokens=6, seed=0)  # fmt: skip
    assert image_token not in rollout.completion_ids[rollout.mask].tolist()
    with torch.no_grad():
        rows = completion_logprobs(model, rollout, share_prompt=False)
    assert_same_f64(rows, rollout.old_logp)
    assert float(rollout.old_logp[rollout.mask].max()) < -40  # under the biased distribution


def test_a_vision_language_run_stopped_and_resumed_ends_bit_for_bit(root, tmp_path, stop_at):
    """The rows' images are read again on resume and give the same prompts, tensors and
    samples: a run stopped after step 2 and resumed ends on the same weights and metrics."""
    import signal

    args = ["train", "--model", str(root / "idefics3"), "--dataset", str(root / "dots.jsonl"),
            "--rewards", f"{root / 'rewards.py'}:varies", "1", *FLAGS, "--save-every", "1"]  # fmt: skip
    assert main([*args, "--output-dir", str(tmp_path / "whole")]) == 0
    stop_at(2, signal.SIGINT)
    assert main([*args, "--output-dir", str(tmp_path / "cut")]) == 130
    stop_at(None)
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0
    got, want = (load_file(str(tmp_path / d / "final" / "model.safetensors"))
                 for d in ("cut", "whole"))  # fmt: skip
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    times = ("_seconds", "tokens_per_s")
    metrics = [[{k: v for k, v in json.loads(line).items() if not k.endswith(times)}
                for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
               for d in ("cut", "whole")]  # fmt: skip
    assert metrics[0] == metrics[1]
