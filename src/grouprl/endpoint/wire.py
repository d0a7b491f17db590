"""OpenAI's request and answer shapes, read and written without a server: chat completions,
completions, the model list, and the token-in/token-out route `/inference/v1/generate` in the
shape renderers' client (verifiers 0.4's train client) parses.

A request is refused (`WireError`, answered as OpenAI's error object) when it asks for what the
server cannot honour: another model, sampling parameters other than the run's, `n` > 1 inside an
agent's episode, top log-probs, streaming where it is not served. What every served request
gets, and what is clipped, is in the agents guide (docs/guides/agents.md).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class WireError(Exception):
    """A request the server refuses: the HTTP status and one line saying why and what to do."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}


@dataclass(frozen=True)
class Sampling:
    """The sampling a server applies (a run's: `--temperature`, `--top-p`, `--top-k`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass(frozen=True)
class Request:
    """One request: `kind` chat, completion or tokens, and what it carries."""

    kind: str
    model: str
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    prompt: str | None = None
    token_ids: list[int] | None = None
    logprobs: bool = False
    max_tokens: int | None = None
    stream: bool = False
    sampling: Sampling | None = None  # a server that samples as asked: the request's
    stop: list[str] = field(default_factory=list)  # strings that end the turn
    include_stop: bool = False  # the answer's text keeps the stop string that ended it


@dataclass(frozen=True)
class Answer:
    """What the model wrote for a request: its ids, their log-probs, the text, and why it
    stopped ("stop", "length" or "tool_calls")."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish: str
    message: dict[str, Any] | None = None  # a chat turn: content and tool_calls
    prompt_tokens: int = 0


#: Parameters every route accepts and ignores: they change nothing a server samples here.
IGNORED = {"user", "metadata", "store", "seed", "parallel_tool_calls", "service_tier",
           "stream_options", "presence_penalty", "frequency_penalty", "cache_salt",
           "priority", "skip_special_tokens", "return_token_ids", "content_parts",
           "stop_token_ids", "tool_choice", "response_format", "reasoning_effort",
           "spaces_between_special_tokens", "extra_body"}  # fmt: skip


def _model(body: dict, served: str) -> str:
    name = body.get("model")
    if name not in (None, served):
        raise WireError(404, f"this server serves the model {served!r}, not {name!r}; ask for "
                        f"model={served!r} (GET /v1/models lists it)", "not_found_error")  # fmt: skip
    return served


def _sampling(values: dict, sampling: Sampling | None, *, stops: bool = True) -> Sampling | None:
    """The request's sampling where the server samples as asked (`sampling` None), else None
    after refusing any the server does not do (its own is the run's; `stops` False: nor stop
    strings)."""
    _single(values, stops=stops or sampling is None)
    if sampling is None:
        temperature, top_p = values.get("temperature"), values.get("top_p")
        top_k = values.get("top_k")
        if temperature is not None and not 0 <= float(temperature) <= 100:
            raise WireError(400, f"temperature={temperature}: give a number from 0 to 100")
        if top_p is not None and not 0 < float(top_p) <= 1:
            raise WireError(400, f"top_p={top_p}: give a number in (0, 1]")
        return Sampling(1.0 if temperature is None else float(temperature),
                        1.0 if top_p is None else float(top_p),
                        0 if top_k in (None, -1) else int(top_k))  # fmt: skip
    for key, ours, flag in (("temperature", sampling.temperature, "--temperature"),
                            ("top_p", sampling.top_p, "--top-p")):  # fmt: skip
        given = values.get(key)
        if given is not None and not math.isclose(float(given), ours, abs_tol=1e-6):
            raise WireError(400, f"{key}={given}: this server samples at {key} {ours:g} (the "
                            f"run's {flag}); drop {key} from the request or pass {ours:g}")  # fmt: skip
    top_k = values.get("top_k")
    if top_k not in (None, -1, 0, sampling.top_k):
        raise WireError(400, f"top_k={top_k}: this server samples with top_k "
                        f"{sampling.top_k} (the run's --top-k); drop top_k from the request")  # fmt: skip
    return None


def _single(values: dict, *, stops: bool) -> None:
    """Refuse more than one choice, top log-probs, and (`stops` False) stop strings."""
    n = values.get("n")
    if n not in (None, 1):
        raise WireError(400, f"n={n}: each request is answered with one choice (a run samples "
                        "its groups itself); ask with n=1, or send n requests")  # fmt: skip
    if values.get("stop") and not stops:
        raise WireError(400, "stop=: a chat turn here ends at the model's end-of-turn token "
                        "(and the run's --stop strings); drop stop from the request, or ask on "
                        "/v1/completions, where stop strings end turns")  # fmt: skip
    top = values.get("top_logprobs")
    if top:
        raise WireError(400, f"top_logprobs={top}: only the sampled tokens' log-probs are "
                        "served; drop top_logprobs")  # fmt: skip


def _stops(values: dict) -> list[str]:
    stop = values.get("stop") or []
    return [stop] if isinstance(stop, str) else list(stop)


def _max_tokens(values: dict) -> int | None:
    out = values.get("max_completion_tokens", values.get("max_tokens"))
    if out is not None and (not isinstance(out, int) or out < 1):
        raise WireError(400, f"max_tokens={out}: give a positive whole number")
    return out


