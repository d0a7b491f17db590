"""Checks on what the policy learns: groups that teach nothing, entropy, the training reward
against held-out pass@1, and held-out pass@1 falling."""

from __future__ import annotations

import math
import statistics

from grouprl.report.doctor.findings import (
    ACCURACY_DROP,
    BROKEN,
    FLAT_EVALS,
    MIN_STEPS,
    REWARD_GAIN,
    Finding,
    accuracy_fell_by,
    finite_series,
    has_converged,
    heldout_series,
    window_medians,
    window_size,
)
from grouprl.report.runs import RunLog

# ----- zero-variance groups ---------------------------------------------------------------------
#: Share of sampled groups whose completions all fail, over the last half of the run, above
#: which a warning fires: such a group's advantages are all 0, so it costs its rollout and
#: teaches nothing. REFERENCES.md's collapsing TRL run had 0.35 rising to 0.95; DAPO (arXiv
#: 2503.14476, §3.2) introduced dynamic sampling because this share grows during training.
ALL_WRONG_WARN = 0.5
#: Share of all-correct groups, over the last tenth of the run, from which a run with high,
#: flat held-out pass@1 counts as converged (the bundled task's demo ends at about 0.85).
ALL_CORRECT_HIGH = 0.5

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

# ----- reward against held-out ------------------------------------------------------------------
HELDOUT_FLAT_GAIN = 0.02
#: Example completions shown with that finding.
EXAMPLES = 3


def check_zero_variance(run: RunLog) -> list[Finding]:
    steps, none_pass = finite_series(run, "frac_none_pass")
    if len(none_pass) < MIN_STEPS:
        return []
    half = len(none_pass) // 2
    wrong = statistics.fmean(none_pass[half:])
    t_steps, token_share = finite_series(run, "zero_std_token_frac")
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
        fell = accuracy_fell_by(run)
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
    ends = window_medians(run, "frac_all_pass")
    if ends is not None and ends[1] >= ALL_CORRECT_HIGH:
        converged, heldout = has_converged(run)
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
    ends = window_medians(run, "entropy")
    if ends is None or ends[0] <= 0:
        return []
    first, last, first_steps, last_steps = ends
    if last >= ENTROPY_COLLAPSE_RATIO * first:
        return []
    evidence = f"entropy {first:.3f} ({first_steps}) -> {last:.3f} ({last_steps})"
    converged, heldout = has_converged(run)
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
    acc = window_medians(run, "accuracy")
    reward = window_medians(run, "reward_mean")
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


def check_reward_vs_heldout(run: RunLog) -> list[Finding]:
    reward = window_medians(run, "reward_mean")
    steps, heldout = heldout_series(run)
    if reward is None or len(heldout) < 1 + FLAT_EVALS or steps[0] != 0:
        return []
    gain = reward[1] - reward[0]
    held_gain = heldout[-1] - heldout[0]
    if gain < REWARD_GAIN or held_gain > HELDOUT_FLAT_GAIN:
        return []
    last_step = run.metrics[-1]["step"] if run.metrics else 0
    late = [s for s in run.samples() if s.get("step", 0) >= last_step - window_size(last_step)]
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


def check_heldout_drop(run: RunLog) -> list[Finding]:
    steps, values = heldout_series(run)
    if len(values) < 2:
        return []
    best = max(range(len(values)), key=values.__getitem__)
    # and three standard errors of pass@1 over eval_size problems: a small evaluation is noisy
    n = max(1, int(run.config.get("eval_size") or 200))
    noise = 3 * math.sqrt(values[best] * (1 - values[best]) / n)
    if values[best] - values[-1] < max(ACCURACY_DROP, noise):
        return []
    fell = accuracy_fell_by(run)
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


#: On-policy distillation learns when the student's reverse KL to its teacher falls: a last
#: window at 90% or more of the first is a student that is not moving toward it.
DISTILL_STALL = 0.9
#: An entropy bonus is meant to hold entropy up, not to grow it: 3x the first window's mean
#: token entropy is a bonus pushing the policy toward uniform (the adaptive coefficient's
#: target is a level to hold; a fixed coefficient has none).
ENTROPY_BONUS_GROWTH = 3.0


def check_distillation(run: RunLog) -> list[Finding]:
    """With a teacher: the student's divergence from it not falling (`teacher_kl`, its reverse
    KL, or `teacher_jsd`, --teacher-loss jsd's generalized JSD)."""
    ends, name = window_medians(run, "teacher_kl"), "KL(student || teacher)"
    if ends is None or ends[0] <= 0:
        ends, name = window_medians(run, "teacher_jsd"), "JSD"
    if ends is None or ends[0] <= 0:
        return []
    first, last, early, late = ends
    if last < DISTILL_STALL * first:
        return []
    return [
        Finding(
            "distillation_stalled",
            "warning",
            "the student is not getting closer to its teacher",
            f"{name} per token {first:.3g} ({early}) -> {last:.3g} ({late})",
            "raise --teacher-coef or --lr, or weigh the task less (--teacher-task-weight); a "
            "teacher far from the student's start may need more steps",
        )
    ]


def check_entropy_bonus(run: RunLog) -> list[Finding]:
    """With an entropy bonus: the policy's entropy growing past ENTROPY_BONUS_GROWTH x."""
    ends = window_medians(run, "policy_entropy")
    if ends is None or ends[0] <= 0 or not run.config.get("entropy_coef"):
        return []
    first, last, early, late = ends
    if last < ENTROPY_BONUS_GROWTH * first:
        return []
    return [
        Finding(
            "entropy_bonus_blowup",
            "warning",
            "the entropy bonus is driving the policy toward uniform",
            f"mean token entropy {first:.3f} ({early}) -> {last:.3f} ({late})",
            "lower --entropy-coef, or let it adapt (--entropy-target, TRL's 0.2)",
        )
    ]
