"""The bundled base policies: the built-in task's `builtin:arith`, its mixture-of-experts twin
`builtin:arith-moe`, and the dots task's vision-language `builtin:dots`: small, loadable both
ways, and as good as documented."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    Idefics3ForConditionalGeneration,
    LlamaForCausalLM,
    Qwen3MoeForCausalLM,
)

from grouprl.models import load_model, load_tokenizer, resolve_model_path
from grouprl.tasks import get_task
from grouprl.train.evaluate import EvalSettings, evaluate

#: each bundled policy: its class, the most its directory may weigh, its parameter count's range
MODELS = {"builtin:arith": (LlamaForCausalLM, 10 * 2**20, (1e6, 5e6)),
          "builtin:arith-moe": (Qwen3MoeForCausalLM, 14 * 2**20, (1e6, 5e6)),
          "builtin:dots": (Idefics3ForConditionalGeneration, 4 * 2**20, (5e5, 2e6))}  # fmt: skip
#: each one's task
TASKS = {"builtin:arith": "arithmetic", "builtin:arith-moe": "arithmetic", "builtin:dots": "dots"}
each_model = pytest.mark.parametrize("spec", list(MODELS))


@each_model
def test_directory_is_small_and_ordinary(spec) -> None:
    path = resolve_model_path(spec)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors"} <= names
    assert {"tokenizer.json", "tokenizer_config.json", "README.md", "metrics.json"} <= names
    assert sum(p.stat().st_size for p in path.iterdir()) <= MODELS[spec][1]


@each_model
def test_loads_through_the_public_loader_and_transformers(spec) -> None:
    ours = load_model(spec)
    auto = AutoModelForImageTextToText if spec == "builtin:dots" else AutoModelForCausalLM
    theirs = auto.from_pretrained(resolve_model_path(spec))
    assert isinstance(ours, MODELS[spec][0]) and isinstance(theirs, MODELS[spec][0])
    low, high = MODELS[spec][2]
    assert low <= sum(p.numel() for p in ours.parameters()) <= high
    state = theirs.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in ours.state_dict().items())
    tokenizer = load_tokenizer(spec)
    configs = (ours.config.get_text_config(), ours.generation_config)
    for config in configs if spec != "builtin:dots" else configs[:1]:
        assert config.eos_token_id == tokenizer.eos_token_id
        assert config.pad_token_id == tokenizer.pad_token_id
        assert config.bos_token_id == tokenizer.bos_token_id


@pytest.mark.parametrize("spec", ["builtin:arith", "builtin:arith-moe"])
def test_greedy_completion_is_a_worked_trace(spec) -> None:
    model, tokenizer = load_model(spec), load_tokenizer(spec)
    ids = tokenizer("37+45=", return_tensors="pt")["input_ids"]
    out = model.generate(ids, do_sample=False, max_new_tokens=30)
    assert out[0, -1] == tokenizer.eos_token_id
    assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == "7+5=12,3+4+1=8|82"


@pytest.mark.numerics
@each_model
def test_documented_figures_hold(spec) -> None:
    """Re-measure the docs' evaluation (a fixed seed: 200 held-out problems x 8 samples)."""
    # The measured figures the model's README quotes, and the setting that produced them.
    metrics = json.loads((resolve_model_path(spec) / "metrics.json").read_text())
    setting = metrics["eval"]
    task = get_task(setting["task"])
    result = evaluate(
        load_model(spec),
        load_tokenizer(spec),
        list(task.heldout[: setting["limit"]]),
        EvalSettings(
            task.max_new_tokens,
            samples=setting["samples"],
            temperature=setting["temperature"],
            seed=setting["seed"],
        ),
        reward_fn=task.reward_funcs["correct"],
        progress=False,
    )
    documented = metrics["heldout"]
    # Sampling statistics: on another CPU, rounding moves some inverse-CDF draws across a
    # token boundary, so some completions differ. Each figure is held to 4 standard deviations
    # of a fresh measurement of its kind, √(p(1 − p)/n) with the documented p: n = 1600
    # sampled completions for pass@1, 200 problems for pass@8 and greedy pass@1; a documented
    # p of 0 or 1 (no spread of its own) is taken one event in from the edge, 1/n or 1 − 1/n.
    n = setting["limit"]
    for got, key, count in ((result.pass_at_1, "pass_at_1", n * setting["samples"]),
                            (result.pass_at_k, "pass_at_8", n),
                            (result.greedy_pass_at_1, "greedy_pass_at_1", n)):  # fmt: skip
        p = documented[key]
        q = min(max(p, 1 / count), 1 - 1 / count)
        assert abs(got - p) <= 4 * (q * (1 - q) / count) ** 0.5, (key, got, p)
    # The design targets of the base policy: room for RL, and mostly right when greedy.
    assert 0.2 <= result.pass_at_1 <= 0.6
    assert result.pass_at_k >= 0.8 and result.greedy_pass_at_1 >= 0.8
