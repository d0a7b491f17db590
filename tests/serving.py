"""`grouprl serve` in a thread of the test's process, for the tests that talk to it."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def served(spec: Any, **kwargs: Any) -> Iterator[str]:
    """`serve_model(spec, port=0, **kwargs)` in a thread: its URL once the model is loaded and
    the port bound; stopped when the block ends."""
    from grouprl.endpoint.serve import serve_model

    urls, stop = [], threading.Event()
    thread = threading.Thread(target=serve_model, args=(str(spec),), daemon=True,
                              kwargs={"port": 0, **kwargs, "ready": urls.append, "stop": stop})  # fmt: skip
    thread.start()
    try:
        for _ in range(600):  # the model loads, then the port is bound
            if urls or not thread.is_alive():
                break
            thread.join(0.05)
        if not urls:
            raise RuntimeError(f"grouprl serve {spec} did not start")
        yield urls[0]
    finally:
        stop.set()
        thread.join(10)
