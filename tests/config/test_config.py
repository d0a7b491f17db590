"""Config: presets, overrides, validation (one line each), YAML files and the CLI's errors."""

import dataclasses
import os
import re
import warnings

import pytest
import yaml

from grouprl.cli import main
from grouprl.config import (
    PRESETS,
    TrainConfig,
    field_names,
    from_mapping,
    parse_train_args,
    resolve,
)
from grouprl.errors import UserError


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
    with pytest.warns(UserWarning, match="biases every sequence ratio"):
        _resolve(algo="gspo", top_p=0.9)
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


def test_cli_unknown_flag_is_one_line_with_a_suggestion(capsys):
    assert main(["train", "--grop-size", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["grouprl train: error: unknown flag --grop-size; did you mean --group-size?"]


def test_cli_help_lists_every_field_with_its_doc(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in field_names():
        assert f"--{name.replace('_', '-')}" in out, name
    assert "Completions sampled per prompt (G)" in out
    assert "(default: 8)" in out


TINY = ["--steps", "1", "--prompts-per-step", "4", "--group-size", "2", "--eval-size", "2",
        "--eval-samples", "1", "--threads", "1", "--no-progress"]  # fmt: skip


def test_a_saved_config_is_a_record_that_starts_new_runs(tmp_path, capsys):
    """An earlier run's config.yaml holds no launch directive, and `--config OLD/config.yaml
    --output-dir NEW` starts a new run in NEW, also from a config written by an older grouprl
    that still held `resume:` (which used to continue, and overwrite, the old run)."""
    old = tmp_path / "old"
    assert main(["train", "--output-dir", str(old), *TINY]) == 0
    saved = (old / "config.yaml").read_text()
    keys = {line.split(":", 1)[0] for line in saved.splitlines() if not line.startswith(" ")}
    assert not keys & {"resume", "config", "allow_change"}
    before = _snapshot(old)
    (tmp_path / "older.yaml").write_text(saved + f"resume: {old}\nconfig: null\n")
    for i, config in enumerate([old / "config.yaml", tmp_path / "older.yaml"]):
        new = tmp_path / f"new{i}"
        assert main(["train", "--config", str(config), "--output-dir", str(new), *TINY]) == 0
        assert (new / "final" / "model.safetensors").is_file()
    assert "'resume' ignored" in capsys.readouterr().err
    assert _snapshot(old) == before


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("steps: 3.0", "steps in {file} takes an integer"),
        ("steps: five", "steps in {file} takes an integer"),
        ("eval_size: 8.5", "eval_size in {file} takes an integer"),
        ("adam_betas: 0.9", "adam_betas in {file} takes 2 numbers"),
        ("algo: ppo", "algo in {file}: 'ppo' is not one of grpo, gspo, dr_grpo, dapo"),
        ("precision: fp16", "precision in {file}: 'fp16' is not one of fp32, bf16"),
        ("progress: maybe", "progress in {file} must be true or false, got 'maybe'"),
        ("lr: abc", "lr in {file} takes a number"),
        ("rewards: {correct: x}", "rewards in {file} takes NAME VALUE pairs"),
        ("weight_decay: -1", "invalid config: weight_decay must be >= 0"),
        ("routing_metrics_every: -1", "invalid config: routing_metrics_every must be >= 0"),
        ("router_aux_loss_coef: -0.1", "invalid config: router_aux_loss_coef must be >= 0"),
        ("routing_replay: R2", "routing_replay in {file}: 'R2' is not one of off, r2, r3"),
        ("- a list", "must hold a mapping of field: value"),
    ],
)
def test_yaml_values_are_parsed_like_flags_with_one_line_errors(tmp_path, capsys, text, message):
    config = tmp_path / "run.yaml"
    config.write_text(text + "\n")
    out = tmp_path / "out"
    assert main(["train", "--config", str(config), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.format(file=config) in err[0], err
    assert not out.exists()


def test_a_yaml_value_means_what_the_same_flag_means(tmp_path):
    from grouprl.config import parse_train_args

    config = tmp_path / "run.yaml"
    config.write_text("lr: 1e-4\nsteps: 7\nadam_betas: [0.8, 0.9]\nprogress: false\n")
    from_file = parse_train_args(["--config", str(config)])
    from_flags = parse_train_args(
        ["--lr", "1e-4", "--steps", "7", "--adam-betas", "0.8", "0.9", "--no-progress"]
    )
    assert from_file.lr == 1e-4 and isinstance(from_file.lr, float)  # PyYAML reads a string
    assert dataclasses.replace(from_file, config=None) == from_flags
    # flags given with --config override the file
    assert parse_train_args(["--config", str(config), "--steps", "9"]).steps == 9


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "five"], "--steps takes an integer"),
        (["--algo", "ppo"], "--algo: 'ppo' is not one of grpo, gspo, dr_grpo, dapo"),
        (["--adam-betas", "0.9"], "--adam-betas takes 2 numbers"),
        (["--progress", "maybe"], "unexpected value 'maybe'"),
        (["--rewards", "accuracy"], "--rewards takes NAME VALUE pairs"),
    ],
)
def test_bad_flags_are_one_line(capsys, flags, message):
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.numerics
def test_resume_changes_only_what_may_change(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), *TINY]) == 0
    capsys.readouterr()
    refused = [
        (["--algo", "grpo"], "algo would change from 'gspo' to 'grpo'"),
        (["--lr", "1e-3"], "lr would change from 5e-05 to 0.001"),
        (["--output-dir", str(tmp_path / "other")], "--resume continues a run in its own"),
        (["--config", str(run / "config.yaml")], "drop --config"),
        (["--allow-change", "lrr"], "--allow-change names no field 'lrr'"),
    ]
    before = _snapshot(run)
    for flags, message in refused:
        assert main(["train", "--resume", str(run), "--steps", "2", *flags]) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert _snapshot(run) == before
    assert main(["train", "--resume", str(run), "--steps", "2", "--lr", "1e-4",
                 "--allow-change", "lr", "--eval-size", "3"]) == 0  # fmt: skip
    import json

    import yaml

    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert (recorded["steps"], recorded["lr"], recorded["eval_size"]) == (2, 1e-4, 3)
    from grouprl.config import TrainConfig as Config
    from grouprl.train.run import lr_factor

    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    # the new lr ran (one float64 product of given numbers: approx's 1e-6 is far above it)
    assert last["lr"] == pytest.approx(1e-4 * lr_factor(Config(steps=2), 1))


