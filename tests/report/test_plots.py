"""Plots of one run: an overview page and a figure per quantity, each readable on its axis."""

from synthetic_runs import make_run, ramp

from grouprl.report.plots import PANELS, _draw, plot_run, pyplot
from grouprl.report.runs import load_run


def test_every_quantity_gets_a_figure_and_the_overview_shows_them(tmp_path):
    run = make_run(tmp_path / "r", kl=lambda s: 2e-6)
    written = plot_run(run)
    assert written[0].name == "overview.png" and written[0].stat().st_size > 50_000
    names = {p.stem for p in written[1:]}
    # lr, the reward functions and tool use were not logged by this synthetic run
    assert names == {p.name for p in PANELS} - {"lr", "tools"}
    assert all(p.stat().st_size > 5_000 for p in written)


def test_kl_is_readable_beside_entropy_and_identical_rewards_are_not_drawn_twice(tmp_path):
    run = load_run(
        make_run(
            tmp_path / "r",
            approx_kl=lambda s: 1e-6 * s,  # what an on-policy run logs: invisible beside 0.17
            entropy=lambda s: 0.17,
            reward_correct=ramp(0.3, 0.7),  # the same curve as reward_mean
            reward_format=lambda s: 0.99,
        )
    )
    plt = pyplot()
    panels = {p.name: p for p in PANELS}
    fig, (kl, reward) = plt.subplots(1, 2)
    assert _draw(kl, run, panels["kl"]) and kl.get_yscale() == "log"
    low, high = kl.get_ylim()
    assert low <= 1e-6 and 6e-5 <= high < 1e-3  # the axis spans the KL values, not entropy
    assert _draw(reward, run, panels["reward"])
    assert [line.get_label() for line in reward.get_lines()] == ["total (weighted)", "format"]
    plt.close(fig)
