"""Headless Chromium for the docs' pictures: Debian's chromium and chromium-driver (as the
viewer's browser tests use them), with nothing fetched from the network."""

from __future__ import annotations

import os
import tempfile
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]  # fmt: skip


def chromium(width: int, height: int) -> Any:
    """A selenium driver of a fresh headless Chromium window of that size (quit it when done)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in [
        *FLAGS,
        f"--window-size={width},{height}",
        f"--user-data-dir={tempfile.mkdtemp()}",
    ]:
        options.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
