"""TRL 1.16's GRPOConfig as a dataclass transformers' HfArgumentParser (TRL's TrlParser) parses
as it parses TRL's: every field with TRL's type, default and argparse options, help in grouprl's
words, and what grouprl does with it (`FIELDS`; the mapping itself is `grouprl.trl.config`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal, NamedTuple

from transformers.debug_utils import DebugOption
from transformers.trainer_utils import HubStrategy, IntervalStrategy, SaveStrategy, SchedulerType
from transformers.training_args import OptimizerNames

from grouprl.errors import UserError

try:  # TRL's type for parallelism_config (accelerate comes with TRL; grouprl needs neither)
    from accelerate.parallelism_config import ParallelismConfig
except ImportError:  # pragma: no cover - only where accelerate is not installed
    ParallelismConfig = str  # type: ignore[assignment,misc]

TRL_VERSION = "1.16"

MAPPED, REFUSED, WARNED = "mapped", "refused", "warned"


class Field(NamedTuple):
    """A GRPOConfig field: TRL's type (what HfArgumentParser parses a flag as), TRL's default,
    and what grouprl does with it."""

    type: Any
    default: Any
    kind: str


#: Every field of TRL 1.16's GRPOConfig: its type and default, and what grouprl does with it.
#: MAPPED: onto grouprl's options (`options_from`; some values of some of these are refused
#: there, in one line). REFUSED: grouprl does not implement it; any value but the default
#: raises. WARNED: TRL's plumbing only (it cannot change what is trained); a value but the
#: default is warned about.
FIELDS: dict[str, Field] = {name: Field(*spec) for name, spec in {
    # -- transformers' TrainingArguments, with GRPOConfig's defaults --
    "output_dir": (str | None, None, MAPPED),
    "per_device_train_batch_size": (int, 8, MAPPED),
    "num_train_epochs": (float, 3.0, MAPPED),
    "max_steps": (int, -1, MAPPED),
    "learning_rate": (float, 1e-06, MAPPED),
    "lr_scheduler_type": (SchedulerType | str, "linear", MAPPED),
    "lr_scheduler_kwargs": (dict | str | None, None, REFUSED),
    "warmup_steps": (float, 0, MAPPED),
    "optim": (OptimizerNames | str, "adamw_torch_fused", MAPPED),
    "optim_args": (str | None, None, REFUSED),
    "weight_decay": (float, 0.0, MAPPED),
    "adam_beta1": (float, 0.9, MAPPED),
    "adam_beta2": (float, 0.999, MAPPED),
    "adam_epsilon": (float, 1e-08, REFUSED),
    "optim_target_modules": (None | str | list[str], None, REFUSED),
    "gradient_accumulation_steps": (int, 1, MAPPED),
    "average_tokens_across_devices": (bool, True, REFUSED),
    "max_grad_norm": (float, 1.0, MAPPED),
    "label_smoothing_factor": (float, 0.0, WARNED),
    "bf16": (bool | None, None, MAPPED),
    "fp16": (bool, False, REFUSED),
    "bf16_full_eval": (bool, False, WARNED),
    "fp16_full_eval": (bool, False, WARNED),
    "tf32": (bool | None, None, WARNED),
    "activation_checkpointing": (bool | None, None, MAPPED),
    "activation_checkpointing_kwargs": (dict[str, Any] | str | None, None, WARNED),
    "gradient_checkpointing": (bool, True, MAPPED),
    "gradient_checkpointing_kwargs": (dict[str, Any] | str | None, None, WARNED),
    "torch_compile": (bool, False, WARNED),
    "torch_compile_backend": (str | None, None, WARNED),
    "torch_compile_mode": (str | None, None, WARNED),
    "use_liger_kernel": (bool, False, WARNED),
    "liger_kernel_config": (dict[str, bool] | None, None, WARNED),
    "use_cache": (bool, False, WARNED),
    "neftune_noise_alpha": (float | None, None, REFUSED),
    "torch_empty_cache_steps": (int | None, None, WARNED),
    "auto_find_batch_size": (bool, False, REFUSED),
    "logging_strategy": (IntervalStrategy | str, "steps", WARNED),
    "logging_steps": (float, 10, WARNED),
    "logging_first_step": (bool, False, WARNED),
    "log_on_each_node": (bool, True, WARNED),
    "logging_nan_inf_filter": (bool, True, WARNED),
    "include_num_input_tokens_seen": (str | bool, "no", WARNED),
    "log_level": (str, "passive", WARNED),
    "log_level_replica": (str, "warning", WARNED),
    "disable_tqdm": (bool | None, None, MAPPED),
    "report_to": (None | str | list[str], "none", MAPPED),
    "run_name": (str | None, None, MAPPED),
    "project": (str, "huggingface", WARNED),
    "trackio_space_id": (str | None, None, WARNED),
    "trackio_bucket_id": (str | None, None, WARNED),
    "trackio_static_space_id": (str | None | Literal[False], None, WARNED),
    "eval_strategy": (IntervalStrategy | str, "no", MAPPED),
    "eval_steps": (float | None, None, MAPPED),
    "eval_delay": (float, 0, WARNED),
    "per_device_eval_batch_size": (int, 8, WARNED),
    "prediction_loss_only": (bool, False, WARNED),
    "eval_on_start": (bool, False, MAPPED),
    "eval_do_concat_batches": (bool, True, WARNED),
    "eval_use_gather_object": (bool, False, WARNED),
    "eval_accumulation_steps": (int | None, None, WARNED),
    "include_for_metrics": (list[str], [], WARNED),
    "batch_eval_metrics": (bool, False, WARNED),
    "save_only_model": (bool, False, WARNED),
    "save_strategy": (SaveStrategy | str, "steps", MAPPED),
    "save_steps": (float, 500, MAPPED),
    "save_on_each_node": (bool, False, WARNED),
    "save_total_limit": (int | None, None, MAPPED),
    "enable_jit_checkpoint": (bool, False, WARNED),
    "push_to_hub": (bool, False, WARNED),
    "hub_token": (str | None, None, WARNED),
    "hub_private_repo": (bool | None, None, WARNED),
    "hub_model_id": (str | None, None, WARNED),
    "hub_strategy": (HubStrategy | str, "every_save", WARNED),
    "hub_always_push": (bool, False, WARNED),
    "hub_revision": (str | None, None, WARNED),
    "load_best_model_at_end": (bool, False, REFUSED),
    "metric_for_best_model": (str | None, None, WARNED),
    "greater_is_better": (bool | None, None, WARNED),
    "ignore_data_skip": (bool, False, WARNED),
    "restore_callback_states_from_checkpoint": (bool, False, WARNED),
    "full_determinism": (bool, False, WARNED),
    "seed": (int, 42, MAPPED),
    "data_seed": (int | None, None, REFUSED),
    "use_cpu": (bool, False, MAPPED),
    "accelerator_config": (dict | str | None, None, WARNED),
    "parallelism_config": (ParallelismConfig | None, None, REFUSED),
    "dataloader_drop_last": (bool, False, WARNED),
    "dataloader_num_workers": (int, 0, WARNED),
    "dataloader_pin_memory": (bool, True, WARNED),
    "dataloader_persistent_workers": (bool, False, WARNED),
    "dataloader_prefetch_factor": (int | None, None, WARNED),
    "dataloader_multiprocessing_context": (str | None, None, WARNED),
    "dataloader_in_order": (bool, True, WARNED),
    "remove_unused_columns": (bool | None, False, WARNED),
    "label_names": (list[str] | None, None, WARNED),
    "train_sampling_strategy": (str, "random", REFUSED),
    "length_column_name": (str, "length", WARNED),
    "ddp_find_unused_parameters": (bool | None, None, WARNED),
    "ddp_bucket_cap_mb": (int | None, None, WARNED),
    "ddp_broadcast_buffers": (bool | None, None, WARNED),
    "ddp_static_graph": (bool | None, None, WARNED),
    "ddp_backend": (str | None, None, WARNED),
    "ddp_timeout": (int, 1800, WARNED),
    "fsdp": (str | None, None, MAPPED),
    "fsdp_config": (dict[str, Any] | str | None, None, WARNED),
    "deepspeed": (dict | str | None, None, REFUSED),
    "debug": (str | list[DebugOption], "", WARNED),
    "skip_memory_metrics": (bool, True, WARNED),
    "do_train": (bool, False, WARNED),
    "do_eval": (bool, False, WARNED),
    "do_predict": (bool, False, WARNED),
    "resume_from_checkpoint": (str | None, None, MAPPED),
    "local_rank": (int, -1, WARNED),
    # -- GRPOConfig's own --
    "model_init_kwargs": (dict[str, Any] | str | None, None, MAPPED),
    "trust_remote_code": (bool, False, MAPPED),
    "router_aux_loss_coef": (float | None, None, MAPPED),
    "disable_dropout": (bool, False, MAPPED),
    "cast_lm_head_to_fp32": (bool, False, REFUSED),
    "num_generations": (int | None, 8, MAPPED),
    "num_generations_eval": (int | None, None, MAPPED),
    "max_completion_length": (int | None, 512, MAPPED),
    "ds3_gather_for_generation": (bool, True, WARNED),
    "shuffle_dataset": (bool | None, True, REFUSED),
    "pad_to_multiple_of": (int | str | None, "auto", WARNED),
    "generation_batch_size": (int | None, None, MAPPED),
    "steps_per_generation": (int | None, None, MAPPED),
    "temperature": (float, 1.0, MAPPED),
    "top_p": (float, 1.0, MAPPED),
    "top_k": (int, 0, MAPPED),
    "min_p": (float | None, None, REFUSED),
    "generation_kwargs": (dict | str | None, None, REFUSED),
    "chat_template_kwargs": (dict | str | None, None, MAPPED),
    "repetition_penalty": (float, 1.0, REFUSED),
    "cache_implementation": (str | None, None, WARNED),
    "use_vllm": (bool, False, MAPPED),
    "vllm_mode": (str, "colocate", MAPPED),
    "vllm_model_impl": (str, "vllm", WARNED),
    "vllm_enable_sleep_mode": (bool, False, MAPPED),
    "vllm_structured_outputs_regex": (str | None, None, REFUSED),
    "vllm_server_base_url": (str | None, None, MAPPED),
    "vllm_server_host": (str, "0.0.0.0", MAPPED),
    "vllm_server_port": (int, 8000, MAPPED),
    "vllm_server_timeout": (float, 240.0, WARNED),
    "vllm_group_port": (int, 51216, WARNED),
    "vllm_gpu_memory_utilization": (float, 0.3, MAPPED),
    "vllm_max_model_length": (int | None, None, MAPPED),
    "vllm_tensor_parallel_size": (int, 1, MAPPED),
    "beta": (float, 0.0, MAPPED),
    "num_iterations": (int, 1, MAPPED),
    "epsilon": (float, 0.2, MAPPED),
    "delta": (float | None, None, MAPPED),
    "epsilon_high": (float | None, None, MAPPED),
    "sapo_temperature_neg": (float, 1.05, MAPPED),
    "sapo_temperature_pos": (float, 1.0, MAPPED),
    "vespo_k_pos": (float, 2.0, MAPPED),
    "vespo_lambda_pos": (float, 3.0, MAPPED),
    "vespo_k_neg": (float, 3.0, MAPPED),
    "vespo_lambda_neg": (float, 2.0, MAPPED),
    "importance_sampling_level": (str, "token", MAPPED),
    "reward_weights": (list[float] | None, None, MAPPED),
    "multi_objective_aggregation": (str, "sum_then_normalize", MAPPED),
    "scale_rewards": (str, "group", MAPPED),
    "loss_type": (str, "dapo", MAPPED),
    "mask_truncated_completions": (bool, False, MAPPED),
    "sync_ref_model": (bool, False, REFUSED),
    "ref_model_mixup_alpha": (float, 0.6, REFUSED),
    "ref_model_sync_steps": (int, 512, REFUSED),
    "top_entropy_quantile": (float, 1.0, MAPPED),
    "entropy_coef": (float, 0.0, MAPPED),
    "use_adaptive_entropy": (bool, False, MAPPED),
    "entropy_coef_min": (float, 0.0, MAPPED),
    "entropy_coef_max": (float, 1.0, MAPPED),
    "entropy_coef_delta": (float, 0.005, MAPPED),
    "entropy_target": (float, 0.2, MAPPED),
    "max_tool_calling_iterations": (int | None, None, MAPPED),
    "vllm_importance_sampling_correction": (bool, True, MAPPED),
    "vllm_importance_sampling_mode": (str, "sequence_mask", MAPPED),
    "vllm_importance_sampling_clip_max": (float | None, 3.0, MAPPED),
    "vllm_importance_sampling_clip_min": (float | None, None, MAPPED),
    "off_policy_mask_threshold": (float | None, None, MAPPED),
    "use_bias_correction_kl": (bool, True, MAPPED),
    "log_completions": (bool, False, MAPPED),
    "log_multimodal": (bool, True, WARNED),
    "num_completions_to_print": (int | None, None, WARNED),
    "log_unique_prompts": (bool, False, WARNED),
    "log_completions_hub_repo": (str | None, None, WARNED),
    "use_transformers_continuous_batching": (bool, False, WARNED),
    "transformers_continuous_batching_config": (dict | str | None, None, WARNED),
    "use_transformers_paged": (bool, False, WARNED),
    "vllm_importance_sampling_cap": (float | None, None, MAPPED),
}.items()}  # fmt: skip


#: What grouprl does with each mapped field, as the parser's --help says it (the docs' TRL
#: table has the detail).
HELP: dict[str, str] = {
    "output_dir": "The run directory (default trainer_output): config, checkpoints, metrics, final/.",
    "per_device_train_batch_size": "Completions per process in a micro-batch (grouprl's "
        "micro-batch size); x gradient_accumulation_steps x processes: an optimizer step's.",
    "num_train_epochs": "Passes over the training prompts, when max_steps is not set.",
    "max_steps": "Optimizer steps (-1: from num_train_epochs); a multiple of the optimizer steps "
        "a generation batch serves.",
    "learning_rate": "AdamW's learning rate.",
    "lr_scheduler_type": "linear, cosine, constant or constant_with_warmup.",
    "warmup_steps": "Warm-up optimizer steps (below 1: a share of the run).",
    "optim": "adamw_torch or adamw_torch_fused: grouprl's AdamW.",
    "weight_decay": "AdamW's decoupled weight decay.",
    "adam_beta1": "AdamW's beta1.",
    "adam_beta2": "AdamW's beta2.",
    "gradient_accumulation_steps": "Micro-batches per optimizer step.",
    "max_grad_norm": "Clip the gradient to this global norm.",
    "bf16": "bf16 autocast forwards where the device supports it (unset: yes, as TRL); "
        "weights and AdamW stay fp32.",
    "activation_checkpointing": "Recompute activations in the backward pass.",
    "gradient_checkpointing": "Recompute activations in the backward pass.",
    "disable_tqdm": "No progress bar.",
    "report_to": "Trackers: tensorboard, wandb, trackio, mlflow, all or none.",
    "run_name": "The run's name in the trackers.",
    "eval_strategy": "steps, epoch or no; grouprl also measures at the start and the end.",
    "eval_steps": "Evaluate every this many optimizer steps (unset: logging_steps).",
    "eval_on_start": "grouprl always evaluates at the start.",
    "save_strategy": "steps, epoch or no: when checkpoints are written.",
    "save_steps": "Save every this many optimizer steps (below 1: a share of the run).",
    "save_total_limit": "Keep this many checkpoints (unset: all).",
    "seed": "The run's seed: sampling, data order and initialisation.",
    "use_cpu": "Train on the CPU even where CUDA is available.",
    "fsdp": "Any value: FSDP2 under torchrun (else DDP).",
    "resume_from_checkpoint": "Continue the run in this directory, exactly.",
    "model_init_kwargs": "from_pretrained's dtype (a LoRA base's and the reference model's), "
        "attn_implementation, revision and trust_remote_code; a dict or JSON.",
    "trust_remote_code": "Let from_pretrained run code shipped with the model.",
    "disable_dropout": "Dropout off in the policy (grouprl's models train without it).",
    "num_generations": "Completions per prompt: the group size G.",
    "num_generations_eval": "Completions per held-out prompt when evaluating.",
    "max_completion_length": "Most new tokens per completion.",
    "generation_batch_size": "Completions sampled per generation (grouprl's step); or give "
        "steps_per_generation.",
    "steps_per_generation": "Optimizer steps one generation batch serves (unset: "
        "gradient_accumulation_steps).",
    "temperature": "Sampling temperature (the log-probs are of the tempered policy).",
    "top_p": "Nucleus sampling's mass (1: off).",
    "top_k": "Sample from the k most likely tokens (0: off).",
    "chat_template_kwargs": "Variables for the chat template; a dict or JSON.",
    "use_vllm": "Sample with vLLM (pip install 'grouprl[vllm]').",
    "vllm_mode": "colocate: vLLM in the training process; server: the vLLM server "
        "vllm_server_base_url (or vllm_server_host/port) names, or with none named vLLM in a "
        "process of grouprl's own.",
    "vllm_server_base_url": "The vLLM server of server mode (grouprl's --vllm-server).",
    "vllm_server_host": "The vLLM server's host, when no base URL is given.",
    "vllm_server_port": "The vLLM server's port, when no base URL is given.",
    "vllm_enable_sleep_mode": "Put vLLM to sleep during the update (CUDA).",
    "vllm_gpu_memory_utilization": "The share of the GPU vLLM may hold.",
    "vllm_max_model_length": "Longest prompt + completion vLLM holds.",
    "vllm_tensor_parallel_size": "Only 1: grouprl's vLLM runs on one device.",
    "beta": "The KL penalty's coefficient (0: no reference model).",
    "router_aux_loss_coef": "A mixture-of-experts policy's load-balancing loss weight (None: "
    "the model config's own; grouprl's --router-aux-loss-coef).",
    "num_iterations": "Epochs over each generation batch.",
    "epsilon": "The clip's lower epsilon.",
    "delta": "The two-sided clip's upper bound on the ratio (INTELLECT-2).",
    "epsilon_high": "The clip's upper epsilon (unset: epsilon).",
    "sapo_temperature_neg": "SAPO's temperature for negative advantages.",
    "sapo_temperature_pos": "SAPO's temperature for positive advantages.",
    "vespo_k_pos": "VESPO's k for positive advantages.",
    "vespo_lambda_pos": "VESPO's lambda for positive advantages.",
    "vespo_k_neg": "VESPO's k for negative advantages.",
    "vespo_lambda_neg": "VESPO's lambda for negative advantages.",
    "importance_sampling_level": "token (GRPO) or sequence (GSPO's length-normalised ratio).",
    "reward_weights": "One weight per reward function.",
    "multi_objective_aggregation": "sum_then_normalize, or normalize_then_sum (GDPO).",
    "scale_rewards": "group, batch or none: what the advantage is divided by.",
    "loss_type": "dapo, bnpo, grpo, dr_grpo, cispo, sapo, luspo or vespo.",
    "mask_truncated_completions": "No gradient from completions cut at max_completion_length.",
    "max_tool_calling_iterations": "Most tool-calling turns per completion.",
    "vllm_importance_sampling_correction": "With use_vllm: correct for vLLM's log-probs "
        "differing from the trainer's (grouprl's --correction).",
    "vllm_importance_sampling_mode": "token_truncate, token_mask, sequence_truncate or "
        "sequence_mask (sequence: the product of token ratios).",
    "vllm_importance_sampling_clip_max": "The correction's upper bound on the ratio.",
    "vllm_importance_sampling_clip_min": "The correction's lower bound on the ratio.",
    "off_policy_mask_threshold": "DeepSeek-V3.2's off-policy sequence mask's delta.",
    "use_bias_correction_kl": "Weigh the KL term by the ratio (DeepSeek-V3.2's unbiased KL).",
    "log_completions": "Write each step's completions to the run directory.",
    "top_entropy_quantile": "Train only the tokens in the top rho of the batch by entropy.",
    "entropy_coef": "The entropy bonus's coefficient (the adaptive one's start).",
    "use_adaptive_entropy": "Adapt the entropy coefficient toward entropy_target.",
    "entropy_coef_min": "The adaptive entropy coefficient's floor.",
    "entropy_coef_max": "The adaptive entropy coefficient's ceiling.",
    "entropy_coef_delta": "The adaptive entropy coefficient's step.",
    "entropy_target": "The mean token entropy (nats) the adaptive coefficient aims at.",
    "vllm_importance_sampling_cap": "Deprecated by TRL: vllm_importance_sampling_clip_max.",
}  # fmt: skip
_HELP_OTHER = {
    REFUSED: "Not implemented by grouprl: any value but the default is refused.",
    WARNED: "TRL's plumbing: grouprl ignores it (and warns when it is set).",
}
#: What argparse takes besides a field's type (TRL's own choices and optional values).
_LEVELS = ["detail", "debug", "info", "warning", "error", "critical", "passive"]
_ARGPARSE: dict[str, dict[str, Any]] = {
    "activation_checkpointing": {"nargs": "?", "const": True},
    "fsdp": {"nargs": "?", "const": True},
    "log_level": {"choices": _LEVELS},
    "log_level_replica": {"choices": _LEVELS},
    "dataloader_multiprocessing_context": {"choices": ["fork", "spawn", "forkserver"]},
    "train_sampling_strategy": {"choices": ["random", "sequential", "group_by_length",
                                            "batch_rebalance"]},
    "ddp_backend": {"choices": ["nccl", "gloo", "mpi", "xccl", "hccl", "cncl", "mccl"]},
    "dtype": {"choices": ["auto", "bfloat16", "float16", "float32"]},  # AsyncGRPOConfig's
}  # fmt: skip


def _field(name: str, spec: Field, help: dict[str, str]) -> Any:
    """A dataclass field for HfArgumentParser: TRL's default, help and argparse options."""
    metadata = {"help": help.get(name) or _HELP_OTHER[spec.kind], **_ARGPARSE.get(name, {})}
    default = spec.default
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


