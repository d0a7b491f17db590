"""An LLM judge as a reward (`--rewards judge.yaml W`), against a scripted judge server: its
parsing, retries, timeouts and cache, exactly (the server counts every call); its mistakes in one
line; a run with it trains, and a resumed run asks the judge nothing twice."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import Counter

import pytest

pytest.importorskip("aiohttp", reason="pip install -e '.[agents]' (make test does)")
pytest.importorskip("httpx", reason="pip install -e '.[agents]' (make test does)")

from grouprl.errors import UserError
from grouprl.tasks.rewards.judge import load_judge
from grouprl.tasks.rewards.scoring import build_reward_set, load_reward


class JudgeServer:
    """An OpenAI-compatible judge on 127.0.0.1 that scores an answer by its length ("Score: N"),
    and, by what the answer says: SLOW answers after the client gave up, FLAKY fails twice (503)
    first, GARBLE says nothing it can parse. `calls` counts the calls per answer."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.asked: Counter = Counter()  # per message: per (prompt, completion)
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        self.ready.wait(10)

    def _serve(self) -> None:
        from aiohttp import web

        async def models(request):
            return web.json_response({"object": "list", "data": [{"id": "judge"}]})

        async def chat(request):
            body = await request.json()
            message = body["messages"][0]["content"]
            self.asked[message] += 1
            if "Answers:" in message:  # a group judge: "k: score" a line, by length
                listed = re.findall(r"^(\d+)\. (.*)$", message, re.M)
                lines = [f"{k}: {len(t)}" for k, t in listed]
                if any("SHORT" in t for _, t in listed):
                    lines = lines[:1]  # scores for fewer answers than it was shown
                return web.json_response({"choices": [{"message": {
                    "role": "assistant", "content": "Scores:\n" + "\n".join(lines)}}]})  # fmt: skip
            answer = re.search(r"A: (.*)\nRef", message, re.S).group(1)
            self.calls[answer] += 1
            if "FLAKY" in answer and self.calls[answer] <= 2:
                return web.json_response({"error": "busy"}, status=503)
            if "SLOW" in answer:
                await asyncio.sleep(1.0)
            text = "I cannot say." if "GARBLE" in answer else f"Score: {len(answer)}"
            return web.json_response({"choices": [{"message": {"role": "assistant",
                                                               "content": text}}]})  # fmt: skip

        async def start():
            app = web.Application()
            app.router.add_get("/v1/models", models)
            app.router.add_post("/v1/chat/completions", chat)
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self.ready.set()

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(start())
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@pytest.fixture(scope="module")
def server():
    return JudgeServer()


def _judge_file(tmp_path, url, **extra):
    settings = {"url": url, "model": "judge", "template": "Q: {prompt}\nA: {completion}\nRef: "
                "{answer}\n", "parse": "number", "scale": [0, 10], "retries": 2,
                "backoff": 0.01, "timeout": 0.3, **extra}  # fmt: skip
    path = tmp_path / "judge.yaml"
    path.write_text(json.dumps({"judge": settings}))  # JSON is YAML
    return path


def test_parsing_retries_timeouts_and_the_cache_exactly(server, tmp_path):
    judge = load_judge(str(_judge_file(tmp_path, server.url)))
    judge.bind(tmp_path)
    answers = ["abc", "FLAKY xy", "GARBLE", "SLOW", "0123456789AB"]
    extra, metrics = {}, {}
    kw = dict(prompts=["q"] * 5, answer=["r"] * 5, log_extra=extra.__setitem__,
              log_metric=metrics.__setitem__)  # fmt: skip
    scores = judge(answers, **kw)
    # lengths 3 and 8 of 10; no number, a timeout, 12 beyond the scale: None, never 0
    assert scores == [0.3, 0.8, None, None, None]
    assert dict(server.calls) == {"abc": 1, "FLAKY xy": 3, "GARBLE": 1, "SLOW": 3,
                                  "0123456789AB": 1}  # fmt: skip
    assert extra["judge_answer"] == ["Score: 3", "Score: 8", "I cannot say.", None, "Score: 12"]
    assert metrics["judge_unscored"] == 3 / 5
    # again: from the cache, but for the call that got no answer (asked again, 3 tries)
    assert judge(answers, **kw) == scores
    assert server.calls["SLOW"] == 6 and sum(server.calls.values()) == 12
    # a new judge over the same run directory (a resumed run) reads it: only SLOW again
    again = load_judge(str(_judge_file(tmp_path, server.url)))
    again.bind(tmp_path)
    assert again(answers, **kw) == scores and sum(server.calls.values()) == 15
    # a resumed run whose judge runs elsewhere, more patiently: the same judgements
    moved = load_judge(str(_judge_file(tmp_path, "http://127.0.0.1:1/v1", timeout=5)))
    moved.bind(tmp_path)
    ok = [0, 1, 2, 4]  # all but SLOW, which no cache holds
    assert moved([answers[i] for i in ok], **{k: v[:4] if isinstance(v, list) else v
                                             for k, v in kw.items()}) == [scores[i] for i in ok]  # fmt: skip
    assert moved.calls == 0
    # another judge (another template) asks anew
    other = load_judge(str(_judge_file(tmp_path, server.url, max_tokens=32)))
    other.bind(tmp_path)
    assert other(["abc"], **{k: v[:1] if isinstance(v, list) else v for k, v in kw.items()}) == [
        0.3
    ]
    assert server.calls["abc"] == 2