def test_help_and_version_need_no_torch():
    """`grouprl train|eval|compare|doctor --help` answer without importing torch or
    transformers; `--version` and `python -m grouprl` work."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom grouprl.cli import main\n"
        "for argv in (['train', '--help'], ['eval', '--help'], ['compare', '--help'],\n"
        "             ['doctor', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'peft') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
    version = subprocess.run(
        [sys.executable, "-m", "grouprl", "--version"], capture_output=True, text=True, check=True
    )
    assert version.stdout.startswith("grouprl 0.")


def test_text_values_stay_text(tmp_path):
    """Strings that look like flags or like None stay strings, through a saved config too."""
    from grouprl.config import to_yaml

    cfg = from_mapping(
        {"stop": ["-x", "None", "--help"], "system_prompt": "None", "model": "-m"}, source="f"
    )
    assert cfg.stop == ["-x", "None", "--help"] and cfg.system_prompt == "None"
    import yaml

    again = from_mapping(yaml.safe_load(to_yaml(cfg)), source="saved")
    assert again.stop == cfg.stop and again.system_prompt == "None" and again.model == "-m"
    assert "output_dir" not in yaml.safe_load(to_yaml(cfg))
    with pytest.raises(UserError, match="stop in f takes a list of strings"):
        from_mapping({"stop": [{"a": 1}]}, source="f")


def test_an_empty_list_in_a_saved_config_stays_empty():
    """`--report-to none` saves `report_to: []`: read back (a resume, a --config) it must stay
    no tracker, not become None (TensorBoard); `tools: []` stays no tools, not the task's."""
    from grouprl.config import to_yaml

    saved = yaml.safe_load(to_yaml(resolve(parse_train_args(["--report-to", "none"]),
                                           task_max_new_tokens=8)))  # fmt: skip
    assert saved["report_to"] == []
    again = from_mapping(saved, source="config.yaml")
    assert again.report_to == [] and resolve(again, task_max_new_tokens=8).report_to == []
    assert from_mapping({"tools": []}, source="f").tools == []