#: Values HfArgumentParser gives fields that were not on the command line, and what TRL's
#: TrainingArguments makes of them (a list field's default is lost; a str | bool is a bool).
_PARSED = {"debug": {None: ""}, "include_num_input_tokens_seen": {False: "no", True: "all"}}


def _post_init(fields: dict[str, Field]) -> Any:
    """A __post_init__ that turns a dict field given as JSON text (from a flag) into the dict
    and the parser's forms of `_PARSED` into TRL's, as TrainingArguments does. (The field names
    are taken here: HfArgumentParser rewrites a parsed dataclass's field types in place.)"""
    names = [n for n, spec in fields.items() if "dict" in str(spec.type)]

    def decode(self: Any) -> None:
        for name, forms in _PARSED.items():
            value = getattr(self, name)
            if isinstance(value, bool | None) and value in forms:
                setattr(self, name, forms[value])
        for name in names:
            value = getattr(self, name)
            if isinstance(value, str) and value.lstrip().startswith("{"):
                try:
                    setattr(self, name, json.loads(value))
                except ValueError as err:
                    raise UserError(f"{name}: not valid JSON ({err}): {value}") from None

    return decode


def config_class(
    name: str, fields: dict[str, Field], doc: str, help: dict[str, str] | None = None
) -> type:
    """A dataclass with `fields`' types, defaults and help (`HELP`, with `help`'s in its
    place), which HfArgumentParser (TRL's TrlParser) parses from flags, YAML and dicts as it
    parses TRL's."""
    help = {**HELP, **(help or {})}
    cls = dataclasses.make_dataclass(
        name,
        [(n, spec.type, _field(n, spec, help)) for n, spec in fields.items()],
        kw_only=True,
        namespace={"__post_init__": _post_init(fields), "__doc__": doc},
    )
    cls.__module__ = __name__
    return cls


GRPOConfig = config_class(
    "GRPOConfig",
    FIELDS,
    "TRL 1.16's GRPOConfig: its fields, types and defaults, mapped onto grouprl's options when "
    "a GRPOTrainer starts (grouprl.trl.FIELDS; the docs' reference of grouprl trl).",
)
