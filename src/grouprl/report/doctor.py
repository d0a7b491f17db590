"""`grouprl doctor`: the failure modes of GRPO-style training, read off a run's own logs.

Each check looks at metrics.jsonl, eval.jsonl and samples.jsonl (a run finished or still being
written) and returns findings: a severity, the evidence (steps and values) and one suggestion.
A `warning` is something that costs the run (compute spent on groups that teach nothing, a
policy collapsing, a verifier being gamed); `info` is worth knowing but not wrong (the run has
converged). The same checks run live in `grouprl train` at each evaluation.

Trends compare the median of the first and the last WINDOW_FRACTION of the steps, so one noisy
step never decides a finding. Every threshold below says where its number comes from.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from grouprl.report.runs import RunLog, load_run

# ----- how much of a run a trend is read from ---------------------------------------------------
#: Steps needed before any trend is judged: fewer and a 10% window is one or two steps.
MIN_STEPS = 10
#: Trends compare the medians of the first and the last tenth of the steps (at least 3 steps).
WINDOW_FRACTION = 0.1
MIN_WINDOW = 3
#: Per-update quantities (clip fraction, approx KL) swing from step to step as the share of
#: groups trained changes: their window medians span at least this many steps.
MIN_UPDATE_WINDOW = 10

# ----- zero-variance groups ---------------------------------------------------------------------
#: Share of sampled groups whose completions all fail, over the last half of the run, above
#: which a warning fires: such a group's advantages are all 0, so it costs its rollout and
#: teaches nothing. REFERENCES.md's collapsing TRL run had 0.35 rising to 0.95; DAPO (arXiv
#: 2503.14476, §3.2) introduced dynamic sampling because this share grows during training.
ALL_WRONG_WARN = 0.5
#: Share of all-correct groups, over the last tenth of the run, from which a run with high,
#: flat held-out pass@1 counts as converged (the bundled task's demo ends at about 0.85).
ALL_CORRECT_HIGH = 0.5
#: Held-out pass@1 counted as high (the demo ends at 0.94; its base policy starts at 0.40).
HIGH_PASS_AT_1 = 0.8
#: Held-out pass@1 is flat when its last evaluations lie within this band: a 200-problem
#: evaluation with 4 samples each has a standard error of about 0.015 at pass@1 0.9.
FLAT_BAND = 0.03
#: Evaluations (after step 0) needed to call held-out pass@1 flat.
FLAT_EVALS = 3

# ----- entropy ----------------------------------------------------------------------------------
#: Entropy has collapsed when its last-window median is under this share of its first-window
#: median (the demo falls 0.17 -> 0.01 while converging; REFERENCES.md's lr-1e-3 TRL run fell
#: the same way while its reward fell to 0.13: the ratio alone cannot tell them apart, the
#: reward and held-out pass@1 do).
ENTROPY_COLLAPSE_RATIO = 0.1
#: Training accuracy (the pass reward's pass rate) under which a collapse is a warning.
LOW_ACCURACY = 0.5
#: A fall of the training reward (first window -> last window) that counts as falling.
REWARD_FALL = 0.05

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

# ----- length -----------------------------------------------------------------------------------
#: Share of completions hitting max_new_tokens (last window) that makes a warning when it rose
#: by TRUNCATED_RISE: their ends are cut, so the verifier scores a half-written answer
#: (DAPO §3.4 calls it reward noise and masks or penalises them).
TRUNCATED_WARN = 0.2
TRUNCATED_RISE = 0.1
#: Mean completion length growing this many times (first window -> last) with truncation up.
LENGTH_GROWTH = 1.5

# ----- reward against held-out ------------------------------------------------------------------
#: Training reward gain (first window -> last) that, with held-out pass@1 up by at most
#: HELDOUT_FLAT_GAIN since step 0, suggests the reward is being gamed (or the train prompts
#: memorised). 0.1 is ten held-out standard errors at the default evaluation size.
REWARD_GAIN = 0.1
HELDOUT_FLAT_GAIN = 0.02
#: Example completions shown with that finding.
EXAMPLES = 3
#: Held-out pass@1 falling this far below its best evaluation (or training accuracy this far
#: below its first window) means the updates made the policy worse: ten standard errors of a
#: default evaluation. A learning rate 60x the default collapses the bundled task's policy from
#: 0.40 to 0.00 within 20 steps.
ACCURACY_DROP = 0.1

# ----- reward health (runs with several rewards) ---------------------------------------------
#: One weighted reward's share Cov(w_k·r_k, R) / Var(R) of the within-group variance of the
#: total reward R above this, over the last window, means it alone decides the advantages: the
#: other rewards move less than a tenth of them. (Our threshold; the shares sum to 1.)
REWARD_DOMINANCE = 0.9
#: Reward up by REWARD_GAIN and mean completion length up this many times (first window ->
#: last) while the training pass rate moved less than FLAT_BAND: the reward is paying for
#: length, not correctness (length hacking; Singhal et al., arXiv 2310.03716, on RLHF).
LENGTH_HACK_GROWTH = 1.3
#: A weighted reward whose std over a step's completions fell below this (last window) after
#: varying in the first, while the pass rate is under CONVERGED: it no longer ranks anything.
SPREAD_GONE = 1e-6
CONVERGED = 0.9


@dataclass(frozen=True)
class Finding:
    """One thing the doctor found: what, how sure (warning or info), the numbers, what to do."""

    code: str
    severity: str  # "warning" | "info"
    title: str
    evidence: str
    suggestion: str
    examples: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ----- helpers ----------------------------------------------------------------------------------


def _window(n: int) -> int:
    return max(MIN_WINDOW, int(n * WINDOW_FRACTION))


def _values(run: RunLog, key: str) -> tuple[list[int], list[float]]:
    steps, values = run.series(key)
    keep = [(s, v) for s, v in zip(steps, values, strict=True) if math.isfinite(v)]
    return [s for s, _ in keep], [v for _, v in keep]


def _ends(run: RunLog, key: str) -> tuple[float, float, str, str] | None:
    """Medians of `key` over the first and the last window, and the steps each covers."""
    steps, values = _values(run, key)
    if len(values) < MIN_STEPS:
        return None
    w = _window(len(values))
    first, last = statistics.median(values[:w]), statistics.median(values[-w:])
    return first, last, f"steps {steps[0]}-{steps[w - 1]}", f"steps {steps[-w]}-{steps[-1]}"


def _heldout(run: RunLog) -> tuple[list[int], list[float]]:
    return run.series("pass_at_1", source="evals")


def _converged(run: RunLog) -> tuple[bool, str]:
    """Held-out pass@1 high and flat over its last FLAT_EVALS evaluations."""
    steps, values = _heldout(run)
    later = [(s, v) for s, v in zip(steps, values, strict=True) if s > 0][-FLAT_EVALS:]
    if len(later) < FLAT_EVALS:
        return False, ""
    vals = [v for _, v in later]
    high, flat = min(vals) >= HIGH_PASS_AT_1, max(vals) - min(vals) <= FLAT_BAND
    text = ", ".join(f"{v:.3f}" for v in vals)
    return high and flat, f"held-out pass@1 {text} at steps {later[0][0]}-{later[-1][0]}"


def _accuracy_fell(run: RunLog) -> str | None:
    """'accuracy A (steps) -> B (steps)' when training accuracy fell by ACCURACY_DROP or more."""
    acc = _ends(run, "accuracy")
    if acc is None or acc[0] - acc[1] < ACCURACY_DROP:
        return None
    return f"training accuracy {acc[0]:.2f} ({acc[2]}) -> {acc[1]:.2f} ({acc[3]})"


#: What to do when the updates broke a policy that used to pass.
BROKEN = "lower --lr (or set --beta to hold the policy near the reference) and start again"


def _off_policy(run: RunLog) -> bool:
    return int(run.config.get("minibatches") or 1) > 1 or int(run.config.get("epochs") or 1) > 1


# ----- the checks -------------------------------------------------------------------------------


def check_zero_variance(run: RunLog) -> list[Finding]:
    steps, none_pass = _values(run, "frac_none_pass")
    if len(none_pass) < MIN_STEPS:
        return []
    half = len(none_pass) // 2
    wrong = statistics.fmean(none_pass[half:])
    t_steps, token_share = _values(run, "zero_std_token_frac")
    late = [v for t, v in zip(t_steps, token_share, strict=True) if t >= steps[half]]
    cost = (
        f"; zero-variance groups took {statistics.fmean(late):.0%} of the sampled tokens"
        if late
        else ""
    )
    remedies = "a larger --group-size" + (
        "" if run.config.get("dynamic_sampling") else ", or --dynamic-sampling"
    )
    out = []
    if wrong >= ALL_WRONG_WARN:
        fell = _accuracy_fell(run)
        out.append(
            Finding(
                "all_wrong_groups",
                "warning",
                "most groups teach nothing: every completion fails",
                f"{wrong:.0%} of sampled groups at steps {steps[half]}-{steps[-1]} had no "
                f"completion passing{cost}" + (f"; {fell}" if fell else ""),
                f"the policy used to pass, so the data is not too hard: {BROKEN}"
                if fell
                else f"use easier data or a supervised warm start (grouprl sft), {remedies}",
            )
        )
    ends = _ends(run, "frac_all_pass")
    if ends is not None and ends[1] >= ALL_CORRECT_HIGH:
        converged, heldout = _converged(run)
        if converged:
            out.append(
                Finding(
                    "converged_groups",
                    "info",
                    "converged: most groups are solved by every completion",
                    f"{ends[1]:.0%} of groups all correct at {ends[3]}; {heldout}",
                    "stop here (or train on harder prompts): further steps mostly sample "
                    "groups that teach nothing",
                )
            )
    return out


def check_entropy(run: RunLog) -> list[Finding]:
    ends = _ends(run, "entropy")
    if ends is None or ends[0] <= 0:
        return []
    first, last, first_steps, last_steps = ends
    if last >= ENTROPY_COLLAPSE_RATIO * first:
        return []
    evidence = f"entropy {first:.3f} ({first_steps}) -> {last:.3f} ({last_steps})"
    converged, heldout = _converged(run)
    if converged:
        return [
            Finding(
                "converged_entropy",
                "info",
                "converged: the policy has become near-deterministic",
                f"{evidence}; {heldout}",
                "stop here: with entropy this low, more steps change little",
            )
        ]
    acc = _ends(run, "accuracy")
    reward = _ends(run, "reward_mean")
    # low and not climbing: a run that went 0.1 -> 0.45 is learning, however low it still is
    low = acc is not None and acc[1] < LOW_ACCURACY and acc[1] <= acc[0] + REWARD_FALL
    falling = reward is not None and reward[1] < reward[0] - REWARD_FALL
    if low or falling:
        how = f"accuracy {acc[1]:.2f}" if low else f"reward {reward[0]:.3f} -> {reward[1]:.3f}"
        return [
            Finding(
                "entropy_collapse",
                "warning",
                "entropy collapse: the policy became deterministic without getting it right",
                f"{evidence}, while {how}",
                "lower --lr, sample at a higher --temperature, or raise --clip-high "
                "(clip-higher, DAPO)",
            )
        ]
    return [
        Finding(
            "low_entropy",
            "info",
            "entropy has fallen by more than 10x",
            evidence,
            "exploration is limited from here; if held-out pass@1 stalls, raise --temperature",
        )
    ]


def check_clipping(run: RunLog) -> list[Finding]:
    if not _off_policy(run):
        return []
    steps, low = _values(run, "clip_frac_low")
    _, high = _values(run, "clip_frac_high")
    if len(low) < MIN_STEPS or len(high) != len(low):
        return []
    total = [a + b for a, b in zip(low, high, strict=True)]
    sequence = run.config.get("ratio_level") == "sequence"
    limit = SEQUENCE_CLIP_WARN if sequence else TOKEN_CLIP_WARN
    w = max(MIN_UPDATE_WINDOW, _window(len(total)))
    if len(total) < w:
        return []
    medians = [statistics.median(total[i : i + w]) for i in range(len(total) - w + 1)]
    worst = max(range(len(medians)), key=medians.__getitem__)
    if medians[worst] <= limit:
        return []
    unit = "sequences" if sequence else "tokens"
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
    steps, kl = _values(run, "approx_kl")
    if len(kl) >= max(MIN_STEPS, MIN_UPDATE_WINDOW):
        w = max(MIN_UPDATE_WINDOW, _window(len(kl)))
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
    ref_steps, ref_kl = _values(run, "kl")
    if len(ref_kl) >= MIN_STEPS:
        w = _window(len(ref_kl))
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
    r_steps, r_max = _values(run, "ratio_max")
    _, r_min = _values(run, "ratio_min")
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
    g_steps, grad = _values(run, "grad_norm")
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


def check_length(run: RunLog) -> list[Finding]:
    trunc = _ends(run, "truncated_frac")
    length = _ends(run, "completion_len_mean")
    if trunc is None or length is None:
        return []
    rising = trunc[1] >= trunc[0] + TRUNCATED_RISE
    fell = _accuracy_fell(run)
    if rising and (trunc[1] >= TRUNCATED_WARN or length[1] >= LENGTH_GROWTH * length[0]):
        return [
            Finding(
                "length_runaway",
                "warning",
                "completions are running into the length limit",
                f"truncated share {trunc[0]:.2f} ({trunc[2]}) -> {trunc[1]:.2f} ({trunc[3]}); "
                f"mean length {length[0]:.0f} -> {length[1]:.0f} tokens"
                + (f"; {fell}" if fell else ""),
                f"the policy is degenerating into long outputs: {BROKEN}"
                if fell
                else "raise --max-new-tokens if answers need the room; else --overlong-penalty "
                "or --mask-truncated (DAPO) so cut-off completions stop being rewarded",
            )
        ]
    return []


def check_reward_vs_heldout(run: RunLog) -> list[Finding]:
    reward = _ends(run, "reward_mean")
    steps, heldout = _heldout(run)
    if reward is None or len(heldout) < 1 + FLAT_EVALS or steps[0] != 0:
        return []
    gain = reward[1] - reward[0]
    held_gain = heldout[-1] - heldout[0]
    if gain < REWARD_GAIN or held_gain > HELDOUT_FLAT_GAIN:
        return []
    last_step = run.metrics[-1]["step"] if run.metrics else 0
    late = [s for s in run.samples() if s.get("step", 0) >= last_step - _window(last_step)]
    examples = sorted(late, key=lambda s: -(s.get("reward") or 0))[:EXAMPLES]
    return [
        Finding(
            "reward_not_heldout",
            "warning",
            "training reward rises but held-out pass@1 does not (is the verifier gamed?)",
            f"train reward {reward[0]:.3f} ({reward[2]}) -> {reward[1]:.3f} ({reward[3]}); "
            f"held-out pass@1 {heldout[0]:.3f} (step 0) -> {heldout[-1]:.3f} (step {steps[-1]})",
            "read the high-reward completions below: if they are wrong but rewarded, fix the "
            "reward function; if right, the training prompts differ from the held-out ones",
            examples=[
                {k: s.get(k) for k in ("step", "prompt", "completion", "reward", "answer")}
                for s in examples
            ],
        )
    ]


# ----- tools ------------------------------------------------------------------------------------
#: Share of failed tool calls, over the last window, above which a warning fires: past half,
#: most of what the policy learns from its tools is their error messages.
TOOL_FAILURE_WARN = 0.5
#: Share of trajectories ended by --max-turns, over the last window, above which a warning
#: fires: past half, most trajectories are cut before they answer.
TURN_LIMIT_WARN = 0.5


def check_tools(run: RunLog) -> list[Finding]:
    """Tool runs: tools never called, most calls failing, most trajectories out of turns."""
    calls = _ends(run, "tool_calls_mean")
    if calls is None:  # a run without tools
        return []
    findings = []
    steps = _ends(run, "env_steps_mean")
    played = steps is not None and steps[1] > 0  # a step() game may have no tools at all
    if calls[0] == 0 and calls[1] == 0 and not played:
        findings.append(Finding(
            "tools_unused", "warning", "the policy never calls its tools",
            f"tool calls per trajectory 0 from {calls[2]} to {calls[3]}",
            "check that the tool format is what the model writes (see samples.jsonl): a model "
            "that never writes a call can only learn one from a warm start that shows it "
            "(grouprl sft), or from prompts that describe the tools",
        ))  # fmt: skip
    failures = _ends(run, "tool_failure_frac")
    if failures is not None and failures[1] > TOOL_FAILURE_WARN:
        findings.append(Finding(
            "tool_failures", "warning", "most tool calls fail",
            f"failed share of calls {failures[0]:.2f} ({failures[2]}) -> {failures[1]:.2f} "
            f"({failures[3]})",
            "read the error observations in samples.jsonl: malformed arguments need a format "
            "the model can write; tools that raise or time out need fixing or --tool-timeout",
        ))  # fmt: skip
    ended = _ends(run, "ended_by_turns_frac")
    if ended is not None and ended[1] > TURN_LIMIT_WARN:
        findings.append(Finding(
            "turn_limit", "warning", "most trajectories hit --max-turns",
            f"share ended by --max-turns {ended[0]:.2f} ({ended[2]}) -> {ended[1]:.2f} "
            f"({ended[3]})",
            "raise --max-turns if the task needs more calls; else the policy is calling in a "
            "loop, which a reward for answering (not for calling) discourages",
        ))  # fmt: skip
    return findings


def check_heldout_drop(run: RunLog) -> list[Finding]:
    steps, values = _heldout(run)
    if len(values) < 2:
        return []
    best = max(range(len(values)), key=values.__getitem__)
    # and three standard errors of pass@1 over eval_size problems: a small evaluation is noisy
    n = max(1, int(run.config.get("eval_size") or 200))
    noise = 3 * math.sqrt(values[best] * (1 - values[best]) / n)
    if values[best] - values[-1] < max(ACCURACY_DROP, noise):
        return []
    fell = _accuracy_fell(run)
    return [
        Finding(
            "heldout_drop",
            "warning",
            "held-out pass@1 fell: the updates made the policy worse",
            f"held-out pass@1 {values[best]:.3f} (step {steps[best]}) -> {values[-1]:.3f} "
            f"(step {steps[-1]})" + (f"; {fell}" if fell else ""),
            f"{BROKEN}; checkpoints/ keeps the last --keep-last steps to restart from",
        )
    ]


def check_reward_health(run: RunLog) -> list[Finding]:
    """Several rewards: one deciding everything; reward bought with length; a reward gone flat."""
    out = []
    shares = {}
    for key in sorted({k for r in run.metrics for k in r if k.startswith("reward_share_")}):
        steps, values = _values(run, key)
        if len(values) >= MIN_STEPS:
            w = _window(len(values))
            shares[key.removeprefix("reward_share_")] = (statistics.mean(values[-w:]), steps, w)
    # GDPO normalises each reward inside its group: no reward's variance can dominate there
    if len(shares) >= 2 and run.config.get("adv_estimator") != "gdpo":
        name, (top, steps, w) = max(shares.items(), key=lambda kv: kv[1][0])
        if top >= REWARD_DOMINANCE:
            listed = ", ".join(f"{n} {v[0]:.2f}" for n, v in shares.items())
            out.append(Finding(
                "reward_dominates", "warning", f"reward {name} decides almost all of the advantage",
                f"share of the within-group reward variance, steps {steps[-w]}-{steps[-1]}: "
                f"{listed} (threshold {REWARD_DOMINANCE})",
                "the other rewards barely move the advantages: raise their weights, or use "
                "--algo gdpo, which normalises each reward inside its group before combining",
            ))  # fmt: skip
    reward, length, accuracy = (_ends(run, k) for k in ("reward_mean", "completion_len_mean",
                                                        "accuracy"))  # fmt: skip
    if (
        reward
        and length
        and accuracy
        and (
            reward[1] - reward[0] >= REWARD_GAIN
            and length[1] >= LENGTH_HACK_GROWTH * length[0]
            and abs(accuracy[1] - accuracy[0]) < FLAT_BAND
        )
    ):
        out.append(Finding(
            "length_hacking", "warning", "the reward rises with completion length, not correctness",
            f"reward {reward[0]:.2f} -> {reward[1]:.2f}, mean length {length[0]:.0f} -> "
            f"{length[1]:.0f} tokens, pass rate {accuracy[0]:.2f} -> {accuracy[1]:.2f} "
            f"({reward[2]} -> {reward[3]})",
            "a reward (or its weight) pays for longer answers: cap or normalise it by length, "
            "or lower its weight against the pass reward",
        ))  # fmt: skip
    for key in sorted({k for r in run.metrics for k in r if k.endswith("_spread")}):
        name = key.removeprefix("reward_").removesuffix("_spread")
        spread = _ends(run, key)
        if spread is None or accuracy is None:
            continue
        if spread[0] > SPREAD_GONE and spread[1] < SPREAD_GONE and accuracy[1] < CONVERGED:
            out.append(Finding(
                f"reward_flat_{name}", "warning", f"reward {name} gives every completion one score",
                f"its std over a step's completions {spread[0]:.3f} ({spread[2]}) -> "
                f"{spread[1]:.1e} ({spread[3]}) while the pass rate is {accuracy[1]:.2f}",
                f"{name} no longer ranks anything: check it on recent samples.jsonl lines "
                "(a saturated format bonus is harmless; a broken scorer is not)",
            ))  # fmt: skip
    return out


CHECKS: list[Callable[[RunLog], list[Finding]]] = [
    check_heldout_drop,
    check_zero_variance,
    check_entropy,
    check_clipping,
    check_blowups,
    check_nonfinite,
    check_length,
    check_reward_vs_heldout,
    check_reward_health,
    check_tools,
]


def diagnose(run: RunLog | Path) -> list[Finding]:
    """Every check's findings on `run` (a RunLog or a run directory), warnings first."""
    if not isinstance(run, RunLog):
        run = load_run(run)
    findings = [f for check in CHECKS for f in check(run)]
    return sorted(findings, key=lambda f: f.severity != "warning")


def format_findings(run: RunLog, findings: list[Finding]) -> str:
    """The doctor's transcript: a header line, then each finding with its evidence and advice."""
    steps = run.metrics[-1]["step"] if run.metrics else 0
    state = f"finished at step {run.finished_at}" if run.finished_at else "not finished"
    lines = [f"{run.path}: {run.algo}, {steps} steps logged ({state})"]
    if not findings:
        lines.append("no findings: nothing in this run's logs looks wrong")
    for f in findings:
        lines.append(f"{f.severity:<8}{f.title}")
        lines.append(f"        evidence: {f.evidence}")
        lines.append(f"        suggest:  {f.suggestion}")
        for ex in f.examples:
            text = str(ex.get("completion", ""))[:120].replace("\n", "\\n")
            lines.append(
                f"        e.g. step {ex.get('step')}: {ex.get('prompt')!r} -> {text!r} "
                f"(reward {ex.get('reward')}, answer {ex.get('answer')!r})"
            )
    warnings_ = sum(f.severity == "warning" for f in findings)
    lines.append(f"{warnings_} warning(s), {len(findings) - warnings_} info")
    return "\n".join(lines)
