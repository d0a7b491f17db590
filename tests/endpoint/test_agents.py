"""Agent programs as rollouts (`--agent`): a loop over the real `openai` client talks to
grouprl's endpoint, answered by the run's sampler. Token exactness: with a scripted model, a
tool-calling episode's ids are its sampled turns and the fed renderings of what the agent sent
back, turn by turn, and they decode to the chat template's rendering of the agent's own
conversation."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="pip install -e '.[agents]' (make test does)")
pytest.importorskip("openai", reason="pip install -e '.[agents]' (make test does)")

import openai
import torch

from grouprl.cli import main
from grouprl.endpoint.use import agent_use
from grouprl.endpoint.wire import Sampling
from grouprl.errors import UserError
from grouprl.models.tiny import QWEN25_TOOLS, save_tiny_chat_model
from grouprl.rollout import sample_groups
from scripted import Scripted
from serving import served

PROGRAMS = Path(__file__).with_name("agents") / "programs.py"
ROW = {"prompt": "What is lookup(4) doubled?", "answer": 62}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny random chat model with a Qwen2.5-style tool template, its tokenizer, and a
    12-row dataset."""
    path = tmp_path_factory.mktemp("agent_chat")
    _, tokenizer = save_tiny_chat_model(path / "model", template=QWEN25_TOOLS)
    with (path / "data.jsonl").open("w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"What is {i} plus {i}?", "answer": 2 * i}) + "\n")
    return path, tokenizer


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _use(tokenizer, program, max_calls=4, **kw):
    end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return agent_use(f"{PROGRAMS}:{program}", tokenizer, end, Sampling(temperature=0.0),
                     served="grouprl", max_calls=max_calls, **kw)  # fmt: skip


def _rollout(tokenizer, program, script_of, row=ROW, max_calls=4):
    """One group of 2 episodes of `row`, sampled by a scripted model whose script
    `script_of(renderer)` returns as (ids, trained) pieces."""
    use = _use(tokenizer, program, max_calls)
    start = use.rollout([row], 2)
    (prompt,) = start.prompts
    pieces = script_of(start.handler.episodes[0].renderer)
    script = [i for ids, _ in pieces for i in ids]
    model = Scripted(tokenizer, ids={tuple(prompt): [*script, tokenizer.eos_token_id]})
    r = sample_groups(model, tokenizer, [prompt], group_size=2, max_new_tokens=len(script) + 4,
                      temperature=0.0, tools=start.handler)  # fmt: skip
    use.sampled(r, start.handler)
    return r, start.handler, pieces, prompt


@pytest.mark.usefixtures("scripted_cache")
def test_a_tool_episode_trains_on_the_ids_sampled_and_fed_turn_by_turn(chat):
    _, tokenizer = chat
    calls = ('<tool_call>\n{"name": "lookup", "arguments": {"key": 4}}\n</tool_call>',
             '<tool_call>\n{"name": "double", "arguments": {"x": 31}}\n</tool_call>')  # fmt: skip
    answer = "It is 62."

    def script(renderer):
        pieces = []
        for call, result in zip(calls, ("31", "62")):
            turn = renderer.assistant(call)
            fed = renderer.tail(turn, [{"role": "tool", "tool_call_id": "x", "content": result}])
            pieces += [(_ids(tokenizer, call + "<|im_end|>"), True), (fed, False)]
        return [*pieces, (_ids(tokenizer, answer + "<|im_end|>"), True)]

    r, handler, pieces, prompt = _rollout(tokenizer, "two_tools", script)
    script_ids = [i for ids, _ in pieces for i in ids]
    n = len(script_ids)
    for row in (0, 1):
        assert r.completion_ids[row, :n].tolist() == script_ids and int(r.lengths[row]) == n
        assert r.loss_mask[row, :n].tolist() == [own for ids, own in pieces for _ in ids]
    results = handler.environments
    assert [x.reward for x in results] == [1.0, 1.0]
    assert [x.requests for x in results] == [3, 3] and results[0].prefix_breaks == 0
    # what the agent sent is what the ids say: the template's rendering of its conversation
    conversation = results[0].messages
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool", "assistant",
                                                 "tool", "assistant"]  # fmt: skip
    assert conversation[1]["tool_calls"][0]["function"]["name"] == "lookup"
    assert conversation[-1]["content"] == answer
    schemas = handler.episodes[0].renderer.schemas
    rendered = tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=False)
    assert tokenizer.decode(prompt + r.completion_ids[0, :n].tolist()).rstrip() == rendered.rstrip()
    # the sampled turns' log-probs reached the agent as the sampler computed them
    assert r.old_logp[0, : len(pieces[0][0])].tolist() == pytest.approx(
        [float(torch.log_softmax(torch.tensor([2.0] + [0.0] * (len(tokenizer) - 1)), 0)[0])]
        * len(pieces[0][0]))  # fmt: skip


