"""`grouprl view`'s page: a stdlib HTTP server on 127.0.0.1, and the same page as one
self-contained HTML file (`export_html`).

Routes (nothing else is served; no path reaches the file system but through these):

    /                           the page (static/index.html with viewer.css and viewer.js)
    /api/runs                   every run's summary, read anew at each request (a live run grows)
    /api/run/I/step/N           run I's record of step N, gzipped as written
    /api/run/I/vocab            run I's vocabulary, gzipped

Requests whose Host header is not this server's own address are refused (a page elsewhere that
resolves a name to 127.0.0.1 must not read the runs: DNS rebinding).
"""

from __future__ import annotations

import gzip
import json
import re
import threading
from functools import partial
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

from grouprl.errors import UserError
from grouprl.report.viewer.data import step_bytes, summary, unzipped, vocab_bytes

_STEP = re.compile(r"/api/run/(\d+)/step/(\d+)")
_VOCAB = re.compile(r"/api/run/(\d+)/vocab")
#: where the page's data goes in an exported file
_DATA_SLOT = "<!--grouprl-data-->"


def static_text(name: str) -> str:
    return resources.files("grouprl.report.viewer").joinpath("static", name).read_text("utf-8")


def page(data: dict[str, Any] | None = None) -> str:
    """The page, its CSS and JS inlined; with `data` (an export) the runs' records inside it as
    JSON that no HTML parser reads as markup (every '<' escaped)."""
    html = static_text("index.html")
    html = html.replace("/*grouprl-css*/", static_text("viewer.css"))
    html = html.replace("/*grouprl-js*/", static_text("viewer.js").replace("</", "<\\/"))
    embedded = ""
    if data is not None:
        text = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
        embedded = f'<script type="application/json" id="grouprl-data">{text}</script>'
    return html.replace(_DATA_SLOT, embedded)


class _Handler(BaseHTTPRequestHandler):
    runs: list[Path]
    hosts: set[str]

    def __init__(self, *args, runs: list[Path], hosts: set[str], **kwargs):
        self.runs, self.hosts = runs, hosts
        super().__init__(*args, **kwargs)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the console is the user's
        pass

    def do_GET(self) -> None:  # the stdlib calls it by this name
        if self.headers.get("Host", "") not in self.hosts:
            self._send(HTTPStatus.FORBIDDEN, b"wrong Host header", "text/plain")
            return
        path = self.path.split("?", 1)[0].split("#", 1)[0]
        try:
            if path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, page().encode(), "text/html; charset=utf-8")
            elif path == "/api/runs":
                body = json.dumps({"runs": [summary(p) for p in self.runs]}, allow_nan=False)
                self._send(HTTPStatus.OK, body.encode(), "application/json")
            elif m := _STEP.fullmatch(path):
                self._send_gzip(step_bytes(self._run(m.group(1)), int(m.group(2))))
            elif m := _VOCAB.fullmatch(path):
                self._send_gzip(vocab_bytes(self._run(m.group(1))))
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")
        except UserError:  # no such run or step: nothing about the files beyond that
            self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")

    def _run(self, index: str) -> Path:
        i = int(index)
        if i >= len(self.runs):
            raise UserError(f"no run {i}")
        return self.runs[i]

    def _send_gzip(self, data: bytes) -> None:
        if "gzip" in self.headers.get("Accept-Encoding", ""):
            self._send(HTTPStatus.OK, data, "application/json", encoding="gzip")
        else:
            self._send(HTTPStatus.OK, gzip.decompress(data), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, kind: str, encoding: str | None = None):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")  # a live run's records change
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header(
            "Content-Security-Policy", "default-src 'self' 'unsafe-inline'; img-src 'self' data:"
        )  # thumbnails
        if encoding:
            self.send_header("Content-Encoding", encoding)
        self.end_headers()
        self.wfile.write(body)


class ViewerServer:
    """The page's server on 127.0.0.1 (`port` 0: a free one), serving in a thread of its own
    once `start`ed; `url` is its address."""

    def __init__(self, runs: list[Path], port: int = 0):
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), partial(_Handler, runs=runs,
                                                                       hosts=set()))  # fmt: skip
        self.port = self._httpd.server_address[1]
        hosts = {f"127.0.0.1:{self.port}", f"localhost:{self.port}"}
        self._httpd.RequestHandlerClass = partial(_Handler, runs=runs, hosts=hosts)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> ViewerServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        self._httpd.shutdown() if self._thread is not None else None
        self._httpd.server_close()


def export_html(runs: list[Path], out: Path, steps: list[int] | None = None) -> int:
    """Write the page with the runs' records inside it to `out` (it opens from file://, with no
    server); `steps`: only these logged steps (None: all). Returns the file's size in bytes."""
    summaries = [summary(p) for p in runs]
    logged = sorted({s for info in summaries for s in info["steps"]})
    missing = sorted(set(steps or ()) - set(logged))
    if missing:
        raise UserError(f"--steps {' '.join(map(str, missing))}: not logged in these runs (logged "
                        f"steps: {' '.join(map(str, logged)) or 'none'})")  # fmt: skip
    records: dict[str, dict[str, Any]] = {}
    vocabs: dict[str, Any] = {}
    for i, (path, info) in enumerate(zip(runs, summaries, strict=True)):
        chosen = [s for s in info["steps"] if steps is None or s in steps]
        info["steps"] = chosen
        records[str(i)] = {str(s): unzipped(step_bytes(path, s)) for s in chosen}
        if chosen:
            vocabs[str(i)] = unzipped(vocab_bytes(path))
    text = page({"runs": summaries, "records": records, "vocabs": vocabs})
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return out.stat().st_size
