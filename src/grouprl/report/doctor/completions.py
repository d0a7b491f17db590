"""Checks on what the policy writes and how it is scored: length and truncation, tool calls, the
health of several rewards (one deciding everything, length hacking, a reward gone flat), the
programs the code rewards run."""

from __future__ import annotations

import statistics

from grouprl.report.doctor.findings import (
    BROKEN,
    FLAT_BAND,
    MIN_STEPS,
    REWARD_GAIN,
    Finding,
    accuracy_fell_by,
    finite_series,
    window_medians,
    window_size,
)
from grouprl.report.runs import RunLog

# ----- length -----------------------------------------------------------------------------------
#: Share of completions hitting max_new_tokens (last window) that makes a warning when it rose
#: by TRUNCATED_RISE: their ends are cut, so the verifier scores a half-written answer
#: (DAPO §3.4 calls it reward noise and masks or penalises them).
TRUNCATED_WARN = 0.2
TRUNCATED_RISE = 0.1
#: Mean completion length growing this many times (first window -> last) with truncation up.
LENGTH_GROWTH = 1.5

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

# ----- code -------------------------------------------------------------------------------------
#: Share of checked completions without a program (last window) above which a warning fires:
#: past half, most of the reward signal is "write a code block", not the task.
CODE_MISSING_WARN = 0.5
#: Share of checked completions the sandbox gave no verdict for (wall-clock backstop or a
#: checker killed): any steady share above 5% is noise in the reward the policy can learn from.
CODE_LOST_WARN = 0.05
#: Share of checked completions over their CPU limit above which it is worth knowing.
CODE_TIMEOUT_WARN = 0.3

# ----- tools ------------------------------------------------------------------------------------
#: Share of failed tool calls, over the last window, above which a warning fires: past half,
#: most of what the policy learns from its tools is their error messages.
TOOL_FAILURE_WARN = 0.5
#: Share of trajectories ended by --max-turns, over the last window, above which a warning
#: fires: past half, most trajectories are cut before they answer.
TURN_LIMIT_WARN = 0.5


def check_length(run: RunLog) -> list[Finding]:
    trunc = window_medians(run, "truncated_frac")
    length = window_medians(run, "completion_len_mean")
    if trunc is None or length is None:
        return []
    rising = trunc[1] >= trunc[0] + TRUNCATED_RISE
    fell = accuracy_fell_by(run)
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


def check_tools(run: RunLog) -> list[Finding]:
    """Tool runs: tools never called, most calls failing, most trajectories out of turns."""
    calls = window_medians(run, "tool_calls_mean")
    if calls is None:  # a run without tools
        return []
    findings = []
    steps = window_medians(run, "env_steps_mean")
    played = steps is not None and steps[1] > 0  # a step() game may have no tools at all
    if calls[0] == 0 and calls[1] == 0 and not played:
        findings.append(Finding(
            "tools_unused", "warning", "the policy never calls its tools",
            f"tool calls per trajectory 0 from {calls[2]} to {calls[3]}",
            "check that the tool format is what the model writes (see samples.jsonl): a model "
            "that never writes a call can only learn one from a warm start that shows it "
            "(grouprl sft), or from prompts that describe the tools",
        ))  # fmt: skip
    failures = window_medians(run, "tool_failure_frac")
    if failures is not None and failures[1] > TOOL_FAILURE_WARN:
        findings.append(Finding(
            "tool_failures", "warning", "most tool calls fail",
            f"failed share of calls {failures[0]:.2f} ({failures[2]}) -> {failures[1]:.2f} "
            f"({failures[3]})",
            "read the error observations in samples.jsonl: malformed arguments need a format "
            "the model can write; tools that raise or time out need fixing or --tool-timeout",
        ))  # fmt: skip
    ended = window_medians(run, "ended_by_turns_frac")
    if ended is not None and ended[1] > TURN_LIMIT_WARN:
        findings.append(Finding(
            "turn_limit", "warning", "most trajectories hit --max-turns",
            f"share ended by --max-turns {ended[0]:.2f} ({ended[2]}) -> {ended[1]:.2f} "
            f"({ended[3]})",
            "raise --max-turns if the task needs more calls; else the policy is calling in a "
            "loop, which a reward for answering (not for calling) discourages",
        ))  # fmt: skip
    return findings


def code_error_share(run: RunLog, kinds: tuple[str, ...]) -> tuple[float, str] | None:
    """The share of checked programs that failed with one of `kinds` (the code rewards'
    `code_errors/KIND` over `code_checked`), over the last window; None without them."""
    steps, shares = [], []
    for record in run.metrics:
        checked = record.get("code_checked")
        if isinstance(checked, int | float) and checked > 0:
            failed = sum(float(record.get(f"code_errors/{k}") or 0.0) for k in kinds)
            steps.append(record["step"])
            shares.append(failed / checked)
    if len(shares) < MIN_STEPS:
        return None
    w = window_size(len(shares))
    return statistics.median(shares[-w:]), f"steps {steps[-w]}-{steps[-1]}"


def check_code(run: RunLog) -> list[Finding]:
    """Code rewards: programs missing from the completions, verdicts the sandbox could not give,
    programs over their CPU limit."""
    findings = []
    missing = code_error_share(run, ("no_code",))
    if missing is not None and missing[0] > CODE_MISSING_WARN:
        findings.append(Finding(
            "code_missing", "warning", "most completions hold no program to run",
            f"share of checked completions without a ```python block {missing[0]:.2f} "
            f"({missing[1]})",
            "read samples.jsonl: ask for one ```python block in the prompt or system prompt, or "
            "score the whole completion (code_reward(extract=\"whole\") in a reward file)",
        ))  # fmt: skip
    lost = code_error_share(run, ("sandbox", "wall"))
    if lost is not None and lost[0] > CODE_LOST_WARN:
        findings.append(Finding(
            "code_unjudged", "warning", "the sandbox gave no verdict for many programs",
            f"share of checked completions failed as sandbox or wall {lost[0]:.2f} ({lost[1]})",
            "`wall` is the wall-clock backstop: a loaded machine or programs that sleep (raise "
            "wall_seconds in code_reward's Limits); `sandbox` is a checker killed from inside",
        ))  # fmt: skip
    slow = code_error_share(run, ("timeout",))
    if slow is not None and slow[0] > CODE_TIMEOUT_WARN:
        findings.append(Finding(
            "code_timeouts", "info", "many programs run past their CPU limit",
            f"share of checked completions with a timeout {slow[0]:.2f} ({slow[1]})",
            "if right answers need more than 2 CPU seconds per test, raise cpu_seconds in "
            "code_reward's Limits; else the policy writes loops that do not end",
        ))  # fmt: skip
    return findings


def check_reward_health(run: RunLog) -> list[Finding]:
    """Several rewards: one deciding everything; reward bought with length; a reward gone flat."""
    out = []
    shares = {}
    for key in sorted({k for r in run.metrics for k in r if k.startswith("reward_share_")}):
        steps, values = finite_series(run, key)
        if len(values) >= MIN_STEPS:
            w = window_size(len(values))
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
    reward, length, accuracy = (window_medians(run, k) for k in ("reward_mean", "completion_len_mean",
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
        spread = window_medians(run, key)
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
