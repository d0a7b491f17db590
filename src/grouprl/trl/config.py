"""TRL 1.16's GRPOConfig, every field with TRL's default, and its mapping onto grouprl's options.

TRL's meaning, decided: a step is an optimizer step; an optimizer step's batch is
per_device_train_batch_size x gradient_accumulation_steps x world size completions, in groups of
num_generations; a generation batch (one grouprl step) serves steps_per_generation /
gradient_accumulation_steps minibatches, num_iterations times, so grouprl's steps are max_steps
/ (minibatches x num_iterations). A value that does not divide is refused in one line.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path
from typing import Any

from grouprl.errors import UserError

TRL_VERSION = "1.16"

MAPPED, REFUSED, WARNED = "mapped", "refused", "warned"

#: Every field of TRL 1.16's GRPOConfig: its default and what grouprl does with it. MAPPED: onto
#: grouprl's options (`_options`; some values of some of these are refused there, in one line).
#: REFUSED: grouprl does not implement it; any value but the default raises. WARNED: TRL's
#: plumbing only (it cannot change what is trained); a value but the default is warned about.
FIELDS: dict[str, tuple[Any, str]] = {
    # -- transformers' TrainingArguments, with GRPOConfig's defaults --
    "output_dir": (None, MAPPED),
    "per_device_train_batch_size": (8, MAPPED),
    "num_train_epochs": (3.0, MAPPED),
    "max_steps": (-1, MAPPED),
    "learning_rate": (1e-06, MAPPED),
    "lr_scheduler_type": ("linear", MAPPED),
    "lr_scheduler_kwargs": (None, REFUSED),
    "warmup_steps": (0, MAPPED),
    "optim": ("adamw_torch_fused", MAPPED),
    "optim_args": (None, REFUSED),
    "weight_decay": (0.0, MAPPED),
    "adam_beta1": (0.9, MAPPED),
    "adam_beta2": (0.999, MAPPED),
    "adam_epsilon": (1e-08, REFUSED),
    "optim_target_modules": (None, REFUSED),
    "gradient_accumulation_steps": (1, MAPPED),
    "average_tokens_across_devices": (True, REFUSED),
    "max_grad_norm": (1.0, MAPPED),
    "label_smoothing_factor": (0.0, WARNED),
    "bf16": (None, MAPPED),
    "fp16": (False, REFUSED),
    "bf16_full_eval": (False, WARNED),
    "fp16_full_eval": (False, WARNED),
    "tf32": (None, WARNED),
    "activation_checkpointing": (None, MAPPED),
    "activation_checkpointing_kwargs": (None, WARNED),
    "gradient_checkpointing": (True, MAPPED),
    "gradient_checkpointing_kwargs": (None, WARNED),
    "torch_compile": (False, WARNED),
    "torch_compile_backend": (None, WARNED),
    "torch_compile_mode": (None, WARNED),
    "use_liger_kernel": (False, WARNED),
    "liger_kernel_config": (None, WARNED),
    "use_cache": (False, WARNED),
    "neftune_noise_alpha": (None, REFUSED),
    "torch_empty_cache_steps": (None, WARNED),
    "auto_find_batch_size": (False, REFUSED),
    "logging_strategy": ("steps", WARNED),
    "logging_steps": (10, WARNED),
    "logging_first_step": (False, WARNED),
    "log_on_each_node": (True, WARNED),
    "logging_nan_inf_filter": (True, WARNED),
    "include_num_input_tokens_seen": ("no", WARNED),
    "log_level": ("passive", WARNED),
    "log_level_replica": ("warning", WARNED),
    "disable_tqdm": (None, MAPPED),
    "report_to": ("none", MAPPED),
    "run_name": (None, MAPPED),
    "project": ("huggingface", WARNED),
    "trackio_space_id": (None, WARNED),
    "trackio_bucket_id": (None, WARNED),
    "trackio_static_space_id": (None, WARNED),
    "eval_strategy": ("no", MAPPED),
    "eval_steps": (None, MAPPED),
    "eval_delay": (0, WARNED),
    "per_device_eval_batch_size": (8, WARNED),
    "prediction_loss_only": (False, WARNED),
    "eval_on_start": (False, MAPPED),
    "eval_do_concat_batches": (True, WARNED),
    "eval_use_gather_object": (False, WARNED),
    "eval_accumulation_steps": (None, WARNED),
    "include_for_metrics": ([], WARNED),
    "batch_eval_metrics": (False, WARNED),
    "save_only_model": (False, WARNED),
    "save_strategy": ("steps", MAPPED),
    "save_steps": (500, MAPPED),
    "save_on_each_node": (False, WARNED),
    "save_total_limit": (None, MAPPED),
    "enable_jit_checkpoint": (False, WARNED),
    "push_to_hub": (False, WARNED),
    "hub_token": (None, WARNED),
    "hub_private_repo": (None, WARNED),
    "hub_model_id": (None, WARNED),
    "hub_strategy": ("every_save", WARNED),
    "hub_always_push": (False, WARNED),
    "hub_revision": (None, WARNED),
    "load_best_model_at_end": (False, REFUSED),
    "metric_for_best_model": (None, WARNED),
    "greater_is_better": (None, WARNED),
    "ignore_data_skip": (False, WARNED),
    "restore_callback_states_from_checkpoint": (False, WARNED),
    "full_determinism": (False, WARNED),
    "seed": (42, MAPPED),
    "data_seed": (None, REFUSED),
    "use_cpu": (False, MAPPED),
    "accelerator_config": (None, WARNED),
    "parallelism_config": (None, REFUSED),
    "dataloader_drop_last": (False, WARNED),
    "dataloader_num_workers": (0, WARNED),
    "dataloader_pin_memory": (True, WARNED),
    "dataloader_persistent_workers": (False, WARNED),
    "dataloader_prefetch_factor": (None, WARNED),
    "dataloader_multiprocessing_context": (None, WARNED),
    "dataloader_in_order": (True, WARNED),
    "remove_unused_columns": (False, WARNED),
    "label_names": (None, WARNED),
    "train_sampling_strategy": ("random", REFUSED),
    "length_column_name": ("length", WARNED),
    "ddp_find_unused_parameters": (None, WARNED),
    "ddp_bucket_cap_mb": (None, WARNED),
    "ddp_broadcast_buffers": (None, WARNED),
    "ddp_static_graph": (None, WARNED),
    "ddp_backend": (None, WARNED),
    "ddp_timeout": (1800, WARNED),
    "fsdp": (None, MAPPED),
    "fsdp_config": (None, WARNED),
    "deepspeed": (None, REFUSED),
    "debug": ("", WARNED),
    "skip_memory_metrics": (True, WARNED),
    "do_train": (False, WARNED),
    "do_eval": (False, WARNED),
    "do_predict": (False, WARNED),
    "resume_from_checkpoint": (None, MAPPED),
    "local_rank": (-1, WARNED),
    # -- GRPOConfig's own --
    "model_init_kwargs": (None, REFUSED),
    "trust_remote_code": (False, MAPPED),
    "router_aux_loss_coef": (None, REFUSED),
    "disable_dropout": (False, MAPPED),
    "cast_lm_head_to_fp32": (False, REFUSED),
    "num_generations": (8, MAPPED),
    "num_generations_eval": (None, MAPPED),
    "max_completion_length": (512, MAPPED),
    "ds3_gather_for_generation": (True, WARNED),
    "shuffle_dataset": (True, REFUSED),
    "pad_to_multiple_of": ("auto", WARNED),
    "generation_batch_size": (None, MAPPED),
    "steps_per_generation": (None, MAPPED),
    "temperature": (1.0, MAPPED),
    "top_p": (1.0, MAPPED),
    "top_k": (0, MAPPED),
    "min_p": (None, REFUSED),
    "generation_kwargs": (None, REFUSED),
    "chat_template_kwargs": (None, MAPPED),
    "repetition_penalty": (1.0, REFUSED),
    "cache_implementation": (None, WARNED),
    "use_vllm": (False, MAPPED),
    "vllm_mode": ("colocate", MAPPED),
    "vllm_model_impl": ("vllm", WARNED),
    "vllm_enable_sleep_mode": (False, MAPPED),
    "vllm_structured_outputs_regex": (None, REFUSED),
    "vllm_server_base_url": (None, WARNED),
    "vllm_server_host": ("0.0.0.0", WARNED),
    "vllm_server_port": (8000, WARNED),
    "vllm_server_timeout": (240.0, WARNED),
    "vllm_group_port": (51216, WARNED),
    "vllm_gpu_memory_utilization": (0.3, MAPPED),
    "vllm_max_model_length": (None, MAPPED),
    "vllm_tensor_parallel_size": (1, MAPPED),
    "beta": (0.0, MAPPED),
    "num_iterations": (1, MAPPED),
    "epsilon": (0.2, MAPPED),
    "delta": (None, MAPPED),
    "epsilon_high": (None, MAPPED),
    "sapo_temperature_neg": (1.05, MAPPED),
    "sapo_temperature_pos": (1.0, MAPPED),
    "vespo_k_pos": (2.0, MAPPED),
    "vespo_lambda_pos": (3.0, MAPPED),
    "vespo_k_neg": (3.0, MAPPED),
    "vespo_lambda_neg": (2.0, MAPPED),
    "importance_sampling_level": ("token", MAPPED),
    "reward_weights": (None, MAPPED),
    "multi_objective_aggregation": ("sum_then_normalize", MAPPED),
    "scale_rewards": ("group", MAPPED),
    "loss_type": ("dapo", MAPPED),
    "mask_truncated_completions": (False, MAPPED),
    "sync_ref_model": (False, REFUSED),
    "ref_model_mixup_alpha": (0.6, REFUSED),
    "ref_model_sync_steps": (512, REFUSED),
    "top_entropy_quantile": (1.0, REFUSED),
    "entropy_coef": (0.0, REFUSED),
    "use_adaptive_entropy": (False, REFUSED),
    "entropy_coef_min": (0.0, REFUSED),
    "entropy_coef_max": (1.0, REFUSED),
    "entropy_coef_delta": (0.005, REFUSED),
    "entropy_target": (0.2, REFUSED),
    "max_tool_calling_iterations": (None, MAPPED),
    "vllm_importance_sampling_correction": (True, REFUSED),
    "vllm_importance_sampling_mode": ("sequence_mask", REFUSED),
    "vllm_importance_sampling_clip_max": (3.0, REFUSED),
    "vllm_importance_sampling_clip_min": (None, REFUSED),
    "off_policy_mask_threshold": (None, REFUSED),
    "use_bias_correction_kl": (True, MAPPED),
    "log_completions": (False, MAPPED),
    "log_multimodal": (True, WARNED),
    "num_completions_to_print": (None, WARNED),
    "log_unique_prompts": (False, WARNED),
    "log_completions_hub_repo": (None, WARNED),
    "use_transformers_continuous_batching": (False, WARNED),
    "transformers_continuous_batching_config": (None, WARNED),
    "use_transformers_paged": (False, WARNED),
    "vllm_importance_sampling_cap": (None, REFUSED),
}  # fmt: skip


def _field(default: Any) -> Any:
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default))
    return dataclasses.field(default=default)


GRPOConfig = dataclasses.make_dataclass(
    "GRPOConfig",
    [(name, Any, _field(default)) for name, (default, _) in FIELDS.items()],
    kw_only=True,
)
GRPOConfig.__module__ = __name__
GRPOConfig.__doc__ = (
    "TRL 1.16's GRPOConfig: its fields and defaults, mapped onto grouprl's options when a "
    "GRPOTrainer starts (grouprl.trl.FIELDS; the README's table)."
)

#: TRL's loss_type -> grouprl's loss aggregation (TRL's other losses are other objectives).
_AGGREGATIONS = {"dapo": "token_mean", "bnpo": "token_mean", "grpo": "seq_mean_token_mean",
                 "dr_grpo": "seq_mean_token_sum_norm", "cispo": "token_mean",
                 "sapo": "seq_mean_token_mean", "luspo": "seq_mean_token_sum",
                 "vespo": "token_mean"}  # fmt: skip
#: TRL's losses that are not the clipped surrogate: grouprl's objective of the same name.
_OBJECTIVES = ("cispo", "sapo", "vespo")
_SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant",
              "constant_with_warmup": "constant"}  # fmt: skip
_OPTIMIZERS = {"adamw_torch", "adamw_torch_fused"}
_TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
#: TRL evaluates and saves on these schedules; grouprl's own are by step.
_EVERY = {"steps", "no", "epoch"}
#: Enough to keep every checkpoint (save_total_limit=None).
_KEEP_ALL = 1_000_000


def _check_fields(args: Any) -> None:
    """Refused fields set to anything but TRL's default raise; plumbing set so is warned of."""
    if not dataclasses.is_dataclass(args) or {f.name for f in dataclasses.fields(args)} < set(
        FIELDS
    ):
        raise UserError(
            "args= takes grouprl.trl.GRPOConfig (TRL's fields); build it with "
            "`from grouprl.trl import GRPOConfig`"
        )
    changed = {name: getattr(args, name) for name, (default, _) in FIELDS.items()
               if getattr(args, name) != default}  # fmt: skip
    for name, value in changed.items():
        if FIELDS[name][1] == REFUSED:
            raise UserError(
                f"GRPOConfig({name}={value!r}): grouprl does not implement it; leave it at "
                f"{FIELDS[name][0]!r} (the README's TRL table lists what grouprl maps)"
            )
    warned = [f"{n}={v!r}" for n, v in changed.items() if FIELDS[n][1] == WARNED]
    if warned:
        warnings.warn(
            "grouprl ignores these GRPOConfig fields, which concern only TRL's plumbing: "
            + ", ".join(warned),
            UserWarning,
            stacklevel=3,
        )