def test_a_flag_without_its_value_is_one_line(capsys):
    for flags in (["--config"], ["--resume"]):
        assert main(["train", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "expected one argument" in err[0], err


def test_the_same_model_path_written_another_way_is_no_change(tmp_path, monkeypatch):
    """A run records local paths absolute; resuming with the same path written relative (or
    through another directory) is the same run."""
    from grouprl.models.loading import BUILTIN_DIR

    monkeypatch.chdir(tmp_path)
    model = BUILTIN_DIR / "arith"
    run = tmp_path / "run"
    assert main(["train", "--model", str(model), "--output-dir", str(run), *TINY]) == 0
    relative = os.path.relpath(model, tmp_path)
    assert main(["train", "--resume", str(run), "--steps", "2", "--model", relative]) == 0


def test_choice_names_are_the_core_registries_and_the_presets():
    """The choices live once, in the torch-free config; each must name exactly what the math
    registers (a new variant in core without a name here, or a stale name, fails)."""
    from typing import get_args

    from grouprl import core
    from grouprl.config import choices as config

    for choices, registry in (
        (config.RatioLevel, core.RATIO_LEVELS),
        (config.LossAgg, core.AGGREGATIONS),
        (config.AdvScale, core.ADVANTAGE_SCALES),
        (config.KLEstimator, core.KL_ESTIMATORS),
        (config.CorrectionName, core.CORRECTIONS),
        (config.WeightLevel, core.WEIGHT_LEVELS),
        (config.MaskLevel, core.MASK_LEVELS),
    ):
        assert set(get_args(choices)) == set(registry), choices
    # the registries' own choices are read from them when a parser is built
    for choices, registry in ((config.Algo, PRESETS), (config.Objective, core.OBJECTIVES),
                              (config.AdvEstimator, core.ADVANTAGE_ESTIMATORS)):  # fmt: skip
        (marker,) = [m for m in get_args(choices)[1:] if hasattr(m, "constructor_factory")]
        listed = [a for a in get_args(marker.constructor_factory()) if a is not None]
        names = [n for arg in listed for n in (get_args(arg) or (arg,)) if n is not type(None)]
        assert names == list(registry), choices
    # every estimator takes only what the trainer gives, and each rule names a real scale
    for entry in core.ADVANTAGE_ESTIMATORS.values():
        assert entry.inputs() <= set(core.registry.ESTIMATOR_INPUTS), entry.name
        assert set(entry.scales) <= set(core.ADVANTAGE_SCALES), entry.name
    for entry in core.OBJECTIVES.values():
        assert set(entry.knobs) <= {f.name for f in dataclasses.fields(core.LossOptions)}


def test_resolve_returns_a_frozen_run_config_without_placeholders():
    from grouprl.config import RunConfig

    cfg = _resolve(algo="dapo")
    assert type(cfg) is RunConfig
    filled = [f.name for f in dataclasses.fields(RunConfig) if f.kw_only]
    assert set(filled) >= {f.name for f in dataclasses.fields(PRESETS["dapo"])}
    assert all(getattr(cfg, name) is not None for name in filled)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0
    assert type(dataclasses.replace(cfg, steps=3)) is RunConfig
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    with pytest.raises(ValueError, match="unresolved: clip_low"):
        RunConfig(**{**values, "clip_low": None})


@pytest.mark.parametrize(
    ("fields", "world", "message"),
    [
        ({"prompts_per_step": 8}, 4, "divisible by the world size 4 times minibatches 4 (= 16)"),
        ({"strategy": "fsdp", "lora_r": 4}, 2, "--strategy fsdp does not shard LoRA models"),
        ({"dataset": "x.jsonl"}, 1, "--dataset needs --rewards"),
        ({"eval_dataset": "x.jsonl"}, 1, "--eval-dataset applies to --dataset"),
    ],
)
def test_validation_knows_the_world_size_and_the_data_rules(fields, world, message):
    with pytest.raises(UserError, match=re.escape(message)):
        resolve(TrainConfig(**fields), task_max_new_tokens=40, world_size=world)
    if world > 1:  # the same settings are fine in one process
        resolve(TrainConfig(**fields), task_max_new_tokens=40)