def read_chat(body: dict, served: str, sampling: Sampling | None) -> Request:
    """A `/v1/chat/completions` request."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise WireError(400, "messages: give a non-empty list of {role, content} messages")
    if any(not isinstance(m, dict) or "role" not in m for m in messages):
        raise WireError(400, "messages: every message is an object with a role")
    asked = _sampling(body, sampling, stops=False)
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise WireError(400, "tools: give a list of {type: function, function: {...}} schemas")
    return Request("chat", _model(body, served), messages=messages, tools=tools,
                   logprobs=bool(body.get("logprobs")), max_tokens=_max_tokens(body),
                   stream=bool(body.get("stream")), sampling=asked, stop=_stops(body))  # fmt: skip


def read_completion(body: dict, served: str, sampling: Sampling | None) -> Request:
    """A `/v1/completions` request (one prompt string)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise WireError(400, "prompt: give one string (one request per prompt)")
    asked = _sampling(body, sampling)
    if body.get("echo"):
        raise WireError(400, "echo=true: the prompt is not sent back; drop echo")
    return Request("completion", _model(body, served), prompt=prompt,
                   logprobs=body.get("logprobs") is not None, max_tokens=_max_tokens(body),
                   stream=bool(body.get("stream")), sampling=asked, stop=_stops(body),
                   include_stop=bool(body.get("include_stop_str_in_output")))  # fmt: skip


def read_tokens(body: dict, served: str, sampling: Sampling | None) -> Request:
    """An `/inference/v1/generate` request: prompt token ids in, sampled ids out."""
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise WireError(400, "token_ids: give a non-empty list of token ids")
    params = dict(body.get("sampling_params") or {})
    asked = _sampling({k: v for k, v in params.items() if k != "logprobs"}, sampling)
    if (params.get("logprobs") or 0) > 1:
        raise WireError(400, "sampling_params.logprobs > 1: only the sampled tokens' "
                        "log-probs are served; ask for 1")  # fmt: skip
    return Request("tokens", _model(body, served), token_ids=ids, logprobs=True,
                   max_tokens=_max_tokens(params), sampling=asked, stop=_stops(params),
                   include_stop=bool(params.get("include_stop_str_in_output")))  # fmt: skip


def before_stop(text: str, stops: Sequence[str], keep: bool) -> str:
    """`text` up to the first of `stops` in it (`keep`: and the stop string), as OpenAI answers
    a turn that a stop string ended."""
    at = min(((text.find(s), s) for s in stops if s in text), default=None)
    if at is None:
        return text
    return text[: at[0] + (len(at[1]) if keep else 0)]


def models_body(served: str, max_model_len: int | None) -> dict[str, Any]:
    card = {"id": served, "object": "model", "created": 0, "owned_by": "grouprl"}
    if max_model_len:
        card["max_model_len"] = max_model_len
    return {"object": "list", "data": [card]}


def _usage(answer: Answer) -> dict[str, int]:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": len(answer.ids),
            "total_tokens": answer.prompt_tokens + len(answer.ids)}  # fmt: skip


def _token_logprobs(tokens: Sequence[str], logprobs: Sequence[float]) -> list[dict]:
    return [{"token": t, "logprob": float(lp), "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=True)]  # fmt: skip


def chat_body(request: Request, answer: Answer, tokens: Sequence[str]) -> dict[str, Any]:
    """A chat completion (tool calls with their arguments as JSON text, as OpenAI writes
    them); `tokens`: the sampled tokens' texts, for log-probs."""
    import json

    message = dict(answer.message or {"role": "assistant", "content": answer.text})
    if message.get("tool_calls"):
        message["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": c["function"]["arguments"]
                               if isinstance(c["function"]["arguments"], str)
                               else json.dumps(c["function"]["arguments"])}}
            for c in message["tool_calls"]
        ]  # fmt: skip
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": answer.finish,
                              "logprobs": None}  # fmt: skip
    if request.logprobs:
        choice["logprobs"] = {"content": _token_logprobs(tokens, answer.logprobs)}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": request.model, "choices": [choice],
            "usage": _usage(answer)}  # fmt: skip


def completion_body(request: Request, answer: Answer, tokens: Sequence[str]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": answer.text, "finish_reason": answer.finish,
                              "logprobs": None}  # fmt: skip
    if request.logprobs:
        choice["logprobs"] = {"tokens": list(tokens), "token_logprobs": list(answer.logprobs),
                              "top_logprobs": None, "text_offset": None}  # fmt: skip
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": request.model, "choices": [choice],
            "usage": _usage(answer)}  # fmt: skip


def tokens_body(request: Request, answer: Answer, *, token_strings: bool = True) -> dict[str, Any]:
    """An `/inference/v1/generate` answer. Each log-prob entry's `token` is the string
    `"token_id:N"` (renderers 0.1.12 requires it); vLLM's own route writes the integer id,
    `token_strings=False`."""
    entries = [{"token": f"token_id:{i}" if token_strings else i, "logprob": float(lp)}
               for i, lp in zip(answer.ids, answer.logprobs, strict=True)]  # fmt: skip
    return {"request_id": f"gen-{uuid.uuid4().hex}", "prompt_token_ids": list(request.token_ids
            or []), "mm_placeholders": {}, "usage": _usage(answer),
            "choices": [{"index": 0, "token_ids": list(answer.ids), "finish_reason":
                         answer.finish, "logprobs": {"content": entries}}]}  # fmt: skip
