"""Checks on the updates: clipping, KL, ratio and gradient blow-ups, non-finite steps."""

from __future__ import annotations

import statistics

from grouprl.report.doctor.findings import (
    MIN_STEPS,
    MIN_UPDATE_WINDOW,
    Finding,
    finite_series,
    is_off_policy,
    window_medians,
    window_size,
)
from grouprl.report.runs import RunLog

# ----- clipping (off-policy updates only: one on-policy update has ratio 1, nothing clips) -----
#: Clipped share of tokens (low + high), as the median of a window, above which the step moves
#: the policy further than the clip range allows on most of the batch. Token ratio, eps 0.2:
#: GRPO clips a small fraction of a percent in the GSPO paper's runs (arXiv 2507.18071), and
#: PPO practice (Spinning Up, cleanrl) reads a clip fraction above ~0.2 as a too-large step.
TOKEN_CLIP_WARN = 0.2
#: Sequence ratio with GSPO's 3e-4 / 4e-4: the paper clips about two orders of magnitude more
#: tokens than GRPO and learns faster; this project's default GSPO run peaks at a window median
#: of 0.58 early and then clips almost nothing. Above 0.75, most of each off-policy minibatch
#: is clipped away.
SEQUENCE_CLIP_WARN = 0.75
#: CISPO bounds no ratio; it caps the weight, at 5 by default (a token 5x likelier than when it
#: was sampled, within one rollout's updates). Past 5% of the tokens so, the updates move far.
CISPO_CAP_WARN = 0.05
#: SAPO's gate, VESPO's weight, GPG's REINFORCE and KL-Cov's r·Â bound nothing: no clip to read.
UNBOUNDED = ("sapo", "vespo", "gpg", "kl_cov")

# ----- KL, ratio and gradient blow-ups ----------------------------------------------------------
#: approx KL(old || new) per token after an update, as a window median: PPO implementations
#: stop an update at 1.5 x a 0.01 target (Spinning Up's target_kl); 0.05 is well past it.
APPROX_KL_WARN = 0.05
#: KL to the reference policy (per token) counts as blowing up when its last-window median is
#: above this and has grown this many times since a quarter into the run.
REF_KL_WARN = 0.1
REF_KL_GROWTH = 10.0
#: Extreme importance ratios (max above, min below 1/this) on at least EXTREME_STEPS steps and
#: EXTREME_RATE of them: e^2.3 is outside any clip range in use (verl's dual clip bounds the
#: loss at 3).
RATIO_EXTREME = 10.0
EXTREME_STEPS = 3
EXTREME_RATE = 0.01
#: A gradient-norm spike: this many times the median of the previous 20 steps that trained
#: something (a step with every group skipped logs 0), and above the clipping norm. The demo's
#: GSPO run, whose norm varies 30x with the share of groups trained, has one such step in 200;
#: at least GRAD_SPIKES_WARN spikes on more than EXTREME_RATE of the steps make a warning.
GRAD_SPIKE_FACTOR = 20.0
GRAD_SPIKE_HISTORY = 20
GRAD_SPIKES_WARN = 3


def check_clipping(run: RunLog) -> list[Finding]:
    if not is_off_policy(run):
        return []
    steps, low = finite_series(run, "clip_frac_low")
    _, high = finite_series(run, "clip_frac_high")
    if len(low) < MIN_STEPS or len(high) != len(low):
        return []
    objective = run.config.get("objective") or "clip"
    if objective in UNBOUNDED:
        return []
    total = [a + b for a, b in zip(low, high, strict=True)]
    sequence = run.config.get("ratio_level") == "sequence"
    limit = SEQUENCE_CLIP_WARN if sequence else TOKEN_CLIP_WARN
    limit = CISPO_CAP_WARN if objective == "cispo" else limit
    w = max(MIN_UPDATE_WINDOW, window_size(len(total)))
    if len(total) < w:
        return []
    medians = [statistics.median(total[i : i + w]) for i in range(len(total) - w + 1)]
    worst = max(range(len(medians)), key=medians.__getitem__)
    if medians[worst] <= limit:
        return []
    unit = "sequences" if sequence else "tokens"
    if objective == "cispo":
        return [
            Finding(
                "clip_fraction",
                "warning",
                "many tokens' weights hit CISPO's cap: each update moves far from the sampler",
                f"capped share {medians[worst]:.2f} (median of steps {steps[worst]}-"
                f"{steps[worst + w - 1]}; usual: below {limit})",
                "lower --lr, or use fewer --minibatches (fewer off-policy updates per rollout)",
            )
        ]
    return [
        Finding(
            "clip_fraction",
            "warning",
            f"most {unit} are clipped: each update moves further than the clip range",
            f"clipped share {medians[worst]:.2f} (median of steps {steps[worst]}-"
            f"{steps[worst + w - 1]}; usual for this ratio level: below {limit})",
            "lower --lr, or use fewer --minibatches (fewer off-policy updates per rollout)",
        )
    ]


