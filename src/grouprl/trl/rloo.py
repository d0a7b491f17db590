"""TRL's `RLOOTrainer` on grouprl: a TRL RLOO script runs after changing one import.

    from grouprl.trl import RLOOConfig, RLOOTrainer       # was: from trl import ...

`RLOOConfig` has every field of TRL 1.16's (GRPOConfig's less its loss variants, entropy and
vLLM-correction fields, plus `normalize_advantages` and `reward_clip_range`; G = 2 and
beta = 0.05 by default), and each is mapped with TRL's RLOO semantics, which are not GRPO's
(TRL's `trl/trainer/rloo_trainer.py`):

- the advantage is the leave-one-out one, A_i = R_i − mean of the group's other scored rewards,
  unscaled (`--adv-estimator rloo --adv-scale none`), or with `normalize_advantages` whitened over
  the step's whole batch, (A − mean) / (std + 1e-4) with the sample std (`--adv-scale whiten
  --unbiased-std`);
- the KL is in the reward, not the loss: R_i − beta · Σ_t (log π_old − log π_ref) over the
  completion's tokens, the first-order estimate summed (`--kl-in-reward`), after rewards are
  clamped to `reward_clip_range` (`--reward-clip`);
- the ratio is the whole sequences' probability ratio exp(Σ_t log π − Σ_t log π_old), not
  length-normalised (`--ratio-level sequence_sum`), clipped at epsilon / epsilon_high, and each
  sequence's loss averaged over the sequences (`--loss-agg seq_mean_token_mean`: the loss is
  constant over a sequence's tokens);
- no importance-sampling correction of vLLM's log-probs (RLOOConfig has none of GRPO's fields).

Everything else (batching, steps, the optimizer and schedule, vLLM, LoRA, logging, the
plumbing fields warned about) is the GRPO shim's (`grouprl.trl.config`).
"""

from __future__ import annotations

from typing import Any

from grouprl.trl.config import FIELDS, GRPOConfig, options_from, require_config
from grouprl.trl.fields import MAPPED, Field, config_class
from grouprl.trl.trainer import GRPOTrainer

#: GRPOConfig's fields that RLOOConfig does not have.
_GRPO_ONLY = (
    "cast_lm_head_to_fp32", "delta", "sapo_temperature_neg", "sapo_temperature_pos",
    "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
    "importance_sampling_level", "multi_objective_aggregation", "scale_rewards", "loss_type",
    "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy", "entropy_coef_min",
    "entropy_coef_max", "entropy_coef_delta", "entropy_target", "max_tool_calling_iterations",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
    "off_policy_mask_threshold", "use_bias_correction_kl", "log_completions_hub_repo",
    "vllm_importance_sampling_cap",
)  # fmt: skip
#: RLOOConfig's fields with another default than GRPOConfig's.
_CHANGED = {"num_generations": Field(int | None, 2, MAPPED), "beta": Field(float, 0.05, MAPPED)}
#: RLOOConfig's own fields, after reward_weights in TRL's order.
_OWN = {
    "normalize_advantages": Field(bool, False, MAPPED),
    "reward_clip_range": Field(tuple[float, float] | None, None, MAPPED),
}


def _rloo_fields() -> dict[str, Field]:
    out: dict[str, Field] = {}
    for name, spec in FIELDS.items():
        if name in _GRPO_ONLY:
            continue
        out[name] = _CHANGED.get(name, spec)
        if name == "reward_weights":
            out.update(_OWN)
    return out


#: Every field of TRL 1.16's RLOOConfig, as `grouprl.trl.FIELDS` holds GRPOConfig's.
RLOO_FIELDS = _rloo_fields()
_HELP = {
    "num_generations": "Completions per prompt (the leave-one-out group; at least 2).",
    "beta": "The KL coefficient, applied as a reward penalty (beta · Σ_t log π_old/π_ref).",
    "normalize_advantages": "Whiten the leave-one-out advantages over the step's batch.",
    "reward_clip_range": "Clamp each completion's reward to (min, max) before the KL penalty.",
}

RLOOConfig = config_class(
    "RLOOConfig",
    RLOO_FIELDS,
    "TRL 1.16's RLOOConfig: its fields, types and defaults, mapped onto grouprl's options with "
    "TRL's RLOO semantics when an RLOOTrainer starts (grouprl.trl.rloo).",
    help=_HELP,
)


def rloo_options_from(
    args: Any, *, world: int = 1, rows: int | None = None, lora: bool = False
) -> dict[str, Any]:
    """grouprl's options for TRL's RLOOConfig `args` (see the module)."""
    import warnings

    from grouprl.errors import UserError

    require_config(args, RLOO_FIELDS, "RLOOConfig")
    if args.num_generations is None or args.num_generations < 2:
        raise _refusal("num_generations", args.num_generations,
                       "the leave-one-out baseline needs at least 2 completions per prompt")  # fmt: skip
    clip = args.reward_clip_range
    if clip is not None and not (len(clip) == 2 and float(clip[0]) < float(clip[1])):
        raise _refusal("reward_clip_range", clip, "give (min, max) with min < max")
    if args.beta < 0:
        raise _refusal("beta", args.beta, "the KL coefficient must be >= 0")
    shared = {name: getattr(args, name) for name in RLOO_FIELDS if name in FIELDS}
    # GRPOConfig's other fields at their defaults, less vLLM's correction (RLOO has none)
    grpo = GRPOConfig(**shared, vllm_importance_sampling_correction=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            options = options_from(grpo, world=world, rows=rows, lora=lora)
        except UserError as err:  # in the caller's class's name
            raise UserError(str(err).replace("GRPOConfig(", "RLOOConfig(")) from None
    for warning in caught:  # the same, re-raised in RLOO's names
        text = str(warning.message).replace("GRPOConfig", "RLOOConfig")
        warnings.warn(text, warning.category, stacklevel=3)
    for name in ("correction_weight", "correction_weight_high", "correction_mask",
                 "correction_mask_high", "kl_ratio_weighted", "dual_clip"):  # fmt: skip
        options.pop(name, None)
    beta = float(args.beta)
    options.update(
        adv_estimator="rloo",
        adv_scale="whiten" if args.normalize_advantages else "none",
        unbiased_std=True,
        adv_eps=1e-4,
        ratio_level="sequence_sum",
        loss_agg="seq_mean_token_mean",
        objective="clip",
        beta=beta,
        kl_in_reward=beta > 0,
        kl_estimator="k1",
        reward_clip=None if clip is None else (float(clip[0]), float(clip[1])),
    )
    return options


def _refusal(name: str, value: Any, why: str) -> Exception:
    from grouprl.errors import UserError

    return UserError(f"RLOOConfig({name}={value!r}): {why}")


class RLOOTrainer(GRPOTrainer):
    """TRL 1.16's RLOOTrainer constructor and `train()`, on grouprl (see the module)."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
    ) -> None:
        super().__init__(
            model, reward_funcs, RLOOConfig() if args is None else args,
            train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes, callbacks=callbacks,
            optimizers=optimizers, quantization_config=quantization_config,
            peft_config=peft_config,
        )  # fmt: skip

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        from grouprl.errors import UserError

        raise UserError(f"RLOOTrainer.push_to_hub: grouprl does not push; the model is saved in "
                        f"{self.options['output_dir']} (final/ holds the merged model): upload it "
                        "yourself")  # fmt: skip

    def _options(self, world: int, rows: int | None) -> dict[str, Any]:
        return rloo_options_from(self.args, world=world, rows=rows,
                                 lora=self.peft_config is not None)  # fmt: skip
