"""TRL 1.16's GRPOConfig (`grouprl.trl.fields`) mapped onto grouprl's options: `options_from`.

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
from grouprl.trl.fields import (
    FIELDS,
    HELP,
    MAPPED,
    REFUSED,
    TRL_VERSION,
    WARNED,
    Field,
    GRPOConfig,
    config_class,
)

__all__ = ["FIELDS", "HELP", "MAPPED", "REFUSED", "TRL_VERSION", "WARNED", "Field", "GRPOConfig",
           "config_class", "options_from", "refusal"]  # fmt: skip

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


def require_config(args: Any, fields: Any, name: str) -> None:
    """One line unless `args` is a dataclass with every one of `fields` (TRL's config `name`)."""
    have = {f.name for f in dataclasses.fields(args)} if dataclasses.is_dataclass(args) else set()
    if not set(fields) <= have:
        raise UserError(
            f"args= takes grouprl.trl.{name} (TRL's fields); build it with "
            f"`from grouprl.trl import {name}`"
        )


def _check_fields(args: Any) -> None:
    """Refused fields set to anything but TRL's default raise; plumbing set so is warned of."""
    require_config(args, FIELDS, "GRPOConfig")
    changed = {name: getattr(args, name) for name, spec in FIELDS.items()
               if getattr(args, name) != spec.default}  # fmt: skip
    for name, value in changed.items():
        if FIELDS[name].kind == REFUSED:
            raise UserError(
                f"GRPOConfig({name}={value!r}): grouprl does not implement it; leave it at "
                f"{FIELDS[name].default!r} (the docs' command reference, grouprl trl, lists what grouprl maps)"
            )
    warned = [f"{n}={v!r}" for n, v in changed.items() if FIELDS[n].kind == WARNED]
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
    training process; server is the vLLM server vllm_server_base_url (or vllm_server_host and
    vllm_server_port) names (`--vllm-server`), or, with none named, grouprl's vLLM in a process
    of its own; the memory, length and sleep fields are their options."""
    if not args.use_vllm:
        return {}
    if args.vllm_mode not in ("colocate", "server"):
        raise refusal("vllm_mode", args.vllm_mode, "colocate or server")
    if args.vllm_tensor_parallel_size != 1:
        raise refusal("vllm_tensor_parallel_size", args.vllm_tensor_parallel_size,
                      "grouprl's vLLM engine runs on one device")  # fmt: skip
    server = _server_url(args) if args.vllm_mode == "server" else None
    return {
        "engine": "vllm",
        **({"vllm_server": server} if server else {}),
        "vllm_mode": args.vllm_mode,
        "vllm_gpu_memory_utilization": float(args.vllm_gpu_memory_utilization),
        "vllm_max_model_length": args.vllm_max_model_length,
        "vllm_sleep": bool(args.vllm_enable_sleep_mode),
    }


def _server_url(args: Any) -> str | None:
    """The server TRL's server mode connects to, when the script names one: its base URL, or
    its host and port when either is not TRL's default (0.0.0.0:8000, which a script that
    names no server leaves; grouprl then runs vLLM in a process of its own)."""
    if args.vllm_server_base_url:
        return str(args.vllm_server_base_url)
    host, port = str(args.vllm_server_host), int(args.vllm_server_port)
    if (host, port) == ("0.0.0.0", 8000):
        return None
    return f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"


#: TRL's vllm_importance_sampling_mode: grouprl's correction part and level.
_IS_MODES = {"token_truncate": ("weight", "token"), "token_mask": ("mask", "token"),
             "sequence_truncate": ("weight", "sequence"), "sequence_mask": ("mask", "sequence")}  # fmt: skip


def _correction(args: Any, reuses: bool, precision: str) -> dict[str, Any]:
    """TRL's vLLM importance sampling (only with use_vllm, as TRL) and off-policy sequence mask
    as grouprl's correction: the ratio is the trainer's recomputed old log-probs over vLLM's
    (per token, or the product over a sequence), truncated to or masked outside
    [clip_min, clip_max]; an unset bound is none on that side."""
    out: dict[str, Any] = {}
    delta = args.off_policy_mask_threshold
    if delta is not None:
        if args.use_vllm or reuses or precision != "fp32":
            out["off_policy_mask"] = float(delta)
        else:  # TRL's mask compares the policy with itself here: it never masks
            warnings.warn(
                f"off_policy_mask_threshold={delta}: nothing can drift (fp32, no vLLM, one "
                "update per generation batch), so the mask never acts; not applied",
                UserWarning,
                stacklevel=4,
            )
    if not (args.use_vllm and args.vllm_importance_sampling_correction):
        return out
    mode = args.vllm_importance_sampling_mode
    if mode not in _IS_MODES:
        raise refusal("vllm_importance_sampling_mode", mode, ", ".join(_IS_MODES))
    if args.loss_type == "vespo":
        raise refusal("loss_type", "vespo",
                      "TRL's VESPO takes vLLM's ratio into its gamma weights, which grouprl's "
                      "does not; set vllm_importance_sampling_correction=False")  # fmt: skip
    high = args.vllm_importance_sampling_clip_max
    if args.vllm_importance_sampling_cap is not None:  # TRL's deprecated name for clip_max
        high = args.vllm_importance_sampling_cap
    low = args.vllm_importance_sampling_clip_min
    low = None if low is None or low <= 0 else float(low)  # a ratio is >= 0: no bound at all
    if low is not None and high is not None and low >= high:
        raise refusal("vllm_importance_sampling_clip_min", low,
                      f"must be less than vllm_importance_sampling_clip_max ({high})")  # fmt: skip
    part, level = _IS_MODES[mode]
    if low is None and high is None:
        raise refusal("vllm_importance_sampling_mode", mode,
                      "an importance weight with no bound; set vllm_importance_sampling_clip_max "
                      "or _clip_min")  # fmt: skip
    high = None if high is None else float(high)
    # truncate: the ratio clamped to the band; mask: the ratio inside it and 0 outside (masked
    # IS), a weight whose clamp never acts on what the mask keeps
    parts = ("weight",) if part == "weight" else ("weight", "mask")
    for name in parts:
        out.update({f"correction_{name}": level, f"correction_{name}_low": low,
                    f"correction_{name}_high": high})  # fmt: skip
    return out


def _entropy(args: Any) -> dict[str, Any]:
    """TRL's high-entropy tokens and entropy bonus, fixed or adaptive (`use_adaptive_entropy`:
    grouprl's `entropy_target`)."""
    out = {"top_entropy_quantile": float(args.top_entropy_quantile),
           "entropy_coef": float(args.entropy_coef)}  # fmt: skip
    rule = ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")
    if args.use_adaptive_entropy:
        return {**out, **{name: float(getattr(args, name)) for name in rule}}
    inert = [f"{n}={getattr(args, n)!r}" for n in rule if getattr(args, n) != FIELDS[n].default]
    if inert:
        warnings.warn(f"{', '.join(inert)}: these apply only with use_adaptive_entropy=True (as "
                      "TRL's); not used", UserWarning, stacklevel=4)  # fmt: skip
    return out


