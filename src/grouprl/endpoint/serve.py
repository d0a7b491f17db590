"""`grouprl serve`: the endpoint over a saved model (a run's `final/`, a checkpoint, any model
grouprl loads), for evaluation with the program that will use the model.

Requests are sampled one at a time, as asked (temperature, top-p, top-k, max tokens, stop
strings), each with its own seed drawn in order from `--seed`: the same requests in the same
order get the same answers. Chat requests are rendered by the model's chat template with their
tools, and calls in the answer are parsed into `tool_calls` in the template's convention.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import torch

from grouprl.endpoint.server import Endpoint
from grouprl.endpoint.wire import Answer, Request, Sampling, WireError, before_stop
from grouprl.errors import UserError
from grouprl.models import load_model, load_tokenizer
from grouprl.models.loading import context_length
from grouprl.rollout import sample_groups, stop_token_ids
from grouprl.tasks.tools.rendering import Renderer, message_dict

#: New tokens a request gets when it does not say (its max_tokens).
MAX_NEW_TOKENS = 512


def model_of(spec: str) -> str:
    """A run directory's trained model (its final/), or the spec as given."""
    path = Path(spec).expanduser()
    if (path / "config.yaml").is_file() and (path / "final").is_dir():
        return str(path / "final")
    return spec


class ModelBackend:
    """A loaded model answering requests (see the module docstring)."""

    sampling: Sampling | None = None  # each request's own

    def __init__(self, model: Any, tokenizer: Any, served: str, seed: int = 0,
                 max_new_tokens: int = MAX_NEW_TOKENS) -> None:  # fmt: skip
        self.model, self.tokenizer, self.served = model, tokenizer, served
        self.max_model_len = context_length(model)
        self.max_new_tokens = max_new_tokens
        self.end_ids = stop_token_ids(model, tokenizer)
        self.seed, self.asked = seed, 0
        self.lock = asyncio.Lock()
        self._renderer: Renderer | None = None

    async def answer(self, episode: str | None, request: Request) -> Answer:
        async with self.lock:  # one at a time, in the order they came
            self.asked += 1
            return await asyncio.to_thread(self.sample, request, self.seed * 1_000_003 + self.asked)

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]

    def renderer(self, tools: list[dict] | None) -> Renderer:
        if self._renderer is None:
            self._renderer = Renderer(self.tokenizer, None, self.end_ids, self.served)
        return self._renderer.with_tools(tools)

    def prompt_ids(self, request: Request) -> tuple[list[int], Renderer | None]:
        if request.kind == "chat":
            renderer = self.renderer(request.tools)
            return renderer.prompt_ids([message_dict(m) for m in request.messages]), renderer
        if request.kind == "completion":
            return self.tokenizer(request.prompt)["input_ids"], None
        return list(request.token_ids), None

    def sample(self, request: Request, seed: int) -> Answer:
        try:
            ids, renderer = self.prompt_ids(request)
        except UserError as err:
            raise WireError(400, str(err)) from None
        room = (self.max_model_len or 1 << 30) - len(ids)
        if room < 1:
            raise WireError(400, f"the prompt is {len(ids)} tokens, the model's context "
                            f"{self.max_model_len}: shorten it")  # fmt: skip
        budget = min(request.max_tokens or self.max_new_tokens, room)
        s = request.sampling or Sampling()
        with torch.no_grad():
            r = sample_groups(self.model, self.tokenizer, [ids], group_size=1,
                              max_new_tokens=budget, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k, stop=request.stop or None, seed=seed)  # fmt: skip
        n = int(r.lengths[0])
        out = r.completion_ids[0, :n].tolist()
        logps = r.old_logp[0, :n].tolist()
        finish = "length" if bool(r.truncated[0]) else "stop"
        shown = out[:-1] if out and out[-1] in self.end_ids else out
        text = self.tokenizer.decode(shown, skip_special_tokens=True)
        text = before_stop(text, request.stop, request.include_stop)
        message = None
        if renderer is not None:
            message = renderer.assistant(text)
            if message.get("tool_calls") and finish == "stop":
                finish = "tool_calls"
        if request.kind != "tokens":
            out, logps = shown, logps[: len(shown)]
        return Answer(out, logps, text, finish, message, prompt_tokens=len(ids))


def serve_model(spec: str, *, port: int = 8000, served: str | None = None, seed: int = 0,
                max_new_tokens: int = MAX_NEW_TOKENS, device: str = "cpu",
                ready: Any = None, stop: threading.Event | None = None) -> None:  # fmt: skip
    """Serve `spec` until interrupted (or `stop` is set); `ready(url)` is called once the port
    is bound."""
    source = model_of(spec)
    from grouprl.endpoint.rewards import is_reward_model, serve_reward_model

    if is_reward_model(source):  # OpenRLHF's /get_reward, for `--rewards URL`
        serve_reward_model(source, port=port, device=device, ready=ready, stop=stop)
        return
    model = load_model(source, device=device)
    tokenizer = load_tokenizer(source)
    backend = ModelBackend(model, tokenizer, served or spec, seed, max_new_tokens)
    asyncio.run(_serve(Endpoint(backend, port), ready, stop))


async def _serve(endpoint: Endpoint, ready: Any, stop: threading.Event | None) -> None:
    await endpoint.start()
    try:
        if ready is not None:
            ready(endpoint.url)
        if stop is None:
            await asyncio.Event().wait()  # until cancelled (Ctrl-C)
        while not stop.is_set():
            await asyncio.sleep(0.05)
    finally:
        await endpoint.close()
