"""verifiers 0.4 environments through the endpoint (`--task verifiers:ENV` with verifiers 0.4 in
an environment of its own, `.venv-vf04`): its driver runs each episode with the null harness as
a local subprocess, its train client renders with `renderers` and asks the token route, and the
run's sampler answers. Token exactness: with a scripted model, the trajectory grouprl trains on
is, id for id, the branch verifiers recorded, and its sampled mask is grouprl's loss mask."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("aiohttp", reason="pip install -e '.[agents]' (make test does)")
pytest.importorskip("openai", reason="pip install -e '.[agents]' (make test does)")

from grouprl.cli import main
from grouprl.endpoint.use import v1_agent_use
from grouprl.errors import UserError
from grouprl.models.tiny import QWEN25_TOOLS, save_tiny_chat_model
from grouprl.rollout import sample_groups
from grouprl.tasks import get_task
from grouprl.tasks.ecosystems.verifiers_v1 import PYTHON_VARIABLE
from scripted import Scripted

PYTHON = Path(__file__).resolve().parents[2] / ".venv-vf04" / "bin" / "python"
pytestmark = pytest.mark.skipif(not PYTHON.exists(),
                                reason="make test builds .venv-vf04 (verifiers 0.4)")  # fmt: skip
SUMS = Path(__file__).with_name("tasksets") / "sums.py"


@pytest.fixture(scope="module")
def v04(tmp_path_factory):
    """verifiers 0.4's Python named for the module's runs; a tiny chat model."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(PYTHON_VARIABLE, str(PYTHON))
        path = tmp_path_factory.mktemp("vf04")
        _, tokenizer = save_tiny_chat_model(path / "model", template=QWEN25_TOOLS)
        yield path, tokenizer


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _opts(model, **kw):
    return SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, model=str(model),
                           agent_timeout=120.0, agent_port=0, max_turns=4, **kw)  # fmt: skip


@pytest.mark.usefixtures("scripted_cache")
def test_a_single_turn_episode_is_the_branch_verifiers_recorded_id_for_id(v04):
    path, tokenizer = v04
    task = get_task(f"verifiers:{SUMS}")
    assert [r["prompt"] for r in task.train[:2]] == ["What is 0 plus 0?", "What is 1 plus 1?"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    use = v1_agent_use(_opts(path / "model"), task.driver, tokenizer, [end])
    start = use.rollout([task.train[3]], 2)  # What is 3 plus 3?
    (prompt,) = start.prompts
    # verifiers rendered the prompt with the model's template (renderers' default renderer)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 plus 3?"}],
                                             add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert tokenizer.decode(prompt) == rendered
    script = [*_ids(tokenizer, "It is 6."), end]
    model = Scripted(tokenizer, ids={tuple(prompt): script})
    r = sample_groups(model, tokenizer, [prompt], group_size=2, max_new_tokens=16,
                      temperature=0.0, tools=start.handler)  # fmt: skip
    use.sampled(r, start.handler)
    results = start.handler.results
    assert [x.failed for x in results] == [None, None]
    assert [x.reward for x in results] == [1.5, 1.5]  # correct (x1) and short (x0.5)
    for row, ep in enumerate(start.handler.episodes):
        (branch,) = task.driver.results[ep.key]["branches"]
        assert branch["token_ids"] == prompt + r.completion_ids[row, : len(script)].tolist()
        assert branch["sampled_mask"] == [False] * len(prompt) + [True] * len(script)
        assert r.loss_mask[row, : len(script)].all() and int(r.lengths[row]) == len(script)


def test_a_single_turn_environment_trains_two_steps(v04, tmp_path):
    path, _ = v04
    out = tmp_path / "run"
    assert main(["train", "--model", str(path / "model"), "--task", f"verifiers:{SUMS}",
                 "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
                 "--minibatches", "1", "--max-new-tokens", "8", "--eval-every", "0",
                 "--eval-size", "1", "--eval-samples", "1", "--no-progress", "--threads", "1",
                 "--output-dir", str(out)]) == 0  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert len(rows) == 2 and all(r["reward_agent_failed"] == 0.0 for r in rows)
    assert all(r["reward_agent_requests"] == 1.0 for r in rows)
    assert (out / "final").is_dir()


def test_a_harness_that_runs_commands_on_the_host_is_refused_in_one_line(v04):
    with pytest.raises(UserError, match="null harness only"):
        get_task(f"verifiers:{SUMS}", config={"harness": "bash"})


#: Qwen3's tokens renderers' Qwen3 renderer looks up by id (tool calls, their results, thinking)
QWEN3_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                "</tool_response>"]  # fmt: skip
QWEN3 = {"renderer": {"name": "qwen3", "enable_thinking": False}}
ADDER = Path(__file__).with_name("tasksets") / "adder.py"


