"""grouprl.trl's GRPOConfig is TRL 1.16's (every field, every default), and every field is
mapped, refused or warned about: a refused one raises naming itself, a warned one never changes
the options a run is made from; TRL's batch arithmetic by hand."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from grouprl.errors import UserError
from grouprl.trl import FIELDS, GRPOConfig, options_from
from grouprl.trl.config import MAPPED, REFUSED, WARNED


def other(value):
    """A value unlike TRL's default, of a type the field takes."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 3
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "_x" if value else "x"
    if isinstance(value, list):
        return ["loss"]
    return "x"  # None


def test_the_fields_and_defaults_are_the_installed_trls():
    trl = pytest.importorskip("trl")
    assert trl.__version__.startswith("1.16")
    theirs = {}
    for f in dataclasses.fields(trl.GRPOConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        theirs[f.name] = default
    ours = {f.name: getattr(GRPOConfig(), f.name) for f in dataclasses.fields(GRPOConfig)}
    assert list(ours) == list(theirs)
    assert ours == theirs
    assert {spec.kind for spec in FIELDS.values()} == {MAPPED, REFUSED, WARNED}


@pytest.mark.parametrize("name", [n for n, spec in FIELDS.items() if spec.kind == REFUSED])
def test_a_refused_field_set_raises_naming_it(name):
    with pytest.raises(UserError, match=f"GRPOConfig\\({name}="):
        options_from(GRPOConfig(**{name: other(FIELDS[name].default)}), rows=100)


def test_a_warned_field_never_changes_the_options():
    base = options_from(GRPOConfig(), rows=100)
    warned = [n for n, spec in FIELDS.items() if spec.kind == WARNED]
    for name in warned:
        with pytest.warns(UserWarning, match=name):
            assert options_from(GRPOConfig(**{name: other(FIELDS[name].default)}), rows=100) == base
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # bf16=False: on a CPU without bf16, TRL's default bf16 adds a warning of its own
        options_from(
            GRPOConfig(bf16=False, **{n: other(FIELDS[n].default) for n in warned}), rows=100
        )
    assert len(caught) == 1  # one warning, listing them all
    assert all(n in str(caught[0].message) for n in warned)


def test_trls_batch_arithmetic_by_hand():
    o = options_from(GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                num_generations=4, max_steps=6), rows=100)  # fmt: skip
    # generation batch = 4 x 1 x 2 = 8 completions: 2 prompts, one optimizer step per rollout
    assert (o["prompts_per_step"], o["group_size"], o["minibatches"], o["micro_batch_size"],
            o["epochs"], o["steps"]) == (2, 4, 1, 4, 1, 6)  # fmt: skip
    o = options_from(GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                num_generations=4, steps_per_generation=4, num_iterations=2,
                                max_steps=8), world=2, rows=100)  # fmt: skip
    # generation batch = 4 x 2 x 4 = 32: 8 prompts, 2 minibatches x 2 epochs = 4 updates/rollout
    assert (o["prompts_per_step"], o["minibatches"], o["epochs"], o["steps"]) == (8, 2, 2, 2)
    # epochs: ceil(3 x 100 rows / 1 prompt a step) with TRL's defaults (8 completions, G = 8)
    assert options_from(GRPOConfig(), rows=100)["steps"] == 300
    with pytest.raises(UserError, match="multiple of the optimizer steps per generation"):
        options_from(GRPOConfig(steps_per_generation=2, max_steps=3), rows=100)
    with pytest.raises(UserError, match="whole groups"):
        options_from(GRPOConfig(per_device_train_batch_size=3, num_generations=4,
                                generation_batch_size=12), rows=100)  # fmt: skip
    with pytest.raises(UserError, match="give max_steps"):
        options_from(GRPOConfig(), rows=None)


