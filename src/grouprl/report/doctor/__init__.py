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

from collections.abc import Callable
from pathlib import Path

from grouprl.report.doctor.completions import (
    check_code,
    check_length,
    check_reward_health,
    check_tools,
)
from grouprl.report.doctor.findings import Finding
from grouprl.report.doctor.learning import (
    check_distillation,
    check_entropy,
    check_entropy_bonus,
    check_heldout_drop,
    check_reward_vs_heldout,
    check_zero_variance,
)
from grouprl.report.doctor.updates import (
    check_blowups,
    check_clipping,
    check_mismatch,
    check_nonfinite,
    check_routing,
)
from grouprl.report.runs import RunLog, load_run

__all__ = ["CHECKS", "Finding", "diagnose", "format_findings"]

CHECKS: list[Callable[[RunLog], list[Finding]]] = [
    check_heldout_drop,
    check_zero_variance,
    check_entropy,
    check_entropy_bonus,
    check_distillation,
    check_clipping,
    check_blowups,
    check_nonfinite,
    check_mismatch,
    check_routing,
    check_length,
    check_reward_vs_heldout,
    check_reward_health,
    check_tools,
    check_code,
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
