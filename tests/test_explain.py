"""`grouprl explain`: the seeds' three worked examples, with the numbers computed by grouprl.core.

Tolerances: float64 on O(1) values, a few operations each: 1e-12 (a 2000-token sum of 0.1
per token: 2000 · 1.1e-16 · 200 ≈ 4e-11, so 1e-9); pytest.approx's default (1e-6 relative)
where a value is a product of two given numbers."""

import json
import math

import pytest

from grouprl.cli.explain import show as run
from grouprl.explain import worked_examples


@pytest.fixture(scope="module")
def data() -> dict:
    return worked_examples()


def test_advantages_example(data):
    groups = {tuple(g["rewards"]): g for g in data["advantages"]["groups"]}
    balanced = groups[(1.0, 0.0, 1.0, 0.0)]
    assert balanced["advantages"] == [1.0, -1.0, 1.0, -1.0]
    assert (balanced["mean"], balanced["std"]) == (0.5, 0.5)
    assert groups[(1.0, 1.0, 1.0, 1.0)]["advantages"] == [0.0] * 4
    assert groups[(0.0, 0.0, 0.0, 0.0)]["advantages"] == [0.0] * 4


@pytest.mark.numerics
def test_sequence_ratio_example(data):
    short, long = data["sequence_ratio"]["completions"]
    assert (short["tokens"], long["tokens"]) == (5, 2000)
    for c in (short, long):
        assert c["sequence_ratio"] == pytest.approx(math.exp(0.1), abs=1e-12)
        assert round(c["sequence_ratio"], 3) == 1.105
    assert long["token_log_ratio_sum"] == pytest.approx(200.0, abs=1e-9)
    assert long["token_ratio_product"] == "e^200 ≈ 7.2e86"
    assert short["token_ratio_product"] == "1.65"


@pytest.mark.numerics
def test_clipping_example(data):
    clip = data["clipping"]
    assert clip["token_ratios"] == pytest.approx([2.0, 0.5], abs=1e-12)
    assert clip["clipped_token_ratios"] == pytest.approx([1.2, 0.8], abs=1e-12)
    assert clip["sequence_ratio"] == pytest.approx(1.0, abs=1e-12)
    assert clip["token_objective"]["A=+1"] == pytest.approx([1.2, 0.5])
    assert clip["token_objective"]["A=-1"] == pytest.approx([-2.0, -0.8])
    assert clip["token_clip_binds"] == {"A=+1": [True, False], "A=-1": [False, True]}
    assert clip["sequence_clip_binds"] == {"A=+1": [False], "A=-1": [False]}
    assert clip["sequence_objective"] == {
        "A=+1": pytest.approx([1.0]),
        "A=-1": pytest.approx([-1.0]),
    }
    assert clip["token_clip_frac"] == {
        "A=+1": {"low": 0.0, "high": 0.5},
        "A=-1": {"low": 0.5, "high": 0.0},
    }
    assert (
        clip["sequence_clip_frac"]["A=+1"]
        == clip["sequence_clip_frac"]["A=-1"]
        == {"low": 0.0, "high": 0.0}
    )


def test_route_example(data):
    """One token of 64 rerouted (p 0.5 -> 0.2: log-ratio ln 0.4), the other 63 at ×1.01
    (ln 1.01 each): the sequence's log-ratio is their mean, (ln 0.4 + 63 ln 1.01) / 64."""
    route = data["route"]
    assert route["rerouted_ratio"] == pytest.approx(0.4, rel=1e-12)
    assert route["other_log_ratio"] == pytest.approx(math.log(1.01), rel=1e-12)
    want = (math.log(0.4) + 63 * math.log(1.01)) / 64
    assert route["sequence_log_ratio"] == pytest.approx(want, rel=1e-12)
    assert route["sequence_without_reroute"] == pytest.approx(1.01, rel=1e-12)
    assert abs(route["sequence_log_ratio"] - math.log(1.01)) == pytest.approx(
        (math.log(1.01) - math.log(0.4)) / 64, rel=1e-12)  # fmt: skip