def test_trls_objective_by_name():
    assert options_from(GRPOConfig(), rows=8)["loss_agg"] == "token_mean"  # dapo
    dr = options_from(GRPOConfig(loss_type="dr_grpo", max_completion_length=64), rows=8)
    assert (dr["loss_agg"], dr["norm_len"]) == ("seq_mean_token_sum_norm", 64)
    o = options_from(GRPOConfig(loss_type="grpo", epsilon=0.1, epsilon_high=0.28, delta=1.5,
                                importance_sampling_level="sequence", scale_rewards=False,
                                beta=0.04, use_bias_correction_kl=False,
                                lr_scheduler_type="cosine", warmup_steps=0.5, max_steps=10),
                     rows=8)  # fmt: skip
    assert (o["loss_agg"], o["clip_low"], o["clip_high"], o["dual_clip"], o["ratio_level"],
            o["adv_scale"], o["beta"], o["lr_schedule"], o["warmup_steps"]) == (
        "seq_mean_token_mean", 0.1, 0.28, 1.5, "sequence", "none", 0.04, "cosine", 5)  # fmt: skip
    cispo = options_from(GRPOConfig(loss_type="cispo", epsilon_high=5.0), rows=8)
    assert (cispo["objective"], cispo["cispo_cap"], cispo["loss_agg"]) == ("cispo", 5.0,
                                                                           "token_mean")  # fmt: skip
    assert "clip_high" not in cispo  # no clip range bounds CISPO: its cap does
    # TRL's CISPO with epsilon_high unset caps at epsilon, 0.2, as TRL does
    assert options_from(GRPOConfig(loss_type="cispo"), rows=8)["cispo_cap"] == 0.2
    sapo = options_from(GRPOConfig(loss_type="sapo", sapo_temperature_neg=2.0), rows=8)
    assert (sapo["objective"], sapo["sapo_tau_pos"], sapo["sapo_tau_neg"], sapo["loss_agg"]) == (
        "sapo", 1.0, 2.0, "seq_mean_token_mean")  # fmt: skip
    luspo = options_from(GRPOConfig(loss_type="luspo", importance_sampling_level="sequence"),
                         rows=8)  # fmt: skip
    assert (luspo["objective"], luspo["ratio_level"], luspo["loss_agg"]) == (
        "clip", "sequence", "seq_mean_token_sum")  # fmt: skip
    with pytest.warns(UserWarning, match="expects importance_sampling_level='sequence'"):
        options_from(GRPOConfig(loss_type="luspo"), rows=8)
    vespo = options_from(GRPOConfig(loss_type="vespo", vespo_k_neg=4.0), rows=8)
    assert (vespo["objective"], vespo["vespo_k_neg"], vespo["loss_agg"]) == ("vespo", 4.0,
                                                                             "token_mean")  # fmt: skip
    with pytest.raises(UserError, match="loss_type='ppo'"):
        options_from(GRPOConfig(loss_type="ppo"), rows=8)
    assert options_from(GRPOConfig(beta=0.04), rows=8)["kl_ratio_weighted"] is True
    with pytest.raises(UserError, match="per-process"):
        options_from(GRPOConfig(loss_type="bnpo"), world=2, rows=8)


