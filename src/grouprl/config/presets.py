"""The `--algo` presets: what each fills of the algorithm-defining fields left at None (see
`grouprl.config.resolution`). A preset names its advantage estimator and objective, which are
registered in `grouprl.core.registry`; `algorithm_table` is the docs' table of them, made from
both, so that a new preset is in the docs once it is here."""

from __future__ import annotations

from dataclasses import dataclass


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

#: What the docs' table says of a preset beyond its fields (its paper, its caveats).
NOTES: dict[str, str] = {
    "grpo": "DeepSeekMath (arXiv 2402.03300)",
    "gspo": "GSPO (arXiv 2507.18071)",
    "dr_grpo": "Dr. GRPO (arXiv 2503.20783); loss ÷ max_new_tokens",
    "dapo": "DAPO (arXiv 2503.14476)",
    "gdpo": "GDPO (arXiv 2601.05242), for several rewards",
    "cispo": "CISPO (MiniMax-M1, arXiv 2506.13585)",
    "sapo": "SAPO (arXiv 2511.20347)",
    "gmpo": "GMPO (arXiv 2507.20673; verl `geo_mean`)",
    "luspo": "LUSPO (arXiv 2602.05261)",
    "vespo": "VESPO (arXiv 2602.10693)",
    "reinforce_pp": "REINFORCE++ (arXiv 2501.03262; verl `reinforce_plus_plus`)",
    "reinforce_pp_baseline": "verl `reinforce_plus_plus_baseline`",
    "opo": "OPO (arXiv 2505.23585)",
    "gpg": "GPG (arXiv 2504.02546; verl `gpg`)",
    "grpo_passk": "Pass@k training (arXiv 2503.19595; verl `grpo_passk`)",
    "remax": "ReMax (arXiv 2310.10505; verl `remax`); one greedy sample a prompt each step",
    "clip_cov": "Clip-Cov (arXiv 2505.22617; verl `clip_cov`, YAML defaults)",
    "kl_cov": "KL-Cov (arXiv 2505.22617; verl `kl_cov`, YAML defaults)",
}


def _number(x: float) -> str:
    """A setting as the table writes it: 0.2, 3e-4."""
    return f"{x:.0e}".replace("e-0", "e-") if 0 < abs(x) < 1e-2 else f"{x:g}"


#: How the table names an --adv-scale.
_SCALE_WORDS = {"group": "÷ group std", "batch": "÷ batch std", "none": "unscaled"}


def algorithm_table(default: str) -> list[str]:
    """The docs' table of the presets, one Markdown row each, made from `PRESETS`, `NOTES` and
    the estimators and objectives they name (`grouprl.core.registry`); `default`, the preset
    `--algo` defaults to. Imports torch (for the objectives' knob defaults)."""
    from grouprl.core import ADVANTAGE_ESTIMATORS, OBJECTIVES, LossOptions

    knob_defaults = LossOptions()
    rows = ["| preset | ratio | clip low / high | loss aggregation | advantage | minibatches | β "
            "| notes |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, p in PRESETS.items():
        objective, estimator = OBJECTIVES[p.objective], ADVANTAGE_ESTIMATORS[p.adv_estimator]
        knobs = ", ".join(f"`--{k.replace('_', '-')}` {_number(getattr(knob_defaults, k))}"
                          for k in objective.knobs)  # fmt: skip
        clip = f"{_number(p.clip_low)} / {_number(p.clip_high)}" if objective.clipped else "none"
        if objective.name != "clip":
            clip += f": {objective.summary}" + (f" ({knobs})" if knobs else "")
        advantage = estimator.summary
        if not estimator.self_scaled:
            advantage += f", {_SCALE_WORDS[p.adv_scale]}"
        extras = [NOTES.get(name, "")]
        extras += (
            ["dynamic sampling"] * p.dynamic_sampling
            + ["soft overlong penalty"] * (p.overlong_penalty)
            + ["leaves truncated completions out"] * p.mask_truncated
        )
        extras += ["exactly on-policy only"] * estimator.exactly_on_policy
        label = f"`{name}`" + (" (default)" if name == default else "")
        cells = [label, objective.ratio or p.ratio_level, clip, p.loss_agg, advantage,
                 str(p.minibatches), _number(p.beta), "; ".join(e for e in extras if e)]  # fmt: skip
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return rows