def test_a_choice_parser_takes_the_first_choice_named(server, tmp_path):
    judge = load_judge(str(_judge_file(tmp_path, server.url, parse="choice",
                                       choices={"Score": 1.0, "cannot": 0.0})))  # fmt: skip
    assert judge(["abcd", "GARBLE"], prompts=["q", "q"], answer=["r", "r"]) == [1.0, 0.0]


def test_a_rubric_is_the_weighted_mean_of_its_criteria(tmp_path):
    from grouprl.tasks.rewards.judge import Judge, JudgeConfig

    config = JudgeConfig(url="-", model="-", template="{completion}", parse="rubric",
                         rubric={"correct": 3.0, "clear": 1.0})  # fmt: skip
    judge = Judge("judge", config)
    # 8/10 and 4/10, weighted 3:1
    # float64, three operations on O(1) numbers: within 1e-15 of the exact 0.7
    assert judge._parse("Correct: 8\n**clear**: 4", 1) == [pytest.approx(0.7, rel=0, abs=1e-15)]
    assert judge._parse("correct: 8", 1) == [None]  # a criterion missing
    assert judge._parse("correct: 8\nclear: 11", 1) == [None]  # off the scale
    with pytest.raises(UserError, match="needs rubric"):
        load_judge(str(_judge_file(tmp_path, "-", parse="rubric")))


def test_a_group_judge_scores_each_group_at_once(server, tmp_path):
    """A group judge (RULER's way) sees a prompt's G answers together and gives G scores; an
    answer that does not give one for each leaves the whole group unscored."""
    path = _judge_file(tmp_path, server.url, group=True,
                       template="Q: {prompt}\nAnswers:\n{completions}\nRef: {answer}\n")  # fmt: skip
    judge = load_judge(str(path))
    server.asked.clear()
    answers = ["ab", "abcd", "SHORT", "abcdef"]
    metrics = {}
    scores = judge(answers, prompts=["p", "p", "q", "q"], answer=["r"] * 4, group_size=2,
                   log_metric=metrics.__setitem__)  # fmt: skip
    assert scores == [0.2, 0.4, None, None] and metrics["judge_unscored"] == 0.5
    assert sum(server.asked.values()) == 2  # one call a group
    shown = next(m for m in server.asked if "Q: p" in m)
    assert "1. ab\n2. abcd" in shown
    # kept in a run directory: a resumed run's judge reads each group's judgement (the
    # unparseable one too) and asks nothing
    (tmp_path / "run").mkdir()
    kept = load_judge(str(path))
    kept.bind(tmp_path / "run")
    kw = dict(prompts=["p", "p", "q", "q"], answer=["r"] * 4, group_size=2)
    assert kept(answers, **kw) == scores and sum(server.asked.values()) == 4
    resumed = load_judge(str(path))
    resumed.bind(tmp_path / "run")
    assert resumed(answers, **kw) == scores and sum(server.asked.values()) == 4
    with pytest.raises(UserError, match=r"put \{completions\} in it"):
        load_judge(str(_judge_file(tmp_path, server.url, group=True)))


def test_mistakes_are_one_line(server, tmp_path):
    path = _judge_file(tmp_path, server.url, template="{completion} vs {reference}")
    rewards = build_reward_set({str(path): 1.0}, None)
    with pytest.raises(UserError, match="needs a column 'reference'"):
        rewards.check_columns({"prompt": "q", "answer": "a"}, "the dataset")
    with pytest.raises(UserError, match="does not answer"):
        load_reward(str(_judge_file(tmp_path, "http://127.0.0.1:9/v1")))
    with pytest.raises(UserError, match="unknown setting 'temprature'"):
        load_judge(str(_judge_file(tmp_path, server.url, temprature=0)))
    with pytest.raises(UserError, match="parse choice needs choices"):
        load_judge(str(_judge_file(tmp_path, server.url, parse="choice")))


