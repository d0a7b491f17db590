"""What every check of the doctor shares: a `Finding`, how much of a run a trend is read from,
and the readings of a run's logs that several checks make."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from grouprl.report.runs import RunLog

# ----- how much of a run a trend is read from ---------------------------------------------------
#: Steps needed before any trend is judged: fewer and a 10% window is one or two steps.
MIN_STEPS = 10
#: Trends compare the medians of the first and the last tenth of the steps (at least 3 steps).
WINDOW_FRACTION = 0.1
MIN_WINDOW = 3
#: Per-update quantities (clip fraction, approx KL) swing from step to step as the share of
#: groups trained changes: their window medians span at least this many steps.
MIN_UPDATE_WINDOW = 10

# ----- readings several checks share ----------------------------------------------------------
#: Held-out pass@1 counted as high (the demo ends at 0.94; its base policy starts at 0.40).
HIGH_PASS_AT_1 = 0.8
#: Held-out pass@1 is flat when its last evaluations lie within this band: a 200-problem
#: evaluation with 4 samples each has a standard error of about 0.015 at pass@1 0.9.
FLAT_BAND = 0.03
#: Evaluations (after step 0) needed to call held-out pass@1 flat.
FLAT_EVALS = 3
# ----- reward against held-out ------------------------------------------------------------------
#: Training reward gain (first window -> last) that, with held-out pass@1 up by at most
#: HELDOUT_FLAT_GAIN since step 0, suggests the reward is being gamed (or the train prompts
#: memorised). 0.1 is ten held-out standard errors at the default evaluation size.
REWARD_GAIN = 0.1
#: Held-out pass@1 falling this far below its best evaluation (or training accuracy this far
#: below its first window) means the updates made the policy worse: ten standard errors of a
#: default evaluation. A learning rate 60x the default collapses the bundled task's policy from
#: 0.40 to 0.00 within 20 steps.
ACCURACY_DROP = 0.1


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


def window_size(n: int) -> int:
    return max(MIN_WINDOW, int(n * WINDOW_FRACTION))


def finite_series(run: RunLog, key: str) -> tuple[list[int], list[float]]:
    steps, values = run.series(key)
    keep = [(s, v) for s, v in zip(steps, values, strict=True) if math.isfinite(v)]
    return [s for s, _ in keep], [v for _, v in keep]


def window_medians(run: RunLog, key: str) -> tuple[float, float, str, str] | None:
    """Medians of `key` over the first and the last window, and the steps each covers."""
    steps, values = finite_series(run, key)
    if len(values) < MIN_STEPS:
        return None
    w = window_size(len(values))
    first, last = statistics.median(values[:w]), statistics.median(values[-w:])
    return first, last, f"steps {steps[0]}-{steps[w - 1]}", f"steps {steps[-w]}-{steps[-1]}"


def heldout_series(run: RunLog) -> tuple[list[int], list[float]]:
    return run.series("pass_at_1", source="evals")


def has_converged(run: RunLog) -> tuple[bool, str]:
    """Held-out pass@1 high and flat over its last FLAT_EVALS evaluations."""
    steps, values = heldout_series(run)
    later = [(s, v) for s, v in zip(steps, values, strict=True) if s > 0][-FLAT_EVALS:]
    if len(later) < FLAT_EVALS:
        return False, ""
    vals = [v for _, v in later]
    high, flat = min(vals) >= HIGH_PASS_AT_1, max(vals) - min(vals) <= FLAT_BAND
    text = ", ".join(f"{v:.3f}" for v in vals)
    return high and flat, f"held-out pass@1 {text} at steps {later[0][0]}-{later[-1][0]}"


def accuracy_fell_by(run: RunLog) -> str | None:
    """'accuracy A (steps) -> B (steps)' when training accuracy fell by ACCURACY_DROP or more."""
    acc = window_medians(run, "accuracy")
    if acc is None or acc[0] - acc[1] < ACCURACY_DROP:
        return None
    return f"training accuracy {acc[0]:.2f} ({acc[2]}) -> {acc[1]:.2f} ({acc[3]})"


#: What to do when the updates broke a policy that used to pass.
BROKEN = "lower --lr (or set --beta to hold the policy near the reference) and start again"


def is_off_policy(run: RunLog) -> bool:
    return int(run.config.get("minibatches") or 1) > 1 or int(run.config.get("epochs") or 1) > 1
