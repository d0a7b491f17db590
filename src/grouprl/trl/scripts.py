"""TRL's `trl grpo` and `trl rloo` commands (trl/scripts/grpo.py, rloo.py) on grouprl: what
`grouprl trl grpo` and `grouprl trl rloo` run.

The same parser (TRL's TrlParser over TRL's GRPOScriptArguments or RLOOScriptArguments,
ModelConfig and DatasetMixtureConfig, with grouprl.trl's GRPOConfig or RLOOConfig), the same
flags and `--config` YAML, reward
names resolved as TRL resolves them (`accuracy_reward`, `reasoning_accuracy_reward`,
`think_format_reward`, `get_soft_overlong_punishment` from `trl.rewards`, or a dotted import path
found from the working directory), the same dataset loading, and grouprl's GRPOTrainer or
RLOOTrainer. TRL's
script arguments and rewards are TRL's own, so this command needs TRL installed
(`pip install 'grouprl[trl]'`).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from grouprl.errors import UserError
from grouprl.trl.config import GRPOConfig
from grouprl.trl.rloo import RLOOConfig, RLOOTrainer
from grouprl.trl.trainer import GRPOTrainer

#: The commands of TRL's CLI grouprl runs: (TRL's script module, its script arguments, grouprl's
#: config and trainer).
COMMANDS = {
    "grpo": ("trl.scripts.grpo", "GRPOScriptArguments", GRPOConfig, GRPOTrainer),
    "rloo": ("trl.scripts.rloo", "RLOOScriptArguments", RLOOConfig, RLOOTrainer),
}
#: What TRL's CLI hands to `accelerate launch` (grouprl's processes come from torchrun).
LAUNCH = {"num_processes", "accelerate_config", "num_machines", "machine_rank",
           "main_process_ip", "main_process_port", "multi_gpu", "config_file"}  # fmt: skip


def _trl() -> Any:
    try:
        import trl
    except ImportError:
        raise UserError(
            "grouprl trl parses TRL's script arguments and resolves TRL's reward names: "
            "pip install 'grouprl[trl]'"
        ) from None
    return trl


def make_parser(command: str = "grpo", prog: str | None = None) -> Any:
    """TRL's parser for `trl COMMAND`, with grouprl.trl's config class in TRL's place."""
    trl = _trl()
    module, arguments, config, _ = COMMANDS[command]
    script_arguments = getattr(importlib.import_module(module), arguments)
    return trl.TrlParser(
        (script_arguments, config, trl.ModelConfig, trl.DatasetMixtureConfig),
        prog=prog or f"grouprl trl {command}",
    )


def reward_functions(script_args: Any) -> list[Any]:
    """The script's rewards as TRL resolves them: a reward model first, then each name, from
    TRL's registry or a dotted import path (the working directory on sys.path)."""
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    registry = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(
            max_completion_len=1280, soft_punish_cache=256
        ),
    }
    rewards: list[Any] = []
    if script_args.reward_model_name_or_path:
        rewards.append(script_args.reward_model_name_or_path)
    for name in script_args.reward_funcs or []:
        if name in registry:
            rewards.append(registry[name])
        elif "." in name:
            module, attribute = name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())
            try:
                rewards.append(getattr(importlib.import_module(module), attribute))
            except (ImportError, AttributeError) as err:
                raise UserError(f"--reward_funcs {name}: cannot import it ({err})") from None
        else:
            raise UserError(
                f"--reward_funcs {name}: not one of {', '.join(registry)} nor a dotted import "
                "path (my_rewards.fn)"
            )
    if not rewards:
        raise UserError("give --reward_funcs (or --reward_model_name_or_path)")
    return rewards


def _datasets(script_args: Any, dataset_args: Any) -> Any:
    """The dataset as TRL's script loads it: a mixture (--datasets) or --dataset_name."""
    if dataset_args.datasets:
        from trl import get_dataset

        return get_dataset(dataset_args)
    if not script_args.dataset_name:
        raise UserError("give --dataset_name (a local path or a hub id), or --datasets")
    from datasets import load_dataset

    try:
        return load_dataset(script_args.dataset_name, name=script_args.dataset_config,
                            streaming=script_args.dataset_streaming)  # fmt: skip
    except (FileNotFoundError, ValueError, ConnectionError) as err:
        raise UserError(f"--dataset_name {script_args.dataset_name}: {err}") from None


def train(
    script_args: Any, training_args: Any, model_args: Any, dataset_args: Any, command: str = "grpo"
) -> None:
    """TRL 1.16's trl/scripts/grpo.py (or rloo.py) `main` on grouprl: train what the parsed
    dataclasses say."""
    from trl import get_peft_config, get_quantization_config

    rewards = reward_functions(script_args)
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs
    dataset = _datasets(script_args, dataset_args)
    evaluates = training_args.eval_strategy != "no"
    splits = [script_args.dataset_train_split, *([script_args.dataset_test_split] * evaluates)]
    for split in splits:
        if split not in dataset:
            raise UserError(f"the dataset has no split {split!r} (it has {', '.join(dataset)}); "
                            "name one with --dataset_train_split / --dataset_test_split")  # fmt: skip
    trainer_class = COMMANDS[command][3]
    trainer = trainer_class(
        model=model_args.model_name_or_path,
        reward_funcs=rewards,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if evaluates else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    print(f"Model saved to {training_args.output_dir or trainer.options['output_dir']}.")
