"""The code task (`--task code`): held-out functions never trained on, completions judged only by
running them in the sandbox (any expression that computes the function passes; nothing the
model writes runs here), the `python` tool, and a few steps of `grouprl train` on the bundled
policy."""

from __future__ import annotations

import json
import random

import pytest

from grouprl import sandbox
from grouprl.cli import main
from grouprl.messages import ToolRequest
from grouprl.tasks import get_task
from grouprl.tasks.builtin.code import BUILTIN_TOOLS, Function, noisy_solution, python_tool
from grouprl.tasks.tools.calls import TagTools, load_tools

pytestmark = pytest.mark.skipif(sandbox.available() is not None,
                                reason=f"no sandbox here: {sandbox.available()}")  # fmt: skip


@pytest.fixture(scope="module")
def task():
    return get_task("code")


def test_held_out_problems_are_never_trained_on(task):
    """A held-out problem shows a function on three inputs no training row shows it on: the
    prompts are disjoint, while the functions are shared (finding which one is the skill)."""
    train = {r["prompt"] for r in task.train[: 2 * len(task.train.problems)]}
    held = {r["prompt"] for r in task.heldout[: len(task.heldout.problems)]}
    assert len(held) == len(task.heldout.problems) and not held & train
    assert {r["answer"] for r in task.heldout[:300]} <= {r["answer"] for r in task.train[:5000]}
    assert task.train[7] == get_task("code").train[7]  # rows are a function of the seed
    for row in task.train[:50]:  # the prompt shows three of the function's own pairs
        f = Function(row["shape"], *_constants(row))
        pairs = [p.removeprefix("f(").split(")=") for p in row["prompt"][:-6].split(",")]
        assert len(pairs) == 3 and all(f(int(x)) == int(y) for x, y in pairs)


def test_completions_are_judged_by_running_them(task, tmp_path):
    row = task.heldout[0]
    correct, shown = task.reward_funcs["correct"], task.reward_funcs["shown"]
    f = Function(row["shape"], *_constants(row))
    equivalent = f"({row['answer']})+0"
    wrong = f"{row['answer']}+1"
    target = tmp_path / "written"
    hostile = f"open({str(target)!r}, 'w').write('x')"
    replies = [row["answer"], equivalent, wrong, "x\nx", hostile, ""]
    checks = [row["checks"]] * len(replies)
    assert correct(replies, checks=checks) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert shown([row["answer"], wrong], checks=checks[:2]) == [1.0, 0.0]
    assert not target.exists() and f.body == row["answer"]


def _constants(row):
    from grouprl.tasks.builtin.code import SHAPES

    template = SHAPES[row["shape"]][0]
    for a in SHAPES[row["shape"]][1]:
        for b in SHAPES[row["shape"]][2]:
            if template.format(a=a, b=b) == row["answer"]:
                return a, b
    raise AssertionError(row)


def test_noisy_solutions_are_wrong_at_their_rate(task):
    rng, rows = random.Random(0), task.train[:400]
    wrong = sum(noisy_solution(r, rng, 0.3) != r["solution"] for r in rows) / len(rows)
    assert 0.2 < wrong < 0.35 and all(noisy_solution(r, rng, 0.0) == r["solution"] for r in rows)


def test_the_python_tool_runs_in_the_sandbox():
    assert python_tool("print(6 * 7)") == "42"
    assert python_tool("import socket\nsocket.create_connection(('1.1.1.1', 80), 2)").startswith(
        "error:")  # fmt: skip
    from grouprl.models import load_tokenizer

    tok = load_tokenizer("builtin:code")
    handler = TagTools(load_tools(["python"], BUILTIN_TOOLS), tok, max_calls=2)
    (answer,) = handler.respond([ToolRequest(0, "<python>print(2+3)</python>", 0)])
    assert tok.decode(answer.ids) == "5" and answer.calls == 1 and not answer.failures


def test_a_few_steps_of_training_on_the_bundled_policy(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--task", "code", "--steps", "3", "--prompts-per-step", "4",
                 "--eval-size", "8", "--eval-every", "0", "--no-progress", "--threads", "1",
                 "--output-dir", str(out)]) == 0  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert len(rows) == 3 and {"reward_correct", "reward_shown"} <= set(rows[0])


def test_the_bundled_policy_is_small_and_its_figures_hold():
    """builtin:code as its README documents it: 1.06M parameters in under 5 MB, and held-out
    pass@1 inside the design band (0.2, 0.6) with room above (greedy and pass@8 higher): the
    documented evaluation re-measured (200 problems x 8 samples, the sandbox judging), each
    figure within 4 standard deviations of a fresh measurement, √(p(1 − p)/n) at the
    documented p (n = 1600 completions for pass@1, 200 problems for pass@8 and greedy)."""
    from grouprl.models import load_model, load_tokenizer, resolve_model_path
    from grouprl.train.evaluate import EvalSettings, evaluate

    path = resolve_model_path("builtin:code")
    assert sum(p.stat().st_size for p in path.iterdir()) <= 5 * 2**20
    metrics = json.loads((path / "metrics.json").read_text())
    setting, documented = metrics["eval"], metrics["heldout"]
    task = get_task("code")
    result = evaluate(load_model("builtin:code"), load_tokenizer("builtin:code"), list(task.heldout[: setting["limit"]]), EvalSettings(task.max_new_tokens, samples=setting["samples"], temperature=setting["temperature"], seed=setting["seed"]), reward_fn=task.reward_funcs["correct"], progress=False)  # fmt: skip
    n = setting["limit"]
    for got, key, count in ((result.pass_at_1, "pass_at_1", n * setting["samples"]),
                            (result.pass_at_k, "pass_at_8", n),
                            (result.greedy_pass_at_1, "greedy_pass_at_1", n)):  # fmt: skip
        p = documented[key]
        assert abs(got - p) <= 4 * (p * (1 - p) / count) ** 0.5, (key, got, p)
    assert 0.2 <= result.pass_at_1 <= 0.6 < result.greedy_pass_at_1 < result.pass_at_k
