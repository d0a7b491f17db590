"""`grouprl doctor` on synthetic run directories built to show one failure each (and a healthy
and a converged run): exactly the expected findings, and the exit codes."""

import json

import pytest
from synthetic_runs import make_run, ramp

from grouprl.cli import main
from grouprl.report.doctor import diagnose
from grouprl.report.doctor import learning as doctor


def codes(path):
    return {(f.code, f.severity) for f in diagnose(path)}


CONVERGED_EVAL = {0: 0.4, 50: 0.93, 55: 0.94, 60: 0.935}

CASES = {
    "healthy": ({}, {}, set()),
    "converged": (  # the demo's shape: most groups all right, entropy down 17x, held-out flat
        dict(
            accuracy=ramp(0.5, 0.93),
            reward_mean=ramp(0.5, 0.93),
            entropy=ramp(0.17, 0.005),
            frac_all_pass=ramp(0.0, 0.85),
            frac_zero_std=ramp(0.0, 0.9),
        ),
        {"evals": CONVERGED_EVAL},
        {("converged_groups", "info"), ("converged_entropy", "info")},
    ),
    "all_wrong": (
        dict(
            frac_none_pass=lambda s: 0.7,
            frac_zero_std=lambda s: 0.75,
            zero_std_token_frac=lambda s: 0.8,
        ),
        {},
        {("all_wrong_groups", "warning")},
    ),
    "entropy_collapse": (  # REFERENCES.md's lr-1e-3 TRL run: deterministic and wrong
        dict(
            entropy=ramp(0.5, 0.01),
            accuracy=ramp(0.3, 0.1),
            reward_mean=ramp(0.3, 0.1),
            frac_none_pass=ramp(0.3, 0.9),
        ),
        {"evals": {0: 0.3, 15: 0.25, 30: 0.2, 45: 0.15, 60: 0.12}},
        {
            ("entropy_collapse", "warning"),
            ("all_wrong_groups", "warning"),
            ("heldout_drop", "warning"),
        },
    ),
    "heldout_drop": (  # training looks fine, held-out pass@1 falls from its best
        {},
        {"evals": {0: 0.3, 15: 0.5, 30: 0.45, 45: 0.4, 60: 0.35}},
        {("heldout_drop", "warning")},
    ),
    "clipping": (  # off-policy GSPO clipping 90% of sequences for the whole run
        dict(clip_frac_low=lambda s: 0.45, clip_frac_high=lambda s: 0.45),
        {"config": {"algo": "gspo", "minibatches": 4, "ratio_level": "sequence"}},
        {("clip_fraction", "warning")},
    ),
    "cispo_capping": (  # CISPO's cap acting on 10% of the tokens: its own band (5%)
        dict(clip_frac_low=lambda s: 0.0, clip_frac_high=lambda s: 0.10),
        {"config": {"algo": "cispo", "objective": "cispo", "minibatches": 4}},
        {("clip_fraction", "warning")},
    ),
    "cispo_capping_rarely": (  # 3%: under CISPO's band (and far under the clip's 20%)
        dict(clip_frac_low=lambda s: 0.0, clip_frac_high=lambda s: 0.03),
        {"config": {"algo": "cispo", "objective": "cispo", "minibatches": 4}},
        set(),
    ),
    "sapo_no_bound": (  # SAPO's gate bounds nothing: whatever is logged, nothing to read
        dict(clip_frac_low=lambda s: 0.45, clip_frac_high=lambda s: 0.45),
        {"config": {"algo": "sapo", "objective": "sapo", "minibatches": 4}},
        set(),
    ),
    "clipping_on_policy": (  # the same numbers with one update per rollout: not checked
        dict(clip_frac_low=lambda s: 0.45, clip_frac_high=lambda s: 0.45),
        {},
        set(),
    ),
    "blowups": (
        dict(
            approx_kl=lambda s: 1e-4 if s < 30 else 0.2,
            kl=lambda s: 0.001 if s < 30 else 0.5,
            ratio_max=lambda s: 30.0 if s in (40, 41, 42, 50) else 1.2,
            ratio_min=lambda s: 0.8,
            grad_norm=lambda s: 50.0 if s in (25, 35, 45) else 0.2,
        ),
        {"config": {"minibatches": 2, "beta": 0.04}},
        {
            ("approx_kl", "warning"),
            ("ref_kl", "warning"),
            ("ratio_spread", "warning"),
            ("grad_spikes", "warning"),
        },
    ),
    "one_grad_spike": (  # one spike above the clipping norm: worth knowing, not a warning
        dict(grad_norm=lambda s: 50.0 if s == 40 else 0.2),
        {},
        {("grad_spikes", "info")},
    ),
    "nonfinite": (
        dict(nonfinite_updates=lambda s: int(s == 7), loss=lambda s: None if s == 7 else 0.01),
        {},
        {("nonfinite", "warning")},
    ),
    "tools_healthy": (  # a tool run whose calls work: nothing to say
        dict(
            tool_calls_mean=ramp(0.3, 0.95),
            tool_failure_frac=lambda s: 0.05,
            ended_by_turns_frac=lambda s: 0.0,
        ),
        {},
        set(),
    ),
    "tools_unused": (  # tools given, never called
        dict(
            tool_calls_mean=lambda s: 0.0,
            tool_failure_frac=lambda s: 0.0,
            ended_by_turns_frac=lambda s: 0.0,
        ),
        {},
        {("tools_unused", "warning")},
    ),
    "tools_failing": (  # most calls fail, most trajectories run out of calls
        dict(
            tool_calls_mean=lambda s: 4.0,
            tool_failure_frac=ramp(0.3, 0.8),
            ended_by_turns_frac=ramp(0.2, 0.7),
        ),
        {},
        {("tool_failures", "warning"), ("turn_limit", "warning")},
    ),
    "code_healthy": (  # code rewards whose programs all run: a few wrong, none lost
        dict(
            **{
                "code_checked": lambda s: 128.0,
                "code_errors/no_code": lambda s: 4.0,
                "code_errors/timeout": lambda s: 2.0,
                "code_errors/wall": lambda s: 0.0,
            }
        ),
        {},
        set(),
    ),
    "code_troubled": (  # most completions without a program, verdicts lost, slow programs
        dict(
            **{
                "code_checked": lambda s: 100.0,
                "code_errors/no_code": lambda s: 60.0,
                "code_errors/sandbox": lambda s: 4.0,
                "code_errors/wall": lambda s: 4.0,
                "code_errors/timeout": lambda s: 31.0,
            }
        ),
        {},
        {("code_missing", "warning"), ("code_unjudged", "warning"), ("code_timeouts", "info")},
    ),
    "length": (
        dict(completion_len_mean=ramp(50, 120), truncated_frac=ramp(0.0, 0.4)),
        {},
        {("length_runaway", "warning")},
    ),
    "reward_dominates": (  # two rewards, one of them setting 95% of the advantage
        dict(reward_share_correct=lambda s: 0.95, reward_share_format=lambda s: 0.05),
        {},
        {("reward_dominates", "warning")},
    ),
    "reward_dominates_gdpo": (  # the same shares under GDPO, which normalises each reward
        dict(reward_share_correct=lambda s: 0.95, reward_share_format=lambda s: 0.05),
        {"config": {"adv_estimator": "gdpo"}},
        set(),
    ),
    "rewards_balanced": (
        dict(reward_share_correct=lambda s: 0.6, reward_share_format=lambda s: 0.4),
        {},
        set(),
    ),
    "length_hacking": (  # reward and length up together, the pass rate flat
        dict(reward_mean=ramp(0.3, 0.6), completion_len_mean=ramp(20, 40), accuracy=lambda s: 0.3),
        {},
        {("length_hacking", "warning")},
    ),
    "reward_flat": (  # a weighted reward stops varying while the pass rate is low
        dict(reward_format_spread=lambda s: 0.3 if s < 30 else 0.0),
        {},
        {("reward_flat_format", "warning")},
    ),
    "reward_flat_converged": (  # the same once (almost) everything passes: no finding
        dict(
            reward_format_spread=lambda s: 0.3 if s < 30 else 0.0,
            accuracy=ramp(0.5, 0.97),
            reward_mean=ramp(0.5, 0.97),
        ),
        {},
        set(),
    ),
    "mismatch_growing": (  # the sampler drifts from the trainer (an async run, no correction)
        dict(logp_mismatch_kl=ramp(1e-4, 0.03)),
        {},
        {("logp_mismatch_growing", "warning")},
    ),
    "mismatch_steady": (  # a small, steady gap (vLLM in fp32, or bf16): no finding
        dict(logp_mismatch_kl=lambda s: 2e-5),
        {},
        set(),
    ),
    "routing_climbing": (  # a mixture-of-experts run whose steps change ever more routes
        dict(routing_update_changed=ramp(0.03, 0.2), routing_sampler_changed=lambda s: 0.0),
        {},
        {("routing_volatile", "warning")},
    ),
    "routing_steady": (  # high but not climbing (a noisy small model): no finding
        dict(routing_update_changed=lambda s: 0.2, routing_sampler_changed=lambda s: 0.01),
        {},
        set(),
    ),
    "routing_sampler_apart": (  # the sampler routes elsewhere (another engine, bf16)
        dict(routing_update_changed=lambda s: 0.02, routing_sampler_changed=lambda s: 0.08),
        {},
        {("routing_mismatch", "warning")},
    ),
    "distillation_stalled": (  # the student's KL to its teacher flat
        dict(teacher_kl=lambda s: 0.4),
        {},
        {("distillation_stalled", "warning")},
    ),
    "distillation_learning": (  # and falling: no finding
        dict(teacher_kl=ramp(0.4, 0.05)),
        {},
        set(),
    ),
    "distillation_jsd_stalled": (  # --teacher-loss jsd's divergence flat
        dict(teacher_jsd=lambda s: 0.2),
        {},
        {("distillation_stalled", "warning")},
    ),
    "distillation_jsd_learning": (
        dict(teacher_jsd=ramp(0.2, 0.02)),
        {},
        set(),
    ),
    "entropy_bonus_blowup": (  # a fixed bonus pushing entropy up 5x
        dict(policy_entropy=ramp(0.2, 1.0)),
        {"config": {"entropy_coef": 0.05}},
        {("entropy_bonus_blowup", "warning")},
    ),
    "entropy_bonus_steady": (  # a bonus holding entropy: no finding
        dict(policy_entropy=lambda s: 0.2),
        {"config": {"entropy_coef": 0.05}},
        set(),
    ),
    "gaming": (
        dict(reward_mean=ramp(0.2, 0.8)),
        {"evals": {0: 0.3, 15: 0.31, 30: 0.29, 45: 0.3, 60: 0.3}},
        {("reward_not_heldout", "warning")},
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_each_failure_gives_exactly_its_findings_and_exit_code(tmp_path, case, capsys):
    series, kwargs, expected = CASES[case]
    run = make_run(tmp_path / case, **kwargs, **series)
    assert codes(run) == expected
    status = main(["doctor", str(run)])
    out = capsys.readouterr().out
    assert status == (1 if any(sev == "warning" for _, sev in expected) else 0)
    for _code, severity in expected:
        assert severity in out
    if not expected:
        assert "no findings" in out


def test_findings_carry_steps_values_and_a_suggestion(tmp_path):
    run = make_run(tmp_path / "r", frac_none_pass=lambda s: 0.7)
    (finding,) = diagnose(run)
    assert "70%" in finding.evidence and "steps 31-60" in finding.evidence
    assert "--group-size" in finding.suggestion and "--dynamic-sampling" in finding.suggestion


def test_gaming_shows_example_completions(tmp_path):
    samples = [
        {"step": s, "prompt": f"{s}+1=", "completion": "|1", "reward": float(s % 2), "answer": "2"}
        for s in range(50, 61)
    ]
    run = make_run(
        tmp_path / "r",
        reward_mean=ramp(0.2, 0.8),
        evals={0: 0.3, 15: 0.31, 30: 0.29, 45: 0.3, 60: 0.3},
        samples=samples,
    )
    (finding,) = diagnose(run)
    assert len(finding.examples) == doctor.EXAMPLES
    assert all(ex["reward"] == 1.0 and ex["step"] >= 54 for ex in finding.examples)


def test_json_output_and_a_partial_last_line(tmp_path, capsys):
    run = make_run(tmp_path / "r", frac_none_pass=lambda s: 0.7)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 61, "reward_me')  # a run still writing
    assert main(["doctor", str(run), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [f["code"] for f in report["findings"]] == ["all_wrong_groups"]
    assert report["findings"][0]["severity"] == "warning"


def test_short_or_not_a_run(tmp_path, capsys):
    assert main(["doctor", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a grouprl run directory" in err and err.count("\n") == 1
    short = make_run(tmp_path / "short", frac_none_pass=lambda s: 0.9)
    (short / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "frac_none_pass": 0.9}) + "\n" for s in range(1, 5))
    )
    assert diagnose(short) == []  # four steps: too few to judge a trend
