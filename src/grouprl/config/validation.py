"""Validation: every rule between a run's settings, checked before a model is loaded, each broken
one a single line (`UserError`) and each dubious one a warning."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import typing
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from grouprl.config.choices import TRACKERS
from grouprl.config.options import DataOptions, EvalConfig, RunConfig
from grouprl.config.training import (
    ComputeOptions,
    EntropyOptions,
    OffPolicyOptions,
    UpdateOptions,
)
from grouprl.core.registry import ADVANTAGE_ESTIMATORS, OBJECTIVES
from grouprl.errors import UserError

if TYPE_CHECKING:  # core imports torch: only when a run is validated
    from grouprl.core import Correction, LossOptions

#: The one rule for a sampling temperature wherever a command takes one (the sampler itself
#: also decodes greedily at 0, which no command exposes).
TEMPERATURE_RULE = "temperature must be > 0: log-probs are taken at it"


#: --task-config without a generator to configure
TASK_CONFIG_ALONE = (
    "--task-config configures a --task reasoning_gym:NAME generator, which is not given"
)


def _choice_problems(cfg: Any) -> list[str]:
    """Values outside their Literal choices: the parser checks flags and files, but a config
    built in Python bypasses it."""
    problems = []
    for name, annotation in typing.get_type_hints(type(cfg)).items():
        options = [annotation, *typing.get_args(annotation)]  # Literal, or Optional[Literal]
        literal = next((a for a in options if typing.get_origin(a) is Literal), None)
        value = getattr(cfg, name, None)
        if literal is not None and value is not None and value not in typing.get_args(literal):
            valid = ", ".join(map(str, typing.get_args(literal)))
            problems.append(f"{name} {value!r} is not one of {valid}")
    return problems


def _data_checks(opts: DataOptions) -> list[tuple[bool, str]]:
    """The rules between the data fields, shared by train and eval."""
    given = [
        flag
        for flag, value in (
            ("--eval-dataset", opts.eval_dataset),
            ("--prompt-template", opts.prompt_template),
            ("--answer-column", opts.answer_column),
        )
        if value is not None
    ]
    return [
        (
            opts.dataset is None or opts.task is None,
            f"--task {opts.task} and --dataset are exclusive: a dataset brings its own prompts; "
            "drop --task",
        ),
        (
            # an environment may own the reward (get_reward); build_rewards checks it has one;
            # an agent program returns its episodes' rewards
            opts.dataset is None
            or bool(opts.rewards)
            or opts.environment is not None
            or getattr(opts, "agent", None) is not None,
            "--dataset needs --rewards: name the functions that score your data, e.g. "
            "--rewards accuracy 1.0, or --rewards path/to/rewards.py:my_reward 1.0",
        ),
        (
            opts.dataset is not None or not given,
            f"{given[0] if given else ''} applies to --dataset, which is not given",
        ),
        (
            not opts.task_config or (opts.task or "").startswith(("reasoning_gym:", "verifiers:")),
            TASK_CONFIG_ALONE,
        ),
        (0 < opts.eval_fraction < 1, "eval_fraction must lie in (0, 1)"),
        (
            opts.max_prompt_length is None or opts.max_prompt_length >= 1,
            "max_prompt_length must be at least 1",
        ),
        (
            opts.stop is None or all(isinstance(s, str) and s for s in opts.stop),
            "stop strings must be non-empty",
        ),
        (opts.rewards is None or len(opts.rewards) > 0, "rewards must name at least one function"),
        (opts.reward_timeout > 0, "reward_timeout must be > 0 seconds"),
        (opts.max_turns >= 0, "max_turns must be >= 0 (0: tools available, never run)"),
        (
            opts.max_tool_response_tokens is None or opts.max_tool_response_tokens >= 1,
            "max_tool_response_tokens must be at least 1",
        ),
        (opts.tool_timeout > 0, "tool_timeout must be > 0 seconds"),
        (opts.tools is None or len(opts.tools) > 0, "tools must name at least one tool"),
        (
            opts.max_new_tokens is None or opts.max_new_tokens >= 1,
            "max_new_tokens must be at least 1",
        ),
    ]


def _raise_first(checks: list[tuple[bool, str]], problems: Sequence[str] = ()) -> None:
    for ok, message in checks:
        if not ok:
            raise UserError(message if message.startswith("--") else f"invalid config: {message}")
    for problem in problems:
        raise UserError(f"invalid config: {problem}")


def validate_eval(cfg: EvalConfig) -> None:
    """`grouprl eval`'s settings: one line for the first that is impossible."""
    _raise_first(
        [
            *_data_checks(cfg),
            (cfg.max_image_pixels >= 1, "max_image_pixels must be at least 1"),
            (cfg.limit >= 1, "--limit must be at least 1"),
            (cfg.samples >= 1, "samples must be at least 1"),
            (cfg.batch_prompts >= 1, "batch_prompts must be at least 1"),
            (cfg.temperature > 0, TEMPERATURE_RULE),
            (cfg.threads is None or cfg.threads >= 1, "threads must be at least 1"),
        ],
        _choice_problems(cfg),
    )


