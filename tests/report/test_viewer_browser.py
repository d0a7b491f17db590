"""`grouprl view` in a real browser: headless Chromium (Debian's chromium and chromium-driver,
which `make test` installs as root) driven by Selenium, offline. What a person would see: the
group table's rows, each token's colour as the record says, the clipped tokens' outlines, model
text shown as text, two runs side by side, and the exported file opened from file://.

Colours: the page's diverging scale mixes white with red (202, 0, 32) or blue (5, 113, 176) by
|u|/2 for a value u in clip ranges (`ours`, below); JS rounds halves up and Python to even, so a
channel may differ by 1."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from viewer_runs import HOSTILE, hostile_copy, record, short_run

from grouprl.report.sinks import group_file, write_json_gz
from grouprl.report.viewer import ViewerServer, export_html

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
INSTALL = "apt-get install chromium chromium-driver fonts-dejavu-core (make test does it as root)"
if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip(f"no headless Chromium here: {INSTALL}", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium: pip install -e '.[dev]'")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

#: the flags that keep Chromium off the network and the machine's state (research/viewer.md)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1000"]  # fmt: skip
RED, BLUE = (202, 0, 32), (5, 113, 176)


@pytest.fixture(scope="module")
def browser():
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not look for drivers online
    profile = tempfile.mkdtemp(prefix="grouprl-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("view")
    return short_run(root / "gspo", "gspo"), short_run(root / "grpo", "grpo")


def open_page(browser, url: str) -> None:
    browser.get("about:blank")  # a new document, so data-ready is the new page's
    browser.get(url)
    WebDriverWait(browser, 20).until(
        lambda b: b.execute_script("return document.body.dataset.ready") == "1"
    )


def ours(u: float) -> tuple[int, int, int]:
    t = max(-1.0, min(1.0, u / 2))
    end = RED if t >= 0 else BLUE
    return tuple(round(255 + abs(t) * (e - 255)) for e in end)


def rgb(css: str) -> tuple[int, ...]:
    return tuple(int(x) for x in css[css.index("(") + 1 : css.index(")")].split(",")[:3])


#: every token of the open group: its completion row, index, value, colour, outline and text
TOKENS_JS = """
return Array.from(document.querySelectorAll('[data-testid=run-column]')).map(col =>
  Array.from(col.querySelectorAll('[data-testid=completion]')).map(card =>
    Array.from(card.querySelectorAll('.tok')).map(s => {
      const style = getComputedStyle(s);
      return [Number(card.dataset.row), Number(s.dataset.t), s.dataset.value ?? null,
              style.backgroundColor, style.outlineStyle, s.textContent];
    })).flat());
