"""reasoning-gym's generators as tasks: rows from the run's seed, held-out rows disjoint and the
same for every run, the generator's own scorer run in the sandbox, the config's mistakes in one
line, and a few steps through `grouprl train` and the Python API."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym", reason="pip install -e '.[reasoning-gym]' (make test does)")

import reasoning_gym

import grouprl
from grouprl import sandbox
from grouprl.cli import main
from grouprl.errors import UserError
from grouprl.sandbox.run import Limits, Packages, run_each
from grouprl.tasks import get_task
from grouprl.tasks.ecosystems.reasoning_gym import HELDOUT_ROWS

CONFIG = {"min_terms": "2", "max_terms": "2", "min_digits": "1", "max_digits": "2",
          "allow_negation": "false"}  # fmt: skip
needs_sandbox = pytest.mark.skipif(sandbox.available() is not None,
                                   reason=f"no sandbox here: {sandbox.available()}")  # fmt: skip


def task(seed=0, **config):
    return get_task("reasoning_gym:chain_sum", config={**CONFIG, **config}, seed=seed)


def test_rows_come_from_the_seed_and_never_repeat_a_held_out_problem():
    a, b, again = task(0), task(1), task(0)
    first = [r["entry"]["question"] for r in a.train[:200]]
    assert first == [r["entry"]["question"] for r in again.train[:200]]
    assert first != [r["entry"]["question"] for r in b.train[:200]]
    assert a.heldout == b.heldout and len(a.heldout) == HELDOUT_ROWS  # every run, one held-out
    assert len({r["entry"]["question"] for r in a.heldout}) == HELDOUT_ROWS  # distinct
    held = {r["entry"]["question"] for r in a.heldout}
    assert not held & set(first) and not held & {r["entry"]["question"] for r in a.train[:3000]}
    # the generator's own rows: index i of the seed's generator unless it is a held-out question
    theirs = reasoning_gym.create_dataset("chain_sum", seed=0, size=10, min_terms=2, max_terms=2,
                                          min_digits=1, max_digits=2, allow_negation=False)  # fmt: skip
    same = [i for i in range(10) if theirs[i]["question"] not in held]
    assert all(a.train[i]["entry"]["question"] == theirs[i]["question"] for i in same)
    row = a.train[0]
    assert row["prompt"][0]["role"] == "system" and row["prompt"][1]["content"] == row["entry"][
        "question"]  # fmt: skip
    assert row["answer"] == row["entry"]["answer"]


def test_a_small_problem_space_holds_out_a_fifth():
    """One-digit sums: about a hundred problems; a fifth is held out, the rest trained on."""
    t = get_task("reasoning_gym:chain_sum", config={**CONFIG, "max_digits": "1"})
    held = {r["entry"]["question"] for r in t.heldout}
    seen = {r["entry"]["question"] for r in t.train[:2000]}
    assert 10 <= len(held) <= 40 and not held & seen and len(seen) >= 2 * len(held)


def test_config_mistakes_are_one_line():
    with pytest.raises(UserError, match="no task 'chain_summ'; did you mean chain_sum"):
        get_task("reasoning_gym:chain_summ")
    with pytest.raises(UserError, match="its keywords: min_terms, max_terms"):
        get_task("reasoning_gym:chain_sum", config={"max_term": "3"})
    with pytest.raises(UserError, match="--task-config seed: the run sets it"):
        get_task("reasoning_gym:chain_sum", config={"seed": "3"})
    with pytest.raises(UserError, match="widen it"):  # every problem held out: none to train on
        get_task("reasoning_gym:count_bits", config={"min_n": "2", "max_n": "2"}).train[0]


@needs_sandbox
def test_the_generators_scorer_scores_in_the_sandbox():
    t = task()
    correct = t.reward_funcs["correct"]
    row = t.heldout[0]
    answer = row["answer"]
    replies = [f"Thinking... <answer>{answer}</answer>", f"<answer>{int(answer) + 1}</answer>",
               answer, f"It is {answer}.", "", [{"role": "assistant", "content": answer}]]  # fmt: skip
    scores = correct(replies, entry=[row["entry"]] * len(replies))
    assert scores == [1.0, 0.0, 1.0, pytest.approx(len(answer) / len(f"It is {answer}.")), 0.0, 1.0]
    assert t.reward_funcs["answer_tag"](replies) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


@needs_sandbox
def test_a_scorers_evaluation_stays_in_its_own_worker(tmp_path):
    """What an evaluated answer could do, it does in the sandbox: the host's files are out of
    reach, the trainer's packages are not there (only reasoning-gym's), and the next answer's
    worker starts clean."""
    packages = Packages(("reasoning-gym",), ("reasoning_gym",))
    target = tmp_path / "written"
    program = f"""
import sys
what = sys.stdin.read()
if what == "write":
    open({str(target)!r}, "w").write("x")
elif what == "torch":
    import torch
elif what == "taint":
    import reasoning_gym
    reasoning_gym.tainted = True
    print("tainted")
else:
    import reasoning_gym
    print(getattr(reasoning_gym, "tainted", False), "sympy" in sys.modules)
"""
    ran = run_each(program, ["write", "torch", "taint", "look"], Limits(memory_mb=4096), packages)
    assert not target.exists() and ran[0].kind == "error"
    assert ran[1].kind == "error"  # no torch inside: only the named distributions
    assert ran[2].stdout == "tainted\n" and ran[3].stdout == "False True\n"  # preloaded, clean


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from grouprl.models.tiny import save_tiny_chat_model

    path = tmp_path_factory.mktemp("chat")
    save_tiny_chat_model(path)
    return path


@needs_sandbox
def test_a_few_steps_through_the_command_line_and_the_python_api(chat_model, tmp_path):
    flags = ["--task", "reasoning_gym:chain_sum", "--task-config", *sum(CONFIG.items(), ()),
             "--model", str(chat_model), "--steps", "2", "--prompts-per-step", "2",
             "--group-size", "2", "--max-new-tokens", "8", "--eval-size", "4", "--eval-every",
             "0", "--algo", "grpo", "--no-progress", "--threads", "1"]  # fmt: skip
    assert main(["train", *flags, "--output-dir", str(tmp_path / "cli")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").open()]
    assert len(rows) == 2 and {"reward_correct", "reward_answer_tag"} <= set(rows[0])
    result = grouprl.Trainer(model=str(chat_model), task="reasoning_gym:chain_sum",
                             task_config=CONFIG, steps=2, prompts_per_step=2, group_size=2,
                             max_new_tokens=8, eval_size=4, eval_every=0, progress=False, algo="grpo",
                             threads=1, output_dir=tmp_path / "api").train()  # fmt: skip
    assert result.steps_done == 2
    cli = [json.loads(line) for line in (tmp_path / "cli" / "samples.jsonl").open()]
    api = [json.loads(line) for line in (tmp_path / "api" / "samples.jsonl").open()]
    assert [s["completion"] for s in cli] == [s["completion"] for s in api]  # the same run


def test_task_config_needs_a_generator(chat_model, capsys):
    assert main(["train", "--task-config", "min_terms", "2", "--steps", "1"]) == 2
    assert "--task-config configures a --task reasoning_gym:NAME" in capsys.readouterr().err
    assert main(["train", "--task", "reasoning_gym:chain_sum", "--steps", "1"]) == 2
    assert "needs --model" in capsys.readouterr().err
