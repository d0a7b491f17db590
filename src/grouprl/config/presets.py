"""The `--algo` presets and resolution: a `TrainConfig` whose preset- and task-filled fields are
still None becomes a frozen `RunConfig` with every field filled and the whole config validated.

Precedence, lowest first: field defaults < `--config FILE.yaml` (or the saved config of the run
given to `--resume`) < command-line flags < the `--algo` preset, which fills only the fields
still left at `None`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grouprl.config.options import KNOBS, RunConfig, TrainConfig
from grouprl.config.validation import report_targets, validate
from grouprl.errors import UserError
from grouprl.tasks.specs import absolute_spec


@dataclass(frozen=True)
class Preset:
    """The algorithm-defining fields that an `--algo` preset fills."""

    ratio_level: str
    clip_low: float
    clip_high: float
    loss_agg: str
    adv_scale: str
    beta: float
    minibatches: int
    dynamic_sampling: bool = False
    mask_truncated: bool = False
    overlong_penalty: bool = False
    adv_estimator: str = "grpo"
    objective: str = "clip"


PRESETS: dict[str, Preset] = {
    # DeepSeekMath (arXiv 2402.03300): token ratio, per-sequence token mean, group std, one
    # on-policy update per batch. beta = 0 rather than the paper's 0.04: TRL, DAPO and Dr. GRPO
    # found the KL term unnecessary with verifiable rewards, and it costs a reference forward.
    "grpo": Preset("token", 0.2, 0.2, "seq_mean_token_mean", "group", 0.0, minibatches=1),
    # GSPO (arXiv 2507.18071): sequence ratio, the paper's clip range, and the rollout split into
    # 4 minibatches so that updates after the first are off-policy and the clip matters.
    "gspo": Preset("sequence", 3e-4, 4e-4, "seq_mean_token_mean", "group", 0.0, minibatches=4),
    # Dr. GRPO (arXiv 2503.20783): no std scaling, a constant length normaliser.
    "dr_grpo": Preset("token", 0.2, 0.2, "seq_mean_token_sum_norm", "none", 0.0, minibatches=1),
    # DAPO (arXiv 2503.14476): clip-higher, token-level loss, dynamic sampling, overlong penalty.
    "dapo": Preset(
        "token",
        0.2,
        0.28,
        "token_mean",
        "group",
        0.0,
        minibatches=1,
        dynamic_sampling=True,
        overlong_penalty=True,
    ),
    # GDPO (arXiv 2601.05242): GRPO with each reward normalised inside its group before the
    # weighted sum, which is then normalised over the batch; for runs with several rewards.
    "gdpo": Preset(
        "token", 0.2, 0.2, "seq_mean_token_mean", "group", 0.0, minibatches=1, adv_estimator="gdpo"
    ),
    # The newer objectives, each with GSPO's 4 minibatches: with one on-policy update every
    # ratio is 1 and each of them is GRPO's gradient, so their differences need off-policy steps.
    # CISPO (MiniMax-M1, arXiv 2506.13585): capped-weight REINFORCE, token mean (TRL's loss).
    "cispo": Preset(
        "token", 0.2, 0.2, "token_mean", "group", 0.0, minibatches=4, objective="cispo"
    ),
    # SAPO (arXiv 2511.20347): the soft gate, aggregated as TRL does (GRPO's sequence mean).
    "sapo": Preset(
        "token", 0.2, 0.2, "seq_mean_token_mean", "group", 0.0, minibatches=4, objective="sapo"
    ),
    # GMPO (arXiv 2507.20673): the geometric mean, clipped in log space at the paper's +-0.4.
    "gmpo": Preset(
        "token", 0.4, 0.4, "seq_mean_token_mean", "group", 0.0, minibatches=4, objective="gmpo"
    ),
    # LUSPO (arXiv 2602.05261): GSPO's sequence ratio and clip, each sequence's token losses
    # summed (so its weight grows with its length), then averaged over sequences (TRL's).
    "luspo": Preset("sequence", 3e-4, 4e-4, "seq_mean_token_sum", "group", 0.0, minibatches=4),
    # VESPO (arXiv 2602.10693): the gamma weight of the sequence's ratio, token mean (TRL's).
    "vespo": Preset(
        "token", 0.2, 0.2, "token_mean", "group", 0.0, minibatches=4, objective="vespo"
    ),
    # verl's other estimators (grouprl.core.estimators), each with the clip and verl's token
    # mean. REINFORCE++ (arXiv 2501.03262): the reward whitened over the whole batch's tokens;
    # -baseline: the group's mean subtracted first (verl's reinforce_plus_plus[_baseline]).
    "reinforce_pp": Preset(
        "token", 0.2, 0.2, "token_mean", "none", 0.0, minibatches=1, adv_estimator="reinforce_pp"
    ),
    "reinforce_pp_baseline": Preset(
        "token",
        0.2,
        0.2,
        "token_mean",
        "none",
        0.0,
        minibatches=1,
        adv_estimator="reinforce_pp_baseline",
    ),
    # OPO (arXiv 2505.23585): the length-weighted group mean, exactly on-policy (refused else).
    "opo": Preset("token", 0.2, 0.2, "token_mean", "none", 0.0, minibatches=1, adv_estimator="opo"),
    # GPG (arXiv 2504.02546): its advantage and plain REINFORCE, Â·log π, no ratio or clip.
    "gpg": Preset(
        "token",
        0.2,
        0.2,
        "token_mean",
        "none",
        0.0,
        minibatches=1,
        adv_estimator="gpg",
        objective="gpg",
    ),
    # Pass@k training (arXiv 2503.19595; verl's grpo_passk): GRPO where only each group's best
    # completion learns, by its margin over the second, over the group's std.
    "grpo_passk": Preset(
        "token",
        0.2,
        0.2,
        "seq_mean_token_mean",
        "group",
        0.0,
        minibatches=1,
        adv_estimator="grpo_passk",
    ),
    # ReMax (arXiv 2310.10505; verl's remax): each reward against the prompt's greedy one.
    "remax": Preset(
        "token", 0.2, 0.2, "token_mean", "none", 0.0, minibatches=1, adv_estimator="remax"
    ),
    # The entropy mechanism (arXiv 2505.22617; verl's clip_cov / kl_cov with its YAML defaults,
    # token mean), on GSPO's 4 minibatches: KL-Cov's |log r| is 0 at r = 1, so it acts from
    # the second minibatch on; Clip-Cov on the same schedule, for a like-for-like comparison.
    "clip_cov": Preset(
        "token", 0.2, 0.2, "token_mean", "group", 0.0, minibatches=4, objective="clip_cov"
    ),
    "kl_cov": Preset(
        "token", 0.2, 0.2, "token_mean", "group", 0.0, minibatches=4, objective="kl_cov"
    ),
}
#: Estimators that set their own scaling (no --adv-scale): gdpo and verl's whitened or unscaled.
SELF_SCALED = ("gdpo", "reinforce_pp", "reinforce_pp_baseline", "opo", "gpg", "remax")

#: The objectives the clip range does not bound (CISPO's bound is its cap).
UNCLIPPED = ("cispo", "sapo", "vespo", "gpg", "kl_cov")


def _objective_knobs(cfg: TrainConfig, values: dict[str, Any]) -> None:
    """The objective's own knobs filled with their defaults; a knob of another objective, or a
    clip range for one the clip does not bound, is one line. (A resumed run's saved config holds
    the preset's clip range: that one is no choice of the user's.)"""
    from grouprl.core import LossOptions

    objective, defaults = values["objective"], LossOptions()
    for owner, knobs in KNOBS.items():
        for name in knobs:
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
        if objective in UNCLIPPED and given is not None and given != getattr(preset, name, None):
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
    # (a saved config, resumed, holds the preset's scale: that one is no choice of the user's)
    estimator = cfg.adv_estimator or PRESETS[cfg.algo].adv_estimator
    if estimator in SELF_SCALED and cfg.adv_scale not in (None, PRESETS[cfg.algo].adv_scale):
        how = {"gdpo": "scales each reward by its group's std and the sum by the batch's",
               "reinforce_pp": "whitens over the batch's tokens",
               "reinforce_pp_baseline": "whitens over the batch's tokens",
               "opo": "has no scale", "gpg": "scales by the share of non-zero rewards",
               "remax": "has no scale"}  # fmt: skip
        raise UserError(
            f"{estimator} {how[estimator]}; drop --adv-scale, or use another --adv-estimator"
        )
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)}
    for name, value in dataclasses.asdict(PRESETS[cfg.algo]).items():
        if values[name] is None:
            values[name] = value
    _objective_knobs(cfg, values)
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