def refusal(name: str, value: Any, why: str) -> UserError:
    return UserError(f"GRPOConfig({name}={value!r}): {why}")


def _batches(args: Any, world: int) -> dict[str, int]:
    """TRL's batch arithmetic as grouprl's prompts per step, minibatches and micro-batch."""
    per, accumulation, group = (args.per_device_train_batch_size,
                                args.gradient_accumulation_steps, args.num_generations)  # fmt: skip
    if group < 2:
        raise refusal("num_generations", group, "GRPO needs at least 2 completions per prompt")
    generation, steps_per = args.generation_batch_size, args.steps_per_generation
    if generation is not None and steps_per is not None:
        raise UserError("GRPOConfig: give generation_batch_size or steps_per_generation, not both")
    if generation is None:
        steps_per = accumulation if steps_per is None else steps_per
        generation = per * world * steps_per
    elif generation % (per * world):
        raise refusal("generation_batch_size", generation,
                      f"must be a multiple of the global batch {per} x {world}")  # fmt: skip
    else:
        steps_per = generation // (per * world)
    if generation % group:
        raise refusal("generation_batch_size", generation,
                      f"must be a multiple of num_generations ({group})")  # fmt: skip
    if steps_per % accumulation:
        raise refusal("steps_per_generation", steps_per,
                      f"must be a multiple of gradient_accumulation_steps ({accumulation}): "
                      "grouprl updates on whole optimizer steps of a generation batch")  # fmt: skip
    minibatches = steps_per // accumulation
    if (generation // group) % minibatches:
        raise UserError(
            f"GRPOConfig: an optimizer step's {per * accumulation * world} completions "
            f"(per_device_train_batch_size x gradient_accumulation_steps x {world} processes) "
            f"must be a multiple of num_generations ({group}): grouprl's updates hold whole groups"
        )
    return {"prompts_per_step": generation // group, "group_size": group,
            "minibatches": minibatches, "micro_batch_size": per}  # fmt: skip


def _every(n: float, total_optimizer_steps: int, per_step: int) -> int:
    """A cadence in TRL's optimizer steps (a float below 1: a share of the run) in grouprl's
    steps, at least 1."""
    if 0 < n < 1:
        n = math.ceil(n * total_optimizer_steps)
    return max(1, math.ceil(n / per_step))


def _steps(args: Any, prompts_per_step: int, per_step: int, rows: int | None) -> int:
    """grouprl's steps: max_steps / (optimizer steps per generation batch), or TRL's epochs."""
    if args.max_steps is not None and args.max_steps > 0:
        if args.max_steps % per_step:
            raise refusal("max_steps", args.max_steps,
                          f"must be a multiple of the optimizer steps per generation batch "
                          f"({per_step}: steps_per_generation / gradient_accumulation_steps x "
                          "num_iterations)")  # fmt: skip
        return args.max_steps // per_step
    if rows is None:
        raise UserError(
            "GRPOConfig: give max_steps; without a sized train_dataset (an environment that owns "
            "its data, an IterableDataset) num_train_epochs cannot say how long to train"
        )
    return max(1, math.ceil(args.num_train_epochs * rows / prompts_per_step))


def _objective(args: Any, world: int) -> dict[str, Any]:
    loss = args.loss_type
    if loss not in _AGGREGATIONS:
        raise refusal("loss_type", loss, f"grouprl implements {', '.join(_AGGREGATIONS)}")
    if loss == "luspo" and args.importance_sampling_level != "sequence":
        warnings.warn("loss_type='luspo' expects importance_sampling_level='sequence' (as TRL "
                      "warns)", UserWarning, stacklevel=4)  # fmt: skip
    if loss in _OBJECTIVES and args.delta is not None:
        raise refusal("delta", args.delta, f"TRL's {loss} loss has no two-sided clip")
    if loss == "bnpo" and world > 1:
        raise refusal("loss_type", loss,
                      "a per-process token mean; grouprl's token mean is over every process "
                      "(use dapo)")  # fmt: skip
    if args.importance_sampling_level not in ("token", "sequence"):
        raise refusal("importance_sampling_level", args.importance_sampling_level,
                      "token or sequence")  # fmt: skip
    scale = {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards)
    if scale not in ("group", "batch", "none"):
        raise refusal("scale_rewards", args.scale_rewards, "group, batch or none")
    aggregation = args.multi_objective_aggregation
    if aggregation not in ("sum_then_normalize", "normalize_then_sum"):
        raise refusal("multi_objective_aggregation", aggregation,
                      "sum_then_normalize or normalize_then_sum")  # fmt: skip
    if args.delta is not None and args.delta <= 1:
        raise refusal("delta", args.delta, "the two-sided clip's bound must be > 1")
    high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    bound = {"objective": "clip", "clip_low": args.epsilon, "clip_high": high,
             "dual_clip": args.delta}  # fmt: skip
    if loss in _OBJECTIVES:  # no clip range; TRL's knobs instead
        bound = {"objective": loss, **_knobs(args, loss, high)}
    return {
        **bound,
        "loss_agg": _AGGREGATIONS[loss],
        "norm_len": args.max_completion_length if loss == "dr_grpo" else None,
        "ratio_level": args.importance_sampling_level,
        "beta": float(args.beta),
        "kl_estimator": "k3",
        "kl_ratio_weighted": bool(args.use_bias_correction_kl),
        "epochs": args.num_iterations,
        "adv_estimator": "gdpo" if aggregation == "normalize_then_sum" else "grpo",
        "adv_scale": None if aggregation == "normalize_then_sum" else scale,
        "unbiased_std": True,
        "adv_eps": 1e-4,
        "mask_truncated": bool(args.mask_truncated_completions),
        "dynamic_sampling": False,
        "overlong_penalty": False,
    }


def _knobs(args: Any, loss: str, epsilon_high: float) -> dict[str, float]:
    """TRL's CISPO caps at epsilon_high as an absolute weight (epsilon when unset: 0.2, as TRL;
    5.0 is its recommendation); SAPO's and VESPO's fields are grouprl's knobs."""
    if loss == "cispo":
        return {"cispo_cap": float(epsilon_high)}
    if loss == "sapo":
        return {"sapo_tau_pos": float(args.sapo_temperature_pos),
                "sapo_tau_neg": float(args.sapo_temperature_neg)}  # fmt: skip
    names = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
    return {name: float(getattr(args, name)) for name in names}


def _optimizer(args: Any, steps: int, per_step: int) -> dict[str, Any]:
    if args.optim not in _OPTIMIZERS:
        raise refusal("optim", args.optim, "grouprl trains with AdamW (adamw_torch)")
    if args.lr_scheduler_type not in _SCHEDULES:
        raise refusal("lr_scheduler_type", args.lr_scheduler_type,
                      "grouprl has linear, cosine, constant and constant_with_warmup")  # fmt: skip
    warmup = args.warmup_steps
    if 0 < warmup < 1:  # a share of the run (transformers 5)
        warmup = math.ceil(warmup * steps * per_step)
    return {
        "lr": float(args.learning_rate),
        "lr_schedule": _SCHEDULES[args.lr_scheduler_type],
        "warmup_steps": math.ceil(warmup / per_step),
        "weight_decay": float(args.weight_decay),
        "adam_betas": (float(args.adam_beta1), float(args.adam_beta2)),
        "max_grad_norm": float(args.max_grad_norm),
    }


def _schedules(args: Any, steps: int, per_step: int, rows: int | None, prompts: int) -> dict:
    """When grouprl evaluates and saves: TRL's strategies and steps in grouprl's steps."""
    total = steps * per_step
    for name in ("eval_strategy", "save_strategy"):
        if getattr(args, name) not in _EVERY:
            raise refusal(name, getattr(args, name), "grouprl's are steps, epoch and no")
    epoch = max(1, math.ceil(rows / prompts)) if rows else steps
    eval_every = {"no": 0, "epoch": epoch,
                  "steps": _every(args.eval_steps or args.logging_steps, total, per_step)}  # fmt: skip
    save_every = {"no": steps + 1, "epoch": epoch,
                  "steps": _every(args.save_steps, total, per_step)}  # fmt: skip
    keep = args.save_total_limit
    return {
        "eval_every": eval_every[args.eval_strategy],
        "save_every": save_every[args.save_strategy],
        "keep_last": _KEEP_ALL if keep is None else max(1, int(keep)),
        "eval_samples": args.num_generations_eval or 4,
        # grouprl measures at the start and the end whatever TRL's strategy; with TRL's "no",
        # on fewer prompts (its least hold-out)
        **({"eval_size": 32} if args.eval_strategy == "no" else {}),
    }


def _engine(args: Any) -> dict[str, Any]:
    """TRL's vLLM fields: use_vllm with vllm_mode colocate is grouprl's vLLM engine in the
    training process; the memory, length and sleep fields are its options."""
    if not args.use_vllm:
        return {}
    if args.vllm_mode != "colocate":
        raise refusal("vllm_mode", args.vllm_mode,
                      "grouprl runs vLLM in the training process only: use vllm_mode='colocate' "
                      "(no trl vllm-serve server is needed)")  # fmt: skip
    if args.vllm_tensor_parallel_size != 1:
        raise refusal("vllm_tensor_parallel_size", args.vllm_tensor_parallel_size,
                      "grouprl's vLLM engine runs on one device")  # fmt: skip
    if args.vllm_importance_sampling_correction:  # TRL's default
        warnings.warn(
            "use_vllm=True: grouprl recomputes old log-probs with the trainer and logs how far "
            "vLLM's are from them (logp_mismatch_*), but does not yet correct for the gap as "
            "TRL's vllm_importance_sampling_correction does",
            UserWarning,
            stacklevel=4,
        )
    return {
        "engine": "vllm",
        "vllm_gpu_memory_utilization": float(args.vllm_gpu_memory_utilization),
        "vllm_max_model_length": args.vllm_max_model_length,
        "vllm_sleep": bool(args.vllm_enable_sleep_mode),
    }


def _report_to(value: Any) -> list[str]:
    names = [value] if isinstance(value, str) else list(value or [])
    if "all" in names:
        import importlib.util

        return [t for t in _TRACKERS if importlib.util.find_spec(t)] or ["none"]
    kept = [n for n in names if n in _TRACKERS]
    dropped = [n for n in names if n not in (*_TRACKERS, "none")]
    if dropped:
        warnings.warn(f"report_to: grouprl has no {', '.join(dropped)} tracker; not reported to",
                      UserWarning, stacklevel=4)  # fmt: skip
    return kept or ["none"]


def _precision(args: Any) -> str:
    """TRL's bf16 (None: True, as TRL resolves it): bf16 autocast where the device supports
    it, fp32 with one line where it does not."""
    if args.bf16 is False:
        return "fp32"
    import torch

    if torch.cuda.is_available() and not args.use_cpu:
        supported = torch.cuda.is_bf16_supported()
    else:
        supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if not supported:
        warnings.warn("bf16: this device has no bf16 support; training in fp32", UserWarning,
                      stacklevel=4)  # fmt: skip
    return "bf16" if supported else "fp32"


def options_from(args: Any, *, world: int = 1, rows: int | None = None) -> dict[str, Any]:
    """grouprl's options for TRL's `args` (a GRPOConfig) under `world` processes, with `rows`
    training prompts (None: unknown). UserError for a value grouprl does not implement."""
    _check_fields(args)
    batches = _batches(args, world)
    per_step = batches["minibatches"] * args.num_iterations  # optimizer steps per grouprl step
    steps = _steps(args, batches["prompts_per_step"], per_step, rows)
    turns = args.max_tool_calling_iterations
    options = {
        "algo": "grpo",
        **batches,
        "steps": steps,
        **_objective(args, world),
        **_optimizer(args, steps, per_step),
        **_schedules(args, steps, per_step, rows, batches["prompts_per_step"]),
        "max_new_tokens": args.max_completion_length,
        "max_turns": args.max_completion_length if turns is None else int(turns),
        "temperature": float(args.temperature),
        "top_p": float(args.top_p),
        "top_k": int(args.top_k or 0),
        "chat_template_kwargs": args.chat_template_kwargs,
        "seed": int(args.seed),
        "output_dir": Path(args.output_dir or "trainer_output"),
        "report_to": _report_to(args.report_to),
        "run_name": args.run_name,
        "trl_metrics": True,
        "precision": _precision(args),
        "gradient_checkpointing": bool(
            args.gradient_checkpointing or args.activation_checkpointing
        ),
        "trust_remote_code": bool(args.trust_remote_code),
        "device": "cpu" if args.use_cpu else "auto",
        "progress": not args.disable_tqdm,
        "strategy": "fsdp" if args.fsdp else "ddp",
        **_engine(args),
    }
    # None where grouprl resolves a value itself (norm_len, adv_scale under GDPO, run_name):
    # left to it, so that a resumed run's record (which holds the resolved value) matches
    kept = ("dual_clip", "chat_template_kwargs")
    return {k: v for k, v in options.items() if v is not None or k in kept}
