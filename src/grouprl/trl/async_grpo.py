"""TRL's experimental AsyncGRPOTrainer and AsyncGRPOConfig (trl.experimental.async_grpo) on
grouprl's asynchronous runs.

    from grouprl.trl import AsyncGRPOConfig, AsyncGRPOTrainer
    # was: from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

TRL samples on a vLLM server while the trainer updates, and drops a sample once it lags more
than `max_staleness` weight versions. grouprl's asynchronous run (`--max-staleness K`) samples
every batch with the weights of exactly K optimizer steps before, on a sampler thread beside
the trainer (grouprl's own engine: no server to start), and drops nothing: the lag is the same
every step, so the run is reproducible and resumes exactly. The ratio is clipped against the
sampler's own log-probs (`--proximal behaviour`, TRL's "old_log_probs" = the sampled ones) with
no importance correction, as TRL's; the advantage is the group's (r − mean) / (std + 1e-8) with
the population std, as TRL's worker computes it; the loss is the token mean (TRL's).
"""

from __future__ import annotations

import warnings
from typing import Any

from grouprl.errors import UserError
from grouprl.trl.config import (
    FIELDS,
    MAPPED,
    WARNED,
    Field,
    GRPOConfig,
    config_class,
    options_from,
    refusal,
    require_config,
)
from grouprl.trl.trainer import GRPOTrainer

#: AsyncGRPOConfig's fields that GRPOConfig also has but with another type or default.
_CHANGED = {
    "lr_scheduler_type": Field(str, "constant", MAPPED),
    "logging_steps": Field(float, 1, WARNED),
    "ignore_data_skip": Field(bool, True, WARNED),
    "remove_unused_columns": Field(bool, True, WARNED),
    "num_generations": Field(int, 8, MAPPED),
    "max_completion_length": Field(int, 2048, MAPPED),
    "vllm_server_base_url": Field(str, "http://localhost:8000", MAPPED),
}
#: AsyncGRPOConfig's own fields (after model_init_kwargs, max_tool_calling_iterations,
#: vllm_server_timeout and epsilon_high in TRL's order).
_OWN = {
    "dtype": Field(str, "float32", MAPPED),
    "fork_threshold_tokens": Field(int, 1024, WARNED),
    "request_timeout": Field(int, 600, WARNED),
    "weight_sync_timeout": Field(int, 1800, WARNED),
    "token_budget": Field(int | None, None, MAPPED),
    "max_inflight_tasks": Field(int, -1, WARNED),
    "max_staleness": Field(int, 4, MAPPED),
    "queue_maxsize": Field(int, 1024, WARNED),
    "weight_sync_steps": Field(int, 1, MAPPED),
    "heartbeat_stale_after_s": Field(float, 300.0, WARNED),
}
#: GRPOConfig's fields that AsyncGRPOConfig has (TrainingArguments' and the generation,
#: clipping, tool and logging ones).
_SHARED = (
    *list(FIELDS)[: list(FIELDS).index("model_init_kwargs")],
    "model_init_kwargs", "trust_remote_code", "router_aux_loss_coef", "num_generations",
    "max_completion_length", "temperature", "top_p", "top_k", "min_p", "chat_template_kwargs",
    "repetition_penalty", "max_tool_calling_iterations", "vllm_server_base_url",
    "vllm_server_timeout", "epsilon", "epsilon_high", "log_completions",
    "num_completions_to_print",
)  # fmt: skip

#: Every field of TRL 1.16's AsyncGRPOConfig, as `grouprl.trl.FIELDS` holds GRPOConfig's.
ASYNC_FIELDS: dict[str, Field] = {
    **{name: _CHANGED.get(name, FIELDS[name]) for name in _SHARED},
    **_OWN,
}
_HELP = {
    "dtype": "The frozen weights' dtype (a LoRA base); trainable weights stay fp32.",
    "max_staleness": "grouprl's --max-staleness: every batch is sampled by the weights of "
    "exactly this many optimizer steps before (none dropped).",
    "weight_sync_steps": "Only 1: the sampler gets the weights after every optimizer step.",
    "token_budget": "grouprl's --max-tokens-per-micro-batch when > 0: rows bin-packed into "
    "packed micro-batches of at most this many tokens, each row's prompt counted with it (TRL "
    "counts a prompt its rows share once). None or <= 0: grouprl's own planning.",
}