def test_bf16_runs_where_the_device_has_it_and_fp32_with_one_line_elsewhere(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert options_from(GRPOConfig(), rows=8)["precision"] == "bf16"  # TRL's None means True
    assert options_from(GRPOConfig(bf16=False), rows=8)["precision"] == "fp32"
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with pytest.warns(UserWarning, match="no bf16 support; training in fp32"):
        assert options_from(GRPOConfig(), rows=8)["precision"] == "fp32"


def test_the_docs_say_what_becomes_of_every_field():
    from pathlib import Path

    page = Path(__file__).parents[2] / "docs" / "guides" / "from-trl.md"
    section = page.read_text(encoding="utf-8")
    from grouprl.trl import ASYNC_FIELDS

    missing = [name for name in {**FIELDS, **ASYNC_FIELDS} if f"`{name}`" not in section]
    assert missing == []


def trls_is_ratio(old, sampled, mask, mode, low, high):
    """TRL 1.16's vLLM importance-sampling ratio (GRPOTrainer._generate_and_score_completions),
    transcribed: (B, T) for token modes, (B, 1) for sequence modes."""
    import math

    import torch

    d = (old - sampled) * mask
    d = d.sum(-1, keepdim=True) if mode.startswith("sequence") else d
    ratio = torch.exp(d)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    lo, hi = -math.inf if low is None else low, math.inf if high is None else high
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


@pytest.mark.parametrize(
    ("mode", "low", "high"),
    [("sequence_mask", None, 3.0), ("token_mask", None, 3.0), ("token_mask", 0.5, 2.0),
     ("token_truncate", None, 3.0), ("token_truncate", 0.5, 2.0), ("sequence_truncate", 0.8, 1.5),
     ("token_mask", 0.9, None)],
)  # fmt: skip
def test_trls_vllm_importance_sampling_is_grouprls_correction(mode, low, high):
    import torch

    from grouprl.core import Correction, correction_weights

    args = GRPOConfig(use_vllm=True, bf16=False, vllm_importance_sampling_mode=mode,
                      vllm_importance_sampling_clip_min=low,
                      vllm_importance_sampling_clip_max=high)  # fmt: skip
    o = options_from(args, rows=8)
    parts = {k.removeprefix("correction_"): v for k, v in o.items() if k.startswith("correction_")}
    assert o["engine"] == "vllm" and "correction" not in o  # the preset stays grouprl's none
    correction = Correction(**parts)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(16, 9, generator=g, dtype=torch.float64) * 3
    sampled = old + torch.randn(16, 9, generator=g, dtype=torch.float64) * 0.6
    mask = torch.ones(16, 9, dtype=torch.bool)
    mask[2, 5:] = mask[4, 1:] = False
    theirs = trls_is_ratio(old, sampled, mask.double(), mode, low, high).expand(16, 9)[mask]
    ours, _ = correction_weights(old, sampled, mask, correction)
    acted = (theirs == 0) if mode.endswith("mask") else (theirs == high) | (theirs == low)
    assert 0 < acted.sum() < theirs.numel()  # the bounds act on some tokens, not all
    # the same ratio, rounded once to float32 (the weight's dtype): relative 2^-24, beside the
    # float64 computations' few operations (a log-space clamp against TRL's ratio-space one,
    # the row's sum of 9 log-ratios): 16·2^-53
    torch.testing.assert_close(ours[mask].double(), theirs, rtol=2**-24 + 16 * 2**-53, atol=0)


def test_trls_vllm_fields_with_trls_defaults_and_refusals():
    o = options_from(GRPOConfig(use_vllm=True, bf16=False), rows=8)
    # TRL 1.16's real default: sequence_mask over the product, at 3 (the ratio, or 0 above)
    assert {k: v for k, v in o.items() if k.startswith("correction")} == {
        "correction_mask": "sequence", "correction_mask_high": 3.0,
        "correction_weight": "sequence", "correction_weight_high": 3.0}  # fmt: skip
    assert "correction_mask" not in options_from(GRPOConfig(bf16=False), rows=8)  # no vLLM
    off = options_from(GRPOConfig(use_vllm=True, vllm_importance_sampling_correction=False),
                       rows=8)  # fmt: skip
    assert not any(k.startswith("correction") for k in off)
    capped = options_from(GRPOConfig(use_vllm=True, vllm_importance_sampling_cap=5.0), rows=8)
    assert capped["correction_mask_high"] == 5.0  # TRL's deprecated name for clip_max
    server = options_from(GRPOConfig(use_vllm=True, vllm_mode="server"), rows=8)
    assert (server["engine"], server["vllm_mode"]) == ("vllm", "server")
    assert "vllm_server" not in server  # no server named: grouprl's own process
    for kwargs, url in [
        ({"vllm_server_base_url": "http://rollout:8000"}, "http://rollout:8000"),
        ({"vllm_server_host": "rollout"}, "http://rollout:8000"),
        ({"vllm_server_port": 8011}, "http://127.0.0.1:8011"),  # TRL's 0.0.0.0: this machine
    ]:
        named = options_from(GRPOConfig(use_vllm=True, vllm_mode="server", **kwargs), rows=8)
        assert (named["engine"], named["vllm_server"]) == ("vllm", url)
    colocated = options_from(GRPOConfig(use_vllm=True, vllm_server_base_url="http://x:1"), rows=8)
    assert "vllm_server" not in colocated  # TRL reads the URL in server mode only
    for kwargs, message in [
        ({"vllm_importance_sampling_mode": "token_truncate",
          "vllm_importance_sampling_clip_max": None}, "with no bound"),
        ({"vllm_importance_sampling_clip_max": None}, "with no bound"),
        ({"vllm_importance_sampling_clip_min": 4.0}, "must be less than"),
        ({"vllm_importance_sampling_mode": "geometric"}, "token_truncate, token_mask"),
        ({"loss_type": "vespo"}, "gamma weights"),
        ({"vllm_mode": "remote"}, "colocate or server"),
    ]:  # fmt: skip
        with pytest.raises(UserError, match=message):
            options_from(GRPOConfig(use_vllm=True, **kwargs), rows=8)


def test_trls_off_policy_mask_where_something_can_drift():
    vllm = options_from(GRPOConfig(use_vllm=True, off_policy_mask_threshold=0.5), rows=8)
    assert vllm["off_policy_mask"] == 0.5
    reuse = options_from(GRPOConfig(bf16=False, num_iterations=2, max_steps=4,
                                    off_policy_mask_threshold=0.5), rows=8)  # fmt: skip
    assert reuse["off_policy_mask"] == 0.5  # a second epoch drifts from the sampler
    with pytest.warns(UserWarning, match="the mask never acts"):
        alone = options_from(GRPOConfig(bf16=False, off_policy_mask_threshold=0.5), rows=8)
    assert "off_policy_mask" not in alone


def test_model_init_kwargs_are_honoured():
    import torch

    o = options_from(GRPOConfig(bf16=False, model_init_kwargs={
        "dtype": torch.bfloat16, "attn_implementation": "eager", "revision": "main"}),
        rows=8, lora=True)  # fmt: skip
    assert (o["base_dtype"], o["attn_implementation"], "revision" in o) == ("bf16", "eager", False)
    o = options_from(GRPOConfig(bf16=False, model_init_kwargs='{"dtype": "float16", '
                                '"revision": "v2", "trust_remote_code": true}', beta=0.04),
                     rows=8)  # fmt: skip
    assert (o["base_dtype"], o["revision"], o["trust_remote_code"]) == ("fp16", "v2", True)
    with pytest.warns(UserWarning, match="trains the weights in fp32"):
        o = options_from(GRPOConfig(bf16=False, model_init_kwargs={"dtype": "bfloat16"}), rows=8)
    assert "base_dtype" not in o  # no frozen weights: nothing to put in bf16
    assert "base_dtype" not in options_from(GRPOConfig(model_init_kwargs={"dtype": "auto"}),
                                            rows=8, lora=True)  # fmt: skip
    with pytest.raises(UserError, match="not device_map"):
        options_from(GRPOConfig(model_init_kwargs={"device_map": "auto"}), rows=8)
    with pytest.raises(UserError, match="dtype is auto"):
        options_from(GRPOConfig(model_init_kwargs={"dtype": "int8"}), rows=8)


def test_trls_async_config_is_grouprls_fixed_lag():
    from grouprl.trl import AsyncGRPOConfig
    from grouprl.trl.async_grpo import async_options_from

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # TRL's async defaults are nothing to warn about
        o = async_options_from(AsyncGRPOConfig(bf16=False, max_steps=4), rows=8)
    assert (o["max_staleness"], o["proximal"], o["unbiased_std"], o["adv_eps"]) == (
        4, "behaviour", False, 1e-8)  # fmt: skip
    assert (o["lr_schedule"], o["max_new_tokens"], o["loss_agg"], o["beta"], o["steps"]) == (
        "constant", 2048, "token_mean", 0.0, 4)  # fmt: skip
    assert not any(k.startswith("correction") for k in o) and "engine" not in o
    lora = async_options_from(AsyncGRPOConfig(dtype="bfloat16", max_staleness=0), rows=8,
                              lora=True)  # fmt: skip
    assert (lora["base_dtype"], lora["max_staleness"]) == ("bf16", 0)
    named = async_options_from(AsyncGRPOConfig(bf16=False, vllm_server_base_url="http://r:9"),
                               rows=8)  # fmt: skip
    assert (named["engine"], named["vllm_server"], named["max_staleness"]) == (
        "vllm",
        "http://r:9",
        4,
    )
    assert "max_tokens_per_micro_batch" not in o  # TRL's None: grouprl's own planning
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a token budget is mapped, not ignored
        budget = async_options_from(AsyncGRPOConfig(bf16=False, token_budget=4096), rows=8)
    assert budget["max_tokens_per_micro_batch"] == 4096
    off = async_options_from(AsyncGRPOConfig(bf16=False, token_budget=0), rows=8)
    assert "max_tokens_per_micro_batch" not in off
    with pytest.raises(UserError, match="weight_sync_steps=2"):
        async_options_from(AsyncGRPOConfig(weight_sync_steps=2), rows=8)
    with pytest.warns(UserWarning, match="queue_maxsize=5"):
        async_options_from(AsyncGRPOConfig(queue_maxsize=5), rows=8)
    with pytest.warns(UserWarning, match="logging_steps=3"):
        async_options_from(AsyncGRPOConfig(logging_steps=3), rows=8)


def test_trls_entropy_fields():
    o = options_from(GRPOConfig(top_entropy_quantile=0.2, entropy_coef=0.01), rows=8)
    assert (o["top_entropy_quantile"], o["entropy_coef"], "entropy_target" in o) == (
        0.2,
        0.01,
        False,
    )
    adaptive = options_from(GRPOConfig(entropy_coef=0.01, use_adaptive_entropy=True,
                                       entropy_target=0.3), rows=8)  # fmt: skip
    assert (adaptive["entropy_target"], adaptive["entropy_coef_delta"],
            adaptive["entropy_coef_max"]) == (0.3, 0.005, 1.0)  # fmt: skip
    with pytest.warns(UserWarning, match="entropy_target=0.3: these apply only with"):
        assert "entropy_target" not in options_from(GRPOConfig(entropy_target=0.3), rows=8)
    # TRL accepts 0 (only the highest-entropy tokens train): so does the run it maps to
    from grouprl.config import TrainConfig, resolve

    zero = options_from(GRPOConfig(top_entropy_quantile=0.0), rows=8)["top_entropy_quantile"]
    cfg = resolve(TrainConfig(top_entropy_quantile=zero), task_max_new_tokens=8)
    assert cfg.top_entropy_quantile == 0.0


def test_the_names_errors_give_trl_users_are_options_and_trl_fields():
    import dataclasses

    from grouprl.config import field_names
    from grouprl.errors import option_name, option_names, remedy
    from grouprl.trl.config import OPTION_NAMES

    trl_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert set(OPTION_NAMES) <= set(field_names()) and set(OPTION_NAMES.values()) <= trl_fields
    ways = (("raise", "max_prompt_length"), ("lower", "max_new_tokens"))
    assert remedy(*ways, otherwise="shorten the prompts") == (
        "raise --max-prompt-length, lower --max-new-tokens or shorten the prompts"
    )
    with option_names(OPTION_NAMES):  # no max_prompt_length in TRL: that way is left out
        assert option_name("max_prompt_length") is None
        assert remedy(*ways, otherwise="shorten the prompts") == (
            "lower max_completion_length or shorten the prompts"
        )
    assert option_name("max_new_tokens") == "--max-new-tokens"  # and back outside