@pytest.mark.usefixtures("scripted_cache")
def test_a_request_past_max_turns_is_answered_by_an_empty_turn(chat):
    """--max-turns 2: two turns get a reply (their calls' results); the model's third turn calls
    again, and the agent's request after it is answered empty, finish_reason "length" (a turn
    of no token: the row's fourth, as the agent counts them). Each turn is answered once (none
    again as if the budget had cut it); a further request would be refused."""
    _, tokenizer = chat
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": 4}}\n</tool_call>'

    def script(renderer):
        turn = renderer.assistant(call)
        fed = renderer.tail(turn, [{"role": "tool", "tool_call_id": "x", "content": "31"}])
        return [(_ids(tokenizer, call + "<|im_end|>"), True), (fed, False)] * 2 + [
            (_ids(tokenizer, call + "<|im_end|>"), True)]  # fmt: skip

    r, handler, pieces, _ = _rollout(tokenizer, "two_tools", script, max_calls=2)
    results = handler.environments
    assert [(x.requests, x.failed) for x in results] == [(4, None), (4, None)]
    n = sum(len(ids) for ids, _ in pieces)
    assert r.lengths.tolist() == [n, n] and bool(r.turns.ended_by_turns.all())
    assert [s[-1] for s in r.turns.starts] == [n, n] and [len(s) for s in r.turns.starts] == [4, 4]
    assert results[0].messages[-1] == {"role": "assistant", "content": ""}
    assert [m["role"] for m in results[0].messages].count("tool") == 3  # all three calls run


@pytest.mark.usefixtures("scripted_cache")
def test_a_rewritten_history_ends_the_trajectory_and_is_counted(chat):
    _, tokenizer = chat
    first = _ids(tokenizer, "hello<|im_end|>")
    r, handler, _, _ = _rollout(tokenizer, "rewrites", lambda _: [(first, True),
                                                                 (_ids(tokenizer, "x"), False)])  # fmt: skip
    assert [x.prefix_breaks for x in handler.environments] == [1, 1]
    assert [x.reward for x in handler.environments] == [0.5, 0.5]  # it saw the 409's words
    assert r.lengths.tolist() == [len(first)] * 2  # the trajectory ended at its first turn


@pytest.mark.usefixtures("scripted_cache")
def test_a_rewritten_history_splits_the_trajectory_into_exact_rows(chat):
    _, tokenizer = chat
    use = _use(tokenizer, "rewrites_and_goes_on")
    start = use.rollout([ROW], 2)
    (prompt,) = start.prompts
    renderer = start.handler.episodes[0].renderer
    first = _ids(tokenizer, "hello<|im_end|>")
    rewritten = [{"role": "user", "content": ROW["prompt"]},
                 {"role": "assistant", "content": "something else entirely"},
                 {"role": "user", "content": "and again?"}]  # fmt: skip
    branch_prompt = renderer.prompt_ids(rewritten)
    two = _ids(tokenizer, "two<|im_end|>")
    fed = renderer.tail(renderer.assistant("two"), [{"role": "user", "content": "once more?"}])
    three = _ids(tokenizer, "three<|im_end|>")
    script = [*two, *fed, *three]
    model = Scripted(tokenizer, ids={tuple(prompt): [*first, tokenizer.eos_token_id],
                                     tuple(branch_prompt): [*script, tokenizer.eos_token_id]})  # fmt: skip
    kw = dict(max_new_tokens=len(script) + 4, temperature=0.0, tools=start.handler)
    r = sample_groups(model, tokenizer, [prompt], group_size=2, **kw)
    asked = []

    def resample(prompts, k):
        asked.append(k)
        return sample_groups(model, tokenizer, prompts, group_size=1, **kw)

    branches = use.sampled(r, start.handler, resample)
    # the first rows end where the history was rewritten; the rest is a row of its own each,
    # from the rewritten conversation's rendering, then sampled and fed ids as always
    assert r.lengths.tolist() == [len(first)] * 2 and asked == [0]
    b = branches.rollout
    assert branches.parents.tolist() == [0, 1] and b.group_size == 1 and b.num_prompts == 2
    for row in (0, 1):
        assert b.prompt_ids[row][b.prompt_mask[row]].tolist() == branch_prompt
        assert b.completion_ids[row, : len(script)].tolist() == script
        assert int(b.lengths[row]) == len(script)
        assert b.loss_mask[row, : len(script)].tolist() == (
            [True] * len(two) + [False] * len(fed) + [True] * len(three))  # fmt: skip
    results = start.handler.results
    assert [x.prefix_breaks for x in results] == [1, 1] and [x.requests for x in results] == [3, 3]
    assert [x.reward for x in results] == [1.0, 1.0]
    assert results[0].messages[-1]["content"] == "three"