def _objective_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    """The entropy options', the estimators' and distillation's rules."""
    return [
        (
            cfg.teacher is not None or cfg.teacher_loss == "advantage",
            "--teacher-loss jsd distils from a teacher: give it with --teacher MODEL",
        ),
        (
            cfg.teacher_loss == "jsd" or cfg.teacher_beta == 0.5,
            "--teacher-beta weighs --teacher-loss jsd's divergence; add --teacher-loss jsd",
        ),
        (0 <= cfg.teacher_beta <= 1, "teacher_beta must lie in [0, 1] (0: forward KL, 1: reverse)"),
        (
            cfg.teacher is None
            or cfg.teacher_loss == "jsd"
            or not OBJECTIVES[cfg.objective].sequence_weighted,
            f"--teacher gives each token its own advantage; --objective {cfg.objective} weighs "
            "whole sequences by one: use one that weighs tokens, "
            + ", ".join(n for n, o in OBJECTIVES.items() if not o.sequence_weighted),
        ),
        (
            cfg.teacher is None or (cfg.teacher_coef >= 0 and cfg.teacher_task_weight >= 0),
            "teacher_coef and teacher_task_weight must be >= 0",
        ),
        (
            0 <= cfg.top_entropy_quantile <= 1,
            "top_entropy_quantile must lie in [0, 1] (1: every token; 0: the highest-entropy ones)",
        ),
        (
            cfg.top_entropy_quantile == 1 or cfg.engine == "hf",
            "--top-entropy-quantile reads the sampler's entropy, which --engine vllm does not "
            "give; use --engine hf",
        ),
        (cfg.entropy_coef >= 0, "entropy_coef must be >= 0 (a bonus; 0 turns it off)"),
        (
            cfg.entropy_target is None
            or 0 <= cfg.entropy_coef_min <= cfg.entropy_coef <= cfg.entropy_coef_max,
            "the adaptive entropy coefficient needs entropy_coef_min <= entropy_coef <= "
            "entropy_coef_max",
        ),
        (cfg.entropy_coef_delta >= 0, "entropy_coef_delta must be >= 0"),
        *_estimator_checks(cfg),
    ]