#: model_init_kwargs' dtype as grouprl's dtype names (None: grouprl's fp32).
_DTYPES = {None: None, "auto": None, "float32": None, "bfloat16": "bf16", "float16": "fp16"}
_MODEL_INIT = {"dtype", "torch_dtype", "attn_implementation", "revision", "trust_remote_code"}


def _model_init(args: Any, lora: bool) -> dict[str, Any]:
    """TRL's model_init_kwargs: dtype is the frozen weights' (a LoRA base, the reference model;
    trainable weights and AdamW stay fp32, bf16 forwards come from bf16), attn_implementation,
    revision (main: the default branch) and trust_remote_code are from_pretrained's."""
    kwargs = dict(args.model_init_kwargs or {})
    # a key given as None asks for nothing (TRL's gspo_vlm.py passes device_map=None and
    # quantization_config=None when it does not quantize)
    unknown = sorted(k for k in set(kwargs) - _MODEL_INIT if kwargs[k] is not None)
    if unknown:
        raise refusal("model_init_kwargs", kwargs,
                      f"grouprl takes {', '.join(sorted(_MODEL_INIT))}, not {', '.join(unknown)}")  # fmt: skip
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    name = str(dtype).removeprefix("torch.") if dtype is not None else None
    if name not in _DTYPES:
        raise refusal("model_init_kwargs", kwargs, "dtype is auto, float32, bfloat16 or float16")
    out: dict[str, Any] = {
        "attn_implementation": kwargs.get("attn_implementation"),
        "revision": None if kwargs.get("revision") in (None, "main") else kwargs["revision"],
    }
    if kwargs.get("trust_remote_code"):
        out["trust_remote_code"] = True
    frozen = _DTYPES[name]
    if frozen is not None and (lora or args.beta != 0):
        out["base_dtype"] = frozen
    elif frozen is not None:
        warnings.warn(
            f"model_init_kwargs dtype={name}: grouprl trains the weights in fp32 (with AdamW's "
            "state) and computes in bf16 when bf16=True; the dtype applies to frozen weights "
            "(a LoRA base, the reference model), of which this run has none",
            UserWarning,
            stacklevel=4,
        )
    return out


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


#: How a TRL user names the grouprl options that messages tell them to change (grouprl field ->
#: GRPOConfig field). An option absent here has no GRPOConfig field (TRL 1.16 has no
#: max_prompt_length): messages leave it out of their remedies (`grouprl.errors.option_names`).
OPTION_NAMES = {
    "max_new_tokens": "max_completion_length",
    "vllm_max_model_length": "vllm_max_model_length",
    "vllm_server": "vllm_server_base_url",
    "group_size": "num_generations",
    "lr": "learning_rate",
    "beta": "beta",
    "temperature": "temperature",
    "seed": "seed",
}


def options_from(
    args: Any, *, world: int = 1, rows: int | None = None, lora: bool = False
) -> dict[str, Any]:
    """grouprl's options for TRL's `args` (a GRPOConfig) under `world` processes, with `rows`
    training prompts (None: unknown), `lora`: whether the trainer was given a peft_config.
    UserError for a value grouprl does not implement."""
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
        "router_aux_loss_coef": args.router_aux_loss_coef,  # None: the model's own, as TRL
        "device": "cpu" if args.use_cpu else "auto",
        "progress": not args.disable_tqdm,
        "strategy": "fsdp" if args.fsdp else "ddp",
        **_model_init(args, lora),
        **_engine(args),
    }
    options.update(_correction(args, per_step > 1, options["precision"]))
    options.update(_entropy(args))
    # None where grouprl resolves a value itself (norm_len, adv_scale under GDPO, run_name):
    # left to it, so that a resumed run's record (which holds the resolved value) matches
    kept = ("dual_clip", "chat_template_kwargs")
    return {k: v for k, v in options.items() if v is not None or k in kept}
