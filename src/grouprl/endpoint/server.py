"""The HTTP server: OpenAI's routes over a `Backend`, on 127.0.0.1, in the caller's event loop.

Routes (each also under `/e/EPISODE/`, which names the episode a request belongs to; the
`X-Episode-ID` or `X-Session-ID` header does the same for a client whose base URL cannot
change): `GET /v1/models`, `POST /v1/chat/completions`, `POST /v1/completions`, and
`POST /inference/v1/generate` (token ids in and out, renderers' shape). Errors are OpenAI's error
object with the status `WireError` gives. The server answers only while its event loop runs: a
run's loop runs while its episodes are live (`grouprl.endpoint.agents`), `grouprl serve`'s
always.

`Endpoint.serve` is the server without HTTP: a run hands each episode an `openai` client whose
transport calls it in-process (`in_process_transport`; no socket, no parsing of HTTP), the
same routes and answers as the socket's.
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
#: The POST routes: path (after an optional /e/EPISODE) -> the request's kind.
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
          "/inference/v1/generate": "tokens"}  # fmt: skip
READERS = {"chat": read_chat, "completion": read_completion, "tokens": read_tokens}


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
        app.router.add_route("*", "/{path:.*}", self._http)
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

    async def _http(self, http: Any) -> Any:
        from aiohttp import web

        status, body = await self.serve(http.method, http.path, http.headers, await http.read())
        return web.json_response(body, status=status)

    async def serve(self, method: str, path: str, headers: Any, raw: bytes) -> tuple[int, dict]:
        """One request: its method, URL path, headers (a case-insensitive mapping) and body;
        the status and JSON body of the answer."""
        episode, route = None, path
        if path.startswith("/e/"):
            episode, _, rest = path[3:].partition("/")
            route = "/" + rest
        episode = episode or headers.get("X-Episode-ID") or headers.get("X-Session-ID")
        b = self.backend
        if route == "/v1/models" and method == "GET":
            return 200, models_body(b.served, b.max_model_len)
        kind = ROUTES.get(route)
        try:
            if kind is None or method != "POST":
                raise WireError(404, f"no route {method} {path}: this server answers GET "
                                f"/v1/models and POST {', '.join(ROUTES)}", "not_found_error")  # fmt: skip
            try:
                body = json.loads(raw or b"null")
            except (ValueError, UnicodeDecodeError):
                raise WireError(400, "the request body is not JSON") from None
            if not isinstance(body, dict):
                raise WireError(400, "the request body is not a JSON object")
            request = READERS[kind](body, b.served, b.sampling)
            if request.stream:
                raise WireError(400, "stream=true is not served here; ask without stream")
            answer = await b.answer(episode, request)
        except WireError as err:
            return err.status, err.body()
        if kind == "tokens":
            return 200, tokens_body(request, answer)
        write = chat_body if kind == "chat" else completion_body
        return 200, write(request, answer, b.token_texts(answer.ids))


def in_process_transport(endpoint: Endpoint) -> Any:
    """An httpx transport that hands each request to `endpoint.serve` in the caller's event
    loop: an `openai` client over it talks to the endpoint with no socket in between."""
    import httpx

    class InProcess(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            raw = await request.aread()
            status, body = await endpoint.serve(request.method, request.url.path,
                                                request.headers, raw)  # fmt: skip
            return httpx.Response(status, json=body, request=request)

    return InProcess()