AsyncGRPOConfig = config_class(
    "AsyncGRPOConfig",
    ASYNC_FIELDS,
    "TRL 1.16's AsyncGRPOConfig: its fields, types and defaults, mapped onto grouprl's "
    "asynchronous runs when an AsyncGRPOTrainer starts (grouprl.trl.async_grpo).",
    help=_HELP,
)


def async_options_from(
    args: Any, *, world: int = 1, rows: int | None = None, lora: bool = False
) -> dict[str, Any]:
    """grouprl's options for TRL's AsyncGRPOConfig `args` (see the module)."""
    require_config(args, ASYNC_FIELDS, "AsyncGRPOConfig")
    changed = {n: getattr(args, n) for n, spec in _OWN.items() if getattr(args, n) != spec.default}
    warned = [f"{n}={v!r}" for n, v in changed.items() if _OWN[n].kind == WARNED]
    if warned:
        warnings.warn(
            "grouprl ignores these AsyncGRPOConfig fields, which concern only TRL's rollout "
            "queue and server: " + ", ".join(warned),
            UserWarning,
            stacklevel=3,
        )
    if args.weight_sync_steps != 1:
        raise refusal("weight_sync_steps", args.weight_sync_steps,
                      "grouprl's sampler takes the weights after every optimizer step (its lag is "
                      "max_staleness); leave it at 1")  # fmt: skip
    if args.max_staleness < 0:
        raise refusal("max_staleness", args.max_staleness, "must be >= 0 (0: synchronous)")
    # GRPOConfig's other fields at TRL's async trainer's values: GRPOConfig's defaults (no KL,
    # token-level ratio, the token-mean loss), rewards summed unweighted, no vLLM correction
    shared = {n: getattr(args, n) for n in _SHARED}
    for name, spec in _CHANGED.items():  # plumbing at the async default: not "set"
        if spec.kind == WARNED and shared[name] == spec.default:
            shared[name] = FIELDS[name].default
    init = dict(shared["model_init_kwargs"] or {})
    if "dtype" not in init and "torch_dtype" not in init:  # TRL: model_init_kwargs' dtype wins
        init["dtype"] = args.dtype
    shared["model_init_kwargs"] = init
    grpo = GRPOConfig(**{**shared, "vllm_server_base_url": None,
                         "vllm_importance_sampling_correction": False})  # fmt: skip
    options = options_from(grpo, world=world, rows=rows, lora=lora)
    options.update(max_staleness=int(args.max_staleness), proximal="behaviour",
                   unbiased_std=False, adv_eps=1e-8)  # fmt: skip
    if args.token_budget is not None and args.token_budget > 0:
        options.update(max_tokens_per_micro_batch=int(args.token_budget))
    if args.vllm_server_base_url != _CHANGED["vllm_server_base_url"].default:
        # a server the script names samples (TRL's default, unnamed: grouprl's own sampler)
        options.update(engine="vllm", vllm_server=str(args.vllm_server_base_url))
    return options


class AsyncGRPOTrainer(GRPOTrainer):
    """TRL 1.16's AsyncGRPOTrainer constructor and `train()`, on grouprl's asynchronous runs
    (see the module)."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Any = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        tools: list[Any] | None = None,
        environment_factory: Any = None,
        rollout_worker: Any = None,
        weight_transfer: Any = None,
    ) -> None:
        for name, value in (("rollout_worker", rollout_worker),
                            ("weight_transfer", weight_transfer)):  # fmt: skip
            if value is not None:
                raise UserError(
                    f"AsyncGRPOTrainer({name}=...): grouprl samples on its own sampler thread; "
                    "it takes no rollout worker or weight transfer"
                )
        super().__init__(
            model, reward_funcs, AsyncGRPOConfig() if args is None else args,
            train_dataset=train_dataset, processing_class=processing_class, callbacks=callbacks,
            optimizers=optimizers, peft_config=peft_config, tools=tools,
            environment_factory=environment_factory,
        )  # fmt: skip
        if self.options["max_staleness"]:
            warnings.warn(
                f"max_staleness={self.options['max_staleness']}: grouprl samples every batch "
                "with the weights of exactly that many optimizer steps before and drops nothing "
                "(TRL's is a cap beyond which samples are dropped)",
                UserWarning,
                stacklevel=2,
            )

    def _options(self, world: int, rows: int | None) -> dict[str, Any]:
        return async_options_from(self.args, world=world, rows=rows,
                                  lora=self.peft_config is not None)  # fmt: skip
