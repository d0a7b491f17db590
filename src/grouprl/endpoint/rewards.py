"""`grouprl serve` over a sequence-classification reward model: OpenRLHF's remote reward shape,
`POST /get_reward {"query": [...]}` -> `{"rewards": [...]}`, so that a reward model can run on a
device or machine of its own and a run score with it (`--rewards http://HOST:PORT/get_reward`,
`grouprl.tasks.rewards.remote`).

A query is a string (a prompt and its completion, as OpenRLHF sends them), or a list of messages,
which the reward model's chat template renders. Requests are scored one at a time, in batches of
`batch_size`; a malformed one is answered 400 with the reason.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from grouprl.endpoint.server import HOST
from grouprl.errors import UserError


def is_reward_model(source: str) -> bool:
    """Whether `source` (a directory or hub id) holds a sequence-classification model."""
    try:
        from transformers import AutoConfig

        architectures = AutoConfig.from_pretrained(source).architectures or []
    except Exception:  # not a model config: grouprl's own loading says why
        return False
    return any(a.endswith("ForSequenceClassification") for a in architectures)


def serve_reward_model(source: str, *, port: int = 8000, device: str = "cpu",
                       batch_size: int = 16, ready: Any = None,
                       stop: threading.Event | None = None) -> None:  # fmt: skip
    """Serve the reward model in `source` until interrupted (or `stop` is set); `ready(url)` is
    called once the port is bound."""
    from pathlib import Path

    from grouprl.tasks.rewards.model import RewardModel

    model = RewardModel(Path(source), device=device, batch_size=batch_size)
    asyncio.run(_serve(model, port, ready, stop))


async def _serve(model: Any, port: int, ready: Any, stop: threading.Event | None) -> None:
    from aiohttp import web

    lock = asyncio.Lock()

    async def get_reward(request: Any) -> Any:
        try:
            body = await request.json()
            queries = body["query"]
            if not isinstance(queries, list):
                raise ValueError("query must be a list")
        except (ValueError, KeyError, TypeError) as err:
            return web.json_response({"error": f"give {{'query': [...]}} ({err})"}, status=400)
        async with lock:
            try:
                rewards = await asyncio.to_thread(model.score_queries, queries) if queries else []
            except ValueError as err:
                return web.json_response({"error": str(err)}, status=400)
        return web.json_response({"rewards": rewards})

    app = web.Application(client_max_size=256 * 2**20)
    app.router.add_post("/get_reward", get_reward)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, HOST, port)
    try:
        await site.start()
    except OSError as err:
        await runner.cleanup()
        raise UserError(
            f"port {port} on {HOST}: {err.strerror}; name another with --port"
        ) from None
    bound = site._server.sockets[0].getsockname()[1]
    try:
        if ready is not None:
            ready(f"http://{HOST}:{bound}/get_reward")
        while stop is None or not stop.is_set():
            await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()
