"""The HTTP server: OpenAI's routes over a `Backend`, on 127.0.0.1, in the caller's event loop.

Routes (each also under `/e/EPISODE/`, which names the episode a request belongs to; the
`X-Episode-ID` or `X-Session-ID` header does the same for a client whose base URL cannot
change): `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`, and
`POST /inference/v1/generate` (token ids in and out, renderers' shape). Errors are OpenAI's error
object with the status `WireError` gives. The server answers only while its event loop runs: a
run's loop runs while its episodes are live (`grouprl.endpoint.agents`), `grouprl serve`'s
always.
"""

from __future__ import annotations

import errno
import json
from typing import Any, Protocol

from grouprl.endpoint.wire import (
    Answer,
    Request,
    Sampling,
    WireError,
    chat_body,
    completion_body,
    models_body,
    read_chat,
    read_completion,
    read_tokens,
    tokens_body,
)
from grouprl.errors import UserError

HOST = "127.0.0.1"


class Backend(Protocol):
    """What answers requests: a run's episodes, or `grouprl serve`'s model."""

    served: str  # the model name requests must ask for
    sampling: Sampling
    max_model_len: int | None

    async def answer(self, episode: str | None, request: Request) -> Answer: ...

    def token_texts(self, ids: list[int]) -> list[str]: ...


class Endpoint:
    """The server over `backend`; `start` binds it (port 0: a free one) and returns the port."""

    def __init__(self, backend: Backend, port: int = 0) -> None:
        self.backend, self.port = backend, port
        self._runner: Any = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    async def start(self) -> int:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 2**20)
        for prefix in ("", "/e/{episode}"):
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_post(prefix + "/v1/chat/completions", self._route("chat"))
            app.router.add_post(prefix + "/v1/completions", self._route("completion"))
            app.router.add_post(prefix + "/inference/v1/generate", self._route("tokens"))
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, HOST, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError as err:
            await runner.cleanup()
            if err.errno == errno.EADDRINUSE:
                raise UserError(f"port {self.port} on {HOST} is in use: name another with "
                                "--agent-port (or --port), or give 0 for a free one") from None  # fmt: skip
            raise
        self.port = site._server.sockets[0].getsockname()[1]  # the port bound (0: chosen)
        self._runner = runner
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        b = self.backend
        return web.json_response(models_body(b.served, b.max_model_len))

    def _route(self, kind: str):
        read = {"chat": read_chat, "completion": read_completion, "tokens": read_tokens}[kind]
        write = {"chat": chat_body, "completion": completion_body}.get(kind)

        async def handle(http: Any) -> Any:
            from aiohttp import web

            b = self.backend
            episode = (http.match_info.get("episode") or http.headers.get("X-Episode-ID")
                       or http.headers.get("X-Session-ID"))  # fmt: skip
            try:
                try:
                    body = await http.json()
                except (ValueError, json.JSONDecodeError):
                    raise WireError(400, "the request body is not JSON") from None
                if not isinstance(body, dict):
                    raise WireError(400, "the request body is not a JSON object")
                request = read(body, b.served, b.sampling)
                if request.stream:
                    raise WireError(400, "stream=true is not served here; ask without stream")
                answer = await b.answer(episode, request)
            except WireError as err:
                return web.json_response(err.body(), status=err.status)
            if write is None:
                return web.json_response(tokens_body(request, answer))
            return web.json_response(write(request, answer, b.token_texts(answer.ids)))

        return handle
