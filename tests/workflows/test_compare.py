"""`grouprl compare`: two algorithms x two seeds on the bundled task, interrupted and continued;
the report's numbers are the runs' own; `--from` rebuilds the same report.

Tolerances: the report's numbers are means and ranges of a few float64 values read from the
runs' logs, recomputed here the same way: equal up to one or two roundings (1e-12 absolute on
values <= 1; pytest.approx's 1e-6 relative for seconds)."""

import json
import signal
import statistics

import pytest
import yaml

from grouprl.cli import main
from grouprl.report.runs import finished_at, read_jsonl

TINY = [
    "--steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--eval-size", "4",
    "--eval-samples", "1", "--eval-every", "2", "--save-every", "1", "--no-progress",
    "--threads", "1", "--log-ratios", "4", "--log-ratios-every", "1",
]  # fmt: skip


@pytest.mark.numerics
def test_compare_runs_continues_and_reports_the_runs_own_numbers(tmp_path, stop_at, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--algos", "grpo,gspo", "--seeds", "2", "--output-dir", str(out), *TINY]
    stop_at(1, signal.SIGINT)  # the first run stops after its step 2, with a checkpoint
    assert main(argv) == 130
    assert finished_at(out / "grpo-s0") is None and not (out / "gspo-s0").exists()
    stop_at(None)
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "grpo, seed 0 -> " in printed and "(continuing)" in printed
    runs = {name: out / name for name in ("grpo-s0", "gspo-s0", "grpo-s1", "gspo-s1")}
    for name, run in runs.items():
        assert finished_at(run) == 3, name
        assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
        assert [r["step"] for r in read_jsonl(run / "ratios.jsonl")] == [1, 2, 3]  # no repeats
    assert yaml.safe_load((out / "gspo-s1" / "config.yaml").read_text())["seed"] == 1

    report = json.loads((out / "report.json").read_text())
    by_label = {a["label"]: a for a in report["algos"]}
    assert set(by_label) == {"grpo", "gspo"}
    for algo, numbers in by_label.items():
        finals, seconds = [], []
        for seed in (0, 1):
            run = runs[f"{algo}-s{seed}"]
            evals = read_jsonl(run / "eval.jsonl")
            assert evals[-1]["step"] == 3
            finals.append(evals[-1]["pass_at_1"])
            seconds.append(sum(r["step_seconds"] for r in read_jsonl(run / "metrics.jsonl")))
        assert numbers["pass_at_1_mean"] == pytest.approx(statistics.fmean(finals), abs=1e-12)
        assert numbers["spread"] == pytest.approx(max(finals) - min(finals), abs=1e-12)
        assert numbers["train_seconds_mean"] == pytest.approx(statistics.fmean(seconds))
        assert [r["seed"] for r in numbers["runs"]] == [0, 1]
        assert numbers["ratio_bins"], algo  # from ratios.jsonl
    text = (out / "report.md").read_text()
    assert f"{by_label['grpo']['pass_at_1_mean']:.3f}" in text
    assert "## Verdict" in text and report["verdict"] in text
    for figure in ("learning", "clip", "dynamics", "ratios"):
        assert (out / "figures" / f"{figure}.png").stat().st_size > 5000, figure

    again = tmp_path / "from"
    assert main(["compare", "--from", *map(str, runs.values()), "--output-dir", str(again)]) == 0
    rebuilt = json.loads((again / "report.json").read_text())
    assert rebuilt == report


def test_compare_refuses_what_it_cannot_do(tmp_path, capsys, stop_at):
    out = tmp_path / "cmp"
    assert main(["compare", "--output-dir", str(out), "--prompts-per-step", "2"]) == 2
    assert "minibatches (4) must divide prompts_per_step (2)" in capsys.readouterr().err
    assert not out.exists()  # checked before anything runs
    assert main(["compare", "--algos", "grpo", "--output-dir", str(out)]) == 2
    assert "two or more" in capsys.readouterr().err
    assert main(["compare", "--algos", "grpo,gspo", "--algo", "dapo"]) == 2
    assert "--algo is set by compare" in capsys.readouterr().err
    assert main(["compare", "--from", str(tmp_path), "--lr", "1e-4"]) == 2
    assert "--from builds the report" in capsys.readouterr().err
    # an algorithm-defining flag warns that it overrides every preset
    stop_at(0)  # (and the first run stops at once: what matters is what compare printed)
    assert main(["compare", "--output-dir", str(out), "--clip-high", "0.3", *TINY]) == 130
    assert "--clip-high (from the flags or --config) set an algorithm-defining field" in (
        capsys.readouterr().err
    )
    assert main(["compare", "--algos", "grpo,dapo", "--output-dir", str(out), *TINY]) == 2
    assert "holds another comparison" in capsys.readouterr().err
    # a config saved by an earlier run sets every preset field: all "algorithms" would be one
    saved = tmp_path / "run.yaml"
    saved.write_text("algo: gspo\nratio_level: sequence\nclip_low: 0.0003\nclip_high: 0.0004\n"
                     "loss_agg: seq_mean_token_mean\nadv_scale: group\nbeta: 0.0\n"
                     "minibatches: 1\ndynamic_sampling: false\nmask_truncated: false\n"
                     "overlong_penalty: false\n")  # fmt: skip
    assert main(["compare", "--output-dir", str(tmp_path / "c"), "--config", str(saved)]) == 2
    assert "every preset would train the same run" in capsys.readouterr().err
    # a mistake found only as the first run starts (a missing model) leaves no run behind, so
    # the corrected command may use the same directory
    fresh = tmp_path / "typo"
    assert main(["compare", "--output-dir", str(fresh), "--model", str(tmp_path / "nope"),
                 *TINY]) == 2  # fmt: skip
    assert (fresh / "compare.yaml").is_file() and "nope" in capsys.readouterr().err
    assert main(["compare", "--output-dir", str(fresh), *TINY]) == 130  # stop_at(0) still armed
    assert "holds another comparison" not in capsys.readouterr().err