def check_blowups(run: RunLog) -> list[Finding]:
    out = []
    steps, kl = finite_series(run, "approx_kl")
    if len(kl) >= max(MIN_STEPS, MIN_UPDATE_WINDOW):
        w = max(MIN_UPDATE_WINDOW, window_size(len(kl)))
        medians = [statistics.median(kl[i : i + w]) for i in range(len(kl) - w + 1)]
        worst = max(range(len(medians)), key=medians.__getitem__)
        if medians[worst] > APPROX_KL_WARN:
            out.append(
                Finding(
                    "approx_kl",
                    "warning",
                    "each update moves the policy far (approx KL old->new)",
                    f"approx KL {medians[worst]:.3f} per token (median of steps {steps[worst]}-"
                    f"{steps[worst + w - 1]}; PPO practice stops an update near 0.015)",
                    "lower --lr or --clip-high, or use fewer --minibatches / --epochs",
                )
            )
    ref_steps, ref_kl = finite_series(run, "kl")
    if len(ref_kl) >= MIN_STEPS:
        w = window_size(len(ref_kl))
        quarter = statistics.median(ref_kl[len(ref_kl) // 4 : len(ref_kl) // 4 + w])
        last = statistics.median(ref_kl[-w:])
        if last > REF_KL_WARN and last > REF_KL_GROWTH * max(quarter, 1e-12):
            out.append(
                Finding(
                    "ref_kl",
                    "warning",
                    "KL to the reference policy is blowing up",
                    f"KL to ref {quarter:.4f} (a quarter in) -> {last:.4f} (steps "
                    f"{ref_steps[-w]}-{ref_steps[-1]})",
                    "raise --beta or lower --lr",
                )
            )
    r_steps, r_max = finite_series(run, "ratio_max")
    _, r_min = finite_series(run, "ratio_min")
    if r_max and len(r_min) == len(r_max):
        extreme = [
            (s, hi, lo)
            for s, hi, lo in zip(r_steps, r_max, r_min, strict=True)
            if hi > RATIO_EXTREME or lo < 1 / RATIO_EXTREME
        ]
        if len(extreme) >= max(EXTREME_STEPS, EXTREME_RATE * len(r_max)):
            shown = ", ".join(f"{s} ({lo:.2g}-{hi:.2g})" for s, hi, lo in extreme[:5])
            out.append(
                Finding(
                    "ratio_spread",
                    "warning",
                    "importance ratios far from 1",
                    f"{len(extreme)} steps with a ratio outside [{1 / RATIO_EXTREME:g}, "
                    f"{RATIO_EXTREME:g}]: steps {shown}",
                    "lower --lr or use fewer --minibatches; for long completions a sequence "
                    "ratio (--algo gspo) keeps the ratio near 1",
                )
            )
    g_steps, grad = finite_series(run, "grad_norm")
    clip_norm = float(run.config.get("max_grad_norm") or 0) or 0.0
    spikes, history = [], []
    for s, g in zip(g_steps, grad, strict=True):
        if len(history) >= GRAD_SPIKE_HISTORY // 4:
            before = statistics.median(history[-GRAD_SPIKE_HISTORY:])
            if g > GRAD_SPIKE_FACTOR * before and g > clip_norm:
                spikes.append((s, g, before))
        if g > 0:  # a step that trained nothing has no gradient to compare with
            history.append(g)
    if spikes:
        shown = ", ".join(f"step {s}: {g:.3g} (median {m:.2g})" for s, g, m in spikes[:5])
        out.append(
            Finding(
                "grad_spikes",
                "warning"
                if len(spikes) >= max(GRAD_SPIKES_WARN, EXTREME_RATE * len(grad))
                else "info",
                f"gradient-norm spikes ({len(spikes)})",
                shown,
                "lower --lr or --max-grad-norm; look at the batches of those steps in "
                "samples.jsonl",
            )
        )
    return out


def check_nonfinite(run: RunLog) -> list[Finding]:
    bad = [
        r["step"]
        for r in run.metrics
        # not a null grad_norm alone: an fp16 loss scaler's overflow steps log inf there, skip
        # the step and lower the scale, as designed
        if (r.get("nonfinite_updates") or 0) > 0 or ("loss" in r and r["loss"] is None)
    ]
    if not bad:
        return []
    shown = ", ".join(str(s) for s in bad[:10]) + (" ..." if len(bad) > 10 else "")
    return [
        Finding(
            "nonfinite",
            "warning",
            "non-finite loss or gradient (those updates were skipped)",
            f"{len(bad)} step(s): {shown}",
            "lower --lr, check the reward functions for NaN or inf, or use fp32 (--precision)",
        )
    ]


# ----- the sampler against the trainer (another engine, precision or an older version) ------
#: k3's KL(sampler ‖ trainer) per token, as a last-window median, above which the gap is the
#: size of a policy update (PPO's 0.01 target KL) and counts as growing when it is this many
#: times the first window's. prime-rl's docs call this metric the early warning of off-policy
#: collapse.
MISMATCH_KL_WARN = 0.01
MISMATCH_GROWTH = 4.0


def check_mismatch(run: RunLog) -> list[Finding]:
    """The sampler's log-probs drifting from the trainer's: `logp_mismatch_kl` grown past
    MISMATCH_GROWTH x its first window and above MISMATCH_KL_WARN at the end."""
    medians = window_medians(run, "logp_mismatch_kl")
    if medians is None:
        return []
    first, last, early, late = medians
    if not (last > MISMATCH_KL_WARN and last > MISMATCH_GROWTH * first):
        return []
    corrected = (run.config.get("correction") or "none") != "none"
    return [
        Finding(
            "logp_mismatch_growing",
            "warning",
            "the sampler's log-probs are drifting from the trainer's",
            f"KL(sampler || trainer) per token {first:.2e} ({early}) -> {last:.2e} ({late})",
            ("the correction is not holding it: lower --max-staleness or --lr, or mask harder "
             "(--correction geo_mask_token_tis)") if corrected else
            ("correct for it (--correction token_tis, or geo_mask_token_tis for long "
             "completions), lower --max-staleness, or sample in the trainer's precision"),
        )
    ]  # fmt: skip


# ----- expert routing (mixture-of-experts policies) ---------------------------------------------
#: Share of the completions' (token, layer) expert sets one step changes, as a last-window median:
#: the GSPO paper (Zheng et al. 2025, §5.3) measures about 10% per update on a 48-layer
#: Qwen3-30B-A3B and finds that enough to stop GRPO converging without routing replay.
ROUTING_CHANGE_WARN = 0.1
#: ... and grown this many times since the first window: routing is getting less stable.
ROUTING_GROWTH = 1.5
#: Share of expert sets on which the sampler and the trainer disagree before the update: a few
#: percent means each ratio starts from a different network for those tokens (R3's motivation,
#: Ma et al. 2025); the same weights in the same precision disagree on none.
ROUTING_MISMATCH_WARN = 0.05


def check_routing(run: RunLog) -> list[Finding]:
    """A mixture-of-experts run's routing: the share of expert sets a step changes climbing
    past ROUTING_CHANGE_WARN (by ROUTING_GROWTH x since its first window), and the sampler's
    routes differing from the trainer's on more than ROUTING_MISMATCH_WARN of them."""
    out = []
    replay = run.config.get("routing_replay") or "off"
    sequence = run.config.get("ratio_level") == "sequence"
    medians = window_medians(run, "routing_update_changed")
    if medians is not None:
        first, last, early, late = medians
        if last > ROUTING_CHANGE_WARN and last > ROUTING_GROWTH * first:
            out.append(
                Finding(
                    "routing_volatile",
                    "warning",
                    "each step changes more and more of the experts tokens are routed to",
                    f"expert sets changed per step {first:.3f} ({early}) -> {last:.3f} ({late}); "
                    f"the GSPO paper finds ~{ROUTING_CHANGE_WARN:.0%} enough to stall GRPO",
                    "lower --lr" if replay != "off" or sequence else
                    ("replay the routes (--routing-replay r2, or r3 to replay the sampler's), "
                     "use GSPO's sequence ratio (--algo gspo), or lower --lr"),
                )
            )  # fmt: skip
    medians = window_medians(run, "routing_sampler_changed")
    if medians is not None and medians[1] > ROUTING_MISMATCH_WARN:
        _, last, _, late = medians
        out.append(
            Finding(
                "routing_mismatch",
                "warning",
                "the sampler routes tokens to other experts than the trainer does",
                f"expert sets differing {last:.3f} ({late}; usual: below "
                f"{ROUTING_MISMATCH_WARN})",
                "replay the sampler's routes (--routing-replay r3)" if replay != "r3" else
                "sample in the trainer's precision (--precision fp32)",
            )
        )  # fmt: skip
    return out
