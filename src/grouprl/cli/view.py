"""`grouprl view`: a page that shows runs' groups token by token (`grouprl.report.viewer`)."""

from __future__ import annotations

import webbrowser
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from grouprl.errors import UserError


@dataclass
class ViewArgs:
    """Show runs in the browser: their curves, a logged step's groups (rewards, advantages, a
    badge on groups that give no gradient) and each completion token by token, coloured by the
    ratio the loss used in units of the clip range (so GRPO's and GSPO's compare), the change
    after the step, the advantage or the entropy, the clipped tokens outlined. Two or more runs
    show side by side. Serves on 127.0.0.1 until Ctrl-C, or writes one HTML file (--export)."""

    runs: Annotated[tuple[Path, ...], tyro.conf.Positional]
    """Run directories written by `grouprl train`, or a folder of them (`grouprl compare`'s
    output directory)."""
    port: int = 0
    """The port on 127.0.0.1 (0: a free one)."""
    browser: bool = True
    """Open the page in the default browser (--no-browser: only print its address)."""
    export: Path | None = None
    """Write the page, with the runs' records inside it, to this HTML file and exit: it opens
    from the file, with no server."""
    steps: tuple[int, ...] | None = None
    """With --export: only these logged steps (None: every logged step)."""


def run(argv: list[str]) -> int:
    from grouprl.report.viewer import ViewerServer, export_html, run_dirs

    args = tyro.cli(ViewArgs, args=argv, prog="grouprl view")
    if not args.runs:
        raise UserError("give at least one run directory: grouprl view RUN_DIR [RUN_DIR ...]")
    runs = run_dirs(list(args.runs))
    if args.export is not None:
        size = export_html(runs, args.export, list(args.steps) if args.steps else None)
        print(
            f"wrote {args.export} ({size / 1e6:.1f} MB, {len(runs)} run(s)); open it in a browser"
        )
        return 0
    if args.steps:
        raise UserError("--steps chooses what --export writes; the page loads every step itself")
    try:
        server = ViewerServer(runs, args.port)
    except OSError as err:
        raise UserError(f"cannot listen on 127.0.0.1:{args.port} ({err.strerror}); "
                        "give another --port, or 0 for a free one") from None  # fmt: skip
    print(f"grouprl view: {server.url}  ({len(runs)} run(s); Ctrl-C stops it)", flush=True)
    if args.browser:
        webbrowser.open(server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0
