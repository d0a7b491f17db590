"""grouprl.trl's GRPOConfig and AsyncGRPOConfig parse as TRL's: every field has the installed
TRL's type, default and argparse options, and transformers' HfArgumentParser (TRL's TrlParser)
reads the same flags and YAML into the same values, beside TRL's ScriptArguments and
ModelConfig, refusing the same mistakes."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

trl = pytest.importorskip("trl")
from trl.experimental.async_grpo import AsyncGRPOConfig as TheirAsync  # noqa: E402

from grouprl.trl import (  # noqa: E402
    ASYNC_FIELDS,
    FIELDS,
    RLOO_FIELDS,
    AsyncGRPOConfig,
    GRPOConfig,
    RLOOConfig,
)
from grouprl.trl.config import HELP  # noqa: E402

PAIRS = [(GRPOConfig, trl.GRPOConfig, FIELDS), (AsyncGRPOConfig, TheirAsync, ASYNC_FIELDS),
         (RLOOConfig, trl.RLOOConfig, RLOO_FIELDS)]  # fmt: skip


def default(f: dataclasses.Field):
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def argparse_options(f: dataclasses.Field) -> dict:
    return {k: list(v) if k == "choices" else v for k, v in f.metadata.items() if k != "help"}


@pytest.mark.parametrize(("ours", "theirs", "table"), PAIRS,
                         ids=["GRPOConfig", "AsyncGRPOConfig", "RLOOConfig"])  # fmt: skip
def test_every_field_has_trls_type_default_and_argparse_options(ours, theirs, table):
    assert trl.__version__.startswith("1.16")
    our_types, their_types = typing.get_type_hints(ours), typing.get_type_hints(theirs)
    assert set(our_types) == set(their_types) == set(table)
    assert {n: t for n, t in our_types.items() if t != their_types[n]} == {}
    theirs_by_name = {f.name: f for f in dataclasses.fields(theirs)}
    for f in dataclasses.fields(ours):
        assert default(f) == default(theirs_by_name[f.name]), f.name
        assert argparse_options(f) == argparse_options(theirs_by_name[f.name]), f.name
        assert f.metadata["help"], f.name  # grouprl's words: what it does with the field
    assert [f.name for f in dataclasses.fields(GRPOConfig)] == [
        f.name for f in dataclasses.fields(trl.GRPOConfig)
    ]


#: Flags of every kind HfArgumentParser handles: numbers, strings, enums, bools (bare, valued,
#: --no_), optional bools, lists, JSON dicts, unions with None; and TRL's gspo.py's own.
FLAGS = [
    [],
    ["--output_dir", "out", "--learning_rate", "1e-5", "--max_completion_length", "1024",
     "--log_completions", "--per_device_train_batch_size", "8", "--num_generations", "8",
     "--importance_sampling_level", "sequence", "--epsilon", "3e-4", "--epsilon_high", "4e-4",
     "--beta", "0.0", "--loss_type", "grpo", "--gradient_accumulation_steps", "2",
     "--steps_per_generation", "8", "--use_peft", "--lora_target_modules", "q_proj,", "v_proj",
     "--dtype", "bfloat16", "--model_name_or_path", "m"],
    ["--lr_scheduler_type", "cosine", "--no_gradient_checkpointing", "--bf16", "false",
     "--report_to", "none", "--reward_weights", "1", "0.5", "--save_steps", "0.25",
     "--chat_template_kwargs", '{"enable_thinking": false}', "--use_vllm", "true",
     "--vllm_mode", "server", "--vllm_importance_sampling_mode", "token_truncate",
     "--vllm_importance_sampling_clip_min", "0.5", "--off_policy_mask_threshold", "0.5",
     "--max-steps", "12", "--eval_strategy", "steps", "--fsdp", "--top_k", "5",
     "--model_init_kwargs", '{"attn_implementation": "eager"}', "--scale_rewards", "batch"],
]  # fmt: skip


def parsers():
    from transformers import HfArgumentParser

    script = (trl.ScriptArguments, trl.ModelConfig)
    return (HfArgumentParser((script[0], GRPOConfig, script[1])),
            HfArgumentParser((script[0], trl.GRPOConfig, script[1])))  # fmt: skip


@pytest.mark.parametrize("flags", FLAGS, ids=["defaults", "gspo.py", "kinds"])
def test_flags_parse_to_trls_values(flags):
    ours, theirs = parsers()
    assert vars(ours.parse_args(flags)) == vars(theirs.parse_args(flags))
    # and into a config grouprl maps: a JSON dict is decoded, as TRL decodes it
    config = ours.parse_args_into_dataclasses(flags)[1]
    assert isinstance(config, GRPOConfig)
    if "--chat_template_kwargs" in flags:
        assert config.chat_template_kwargs == {"enable_thinking": False}
        assert config.model_init_kwargs == {"attn_implementation": "eager"}
    assert (config.debug, config.include_num_input_tokens_seen) == ("", "no")  # TRL's forms


def test_a_yaml_config_parses_to_trls_values(tmp_path):
    config = {"model_name_or_path": "m", "dataset_name": "d", "learning_rate": 3e-6,
              "lr_scheduler_type": "constant", "gradient_checkpointing": False,
              "reward_weights": [1.0, 2.0], "vllm_importance_sampling_clip_max": None,
              "chat_template_kwargs": {"enable_thinking": False}, "env": {"GROUPRL_T": "1"}}  # fmt: skip
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(config))
    mine = trl.TrlParser((trl.ScriptArguments, GRPOConfig, trl.ModelConfig))
    parsed = mine.parse_args_and_config(["--config", str(path), "--learning_rate", "1e-5"])
    script, args, model = parsed
    assert (script.dataset_name, model.model_name_or_path) == ("d", "m")
    assert (args.learning_rate, args.lr_scheduler_type, args.gradient_checkpointing,
            args.reward_weights, args.vllm_importance_sampling_clip_max,
            args.chat_template_kwargs) == (1e-5, "constant", False, [1.0, 2.0], None,
                                           {"enable_thinking": False})  # fmt: skip
    # TRL's parser, set from the same file, holds the same values before TRL's __post_init__
    ours, theirs = parsers()
    body = {k: v for k, v in config.items() if k != "env"}
    for parser in (ours, theirs):
        parser.set_defaults(**body)
    assert vars(ours.parse_args([])) == vars(theirs.parse_args([]))


@pytest.mark.parametrize(
    "flags",
    [["--learning_rate", "abc"], ["--lr_scheduler_type", "nope"], ["--log_level", "loud"],
     ["--no_such_flag", "1"], ["--use_vllm", "maybe"]],
)  # fmt: skip
def test_the_same_mistakes_are_refused(flags, capsys):
    ours, theirs = parsers()
    if flags[0] == "--no_such_flag":  # left over by both (parse_args_into_dataclasses raises)
        assert ours.parse_known_args(flags)[1] == theirs.parse_known_args(flags)[1] == flags
        return
    for parser in (ours, theirs):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args(flags)
        assert stop.value.code == 2
    errors = [e for e in capsys.readouterr().err.splitlines() if "error:" in e]
    assert len(errors) == 2 and errors[0] == errors[1]  # word for word


def test_the_help_says_what_grouprl_does_with_a_field(capsys):
    ours, _ = parsers()
    with pytest.raises(SystemExit):
        ours.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert " ".join(HELP["learning_rate"].split()) in text
    assert "Not implemented by grouprl" in text and "TRL's plumbing" in text


#: TRL's documented `trl rloo` command lines (docs/source/rloo_trainer.md and the script's).
RLOO_FLAGS = [
    ["--model_name_or_path", "Qwen/Qwen2-0.5B-Instruct", "--dataset_name", "trl-lib/DeepMath-103K",
     "--reward_funcs", "accuracy_reward", "--output_dir", "Qwen2-0.5B-RLOO"],
    ["--model_name_or_path", "m", "--dataset_name", "trl-lib/tldr", "--learning_rate", "3e-6",
     "--num_generations", "4", "--beta", "0.03", "--normalize_advantages", "--epsilon", "0.2",
     "--steps_per_generation", "4", "--use_vllm", "--vllm_mode", "colocate", "--log_completions",
     "--use_peft", "--lora_r", "16", "--max_completion_length", "512", "--bf16", "false"],
]  # fmt: skip


@pytest.mark.parametrize("flags", RLOO_FLAGS, ids=["quickstart", "tldr"])
def test_trl_rloo_flags_parse_to_trls_values(flags):
    from trl.scripts.rloo import RLOOScriptArguments

    ours = trl.TrlParser((RLOOScriptArguments, RLOOConfig, trl.ModelConfig))
    theirs = trl.TrlParser((RLOOScriptArguments, trl.RLOOConfig, trl.ModelConfig))
    assert vars(ours.parse_args(flags)) == vars(theirs.parse_args(flags))
    _, config, model = ours.parse_args_into_dataclasses(flags)
    assert isinstance(config, RLOOConfig) and model.model_name_or_path == flags[1]