def test_run_prints_seven_tables(capsys):
    assert run() == 0
    out = capsys.readouterr().out
    for text in (
        "1. Group-relative",
        "2. GSPO",
        "3. Where the clip binds",
        "4. The gradient each token keeps",
        "5. Example 1's group [1, 0, 0, 0], by estimator",
        "6. The entropy mechanism",
        "7. A changed route (mixture of experts)",
        "e^200 ≈ 7.2e86",
        "1.105",
    ):
        assert text in out
    assert "[1.000, -1.000, 1.000, -1.000]" in out and "[0.000, 0.000, 0.000, 0.000]" in out
    assert "\x1b[" not in out  # no colour codes when piped
    assert max(len(line.rstrip()) for line in out.splitlines()) <= 80


def test_run_json_prints_one_object_with_all_numbers(capsys, data):
    assert run(as_json=True) == 0
    assert json.loads(capsys.readouterr().out) == data


def test_objectives_example(data):
    """Token ratios 2.0 and 0.5; per unit of ∇log π: the clip keeps r·Â unless it binds (token 1
    at Â > 0, token 2 at Â < 0); CISPO keeps min(r, 5)·Â everywhere; SAPO keeps
    4σ(x)(1 − σ(x))·r·Â with x = τ(r − 1), τ = 1 for Â > 0 and 1.05 otherwise."""
    slopes = data["objectives"]["slopes"]
    assert slopes["clip"] == {"A=+1": [0.0, 0.5], "A=-1": [-2.0, 0.0]}
    assert slopes["cispo"] == {"A=+1": [2.0, 0.5], "A=-1": [-2.0, -0.5]}

    def gate(x):
        s = 1 / (1 + math.exp(-x))
        return 4 * s * (1 - s)

    expected = {"A=+1": [gate(1.0) * 2, gate(-0.5) * 0.5],
                "A=-1": [-gate(1.05) * 2, -gate(-0.525) * 0.5]}  # fmt: skip
    for sign, values in expected.items():  # a few float64 operations: 1e-14 is ample
        assert slopes["sapo"][sign] == pytest.approx(values, rel=1e-14)


def test_estimators_example(data):
    """The group [1, 0, 0, 0] with 4, 8, 8, 8 tokens in example 1's batch (7 of 16 completions
    rewarded): OPO's baseline 4/28 = 1/7; GPG's α = 16/7 times R − 1/4; Pass@k's margin 1 over
    the sample std 0.5; GRPO's (R − 1/4)/√(3/16)."""
    shown = {name: a[1] for name, a in data["estimators"]["advantages"].items()}
    approx = lambda xs: pytest.approx(xs, rel=1e-12, abs=1e-15)  # noqa: E731
    assert shown["opo"] == approx([6 / 7, -1 / 7, -1 / 7, -1 / 7])
    assert shown["gpg"] == approx([12 / 7, -4 / 7, -4 / 7, -4 / 7])
    assert shown["grpo_passk"] == approx([2.0, 0.0, 0.0, 0.0])
    assert shown["grpo"] == approx([3**0.5, -(3**-0.5), -(3**-0.5), -(3**-0.5)])
    assert data["objectives"]["slopes"]["gpg"] == {"A=+1": [1.0, 1.0], "A=-1": [-1.0, -1.0]}


def test_covariance_example(data):
    """Example 1's group [1, 0, 0, 0]: Â = (√3, −1/√3, −1/√3, −1/√3), mean 0; each completion's
    tokens have π 0.9 and 0.05, so log π − mean log π = ±d with d = (log 0.9 − log 0.05)/2 =
    log(18)/2. cov = Â·(±d): o1's confident token √3·d ≈ 2.50 lies in Clip-Cov's band (1, 5) and
    is KL-Cov's top token (the top 2e-4 of 8 tokens is at least one); o2-o4's unlikely tokens
    d/√3 ≈ 0.83 fall below the band; the other two are negative."""
    cov = data["covariance"]
    d = math.log(18) / 2
    approx = lambda xs: pytest.approx(xs, rel=1e-12, abs=1e-15)  # noqa: E731
    r3 = 3**0.5
    assert cov["covariance"] == [approx([r3 * d, -r3 * d])] + [approx([-d / r3, d / r3])] * 3
    assert round(r3 * d, 2) == 2.50 and round(d / r3, 2) == 0.83
    assert cov["clip_cov_candidates"] == [[True, False]] + [[False, False]] * 3
    assert cov["kl_cov_selected"] == [[True, False]] + [[False, False]] * 3
