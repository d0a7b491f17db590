"""`grouprl check`: train's flags and check's own; the report as tables or JSON; exit 1 when the
run would not learn (`grouprl.workflows.check` measures)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from grouprl.cli import quiet_hf
from grouprl.errors import UserError

USAGE = (
    "usage: grouprl check [any grouprl train flag] [--check-steps N] [--json] "
    "[--output FILE] [--memory-limit GB] [--second-temperature T]\n\n"
    "Builds the run as train would, samples --check-steps (2) steps of groups, measures "
    "one update without stepping the optimizer, and reports whether it would learn: "
    "prompts as the model sees them, reward spread, groups without gradient, lengths, "
    "speed, memory. Writes nothing unless --output. Exit 1 when the run would not learn."
)


def usage() -> str:
    """The usage line, then check's own flags with their help (the fields' docstrings, as
    the reference prints them); every other flag is `grouprl train --help`'s."""
    from grouprl.cli.reference import flag_rows
    from grouprl.workflows.check import OWN_FLAGS, CheckOptions

    lines = [USAGE, "", "check's own flags (every other flag is grouprl train's):"]
    for row in flag_rows(CheckOptions, renamed={v: k for k, v in OWN_FLAGS.items()}):
        lines.append(f"  {row.flag} {row.takes}".rstrip())
        lines.append(f"      {row.help} (default: {row.default})")
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(usage())
        return 0
    quiet_hf()
    return main(argv)


def split_args(argv: list[str]) -> tuple[Any, list[str]]:
    """check's own flags out of argv (`CheckOptions`); the rest are train's."""
    from grouprl.workflows.check import OWN_FLAGS, CheckOptions

    own = {k: v for k, v in OWN_FLAGS.items() if k != "--json"}
    values: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, _, inline = arg.partition("=")
        if name == "--json":
            values["json"] = True
        elif name in own:
            if not inline and i + 1 >= len(argv):
                raise UserError(f"{name} needs a value")
            value = inline or argv[i + 1]
            i += 0 if inline else 1
            try:
                kinds = {"steps": int, "output": Path}
                kind = kinds.get(own[name], float)
                values[own[name]] = kind(value)
            except ValueError:
                raise UserError(f"{name} {value!r} is not a number") from None
        else:
            rest.append(arg)
        i += 1
    options = CheckOptions(**values)
    if options.steps < 1:
        raise UserError("--check-steps must be at least 1")
    if options.second_temperature is not None and not options.second_temperature > 0:
        raise UserError("--second-temperature must be > 0")
    return options, rest