def _estimator_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    """What the run's advantage estimator (`grouprl.core.registry`) takes and refuses."""
    estimator = ADVANTAGE_ESTIMATORS[cfg.adv_estimator]
    greedy = "baselines" in estimator.inputs()  # it compares with a greedy completion
    name = f"--adv-estimator {cfg.adv_estimator}"
    return [
        (
            not greedy or cfg.max_staleness == 0,
            f"{name}'s baseline is the current policy's greedy completion, which an older "
            "policy's samples (--max-staleness > 0) are not measured against; use 0",
        ),
        (
            not greedy or (cfg.tools is None and cfg.environment is None),
            f"{name} samples its greedy baselines without tools; use another estimator with "
            "--tools or --environment",
        ),
        (
            estimator.self_scaled or cfg.adv_scale in estimator.scales,
            f"{name} takes --adv-scale {' or '.join(estimator.scales)}",
        ),
        (
            not estimator.exactly_on_policy
            or (
                cfg.minibatches == 1
                and cfg.epochs == 1
                and cfg.beta == 0
                and cfg.max_staleness == 0
            ),
            f"{name}'s baseline is optimal only exactly on-policy: one update per batch "
            "(--minibatches 1 --epochs 1), no KL term (--beta 0) and --max-staleness 0",
        ),
        (
            not estimator.per_turn or not OBJECTIVES[cfg.objective].sequence_weighted,
            f"{name} gives each turn its own advantage; --objective {cfg.objective} weighs "
            "whole sequences by one: use one that weighs tokens, "
            + ", ".join(n for n, o in OBJECTIVES.items() if not o.sequence_weighted),
        ),
    ]


def _micro_batch_checks(cfg: ComputeOptions) -> list[tuple[bool, str]]:
    micro, tokens = cfg.micro_batch_size, cfg.max_tokens_per_micro_batch
    return [
        (micro is None or micro >= 1, "micro_batch_size must be at least 1"),
        (tokens is None or tokens >= 1, "max_tokens_per_micro_batch must be at least 1"),
        (micro is None or tokens is None, "give --micro-batch-size (completions) or "
         "--max-tokens-per-micro-batch (tokens), not both"),
    ]  # fmt: skip


