"""The endpoint's wire: OpenAI's shapes through the real `openai` client, what is refused (one
line each, OpenAI's error object), and the token route in the shape renderers' client parses
(each log-prob entry's token the string "token_id:N")."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("aiohttp", reason="pip install -e '.[agents]' (make test does)")
pytest.importorskip("openai", reason="pip install -e '.[agents]' (make test does)")

import openai

from grouprl.endpoint.server import Endpoint
from grouprl.endpoint.wire import (
    Answer,
    Sampling,
    WireError,
    before_stop,
    read_completion,
    read_tokens,
    tokens_body,
)


class Echo:
    """A backend that answers every request with three fixed tokens."""

    served, sampling, max_model_len = "m", Sampling(temperature=0.7), 512

    def __init__(self) -> None:
        self.asked: list = []

    async def answer(self, episode, request):
        self.asked.append((episode, request))
        return Answer([5, 6, 7], [-0.5, -0.25, -0.125], "abc", "stop", prompt_tokens=4)

    def token_texts(self, ids):
        return [chr(96 + i - 4) for i in ids]


def _served(test):
    async def run():
        backend = Echo()
        endpoint = Endpoint(backend)
        port = await endpoint.start()
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/e/ep-1/v1", api_key="x",
                                    max_retries=0)  # fmt: skip
        try:
            return await test(client, backend)
        finally:
            await client.close()
            await endpoint.close()

    return asyncio.run(run())


def test_chat_completions_models_and_the_episode_in_the_url():
    async def test(client, backend):
        models = await client.models.list()
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True,
            temperature=0.7)  # fmt: skip
        return models, reply, backend.asked

    models, reply, asked = _served(test)
    assert [m.id for m in models.data] == ["m"]
    assert reply.choices[0].message.content == "abc" and reply.choices[0].finish_reason == "stop"
    assert [t.logprob for t in reply.choices[0].logprobs.content] == [-0.5, -0.25, -0.125]
    assert reply.usage.prompt_tokens == 4 and reply.usage.completion_tokens == 3
    assert asked[0][0] == "ep-1" and asked[0][1].messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"model": "gpt-4o"}, "serves the model 'm', not 'gpt-4o'"),
        ({"temperature": 1.0}, "samples at temperature 0.7"),
        ({"n": 2}, "n=2"),
        ({"stop": ["\n"]}, "ask on /v1/completions, where stop strings end turns"),
        ({"logprobs": True, "top_logprobs": 3}, "top_logprobs=3"),
        ({"stream": True}, "stream=true is not served"),
    ],
)
def test_what_cannot_be_honoured_is_refused_in_one_line(kwargs, words):
    async def test(client, backend):
        args = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kwargs}
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(**args)
        return err.value, backend.asked

    err, asked = _served(test)
    assert words in err.message and asked == []  # refused before anything is sampled
    assert err.status_code in (400, 404)


def test_the_token_route_answers_in_the_shape_renderers_parses():
    body = {"model": "m", "token_ids": [1, 2, 3, 4],
            "sampling_params": {"temperature": 0.7, "max_tokens": 8, "logprobs": 1,
                                "stop_token_ids": [9], "skip_special_tokens": False},
            "content_parts": [], "return_token_ids": True}  # fmt: skip
    request = read_tokens(body, "m", Sampling(temperature=0.7))
    assert request.token_ids == [1, 2, 3, 4] and request.max_tokens == 8
    out = tokens_body(request, Answer([5, 6], [-1.0, -2.0], "ab", "stop", prompt_tokens=4))
    choice = out["choices"][0]
    assert choice["token_ids"] == [5, 6] and out["prompt_token_ids"] == [1, 2, 3, 4]
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["token_id:5", "token_id:6"]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-1.0, -2.0]
    assert out["mm_placeholders"] == {}  # renderers asks for it when it sends content_parts
    vllm = tokens_body(request, Answer([5], [-1.0], "a", "stop"), token_strings=False)
    assert vllm["choices"][0]["logprobs"]["content"][0]["token"] == 5  # vLLM's own shape
    with pytest.raises(WireError, match="logprobs > 1"):
        read_tokens({**body, "sampling_params": {"logprobs": 5}}, "m", Sampling(0.7))


def test_a_port_in_use_is_one_line():
    from grouprl.errors import UserError

    async def run():
        first = Endpoint(Echo())
        port = await first.start()
        try:
            with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is in use"):
                await Endpoint(Echo(), port).start()
        finally:
            await first.close()

    asyncio.run(run())


def test_stop_strings_end_completions_turns_in_a_run_and_the_text_before_them():
    run = Sampling(temperature=0.7)
    body = {"model": "m", "prompt": "#482+37=", "stop": "</lookup>"}
    request = read_completion(body, "m", run)
    assert request.stop == ["</lookup>"] and request.include_stop is False
    kept = read_completion({**body, "include_stop_str_in_output": True}, "m", run)
    assert kept.include_stop is True
    tokens = read_tokens({"model": "m", "token_ids": [1, 2],
                          "sampling_params": {"stop": ["</a>", "</b>"]}}, "m", run)  # fmt: skip
    assert tokens.stop == ["</a>", "</b>"]
    # OpenAI's rule: the text ends where the first stop string in it starts
    assert before_stop("<lookup>482</lookup>", ["</lookup>"], False) == "<lookup>482"
    assert before_stop("<lookup>482</lookup>", ["</lookup>"], True) == "<lookup>482</lookup>"
    assert before_stop("x</b>y</a>", ["</a>", "</b>"], False) == "x"
    assert before_stop("no stop here", ["</a>"], False) == "no stop here"