class Turns(Scripted):
    """Writes `turns[k]` in its k-th turn, a turn starting after the ids the prompt ends with
    (the assistant header, and its empty thinking block for Qwen3's renderer), wherever they
    are: fed after a turn, or in a branch's prompt, which renders the turns before it."""

    def __init__(self, tokenizer, turns, tail):
        super().__init__(tokenizer)
        self.turns, self.tail = turns, tail

    def next_token(self, row, prompt):
        n = len(self.tail)
        marks = [i for i in range(len(row) - n + 1) if row[i : i + n] == self.tail]
        turn = self.turns[len(marks) - 1] if len(marks) <= len(self.turns) else []
        done = len(row) - marks[-1] - n
        return turn[done] if done < len(turn) else self.eos


#: The call as Qwen's template writes it, and compact: renderers' default renderer renders the
#: conversation again each turn, with the template's spacing, so the compact call breaks the ids
CALLS = {"bridged": '{"name": "add", "arguments": {"a": 2, "b": 3}}',
         "split": '{"name":"add","arguments":{"a":2,"b":3}}'}  # fmt: skip
RENDERERS = {"bridged": QWEN3, "split": {"renderer": {"name": "default", "tool_parser": "qwen3"}}}


@pytest.mark.parametrize("case", ["bridged", "split"])
@pytest.mark.usefixtures("scripted_cache")
def test_a_tool_episode_is_the_branches_verifiers_recorded_id_for_id(v04, case):
    """Qwen3's renderer bridges a turn (its ids extend the episode's: one row); the default one
    renders again, and a call written without the template's spacing breaks the ids, so the
    episode splits (counted) into two rows: verifiers' two branches, id for id."""
    path, _ = v04
    _, tokenizer = save_tiny_chat_model(path / case, template=QWEN25_TOOLS,
                                        added_tokens=QWEN3_TOKENS)  # fmt: skip
    task = get_task(f"verifiers:{ADDER}", config=RENDERERS[case])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    use = v1_agent_use(_opts(path / case), task.driver, tokenizer, [end])
    start = use.rollout([task.train[2]], 2)  # What is 2+3? Use the add tool.
    (prompt,) = start.prompts
    assert '"name": "add"' in tokenizer.decode(prompt)  # the tool, rendered by renderers
    call = f"<tool_call>\n{CALLS[case]}\n</tool_call>"
    turns = [[*_ids(tokenizer, call), end], [*_ids(tokenizer, "It is 5."), end]]
    model = Turns(tokenizer, turns, prompt[-3:])
    kw = dict(max_new_tokens=96, temperature=0.0, tools=start.handler)
    r = sample_groups(model, tokenizer, [prompt], group_size=2, **kw)
    branches = use.sampled(r, start.handler,
                           lambda prompts, k: sample_groups(model, tokenizer, prompts,
                                                            group_size=1, **kw))  # fmt: skip
    results = start.handler.results
    # the tool ran (its result was fed); the task rewarded each turn (over the rows it split into)
    assert [x.reward for x in results] == [[0.25, 0.75], [0.25, 0.75]]
    assert [x.requests for x in results] == [2, 2]
    assert [x.prefix_breaks for x in results] == ([0, 0] if case == "bridged" else [1, 1])
    for row, ep in enumerate(start.handler.episodes):
        n = int(r.lengths[row])
        rows = [(prompt, r.completion_ids[row, :n].tolist(), r.loss_mask[row, :n].tolist())]
        if branches is not None:  # the episode's rows after its first
            b = branches.rollout
            for k in (branches.parents == row).nonzero().flatten().tolist():
                m = int(b.lengths[k])
                rows.append((b.prompt_ids[k][b.prompt_mask[k]].tolist(),
                             b.completion_ids[k, :m].tolist(), b.loss_mask[k, :m].tolist()))  # fmt: skip
        recorded = task.driver.results[ep.key]["branches"]
        assert len(rows) == len(recorded) == (1 if case == "bridged" else 2)
        for (p, ids, trained), branch in zip(rows, recorded):
            assert branch["token_ids"] == p + ids
            assert branch["sampled_mask"] == [False] * len(p) + trained
        assert sum(sum(t) for _, _, t in rows) == sum(len(t) for t in turns)
        text = tokenizer.decode(rows[-1][0] + rows[-1][1])
        assert "<tool_response>\n5\n</tool_response>" in text and text.endswith(
            "It is 5.<|im_end|>"
        )