def validate(cfg: RunConfig, world_size: int = 1) -> None:
    """Every check a run's settings need before a model is loaded, for a job of `world_size`
    processes: one line for the first that is impossible; a warning for each dubious one. (What
    needs the model or tokenizer, such as the context length, is checked where they load.)"""
    parts = world_size * cfg.minibatches
    checks = [
        *_data_checks(cfg),
        (cfg.max_image_pixels >= 1, "max_image_pixels must be at least 1"),
        (cfg.group_size >= 2, "group_size must be at least 2: a group of one has no baseline"),
        (cfg.prompts_per_step >= 1, "prompts_per_step must be at least 1"),
        (cfg.steps >= 1, "steps must be at least 1"),
        (cfg.temperature > 0, TEMPERATURE_RULE),
        (0 < cfg.top_p <= 1, "top_p must lie in (0, 1]"),
        (cfg.top_k >= 0, "top_k must be >= 0 (0 turns it off)"),
        (cfg.lr > 0 and math.isfinite(cfg.lr), "lr must be a positive number"),
        (0 <= cfg.weight_decay < math.inf, "weight_decay must be >= 0"),
        (cfg.warmup_steps >= 0, "warmup_steps must be >= 0"),
        (cfg.max_grad_norm >= 0, "max_grad_norm must be >= 0 (0 turns clipping off)"),
        (cfg.epochs >= 1, "epochs must be at least 1"),
        (cfg.minibatches >= 1, "minibatches must be at least 1"),
        (
            cfg.prompts_per_step % cfg.minibatches == 0,
            f"minibatches ({cfg.minibatches}) must divide prompts_per_step "
            f"({cfg.prompts_per_step}): each minibatch holds whole groups",
        ),
        (
            cfg.prompts_per_step % parts == 0,
            f"prompts_per_step {cfg.prompts_per_step} must be divisible by the world size "
            f"{world_size} times minibatches {cfg.minibatches} (= {parts}): every rank trains "
            "whole groups, as many in each minibatch; change --prompts-per-step, --minibatches "
            "or --nproc-per-node",
        ),
        (
            world_size == 1 or cfg.strategy != "fsdp" or cfg.teacher_loss != "jsd",
            "--teacher-loss jsd runs the teacher's head inside the policy's forward, which a "
            "sharded (--strategy fsdp) teacher cannot; use --strategy ddp or --teacher-loss "
            "advantage",
        ),
        (
            world_size == 1 or cfg.strategy != "fsdp" or cfg.lora_r is None,
            "--strategy fsdp does not shard LoRA models; use --strategy ddp (each rank holds the "
            "base model, and only the small adapters are reduced)",
        ),
        (cfg.adv_eps >= 0, "adv_eps must be >= 0"),
        *_objective_checks(cfg),
        (
            0 < cfg.overlong_cache <= cfg.max_new_tokens,
            "overlong_cache must lie in [1, max_new_tokens]",
        ),
        (cfg.max_resample_rounds >= 0, "max_resample_rounds must be >= 0"),
        (cfg.eval_every >= 0, "eval_every must be >= 0"),
        (cfg.eval_size >= 1, "eval_size must be at least 1"),
        (cfg.eval_samples >= 1, "eval_samples must be at least 1"),
        (cfg.save_every >= 1, "save_every must be at least 1"),
        (cfg.keep_last >= 1, "keep_last must be at least 1"),
        (cfg.log_ratios >= 0, "log_ratios must be >= 0"),
        (cfg.log_ratios_every >= 1, "log_ratios_every must be at least 1"),
        (cfg.log_groups >= 0, "log_groups must be >= 0"),
        (cfg.log_groups_every >= 1, "log_groups_every must be at least 1"),
        (cfg.routing_metrics_every >= 0, "routing_metrics_every must be >= 0 (0: never)"),
        (
            cfg.router_aux_loss_coef is None or cfg.router_aux_loss_coef >= 0,
            "router_aux_loss_coef must be >= 0 (or unset: the model's own)",
        ),
        (cfg.threads is None or cfg.threads >= 1, "threads must be at least 1"),
        *_micro_batch_checks(cfg),
        (cfg.lora_r is None or cfg.lora_r >= 1, "lora_r must be at least 1 (or unset)"),
        (cfg.lora_alpha is None or cfg.lora_alpha > 0, "lora_alpha must be > 0"),
        (0 <= cfg.lora_dropout < 1, "lora_dropout must lie in [0, 1)"),
        (cfg.max_nonfinite_steps >= 1, "max_nonfinite_steps must be at least 1"),
    ]
    _raise_first(checks, _choice_problems(cfg))
    try:
        loss_options(cfg)
        corr = correction(cfg)
    except ValueError as err:  # LossOptions owns the loss's rules; here they are one line
        raise UserError(f"invalid config: {err}") from None
    _raise_first(_offpolicy_checks(cfg, corr, world_size))
    report_targets(cfg.report_to)  # a tracker that is unknown or not installed: one line
    _warn_dubious(cfg)


def loss_options(cfg: RunConfig) -> LossOptions:
    """The objective `grouprl.core.policy_loss` computes, from a run's config (raises
    ValueError, as `LossOptions` does, for settings the loss cannot take)."""
    from grouprl.core import LossOptions

    return LossOptions(
        level=cfg.ratio_level,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip,
        beta=0.0 if cfg.kl_in_reward else cfg.beta,  # in the reward instead (train_on)
        kl_estimator=cfg.kl_estimator,
        kl_ratio_weighted=cfg.kl_ratio_weighted,
        objective=cfg.objective,
        **{
            name: value
            for entry in OBJECTIVES.values()
            for name in entry.knobs
            if (value := getattr(cfg, name)) is not None
        },
        agg=cfg.loss_agg,
        norm_len=cfg.norm_len,
    )