FLAGS = ["--steps", "3", "--prompts-per-step", "2", "--group-size", "2", "--minibatches", "1",
         "--max-new-tokens", "24", "--eval-every", "0", "--eval-size", "2", "--eval-samples",
         "1", "--no-progress", "--threads", "1", "--seed", "3"]  # fmt: skip


def _train(chat, out, program, *extra):
    path, _ = chat
    return main(["train", "--model", str(path / "model"), "--dataset", str(path / "data.jsonl"),
                 "--agent", f"{PROGRAMS}:{program}", *FLAGS, "--output-dir", str(out),
                 *extra])  # fmt: skip


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


@pytest.mark.parametrize("program", ["single_turn", "two_tools"])
def test_agents_train_three_steps_and_two_runs_are_identical(chat, tmp_path, program):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _train(chat, a, program) == 0 and _train(chat, b, program) == 0
    rows = _metrics(a)
    assert len(rows) == 3 and all(r["reward_agent_failed"] == 0.0 for r in rows)
    assert all(r["reward_agent_requests"] >= 1.0 for r in rows)
    timeless = [{k: v for k, v in r.items() if "seconds" not in k and "per_s" not in k}
                for r in (rows, _metrics(b)) for r in r]  # fmt: skip
    assert timeless[:3] == timeless[3:]
    from safetensors.torch import load_file

    wa, wb = (load_file(next((d / "final").glob("*.safetensors"))) for d in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_split_trajectories_train_and_two_runs_are_identical(chat, tmp_path):
    """An agent that asks again with its prompt edited: each episode splits (counted), its
    second row trains with the episode's advantage, in its parent's minibatch (of two)."""
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        assert _train(chat, out, "rewrites_completions", "--minibatches", "2") == 0
    rows = _metrics(runs[0])
    assert [r["reward_agent_prefix_breaks"] for r in rows] == [1.0, 1.0, 1.0]
    assert all(r["branch_rows"] >= 1 and r["reward_agent_failed"] < 1 for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)
    samples = [json.loads(line) for line in (runs[0] / "samples.jsonl").open()]
    assert any("branches" in s for s in samples)  # the rows after the first are shown
    assert all(len(s["branches"]) == 1 for s in samples if s["reward"] > 0)
    timeless = [{k: v for k, v in r.items() if "seconds" not in k and "per_s" not in k}
                for r in (rows, _metrics(runs[1])) for r in r]  # fmt: skip
    assert timeless[:3] == timeless[3:]


def test_per_turn_rewards_credit_each_row_of_a_split_trajectory(chat, tmp_path, monkeypatch):
    """An agent whose two turns are two rows (its second request rewrote its prompt) rewards
    each turn: the second row trains with turn 2's advantage, the first with turn 1's."""
    from grouprl.train import step

    seen, original = [], step.update

    def update(cfg, policy, optimizer, batch, advantages, *args, parents=None, **kw):
        seen.append((batch.rollout.loss_mask.cpu(), advantages.cpu(), parents))
        return original(cfg, policy, optimizer, batch, advantages, *args, parents=parents, **kw)

    monkeypatch.setattr(step, "update", update)
    out = tmp_path / "run"
    assert _train(chat, out, "rewrites_per_turn", "--adv-estimator", "process") == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").open()]  # 2 groups a step
    split = [s for s in samples if "branches" in s]
    assert split and all(len(s["turn_rewards"]) == 2 for s in split)
    assert any(s["turn_advantages"][0] != s["turn_advantages"][1] for s in split)
    assert len(seen) == 3 and len(samples) == 6
    for i, (mask, given, parents) in enumerate(seen):
        assert given.dim() == 2 and parents is not None
        n = given.shape[0] - len(parents)  # the batch's own rows, then the branch rows
        for k, parent in enumerate(parents.tolist()):
            own, branch = given[parent][mask[parent]], given[n + k][mask[n + k]]
            assert len(set(own.tolist())) == 1 and len(set(branch.tolist())) == 1  # one turn each
            if parent % 2 == 0:  # a group's first completion: logged
                want = samples[2 * i + parent // 2]["turn_advantages"]
                assert [own[0].item(), branch[0].item()] == want


def test_an_agent_that_returns_nothing_is_scored_by_the_runs_rewards(chat, tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def short(completions, **_):\n"
                       "    return [float(len(c[-1]['content']) < 20) for c in completions]\n")  # fmt: skip
    assert _train(chat, tmp_path / "run", "no_reward", "--rewards", f"{rewards}:short",
                  "1.0") == 0  # fmt: skip
    rows = _metrics(tmp_path / "run")
    assert "reward_short" in rows[0] and rows[0]["reward_agent"] is None


def test_mistakes_are_one_line(chat, tmp_path, capsys):
    _, tokenizer = chat
    with pytest.raises(UserError, match="is not an async function"):
        _use(tokenizer, "not_async")
    with pytest.raises(UserError, match="does not exist"):
        agent_use(f"{tmp_path}/missing.py:run", tokenizer, [0], Sampling(), served="x")
    with pytest.raises(UserError, match="give a file and function"):
        agent_use("nothing", tokenizer, [0], Sampling(), served="x")
    # an agent that raises: its episodes fail; when all of a batch fail, the run ends in a line
    assert _train(chat, tmp_path / "run", "raises") == 2
    err = capsys.readouterr().err
    assert (
        "every agent episode of this batch failed; the first: RuntimeError: the agent's own bug"
        in err
    )
    assert err.count("Traceback") == 1  # the traceback once, in the log


def test_serve_answers_the_openai_client_over_a_runs_final(chat, tmp_path):
    assert _train(chat, tmp_path / "run", "single_turn", "--steps", "1") == 0
    with served(tmp_path / "run", served="tiny") as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        asked = {"model": "tiny", "messages": [{"role": "user", "content": "1 plus 1?"}],
                 "max_tokens": 5, "temperature": 0.0, "logprobs": True}  # fmt: skip
        first, again = (client.chat.completions.create(**asked) for _ in range(2))
        assert first.choices[0].message.content == again.choices[0].message.content  # greedy
        assert first.usage.completion_tokens <= 5 and first.choices[0].finish_reason in (
            "stop", "length")  # fmt: skip
        assert len(first.choices[0].logprobs.content) == first.usage.completion_tokens
        text = client.completions.create(model="tiny", prompt="abc", max_tokens=3)
        assert text.usage.completion_tokens <= 3
        with pytest.raises(openai.NotFoundError, match="serves the model 'tiny'"):
            client.chat.completions.create(**{**asked, "model": "gpt-4o"})


def test_the_lookup_agent_program_samples_what_the_native_tool_loop_samples():
    """examples/lookup_agent: the built-in lookup task as an `openai` completions loop with
    `</lookup>` as its stop string. With the same seed its rollout is the native tags loop's,
    id for id: each call's turn ends at the stop string, the agent sends back the prompt so
    far with the closing tag and the value, and only the value is fed."""
    from grouprl.models import load_model, load_tokenizer
    from grouprl.rollout import stop_token_ids
    from grouprl.tasks.builtin.lookup import lookup_task
    from grouprl.tasks.tools.calls import TagTools, load_tools

    tokenizer, model = load_tokenizer("builtin:lookup"), load_model("builtin:lookup")
    task, end = lookup_task(), stop_token_ids(model, tokenizer)
    rows = [task.train[i] for i in range(4)]
    example = Path(__file__).parents[2] / "examples" / "lookup_agent" / "agent.py"
    use = agent_use(f"{example}:agent", tokenizer, end, Sampling(), served="builtin:lookup",
                    max_calls=4)  # fmt: skip
    start = use.rollout(rows, 4)
    agent = sample_groups(model, tokenizer, start.prompts, group_size=4, max_new_tokens=48,
                          seed=7, tools=start.handler)  # fmt: skip
    use.sampled(agent, start.handler)
    native_tools = TagTools(load_tools(sorted(task.tools), task.tools), tokenizer, max_calls=4)
    native = sample_groups(model, tokenizer, [r["prompt"] for r in rows], group_size=4,
                           max_new_tokens=48, seed=7, tools=native_tools)  # fmt: skip
    called = sum("<lookup>" in t for t in native.texts)
    assert 0 < called < len(native.texts)  # some completions call the tool, some guess
    for name in ("prompt_ids", "completion_ids", "mask", "loss_mask", "old_logp"):
        assert torch.equal(getattr(agent, name), getattr(native, name)), name
    assert agent.texts == native.texts
    results = start.handler.environments
    assert [r.requests for r in results] == [1 + ("<lookup>" in t) for t in native.texts]
    assert all(r.failed is None and r.prefix_breaks == 0 for r in results)


def test_a_chat_request_the_template_cannot_render_is_one_line(chat):
    """No chat template (the built-in char model): the agent's chat request is refused (400)
    naming the completions route; tools= on a template that renders no calls, likewise."""
    from grouprl.models import load_tokenizer

    plain = load_tokenizer("builtin:lookup")
    with pytest.raises(UserError, match="has no chat template, so chat requests cannot be"):
        _use(plain, "single_turn").rollout([ROW], 2)
    _, tokenizer = chat
    bare = copy.copy(tokenizer)
    bare.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(UserError, match=r"tools=: the chat template of .* renders no tool calls"):
        _use(bare, "two_tools").rollout([ROW], 2)
