"""`grouprl trl grpo [TRL's flags | --config FILE.yaml]`: TRL's `trl grpo` command line, parsed by
TRL's parser with grouprl.trl's GRPOConfig, run by `grouprl.trl.scripts.train`."""

from __future__ import annotations

import warnings

from grouprl.errors import UserError


def run(argv: list[str]) -> int:
    from grouprl.trl.scripts import COMMANDS, LAUNCH, make_parser, train

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: grouprl trl grpo [TRL's trl grpo flags]   (grouprl trl grpo --help)")
        return 0
    if argv[0] not in COMMANDS:
        raise UserError(f"grouprl runs TRL's {', '.join(COMMANDS)} command, not {argv[0]!r}")
    *parsed, from_config, from_flags = make_parser().parse_args_and_config(
        argv[1:], return_remaining_strings=True, separate_remaining_strings=True
    )
    launch = [a for a in from_config + from_flags
              if a.startswith("--") and a[2:].split("=")[0].replace("-", "_") in LAUNCH]  # fmt: skip
    if launch:
        raise UserError(
            f"{launch[0]} is accelerate's; grouprl scales out with torchrun: torchrun "
            "--nproc-per-node N -m grouprl trl grpo ... (without it)"
        )
    if from_flags:  # TRL's script stops on them too; unknown --config keys it ignores
        raise UserError(f"unknown flags: {' '.join(from_flags)} (grouprl trl grpo --help)")
    ignored = [a[2:] for a in from_config if a.startswith("--")]
    if ignored:  # as TRL's script does, but not silently (a grouprl run's config.yaml, say)
        warnings.warn(f"--config keys trl grpo does not take, ignored: {', '.join(ignored)}",
                      UserWarning, stacklevel=2)  # fmt: skip
    script_args, training_args, model_args, dataset_args = parsed
    if model_args.model_name_or_path is None:
        raise UserError("give --model_name_or_path (a local model directory or a hub id)")
    train(script_args, training_args, model_args, dataset_args)
    return 0