def correction(cfg: OffPolicyOptions) -> Correction:
    """The run's off-policy correction (`grouprl.core.Correction`): the --correction preset with
    any --correction-* field that is set put in its place (raises ValueError, as `Correction`
    does, for bounds it cannot take)."""
    from grouprl.core import CORRECTIONS

    base = CORRECTIONS[cfg.correction]
    parts = {
        "weight": cfg.correction_weight,
        "weight_low": cfg.correction_weight_low,
        "weight_high": cfg.correction_weight_high,
        "mask": cfg.correction_mask,
        "mask_low": cfg.correction_mask_low,
        "mask_high": cfg.correction_mask_high,
        "opsm_delta": cfg.off_policy_mask,
    }
    for side in ("weight", "mask"):
        bounds = [f"--correction-{side}-{end}" for end in ("low", "high")
                  if parts[f"{side}_{end}"] is not None]  # fmt: skip
        if bounds and parts[side] is None and getattr(base, side) is None:
            raise ValueError(
                f"{' and '.join(bounds)} bound a {side} that is not there: name one with "
                f"--correction-{side} or a --correction preset that has one"
            )
    return dataclasses.replace(base, **{k: v for k, v in parts.items() if v is not None})


def sampler_differs(cfg: RunConfig) -> bool:
    """Whether the policy that samples a batch is not the trainer's fp32 forward at that step:
    another engine, another precision (bf16 forwards, a bf16 LoRA base) or an older version."""
    low_precision = cfg.precision != "fp32" or (cfg.lora_r is not None and cfg.base_dtype != "fp32")
    return cfg.engine != "hf" or low_precision or cfg.max_staleness > 0


def dense_gradients(cfg: RunConfig) -> bool:
    """Whether a completion whose group advantage is 0 still has a gradient: an entropy term,
    a teacher's per-token advantage, or the covariance objectives' statistics over every token
    (so no group may be skipped)."""
    return entropy_bonus(cfg) or cfg.teacher is not None or OBJECTIVES[cfg.objective].by_covariance


def entropy_bonus(cfg: EntropyOptions) -> bool:
    """Whether the loss has an entropy term (a fixed coefficient, or the adaptive one, which can
    rise from 0): every completion then has a gradient, advantage or not."""
    return cfg.entropy_coef != 0 or cfg.entropy_target is not None


def reuses_batches(cfg: UpdateOptions) -> bool:
    """Whether a batch trains more than one update (minibatches or epochs), so that the policy
    of a later update is not the one that sampled: the off-policy sequence mask's drift."""
    return cfg.minibatches > 1 or cfg.epochs > 1


def _offpolicy_checks(cfg: RunConfig, corr: Correction, world_size: int) -> list[tuple[bool, str]]:
    importance = corr.weight is not None or corr.mask is not None
    return [
        (
            not importance or sampler_differs(cfg),
            "--correction has nothing to correct: grouprl's sampler in fp32 is the trainer (its "
            "log-probs are the trainer's to float rounding); it applies with --engine vllm, "
            "--precision bf16 or --max-staleness > 0",
        ),
        (
            corr.opsm_delta is None or sampler_differs(cfg) or reuses_batches(cfg),
            "--off-policy-mask has no drift to mask: one update per batch of grouprl's fp32 "
            "sampler trains the policy that sampled; it applies with --minibatches or --epochs "
            "> 1, --engine vllm, --precision bf16 or --max-staleness > 0",
        ),
        (
            cfg.vllm_mode == "colocate" or cfg.engine == "vllm",
            "--vllm-mode says where --engine vllm runs; add --engine vllm (or leave --vllm-mode)",
        ),
        (
            not cfg.kl_in_reward or cfg.beta > 0,
            "--kl-in-reward applies --beta as a reward penalty; give --beta > 0 (or drop it)",
        ),
        (
            cfg.reward_clip is None or cfg.reward_clip[0] < cfg.reward_clip[1],
            "--reward-clip LOW HIGH needs LOW < HIGH",
        ),
        (
            cfg.proximal != "behaviour" or corr.weight is None,
            "--proximal behaviour clips the ratio against the sampler itself, so an importance "
            "weight on top counts the sampler's gap twice; use a rejection mask alone "
            "(token_band, geo_mask) or --proximal recompute",
        ),
        (cfg.max_staleness >= 0, "max_staleness must be >= 0 (0: synchronous)"),
        (
            cfg.sampler_threads is None or cfg.sampler_threads >= 0,
            "sampler_threads must be >= 0 (0: sample in the trainer's thread, between updates)",
        ),
        (
            cfg.vllm_server is None or not cfg.vllm_sleep,
            "--vllm-sleep puts vLLM in this process to sleep; a vLLM server manages its own "
            "memory: drop --vllm-sleep",
        ),
        (
            cfg.max_staleness == 0 or cfg.engine == "hf" or world_size == 1 or cfg.vllm_server,
            "--max-staleness with --engine vllm runs vLLM in a process of its own beside one "
            "trainer; under torchrun use --vllm-server or --engine hf",
        ),
        (
            cfg.max_staleness == 0 or world_size == 1 or cfg.strategy != "fsdp",
            "--max-staleness > 0 keeps a whole copy of the weights for the sampler, which a "
            "sharded (--strategy fsdp) model has not; use --strategy ddp or --max-staleness 0",
        ),
    ]


