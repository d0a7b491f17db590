"""compare's report from run directories: the verdict's rules, labels, and the ratio bins.

Tolerances: the synthetic runs give exact decimal inputs; means, ranges and percentiles of a
few of them are off by a rounding or two of float64, so pytest.approx's default (1e-6
relative) is far above the error and far below a wrong rule (the values differ by >= 0.01)."""

import json

import pytest
from synthetic_runs import make_run

from grouprl.report.compare import MIN_BIN, compare_runs, ratio_bins
from grouprl.report.runs import load_run


def _runs(tmp_path, finals, steps=60, **config):
    """{(algo, seed): final held-out pass@1} -> loaded runs (evaluated at 0, 30 and `steps`)."""
    runs = []
    for (algo, seed), final in finals.items():
        evals = {0: 0.3, 30: (0.3 + final) / 2, steps: final} if final is not None else {0: 0.3}
        path = make_run(tmp_path / f"{algo}-s{seed}", config={"algo": algo, "seed": seed,
                        **config.get(algo, {})}, evals=evals)  # fmt: skip
        runs.append(load_run(path))
    return runs


@pytest.mark.numerics
def test_a_winner_only_when_the_gap_exceeds_the_seeds_spread(tmp_path):
    separated = compare_runs(_runs(tmp_path / "a", {("grpo", 0): 0.60, ("grpo", 1): 0.62,
                                                    ("gspo", 0): 0.70, ("gspo", 1): 0.71}))  # fmt: skip
    assert separated.winner == "gspo" and separated.at_step == 60
    gspo = next(a for a in separated.algos if a.label == "gspo")
    assert gspo.pass_at_1_mean == pytest.approx(0.705) and gspo.spread == pytest.approx(0.01)
    assert "gap of 0.095, larger than the spread across seeds (0.020)" in separated.verdict

    within = compare_runs(_runs(tmp_path / "b", {("grpo", 0): 0.60, ("grpo", 1): 0.64,
                                                 ("gspo", 0): 0.62, ("gspo", 1): 0.66}))  # fmt: skip
    assert within.winner is None and "do not separate gspo and grpo" in within.verdict

    one_seed = compare_runs(_runs(tmp_path / "c", {("grpo", 0): 0.3, ("gspo", 0): 0.9}))
    assert one_seed.winner is None and "fewer than two evaluated seeds" in one_seed.verdict


@pytest.mark.numerics
def test_a_run_without_evaluations_or_unfinished_does_not_decide(tmp_path):
    # grpo's second seed died before its first evaluation: one evaluated seed, no spread
    runs = _runs(tmp_path / "a", {("grpo", 0): 0.60, ("grpo", 1): None, ("gspo", 0): 0.70,
                                  ("gspo", 1): 0.71})  # fmt: skip
    result = compare_runs(runs)
    assert result.winner is None and "fewer than two evaluated seeds" in result.verdict
    grpo = next(a for a in result.algos if a.label == "grpo")
    assert grpo.spread is None and grpo.pass_at_1_mean == pytest.approx(0.60)

    # one gspo run is still going (evaluated up to step 30): everyone is compared at step 30
    runs = _runs(tmp_path / "b", {("grpo", 0): 0.60, ("grpo", 1): 0.62, ("gspo", 0): 0.70})
    runs += _runs(tmp_path / "b2", {("gspo", 1): 0.71}, steps=30)
    result = compare_runs(runs)
    assert result.at_step == 30 and "compared at step 30" in result.verdict
    gspo = next(a for a in result.algos if a.label == "gspo")
    assert [n.final_step for n in gspo.runs] == [30, 30]
    assert gspo.pass_at_1_mean == pytest.approx(((0.3 + 0.70) / 2 + 0.71) / 2)


def test_runs_that_differ_in_more_than_the_algorithm_are_not_pooled(tmp_path):
    runs = _runs(tmp_path, {("gspo", 0): 0.6, ("gspo", 1): 0.7})
    runs += _runs(tmp_path / "hi", {("gspo", 0): 0.8}, gspo={"lr": 1e-4})
    labels = {a.label for a in compare_runs(runs).algos}
    assert labels == {"gspo lr=None", "gspo lr=0.0001"}


@pytest.mark.numerics
def test_where_a_run_logged_to_is_no_difference(tmp_path):
    """A run resumed with other trackers (report_to), or named or logged otherwise, is the same
    experiment: its seeds pool."""
    runs = _runs(tmp_path, {("grpo", 0): 0.6}, grpo={"report_to": ["tensorboard"]})
    runs += _runs(tmp_path / "b", {("grpo", 1): 0.7}, grpo={"report_to": [], "run_name": "x"})
    assert [(a.label, len(a.runs)) for a in compare_runs(runs).algos] == [("grpo", 2)]


@pytest.mark.numerics
def test_ratio_bins_hold_equal_counts_and_the_percentiles(tmp_path):
    run = make_run(tmp_path / "r")
    short = [(10, 0.01 * (i + 1)) for i in range(MIN_BIN)]  # |log ratio| 0.01 ... 0.20
    long_ = [(40, -0.04 * (i + 1)) for i in range(MIN_BIN)]  # 0.04 ... 0.80
    with (run / "ratios.jsonl").open("w") as f:
        for step, chunk in ((5, short), (10, long_)):
            f.write(json.dumps({"step": step, "lengths": [n for n, _ in chunk],
                                "log_ratio_sum": [v for _, v in chunk]}) + "\n")  # fmt: skip
    result = compare_runs([load_run(run), load_run(make_run(tmp_path / "other",
                                                             config={"algo": "gspo"}))])  # fmt: skip
    (grpo,) = [a for a in result.algos if a.label == "grpo"]
    first, second = grpo.ratio_bins
    assert (first["length_from"], first["length_to"], first["completions"]) == (10, 39, MIN_BIN)
    assert (second["length_from"], second["length_to"]) == (40, 40)
    assert first["token_product"] == pytest.approx(0.19)  # 90th percentile of 0.01 ... 0.20
    assert first["sequence"] == pytest.approx(0.019)
    assert second["token_product"] == pytest.approx(0.76) and second["sequence"] == pytest.approx(
        0.019
    )
    assert ratio_bins([load_run(run)], [10, 41])[0]["completions"] == 2 * MIN_BIN
