"""Config: presets, overrides, validation (one line each), YAML files and the CLI's errors."""

import dataclasses
import re
import warnings

import pytest

from grouprl.cli import main
from grouprl.errors import UserError
from grouprl.train.config import PRESETS, TrainConfig, field_names, from_mapping, resolve


def _resolve(**kw) -> TrainConfig:
    return resolve(TrainConfig(**kw), task_max_new_tokens=40)


def test_presets_fill_only_unset_fields():
    gspo = _resolve(algo="gspo")
    assert (gspo.ratio_level, gspo.clip_low, gspo.clip_high) == ("sequence", 3e-4, 4e-4)
    assert gspo.minibatches == 4 and gspo.loss_agg == "seq_mean_token_mean" and gspo.beta == 0
    grpo = _resolve(algo="grpo", clip_high=0.3)
    assert (grpo.ratio_level, grpo.clip_low, grpo.clip_high, grpo.minibatches) == (
        "token",
        0.2,
        0.3,
        1,
    )
    dr = _resolve(algo="dr_grpo")
    assert dr.adv_scale == "none" and dr.loss_agg == "seq_mean_token_sum_norm"
    assert dr.norm_len == dr.max_new_tokens == 40
    dapo = _resolve(algo="dapo")
    assert (dapo.clip_low, dapo.clip_high, dapo.loss_agg) == (0.2, 0.28, "token_mean")
    assert dapo.dynamic_sampling and dapo.overlong_penalty and dapo.overlong_cache == 10


def test_every_preset_sets_every_preset_field():
    for name, preset in PRESETS.items():
        cfg = _resolve(algo=name)
        for field in dataclasses.fields(preset):
            assert getattr(cfg, field.name) is not None, (name, field.name)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"group_size": 1}, "group_size must be at least 2"),
        ({"clip_low": 1.0}, "clip_low must lie in [0, 1)"),
        ({"minibatches": 3}, "minibatches (3) must divide prompts_per_step (16)"),
        ({"dual_clip": 0.5}, "dual_clip must be > 1"),
        ({"top_p": 0.0}, "top_p must lie in (0, 1]"),
        ({"loss_agg": "mean"}, "loss_agg 'mean' is not one of"),
    ],
)
def test_impossible_settings_are_rejected(override, message):
    with pytest.raises(UserError, match=re.escape(message)):
        _resolve(**override)


def test_dubious_setting_warns():
    with pytest.warns(UserWarning, match="weights each completion by its length"):
        _resolve(algo="gspo", loss_agg="token_mean")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _resolve(algo="gspo")


def test_unknown_yaml_key_suggests_the_right_one():
    with pytest.raises(
        UserError, match=r"unknown config key 'grup_size'.*did you mean 'group_size'"
    ):
        from_mapping({"grup_size": 4}, source="x.yaml")


def _snapshot(path):
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_cli_config_error_is_one_line_and_leaves_earlier_run_untouched(tmp_path, capsys):
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "config.yaml").write_text("steps: 3\n")
    (earlier / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _snapshot(earlier)

    assert main(["train", "--group-size", "1", "--output-dir", str(earlier)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "grouprl train: error: invalid config: group_size must be at least 2: a group "
        "of one has no baseline"
    ]
    # A valid config aimed at the earlier run's directory is refused too.
    assert main(["train", "--steps", "1", "--output-dir", str(earlier)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert _snapshot(earlier) == before


def test_cli_yaml_file_and_flag_override(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: 0.001\nclip_hgh: 0.3\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "did you mean 'clip_high'" in capsys.readouterr().err
    missing = tmp_path / "missing.yaml"
    assert main(["train", "--config", str(missing)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_unknown_flag_exits_nonzero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--grop-size", "4"])
    assert exit_info.value.code == 2


def test_cli_help_lists_every_field_with_its_doc(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in field_names():
        assert f"--{name.replace('_', '-')}" in out, name
    assert "Completions sampled per prompt (G)" in out
    assert "(default: 8)" in out
