"""`grouprl trl grpo|rloo [TRL's flags | --config FILE.yaml]`: TRL's `trl grpo` and `trl rloo`
command lines, parsed by TRL's parser with grouprl.trl's GRPOConfig or RLOOConfig, run by
`grouprl.trl.scripts.train`."""

from __future__ import annotations

import warnings

from grouprl.errors import UserError


def run(argv: list[str]) -> int:
    from grouprl.trl.scripts import COMMANDS, LAUNCH, make_parser, train

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: grouprl trl grpo|rloo [TRL's trl grpo or trl rloo flags]   "
              "(grouprl trl grpo --help)")  # fmt: skip
        return 0
    command = argv[0]
    if command not in COMMANDS:
        raise UserError(f"grouprl runs TRL's {' and '.join(COMMANDS)} commands, not {command!r}")
    *parsed, from_config, from_flags = make_parser(command).parse_args_and_config(
        argv[1:], return_remaining_strings=True, separate_remaining_strings=True
    )
    launch = [a for a in from_config + from_flags
              if a.startswith("--") and a[2:].split("=")[0].replace("-", "_") in LAUNCH]  # fmt: skip
    if launch:
        raise UserError(
            f"{launch[0]} is accelerate's; grouprl scales out with torchrun: torchrun "
            f"--nproc-per-node N -m grouprl trl {command} ... (without it)"
        )
    if from_flags:  # TRL's script stops on them too; unknown --config keys it ignores
        raise UserError(f"unknown flags: {' '.join(from_flags)} (grouprl trl {command} --help)")
    ignored = [a[2:] for a in from_config if a.startswith("--")]
    if ignored:  # as TRL's script does, but not silently (a grouprl run's config.yaml, say)
        warnings.warn(f"--config keys trl {command} does not take, ignored: {', '.join(ignored)}",
                      UserWarning, stacklevel=2)  # fmt: skip
    script_args, training_args, model_args, dataset_args = parsed
    if model_args.model_name_or_path is None:
        raise UserError("give --model_name_or_path (a local model directory or a hub id)")
    train(script_args, training_args, model_args, dataset_args, command)
    return 0