def _warn_dubious(cfg: RunConfig) -> None:
    if cfg.lora_dropout > 0:
        warnings.warn(
            "lora_dropout > 0: the update's forward differs from the sampling policy even before "
            "the first optimizer step, so the on-policy ratio is not 1",
            stacklevel=2,
        )
    if cfg.base_dtype != "fp32" and cfg.lora_r is None and cfg.beta == 0:
        warnings.warn(
            "base_dtype sets the dtype of frozen weights (a LoRA base, a reference model); with "
            "full fine-tuning and beta = 0 there are none, so it changes nothing",
            stacklevel=2,
        )
    if cfg.ratio_level != "token" and (cfg.top_k > 0 or cfg.top_p < 1):
        warnings.warn(
            "top_k/top_p with a sequence-level ratio: completions come from the truncated "
            "distribution while old_logp is the full one's, which biases every sequence ratio "
            "(about 0.989 at top-p 0.9, far outside GSPO's clip range); leave them off for GSPO",
            stacklevel=2,
        )
    if cfg.ratio_level != "token" and cfg.loss_agg == "token_mean":
        warnings.warn(
            "a sequence-level ratio with loss_agg=token_mean weights each completion by its "
            "length; seq_mean_token_mean is GSPO's own aggregation",
            stacklevel=2,
        )
    if (
        cfg.epochs == 1
        and cfg.minibatches == 1
        and cfg.ratio_level != "token"
        and cfg.clip_high < 0.01
    ):
        warnings.warn(
            "with one on-policy update per batch every sequence ratio is 1, so GSPO's clip never "
            "acts; use minibatches > 1 or epochs > 1 as the GSPO paper does",
            stacklevel=2,
        )


def report_targets(report_to: Iterable[str] | None, *, installed: bool = True) -> tuple[str, ...]:
    """`--report-to` as tracker names: space- or comma-separated, None → TensorBoard alone,
    `none` → nothing. Raises UserError for an unknown name, or (`installed`) an uninstalled
    tracker."""
    if report_to is None:
        return ("tensorboard",)
    names = [n.strip().lower() for item in report_to for n in str(item).split(",") if n.strip()]
    if names == ["none"]:
        return ()
    for name in names:
        if name not in TRACKERS:
            raise UserError(
                f"--report-to {name!r} is not a tracker grouprl knows; choose from "
                f"{', '.join(TRACKERS)}, or none"
            )
        module, install = TRACKERS[name]
        if installed and importlib.util.find_spec(module) is None:
            raise UserError(
                f"--report-to {name}: {module} is not installed; pip install '{install}'"
            )
    return tuple(dict.fromkeys(names))
