"""Adding an advantage estimator is one function and one preset: registered that way, a new one
is among the command line's choices and in its --help, in the docs' algorithm table, and trains,
with no other edit (docs/contributing.md shows the same)."""

from __future__ import annotations

import json

import pytest
import torch

from grouprl.cli import main
from grouprl.config import PRESETS, Preset, parse_train_args, resolve
from grouprl.config.presets import algorithm_table
from grouprl.core import ADVANTAGE_ESTIMATORS, OBJECTIVES, group_advantages, register_estimator

CALLS: list[tuple[int, int]] = []


def halved(rewards: torch.Tensor, scale: str, eps: float) -> torch.Tensor:
    """GRPO's advantage at half strength (a dummy: what a user's estimator looks like)."""
    CALLS.append(tuple(rewards.shape))
    return group_advantages(rewards, scale=scale, eps=eps) / 2


@pytest.fixture
def registered(monkeypatch):
    """The dummy estimator and its preset, registered the documented way, then taken back."""
    monkeypatch.setitem(PRESETS, "halved", Preset("token", 0.2, 0.2, "seq_mean_token_mean",
                                                  "group", 0.0, minibatches=1,
                                                  adv_estimator="halved"))  # fmt: skip
    register_estimator("halved", halved, "GRPO's advantage, halved")
    yield
    del ADVANTAGE_ESTIMATORS["halved"]
    CALLS.clear()


def test_a_registered_estimator_is_a_choice_in_help_and_in_the_docs_table(registered, capsys,
                                                                            monkeypatch):  # fmt: skip
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "halved}" in text.split("--adv-estimator", 1)[1].splitlines()[0]  # in its choices
    assert ",halved" in text.split("--algo", 1)[1].splitlines()[0]
    cfg = resolve(parse_train_args(["--algo", "halved"]), task_max_new_tokens=8)
    assert (cfg.adv_estimator, cfg.adv_scale) == ("halved", "group")
    rows = [r for r in algorithm_table("gspo") if r.startswith("| `halved` |")]
    assert rows and "GRPO's advantage, halved, ÷ group std" in rows[0]


def test_a_registered_estimator_trains(registered, tmp_path):
    out = tmp_path / "run"
    flags = ["--algo", "halved", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
             "--eval-size", "2", "--eval-samples", "1", "--threads", "1", "--no-progress",
             "--report-to", "none", "--output-dir", str(out)]  # fmt: skip
    assert main(["train", *flags]) == 0
    assert CALLS == [(2, 2)]  # the whole batch's rewards (B, G), once
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["step"] == 1


def test_the_builtin_entries_name_their_functions_and_knobs():
    for entry in ADVANTAGE_ESTIMATORS.values():
        assert callable(entry.load()), entry.name
    for entry in OBJECTIVES.values():
        assert callable(entry.load_term()), entry.name
        assert entry.bound is None or callable(entry.load_bound()), entry.name
