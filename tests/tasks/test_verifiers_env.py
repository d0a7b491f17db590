"""verifiers 0.3 environments on grouprl's sampler (`--task verifiers:ENV`): the environment's own
loop, rubric and tools, with the model answered by grouprl's sampler through an in-process
client. The environments are the tests' own, written as the Hub's are
(tests/tasks/verifiers_envs/). Token exactness: with a scripted model, a tool-calling rollout's
ids are its sampled turns and the fed renderings of the environment's replies, turn by turn,
and they decode to the chat template's rendering of the conversation verifiers recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("verifiers", reason="pip install -e '.[verifiers]' (make test does)")

import grouprl
from grouprl.cli import main
from grouprl.errors import UserError
from grouprl.models.tiny import QWEN25_TOOLS, save_tiny_chat_model
from grouprl.rollout import sample_groups
from grouprl.rollout.sampling import encode_prompts
from grouprl.tasks import get_task
from grouprl.tasks.ecosystems.verifiers import _message_dict, verifiers_use
from scripted import Scripted

ENVS = Path(__file__).with_name("verifiers_envs")
LOOKUP, SUMS, REWRITES, STEPS = (f"verifiers:{ENVS / n}" for n in ("lookup.py", "sums.py",
                                                                   "rewrites.py", "steps.py"))  # fmt: skip


@pytest.fixture(autouse=True)
def verifiers_03(monkeypatch):
    """These tests run verifiers 0.3, this environment's own, whatever names a 0.4 Python."""
    monkeypatch.delenv("GROUPRL_VERIFIERS_PYTHON", raising=False)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny random chat model with a Qwen2.5-style tool template, and its tokenizer."""
    path = tmp_path_factory.mktemp("vf_chat")
    _, tokenizer = save_tiny_chat_model(path, template=QWEN25_TOOLS)
    return path, tokenizer


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _rollout(task_name, tokenizer, row, script_of, max_calls=4):
    """One group of 2 of `row`, sampled by a scripted model whose script `script_of(use)`
    returns as (ids, trained) pieces; the rollout, its results and the pieces."""
    task = get_task(task_name)
    end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    use = verifiers_use(task, tokenizer, end, max_calls=max_calls)
    start = use.rollout([task.train[row]], 2)
    (prompt,), _ = encode_prompts(tokenizer, start.prompts, tools=use.schemas)
    pieces = script_of(use)
    script = [i for ids, _ in pieces for i in ids]
    model = Scripted(tokenizer, ids={tuple(prompt): [*script, tokenizer.eos_token_id]})
    r = sample_groups(model, tokenizer, [prompt], group_size=2, max_new_tokens=len(script) + 4,
                      temperature=0.0, tools=start.handler)  # fmt: skip
    use.sampled(r, start.handler)
    return r, start.handler.environments, pieces, prompt


CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": 4}}\n</tool_call>'


def _call_then(tokenizer, last: str):
    """A script: the lookup call (key 4), the tool's answer 31 fed, then the turn `last`."""

    def script(use):
        turn = use.renderer.assistant(CALL)
        observation = use.renderer.tail(turn, [{"role": "tool", "tool_call_id": "any",
                                                "content": "31"}])  # fmt: skip
        return [(_ids(tokenizer, CALL + "<|im_end|>"), True), (observation, False),
                (_ids(tokenizer, last + "<|im_end|>"), True)]  # fmt: skip

    return script


@pytest.mark.usefixtures("scripted_cache")
def test_a_tool_rollout_trains_on_the_ids_sampled_and_fed_turn_by_turn(chat):
    _, tokenizer = chat
    answer = "The value is 31."
    script = _call_then(tokenizer, answer)
    r, results, pieces, prompt = _rollout(LOOKUP, tokenizer, 3, script)  # key 4: 4 * 7 + 3
    script_ids = [i for ids, _ in pieces for i in ids]
    n = len(script_ids)
    for row in (0, 1):
        assert r.completion_ids[row, :n].tolist() == script_ids and int(r.lengths[row]) == n
        assert r.loss_mask[row, :n].tolist() == [own for ids, own in pieces for _ in ids]
    assert [x.reward for x in results] == [1.0, 1.0]
    assert results[0].metrics["lookup_calls"] == 1.0 and results[0].metrics["num_turns"] == 2.0
    # what verifiers recorded is what the ids say: the template's rendering of its conversation
    state = results[0].state
    conversation = [_message_dict(m) for m in [*state["prompt"], *state["completion"]]]
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool", "assistant"]
    assert conversation[2]["content"] == "31" and conversation[3]["content"] == answer
    rendered = tokenizer.apply_chat_template(conversation, tools=get_task(LOOKUP).driver
                                             .tool_schemas(), tokenize=False)  # fmt: skip
    decoded = tokenizer.decode(prompt + r.completion_ids[0, :n].tolist())
    assert rendered.rstrip() == decoded.rstrip()


