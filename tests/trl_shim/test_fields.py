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
    assert {kind for _, kind in FIELDS.values()} == {MAPPED, REFUSED, WARNED}


@pytest.mark.parametrize("name", [n for n, (_, kind) in FIELDS.items() if kind == REFUSED])
def test_a_refused_field_set_raises_naming_it(name):
    with pytest.raises(UserError, match=f"GRPOConfig\\({name}="):
        options_from(GRPOConfig(**{name: other(FIELDS[name][0])}), rows=100)


def test_a_warned_field_never_changes_the_options():
    base = options_from(GRPOConfig(), rows=100)
    warned = [n for n, (_, kind) in FIELDS.items() if kind == WARNED]
    for name in warned:
        with pytest.warns(UserWarning, match=name):
            assert options_from(GRPOConfig(**{name: other(FIELDS[name][0])}), rows=100) == base
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # bf16=False: on a CPU without bf16, TRL's default bf16 adds a warning of its own
        options_from(GRPOConfig(bf16=False, **{n: other(FIELDS[n][0]) for n in warned}), rows=100)
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


def test_the_readme_says_what_becomes_of_every_field():
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## From TRL") : readme.index("## Tools: a model")]
    missing = [name for name in FIELDS if f"`{name}`" not in section]
    assert missing == []
