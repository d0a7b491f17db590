"""Pictures of the built site (make docs first): its home page and a guide, as a browser shows
them, in headless Chromium (Debian's chromium and chromium-driver, as the tests use), served
from site/ over localhost.

    .venv/bin/python docs/scripts/site_screenshots.py [--site site] [--out runs/site-shots]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import threading
from pathlib import Path

PAGES = {"home": "index.html", "guide": "guides/tools.html"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=Path("site"))
    parser.add_argument("--out", type=Path, default=Path("runs/site-shots"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(args.site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    from browser import chromium  # docs/scripts/browser.py, beside this file

    driver = chromium(1280, 900)
    try:
        for name, page in PAGES.items():
            driver.get(f"http://127.0.0.1:{server.server_port}/{page}")
            out = args.out / f"{name}.png"
            driver.save_screenshot(str(out))
            print(out)
    finally:
        driver.quit()
        server.shutdown()


if __name__ == "__main__":
    main()