def test_a_run_with_a_judge_trains_and_a_resumed_run_asks_nothing_twice(server, tmp_path):
    from safetensors.torch import load_file

    from grouprl.models.tiny import save_tiny_chat_model
    from resumed_runs import straight_and_resumed

    save_tiny_chat_model(tmp_path / "model")
    rows = [{"prompt": f"Say {i} twice.", "answer": f"{i} {i}"} for i in range(20)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    judge = _judge_file(tmp_path, server.url, scale=[0, 40], timeout=10)
    options = dict(model=str(tmp_path / "model"), dataset=str(tmp_path / "data.jsonl"),
                   rewards={str(judge): 1.0}, max_new_tokens=8, steps=3, prompts_per_step=2,
                   group_size=2, minibatches=1, eval_size=2, eval_samples=1, eval_every=0,
                   save_every=1, progress=False, threads=1, seed=3)  # fmt: skip
    straight, _, resumed = straight_and_resumed(options, tmp_path / "runs")
    metrics = [[json.loads(line) for line in (r.run_dir / "metrics.jsonl").open()]
               for r in (straight, resumed)]  # fmt: skip
    timeless = [[{k: v for k, v in m.items() if "seconds" not in k and "per_s" not in k}
                 for m in run] for run in metrics]  # fmt: skip
    assert timeless[0] == timeless[1] and len(timeless[0]) == 3
    assert all(m["reward_judge"] is not None for m in timeless[0])  # parsed: scored
    weights = [load_file(next((r.run_dir / "final").glob("*.safetensors")))
               for r in (straight, resumed)]  # fmt: skip
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])
    # the run directory holds its judgements: its completions scored again ask nothing
    again = load_judge(str(judge))
    again.bind(resumed.run_dir)
    samples = [json.loads(line) for line in (resumed.run_dir / "samples.jsonl").open()]
    before = sum(server.asked.values())
    scores = again([s["completion"] for s in samples], prompts=[s["prompt"] for s in samples],
                   answer=[s["answer"] for s in samples])  # fmt: skip
    assert sum(server.asked.values()) == before and all(x is not None for x in scores)
    # the run's rewards are float32: equal within its rounding of numbers at most 1
    assert scores == pytest.approx([s["reward"] for s in samples], abs=2**-24)


def test_a_judge_fine_tuned_by_grouprl_sft_and_served_scores_a_run(tmp_path):
    """A real judge: a tiny chat model fine-tuned with `grouprl sft` to answer the template as
    "Score: N", served by `grouprl serve`, scores a 3-step run (a random policy's completions),
    with at least 90% of its answers parsed."""
    import random

    from grouprl.cli import main
    from grouprl.models.tiny import save_tiny_chat_model
    from serving import served

    save_tiny_chat_model(tmp_path / "base")
    template = "Q: {prompt}\nA: {completion}\nScore 0-9."
    rng = random.Random(0)
    with (tmp_path / "judging.jsonl").open("w") as f:
        for _ in range(512):
            answer = "".join(rng.choice("abcdefgh 0123456789") for _ in range(rng.randint(1, 12)))
            asked = template.format(prompt=f"Say {rng.randint(0, 99)} twice.", completion=answer)
            f.write(json.dumps({"messages": [
                {"role": "user", "content": asked},
                {"role": "assistant", "content": f"Score: {len(answer) % 10}"}]}) + "\n")  # fmt: skip
    assert main(["sft", "--data", str(tmp_path / "judging.jsonl"), "--model",
                 str(tmp_path / "base"), "--steps", "150", "--batch-size", "32", "--lr", "0.01",
                 "--warmup-steps", "10", "--output-dir", str(tmp_path / "judge")]) == 0  # fmt: skip
    with served(tmp_path / "judge", served="judge") as url:
        settings = {"url": url, "model": "judge", "template": template, "scale": [0, 9],
                    "max_tokens": 8, "timeout": 30}  # fmt: skip
        (tmp_path / "judge.yaml").write_text(json.dumps({"judge": settings}))
        rows = [{"prompt": f"Say {i} twice.", "answer": f"{i} {i}"} for i in range(40)]
        (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = tmp_path / "run"
        assert main(["train", "--model", str(tmp_path / "base"), "--dataset",
                     str(tmp_path / "data.jsonl"), "--rewards", str(tmp_path / "judge.yaml"),
                     "1.0", "--steps", "3", "--prompts-per-step", "4", "--group-size", "4",
                     "--minibatches", "1", "--max-new-tokens", "12", "--eval-size", "4",
                     "--eval-samples", "1", "--no-progress", "--threads", "1",
                     "--output-dir", str(out)]) == 0  # fmt: skip
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    parsed = [1 - m["judge_unscored"] for m in metrics]
    assert len(parsed) == 3 and sum(parsed) / 3 >= 0.9
    samples = [json.loads(line) for line in (out / "samples.jsonl").open()]
    assert all(re.fullmatch(r"Score: \d", s["judge_answer"]) for s in samples)
