"""Resolution: a `TrainConfig` whose preset- and task-filled fields are still None becomes a
frozen `RunConfig` with every field filled (from its `--algo` preset, `grouprl.config.presets`,
and the task) and the whole config validated.

Precedence, lowest first: field defaults < `--config FILE.yaml` (or the saved config of the run
given to `--resume`) < command-line flags < the `--algo` preset, which fills only the fields
still left at `None`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from grouprl.config.options import RunConfig, TrainConfig
from grouprl.config.presets import PRESETS
from grouprl.config.validation import report_targets, validate
from grouprl.core.registry import ADVANTAGE_ESTIMATORS, OBJECTIVES
from grouprl.errors import UserError
from grouprl.tasks.specs import absolute_spec


def _objective_knobs(cfg: TrainConfig, values: dict[str, Any]) -> None:
    """The objective's own knobs filled with their defaults; a knob of another objective, or a
    clip range for one the clip does not bound, is one line. (A resumed run's saved config holds
    the preset's clip range: that one is no choice of the user's.)"""
    from grouprl.core import LossOptions

    objective, defaults = values["objective"], LossOptions()
    for owner, entry in OBJECTIVES.items():
        for name in entry.knobs:
            if owner == objective:
                given = values[name]
                values[name] = getattr(defaults, name) if given is None else given
            elif values[name] is not None:
                raise UserError(
                    f"invalid config: --{name.replace('_', '-')} is a knob of --objective "
                    f"{owner}; this run's objective is {objective}"
                )
    preset = PRESETS[cfg.algo]
    for name in ("clip_low", "clip_high", "dual_clip"):
        given = getattr(cfg, name)
        unclipped = not OBJECTIVES[objective].clipped
        if unclipped and given is not None and given != getattr(preset, name, None):
            raise UserError(
                f"invalid config: --{name.replace('_', '-')} does not apply to --objective "
                f"{objective}, which no clip range bounds"
                + ("; its bound is --cispo-cap" if objective == "cispo" else "")
            )


def local_paths_absolute(cfg: Any) -> Any:
    """The config with its local model, dataset and reward-file paths made absolute (hub ids and
    builtin:NAME unchanged), as a run records them."""
    local = {
        name: str(Path(value).expanduser().resolve())
        for name in ("model", "dataset", "eval_dataset")
        if (value := getattr(cfg, name, None)) is not None and Path(value).expanduser().exists()
    }
    cfg = dataclasses.replace(cfg, **local)
    if cfg.rewards:
        cfg = dataclasses.replace(
            cfg, rewards={absolute_spec(spec): w for spec, w in cfg.rewards.items()}
        )
    if cfg.pass_reward is not None:
        cfg = dataclasses.replace(cfg, pass_reward=absolute_spec(cfg.pass_reward))
    if getattr(cfg, "tools", None):
        cfg = dataclasses.replace(cfg, tools=[absolute_spec(spec) for spec in cfg.tools])
    if getattr(cfg, "environment", None):
        cfg = dataclasses.replace(cfg, environment=absolute_spec(cfg.environment))
    return cfg


def resolve(
    cfg: TrainConfig,
    *,
    task_max_new_tokens: int,
    world_size: int = 1,
    task_model: str = "builtin:arith",
    task_steps: int = 200,
) -> RunConfig:
    """Fill every field left at None from the preset and the task (its budget and its model),
    then `validate` for a job of `world_size` processes.

    Local paths (model, datasets, reward files) are recorded absolute, so a resumed run reads
    the same files from any working directory; hub ids and builtin:NAME stay as they are.
    """
    if cfg.algo not in PRESETS:
        raise UserError(f"invalid config: algo {cfg.algo!r} is not one of {', '.join(PRESETS)}")
    if cfg.algo == "gdpo" and cfg.adv_estimator not in (None, "gdpo"):
        raise UserError(
            f"--algo gdpo is its own advantage estimator; drop --adv-estimator "
            f"{cfg.adv_estimator}, or use --algo grpo --adv-estimator {cfg.adv_estimator}"
        )
    for name, registry, what in ((cfg.adv_estimator, ADVANTAGE_ESTIMATORS, "adv_estimator"),
                                 (cfg.objective, OBJECTIVES, "objective")):  # fmt: skip
        if name is not None and name not in registry:
            raise UserError(f"invalid config: {what} {name!r} is not one of {', '.join(registry)}")
    # (a saved config, resumed, holds the preset's scale: that one is no choice of the user's)
    estimator = ADVANTAGE_ESTIMATORS[cfg.adv_estimator or PRESETS[cfg.algo].adv_estimator]
    if estimator.self_scaled and cfg.adv_scale not in (None, PRESETS[cfg.algo].adv_scale):
        raise UserError(
            f"{estimator.name} sets its own scale ({estimator.summary}); drop --adv-scale, or "
            "use another --adv-estimator"
        )
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)}
    for name, value in dataclasses.asdict(PRESETS[cfg.algo]).items():
        if values[name] is None:
            values[name] = value
    _objective_knobs(cfg, values)
    if values["vllm_server"] is not None:
        values["engine"] = "vllm"  # the servers are vLLM's
    if values["max_new_tokens"] is None:
        values["max_new_tokens"] = task_max_new_tokens
    if values["model"] is None:
        values["model"] = task_model
    if values["steps"] is None:
        values["steps"] = task_steps
    if values["norm_len"] is None:
        values["norm_len"] = values["max_new_tokens"]
    if values["overlong_cache"] is None:
        values["overlong_cache"] = max(1, values["max_new_tokens"] // 4)
    if values["lora_r"] is not None and values["lora_alpha"] is None:
        values["lora_alpha"] = 2.0 * values["lora_r"]
    values["report_to"] = list(report_targets(values["report_to"], installed=False))
    resolved = local_paths_absolute(RunConfig(**values))
    validate(resolved, world_size)
    return resolved