"""


def clip_units(c: dict, t: int, rec: dict) -> float | None:
    if "logp" not in c or not c["trained_mask"][t]:
        return None
    lr = c["logp"][t] - c["old_logp"][t]
    return lr / math.log1p(rec["clip_high"]) if lr >= 0 else lr / -math.log1p(-rec["clip_low"])


def clipped_group(rec: dict) -> int:
    """The first group of `rec` with a token the clip acted on."""
    for k, g in enumerate(rec["groups"]):
        if any(b for c in g["completions"] for b in c.get("bound", [])):
            return k
    raise AssertionError("no clipped token in this step: the test needs one")


@contextlib.contextmanager
def view_command(*runs: Path):
    """`grouprl view RUN ... --no-browser` as a user starts it; yields the address it prints."""
    cmd = [sys.executable, "-m", "grouprl", "view", *map(str, runs), "--no-browser"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("grouprl view: http://127.0.0.1:"), line
        yield line.split()[2]
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_page_shows_the_groups_the_colours_and_the_clipped_tokens(browser, runs):
    gspo, _ = runs
    with view_command(gspo) as url:
        rec = record(gspo, 2)
        k = clipped_group(rec)
        open_page(browser, f"{url}#step=2&group={k}&channel=ratio&runs=0")
        rows = browser.find_elements("css selector", "[data-testid=group-row]")
        assert len(rows) == len(rec["groups"]) == 4
        badges = browser.find_elements("css selector", "[data-testid=zero-variance-badge]")
        zero = [g for g in rec["groups"] if len(set(g["rewards"])) == 1]
        assert len(badges) == len(zero)
        (tokens,) = browser.execute_script(TOKENS_JS)
        group = rec["groups"][k]
        assert len(tokens) == sum(len(c["ids"]) for c in group["completions"])
        outlined = 0
        for row, t, value, colour, outline, _ in tokens:
            c = group["completions"][row]
            want = clip_units(c, t, rec)
            if want is None:
                assert value is None and rgb(colour) in ((0, 0, 0), (255, 255, 255))
            else:
                assert float(value) == pytest.approx(want, rel=1e-12, abs=1e-12)
                assert max(abs(a - b) for a, b in zip(rgb(colour), ours(want))) <= 1
            bound = c["bound"][t] if c["trained_mask"][t] else 0
            assert outline == {0: "none", 1: "dashed", 2: "solid"}[bound], (row, t, bound)
            outlined += bound > 0
        assert outlined > 0
        seq = browser.find_elements("css selector", "[data-testid=seq-ratio]")
        assert len(seq) == len(group["completions"])  # GSPO: each completion's s and its band


def test_model_text_is_shown_as_text(browser, runs, tmp_path):
    hostile = hostile_copy(runs[0], tmp_path / "hostile")
    with_server = ViewerServer([hostile]).start()
    try:
        open_page(browser, f"{with_server.url}#step=1&group=0&channel=entropy&runs=0")
        assert browser.execute_script("return window.__pwned === undefined")
        assert not browser.find_elements("css selector", "[data-testid=group-detail] script, "
                                                         "[data-testid=group-detail] img")  # fmt: skip
        prompt_cell = browser.find_elements("css selector", ".prompt-cell")[0]
        assert prompt_cell.text == HOSTILE
        pieces = [row[5] for row in browser.execute_script(TOKENS_JS)[0]]
        assert HOSTILE in pieces
    finally:
        with_server.close()


def test_rewards_per_turn_are_shown_turn_by_turn(browser, runs, tmp_path):
    run = shutil.copytree(runs[0], tmp_path / "turns")
    rec = record(run, 1)
    rec["groups"][0]["completions"][0].update(turn_rewards=[0.5, None, 0.25],
                                              turn_advantages=[1.25, 0.75, 0.75])  # fmt: skip
    write_json_gz(group_file(run, 1), rec)
    with_server = ViewerServer([run]).start()
    try:
        open_page(browser, f"{with_server.url}#step=1&group=0&channel=advantage&runs=0")
        (shown,) = browser.find_elements("css selector", "[data-testid=turn-rewards]")
        assert shown.text == "turn 1 0.50 Â 1.250 · turn 2 – Â 0.750 · turn 3 0.25 Â 0.750"
    finally:
        with_server.close()


def test_a_groups_images_are_shown_as_thumbnails(browser, runs, tmp_path):
    """A vision-language run's groups carry their prompt's images as PNG data URLs: the page
    shows each as an image; a value that is not a PNG data URL is not shown at all."""
    from PIL import Image

    from grouprl.images import thumbnail

    run = shutil.copytree(runs[0], tmp_path / "images")
    rec = record(run, 1)
    pictures = [Image.new("RGB", (64, 48), "white"), Image.new("RGB", (300, 300), "black")]
    rec["groups"][0]["images"] = [thumbnail(p) for p in pictures] + [
        "javascript:window.__pwned=1",
        HOSTILE,
    ]
    write_json_gz(group_file(run, 1), rec)
    with_server = ViewerServer([run]).start()
    try:
        open_page(browser, f"{with_server.url}#step=1&group=0&channel=advantage&runs=0")
        images = "Array.from(document.querySelectorAll('[data-testid=images] img'))"
        WebDriverWait(browser, 10).until(
            lambda b: b.execute_script(f"return {images}.every(i => i.complete);")
        )
        sizes = browser.execute_script(
            f"return {images}.map(i => [i.naturalWidth, i.naturalHeight]);"
        )
        assert sizes == [[64, 48], [128, 128]]  # decoded, each at most 128 pixels a side
        assert browser.execute_script("return window.__pwned === undefined")
    finally:
        with_server.close()


def test_two_runs_side_by_side(browser, runs):
    with_server = ViewerServer(list(runs)).start()
    try:
        open_page(browser, f"{with_server.url}#step=3&group=0&channel=change&runs=0,1")
        columns = browser.find_elements("css selector", "[data-testid=run-column]")
        assert len(columns) == 2
        for column, run in zip(columns, runs, strict=True):
            assert run.name in column.text
            rows = column.find_elements("css selector", "[data-testid=group-row]")
            assert len(rows) == len(record(run, 3)["groups"])
        left, right = (c.rect["x"] for c in columns)
        assert right > left + 300  # beside each other, not stacked
        curves = browser.find_elements("css selector", "[data-testid=curves] polyline")
        assert len(curves) >= 2 * 4  # each panel a line per run
        first = browser.find_elements("css selector", "[data-testid=group-row]")[1]
        first.click()  # a click opens that group: the hash follows
        WebDriverWait(browser, 10).until(lambda b: "group=1" in b.current_url)
    finally:
        with_server.close()


def test_the_export_opens_from_a_file(browser, runs, tmp_path):
    out = tmp_path / "view.html"
    export_html(list(runs), out)
    open_page(browser, out.as_uri() + "#step=1&group=0&channel=ratio&runs=0,1")
    columns = browser.find_elements("css selector", "[data-testid=run-column]")
    assert len(columns) == 2
    assert all(len(c.find_elements("css selector", "[data-testid=group-row]")) == 4
               for c in columns)  # fmt: skip
    assert browser.execute_script("return document.getElementById('status').textContent") == ""


def test_a_mixture_of_experts_run_shows_its_routes_per_layer(browser, tmp_path):
    """Each step's share of changed routes, per layer, as a steps × layers map whose cells
    name their step, layer and value as the metrics logged them."""
    import json

    from grouprl.models.tiny import save_tiny_moe_model

    save_tiny_moe_model(tmp_path / "moe", "qwen3_moe")
    run = short_run(tmp_path / "run", "grpo", model=str(tmp_path / "moe"), task="arithmetic",
                    lr=1e-2, log_groups=0)  # fmt: skip
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    with_server = ViewerServer([run]).start()
    try:
        open_page(browser, with_server.url)
        cells = browser.find_elements("css selector", "[data-testid=curves] rect")
        assert len(cells) == 3 * 2  # 3 steps, 2 layers
        titles = [c.find_element("css selector", "title").get_attribute("textContent")
                  for c in cells]  # fmt: skip
        shown = [(m["step"], layer, m[f"routing_update_changed_layer{layer}"])
                 for m in metrics for layer in range(2)]  # fmt: skip
        for step, layer, value in shown:  # (the page writes values under 1e-3 as exponents)
            if value == 0 or value >= 1e-3:
                assert f"step {step}, layer {layer}: {value:.3f}" in titles
        panels = browser.find_element("css selector", "[data-testid=curves]").text
        assert "routes changed per layer" in panels and "routes changed by the step" in panels
    finally:
        with_server.close()