@pytest.mark.usefixtures("scripted_cache")
def test_rewarded_steps_are_rewards_per_turn(chat):
    """Steps verifiers rewarded (a trajectory step's `reward`) are the turns' rewards; what the
    rubric gives beyond them lands on the last turn (their sum is the rubric's reward)."""
    _, tokenizer = chat
    r, results, _, _ = _rollout(STEPS, tokenizer, 3, _call_then(tokenizer, "The value is 31."))
    assert [x.reward for x in results] == [[0.5, 1.0], [0.5, 1.0]]  # the call's, the answer's
    assert [len(s) for s in r.turns.starts] == [2, 2]

    # a call each turn, with --max-turns 1: the second is the row's last, and the environment's
    # request after it is refused, not answered by that turn again: its steps are the row's two
    r, results, _, _ = _rollout(STEPS, tokenizer, 3, _call_then(tokenizer, CALL), max_calls=1)
    assert [len(s) for s in r.turns.starts] == [2, 2] and bool(r.turns.ended_by_turns.all())
    assert [x.reward for x in results] == [[0.5, 0.5], [0.5, 0.5]]


@pytest.mark.usefixtures("scripted_cache")
def test_a_single_turn_rollout_is_scored_by_its_rubric(chat):
    _, tokenizer = chat
    task = get_task(SUMS)
    right = task.train[0]["answer"]

    def script(use):
        return [(_ids(tokenizer, f"<answer>{right}</answer><|im_end|>"), True)]

    _, results, _, _ = _rollout(SUMS, tokenizer, 0, script)
    assert [x.reward for x in results] == [pytest.approx(1.2)] * 2  # correct 1 + format 0.2
    assert results[0].metrics["correct"] == 1.0
    assert task.reward_funcs["rubric"]([""] * 2, environments=results) == [
        pytest.approx(1.2)] * 2  # fmt: skip


@pytest.mark.usefixtures("scripted_cache")
def test_an_environment_that_rewrites_its_history_is_one_line(chat):
    _, tokenizer = chat
    with pytest.raises(UserError, match="does not extend the one so far"):
        _rollout(REWRITES, tokenizer, 0, lambda use: [(_ids(tokenizer, "hi<|im_end|>"), True),
                                                     (_ids(tokenizer, "x"), False)])  # fmt: skip


def test_mistakes_are_one_line(tmp_path, capsys):
    with pytest.raises(UserError, match="does not exist"):
        get_task(f"verifiers:{tmp_path / 'missing.py'}")
    (tmp_path / "nothing.py").write_text("x = 1\n")
    with pytest.raises(UserError, match="defines no load_environment"):
        get_task(f"verifiers:{tmp_path / 'nothing.py'}")
    with pytest.raises(UserError, match=r"did not load \(TypeError"):
        get_task(SUMS, config={"no_such_arg": "1"})
    # a verifiers 0.4 taskset where verifiers is 0.3 names the Python that runs 0.4
    (tmp_path / "taskset.py").write_text("class Taskset:\n    pass\n\n\nclass Mine(Taskset):\n"
                                         "    pass\n")  # fmt: skip
    with pytest.raises(UserError, match=r"verifiers 0\.4 taskset.*GROUPRL_VERIFIERS_PYTHON"):
        get_task(f"verifiers:{tmp_path / 'taskset.py'}")


FLAGS = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--algo", "grpo",
         "--max-new-tokens", "24", "--eval-size", "2", "--eval-samples", "2", "--eval-every",
         "0", "--no-progress", "--threads", "1"]  # fmt: skip


@pytest.mark.parametrize("env", [SUMS, LOOKUP])
def test_a_few_steps_through_the_command_line_and_the_python_api(chat, tmp_path, env):
    path, _ = chat
    out = tmp_path / "cli"
    assert main(["train", "--task", env, "--model", str(path), *FLAGS, "--output-dir",
                 str(out)]) == 0  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert len(rows) == 2 and "reward_rubric" in rows[0] and "reward_vf_num_turns" in rows[0]
    result = grouprl.Trainer(model=str(path), task=env, steps=2, prompts_per_step=2,
                             group_size=2, algo="grpo", max_new_tokens=24, eval_size=2,
                             eval_samples=2, eval_every=0, progress=False, threads=1,
                             output_dir=tmp_path / "api").train()  # fmt: skip
    assert result.steps_done == 2
    cli, api = ([json.loads(line)["completion"] for line in (d / "samples.jsonl").open()]
                for d in (out, tmp_path / "api"))  # fmt: skip
    assert cli == api  # the same run
