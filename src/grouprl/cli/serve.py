"""`grouprl serve`: the OpenAI-compatible endpoint over a saved model (`grouprl.endpoint.serve`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Annotated

import tyro

from grouprl.cli import quiet_hf


@dataclass
class ServeArgs:
    """Serve a model (a run directory's final/, a checkpoint, a model directory or hub id) on
    127.0.0.1 with OpenAI's routes: /v1/models, /v1/chat/completions (messages and tools; calls
    in the answer parsed into tool_calls), /v1/completions and the token route
    /inference/v1/generate. Requests are sampled one at a time, as they ask; Ctrl-C stops it.
    A sequence-classification reward model is served as OpenRLHF's POST /get_reward instead
    ({"query": [...]} -> {"rewards": [...]}): a run scores with it by that URL."""

    model: Annotated[str, tyro.conf.Positional]
    """A run directory (its final/ is served), a checkpoint or model directory, or a hub id."""
    port: int = 8000
    """The port on 127.0.0.1 (0: a free one)."""
    served_model_name: str | None = None
    """The model name requests ask for. None: MODEL as given."""
    max_new_tokens: int = 512
    """New tokens a request gets when it gives no max_tokens."""
    seed: int = 0
    """Seeds the requests' sampling in the order they come: the same requests in the same order
    get the same answers."""
    device: str = "cpu"
    """Where the model runs: cpu, cuda, cuda:1, ..."""


def run(argv: list[str]) -> int:
    from grouprl.endpoint.serve import serve_model

    args = tyro.cli(ServeArgs, args=argv, prog="grouprl serve")
    quiet_hf()

    def ready(url: str) -> None:
        print(f"grouprl serve: {url}  (model {args.served_model_name or args.model}; Ctrl-C "
              "stops it)", flush=True)  # fmt: skip

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: the server closes, exit 0
        serve_model(args.model, port=args.port, served=args.served_model_name, seed=args.seed,
                    max_new_tokens=args.max_new_tokens, device=args.device, ready=ready)  # fmt: skip
    return 0