def print_report(report: Any, console: Console) -> None:
    cfg = report.config
    console.print(
        f"[bold]grouprl check[/]: {cfg['model']}, {cfg['algo']}, {cfg['prompts_per_step']} "
        f"prompts x G={cfg['group_size']}, {cfg['steps']} steps"
    )
    for i, p in enumerate(report.prompts):
        console.print(f"[bold]prompt {i}[/] ({p['tokens']} tokens, as the model sees it):")
        console.print(p["rendered"], markup=False, highlight=False)
        mark = "pass" if p["passed"] else "fail"
        console.print(f"  -> {p['completion']!r} ({mark})", markup=False, highlight=False)
    table = Table(title="rewards")
    for col in ("reward", "weight", "mean", "std", "unscored", "same score", "ranks groups"):
        table.add_column(col, justify="right" if col != "reward" else "left")
    for name, s in report.rewards.items():
        cells = [f"{s['weight']:g}", f"{s['mean']:.3f}", f"{s['std']:.3f}"]
        cells += [f"{s[k]:.0%}" for k in ("unscored", "same_score", "ranks_groups")]
        table.add_row(name, *cells)
    console.print(table)
    for pair, r in report.correlations.items():
        console.print(f"correlation {pair}: {r:+.2f}")
    table = Table(title="groups with no gradient (all pass or all fail)")
    table.add_column("G", justify="right")
    table.add_column("predicted", justify="right")
    for g, share in sorted(report.predicted_no_gradient.items()):
        here = "  <- this run" if g == cfg["group_size"] else ""
        table.add_row(str(g), f"{share:.0%}{here}")
    console.print(table)
    passes = sum(k for k, _ in report.pass_counts)
    samples = sum(n for _, n in report.pass_counts)
    console.print(
        f"measured at G={cfg['group_size']}: {report.measured_no_gradient:.0%} of "
        f"{len(report.pass_counts)} groups; pass rate {passes}/{samples}"
    )
    if report.second_temperature is not None:
        t2 = report.second_temperature
        console.print(
            f"at temperature {t2['temperature']:g} (step 0's prompts again): pass rate "
            f"{t2['pass_rate']:.0%}, groups without gradient {t2['measured_no_gradient']:.0%} "
            f"measured, {t2['predicted_no_gradient']:.0%} predicted"
        )
    ln = report.lengths
    console.print(
        f"lengths: p10 {ln['p10']:.0f}, median {ln['p50']:.0f}, p90 {ln['p90']:.0f}, max "
        f"{ln['max']:.0f} of {ln['max_new_tokens']}; {ln['truncated']:.0%} truncated"
    )
    t, m = report.timing, report.memory
    console.print(
        f"speed: {t['tokens_per_s']:.0f} sampled tokens/s; a step ~{t['seconds_per_step']:.1f} s"
        f" (sampling {t['sampling_seconds_per_step']:.1f} + update {t['update_seconds']:.1f});"
        f" the run ~{_duration(t['run_seconds'])} with its evaluations"
    )
    step = report.step
    kl = f", KL to the reference {step['kl']:.2e}" if "kl" in step else ""
    console.print(
        f"update (one step's, as train runs it): loss {step.get('loss', float('nan')):.3g}, "
        f"gradient norm {step.get('grad_norm', float('nan')):.3g}{kl}"
    )
    _print_mismatch(report.mismatch, console)
    console.print(
        f"memory: update peak {m['peak_gb']:.2f} GB ({m['method']}; "
        f"{m['completions_per_forward']} completions per forward)"
    )
    if "limit_gb" in m:
        console.print(
            f"  for --memory-limit {m['limit_gb']:g} GB: predicted {m['predicted_gb']:.2f} GB at "
            f"this micro-batch; {_fits(m['micro_batch_size_that_fits'])} "
            f"({m['prediction']})"
        )
    if not report.findings:
        console.print("no findings: nothing here says this run would not learn")
    for f in report.findings:
        console.print(f"{f.severity:<8}{f.title}", markup=False)
        console.print(f"        evidence: {f.evidence}", markup=False)
        console.print(f"        suggest:  {f.suggestion}", markup=False)
        for ex in f.examples:
            console.print(
                f"        e.g. {ex.get('prompt')!r} -> {ex.get('completion')!r}", markup=False
            )


def _print_mismatch(mm: dict[str, Any], console: Console) -> None:
    console.print(
        f"sampler ({mm['sampler']}) against the trainer's log-probs: mean |d| "
        f"{mm['logp_mismatch_mean']:.2e}, max {mm['logp_mismatch_max']:.2e}, KL "
        f"{mm['logp_mismatch_kl']:.2e} per token, over {mm['tokens']} tokens"
    )


def _fits(micro_batch_size: int) -> str:
    if micro_batch_size == 0:
        return "no micro-batch size fits"
    return f"--micro-batch-size {micro_batch_size} fits"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def main(argv: list[str]) -> int:
    from grouprl.config.parsing import parse_train_args
    from grouprl.workflows.check import check

    console = Console(stderr=True)
    options, train_argv = split_args(argv)
    report = check(parse_train_args(train_argv), options, console=console)
    if options.json:
        print(json.dumps(report.to_json(), default=str))
    else:
        print_report(report, Console(soft_wrap=True))
    if options.output is not None:
        options.output.write_text(json.dumps(report.to_json(), indent=1, default=str) + "\n")
    return 1 if report.would_not_learn else 0
