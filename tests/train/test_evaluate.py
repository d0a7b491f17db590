"""pass@k estimator, evaluation bookkeeping, and `grouprl eval` end to end.

Tolerances: pass@k is a product of <= 20 float64 factors against the exact binomial ratio
(Python integers): <= 20 roundings of ~1.1e-16, so 1e-12; shares of counts are exact fractions
computed by one division (pytest.approx's default 1e-6 relative is far above one rounding)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from grouprl.cli.eval import main
from grouprl.config import EvalConfig
from grouprl.errors import UserError
from grouprl.models import build_char_tokenizer
from grouprl.models.tiny import TinySize, build_tiny_llama
from grouprl.tasks import get_task
from grouprl.train.evaluate import EvalSettings, evaluate, pass_at_k


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (8, 0, 8, 0.0),
        (8, 1, 8, 1.0),
        (8, 8, 1, 1.0),
        (10, 3, 1, 0.3),
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (8, 2, 4, 1 - 15 / 70),  # 1 - C(6,4)/C(8,4)
        (100, 1, 10, 0.1),
        (4, 1, 4, 1.0),
    ],
)
def test_pass_at_k_matches_the_binomial_formula(n, c, k, expected) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_pass_at_k_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    return build_tiny_llama(tokenizer, TinySize(32, 1, 2, 64, 64)), tokenizer


def _rows(n: int) -> list[dict]:
    return list(get_task("arithmetic").heldout[:n])


@pytest.mark.numerics
def test_bookkeeping_with_a_scripted_reward(tiny) -> None:
    model, tokenizer = tiny
    rows = _rows(6)
    calls = []

    def every_other(completions, prompts, answer, **_):
        calls.append((len(completions), list(prompts), list(answer)))
        return [1.0 if i % 2 == 0 else 0.0 for i in range(len(completions))]

    model.train()
    result = evaluate(
        model,
        tokenizer,
        rows,
        EvalSettings(5, samples=4, batch_prompts=4),
        reward_fn=every_other,
        progress=False,
    )
    assert model.training  # mode restored
    # batches of 4 and 2 prompts, 4 samples each, then the greedy pass of each batch
    assert [c[0] for c in calls] == [16, 4, 8, 2]
    assert calls[0][1][:5] == [rows[0]["prompt"]] * 4 + [rows[1]["prompt"]]
    assert calls[0][2][:5] == [rows[0]["answer"]] * 4 + [rows[1]["answer"]]
    assert result.n == 6 and result.samples == 4
    assert result.pass_at_1 == 0.5 and result.pass_at_k == 1.0
    # greedy: one completion per prompt, rows 0 and 2 of the first batch, row 0 of the second
    assert result.greedy_pass_at_1 == pytest.approx(3 / 6)
    assert 1.0 <= result.mean_length <= 5.0


def test_none_and_partial_rewards_count_as_unsolved(tiny) -> None:
    model, tokenizer = tiny
    result = evaluate(
        model,
        tokenizer,
        _rows(3),
        EvalSettings(3, samples=4, greedy=False),
        reward_fn=lambda completions, **_: [None, 0.99, 1.0, 2.0] * (len(completions) // 4),
        progress=False,
    )
    assert result.pass_at_1 == 0.5 and result.pass_at_k == 1.0
    assert result.greedy_pass_at_1 is None


def test_same_seed_same_numbers(tiny) -> None:
    model, tokenizer = tiny
    task = get_task("arithmetic")

    def run(seed: int):
        return evaluate(
            model,
            tokenizer,
            _rows(8),
            EvalSettings(8, samples=3, seed=seed),
            reward_fn=task.reward_funcs["format"],
            progress=False,
        )

    assert run(0) == run(0)


def test_eval_cli_prints_json(capsys) -> None:
    assert main(EvalConfig(limit=4, samples=2, json=True, threads=1)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n"] == 4 and out["k"] == 2 and out["split"] == "heldout"
    assert 0.0 <= out["pass_at_1"] <= out["pass_at_k"] <= 1.0
    assert out["greedy_pass_at_1"] is not None


def test_eval_cli_prints_a_table(capsys) -> None:
    assert main(EvalConfig(limit=2, samples=2, split="train", greedy=False, threads=1)) == 0
    out = capsys.readouterr().out
    assert "pass@1" in out and "pass@2" in out and "greedy" not in out


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (EvalConfig(task="nope"), "unknown task"),
        (EvalConfig(model="/no/such/model"), "not a local directory"),
        (EvalConfig(limit=0), "--limit"),
        (EvalConfig(samples=0, limit=1), "samples"),
        (EvalConfig(temperature=0.0, limit=1), "temperature"),
    ],
)
def test_eval_user_errors(cfg: EvalConfig, match: str) -> None:
    with pytest.raises(UserError, match=match):
        main(cfg)


def test_a_broken_reward_function_is_a_user_error(tiny) -> None:
    model, tokenizer = tiny

    def broken(completions, **_):
        raise ZeroDivisionError("oops")

    with pytest.raises(UserError, match="'broken' raised ZeroDivisionError: oops"):
        evaluate(model, tokenizer, _rows(2), EvalSettings(3, samples=2), reward_fn=broken)
